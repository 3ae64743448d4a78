"""Small modules and functions (docs/architecture.md): no file of the package is over about
400 lines, no function body over 80 (its docstring not counted)."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autopipe"
FILE_LINES = 420  # "about 400"
FUNCTION_LINES = 80
# Files that stay larger, and why. Each must still be over the limit (else drop it here).
LARGER_FILES: dict[str, str] = {}


def _body_lines(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = f.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str)
    start = first.end_lineno + 1 if docstring and len(f.body) > 1 else first.lineno
    return f.end_lineno - start + 1


def test_no_file_is_over_about_400_lines() -> None:
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines > FILE_LINES:
            over[path.relative_to(PACKAGE).as_posix()] = lines
    assert set(over) == set(LARGER_FILES), f"files over {FILE_LINES} lines: {over}"


def test_no_function_is_over_80_lines() -> None:
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > FUNCTION_LINES:
                over.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({_body_lines(node)} lines)")
    assert not over, "\n".join(over)
