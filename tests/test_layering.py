"""The package's layers (docs/architecture.md): no module imports from a layer above its own,
and no module imports autopipe inside a function (such imports hide the cycles they break)."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autopipe"

# Lowest first. A unit is a folder of autopipe/ or a module directly in it; a unit may import
# from its own layer's other units only where the list says so (none do today).
LAYERS: list[set[str]] = [
    {"errors", "graph", "memory_format"},  # core
    {"failure", "models"},  # failure propagation below every wait it watches; model specs
    {"tracer"},
    {"shard"},
    {"partition"},
    {"stages"},  # emission and the graph rewrites a plan names
    {"runtime"},
    {"measure"},
    {"planning"},  # the shared trace -> shard -> partition
    {"search"},
    {"training"},
    {"arguments"},  # parallelize's checks on one rank
    {"api"},
    {"cli"},
    {"__main__", "__init__"},  # the package's entry points
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module(path: pathlib.Path, package: pathlib.Path) -> tuple[str, str]:
    """(dotted module name, the package its relative imports start from)."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path, root: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(imported autopipe module, line, inside a function) for every import in ``path``."""
    _, package = _module(path, root)
    tree = ast.parse(path.read_text(), str(path))
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                names = [".".join(base + [node.module])] if node.module else \
                    [".".join(base + [a.name]) for a in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        out += [(n, node.lineno, id(node) in local) for n in names if n == "autopipe" or n.startswith("autopipe.")]
    return out


def _violations(root: pathlib.Path = PACKAGE) -> tuple[list[str], list[str], list[str]]:
    upward, local, unplaced = [], [], set()
    for path in sorted(root.rglob("*.py")):
        name, _ = _module(path, root)
        src = _unit(name)
        where = f"{path.relative_to(root.parent)}"
        if src not in LAYER_OF:
            unplaced.add(src)
            continue
        for target, line, in_function in _imports(path, root):
            dst = _unit(target)
            if in_function:
                local.append(f"{where}:{line} imports {target} inside a function")
            if dst not in LAYER_OF:
                unplaced.add(dst)
            elif dst != src and LAYER_OF[dst] >= LAYER_OF[src]:
                upward.append(f"{where}:{line} ({src}) imports {target} ({dst}), "
                              f"{'a layer above' if LAYER_OF[dst] > LAYER_OF[src] else 'its own layer'}")
    return upward, local, sorted(unplaced)


def test_no_import_goes_up_a_layer() -> None:
    upward, _, unplaced = _violations()
    assert not unplaced, f"place these in LAYERS (and docs/architecture.md): {unplaced}"
    assert not upward, "\n".join(upward)


def test_no_function_local_imports_of_autopipe() -> None:
    _, local, _ = _violations()
    assert not local, "\n".join(local)


def test_the_check_sees_upward_and_local_imports(tmp_path) -> None:
    """An import of runtime from shard, inside a function, is caught on both counts; a new
    folder that no layer names is reported."""
    bad = tmp_path / "autopipe" / "shard"
    bad.mkdir(parents=True)
    (bad / "bad.py").write_text("def f():\n    from ..runtime import schedule\n")
    (tmp_path / "autopipe" / "extra.py").write_text("from autopipe.errors import ConfigError\n")
    upward, local, unplaced = _violations(tmp_path / "autopipe")
    assert upward == ["autopipe/shard/bad.py:2 (shard) imports autopipe.runtime (runtime), a layer above"]
    assert local == ["autopipe/shard/bad.py:2 imports autopipe.runtime inside a function"]
    assert unplaced == ["extra"]
