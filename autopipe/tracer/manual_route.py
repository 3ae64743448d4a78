"""Route (c): an explicit execution sequence, for models no tracer captures.

As Colossal-AI's ``PipelinableContext`` exec_seq: each item takes the previous item's value (the
first takes the model's inputs); a string names a submodule (an opaque leaf), a callable runs as is.
"""
from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Sequence

import torch.fx as fx
import torch.nn as nn

from ..errors import TraceError
from ..graph import MODULE_KEY

__all__ = ["trace_sequence"]


def _input_names(model: nn.Module, n: int) -> list[str]:
    """The forward's own parameter names where it has ``n`` of them, else ``input_0``..."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[:n] if len(params) >= n else [f"input_{i}" for i in range(n)]


def _function_call(item: Callable[..., Any], index: int, values: tuple) -> tuple[Callable, tuple, dict]:
    """(target, args, kwargs) of one callable item; fx generates code only for named functions."""
    if isinstance(item, functools.partial):  # unpacked, so the graph shows torch.flatten itself
        target, args, kwargs = _function_call(item.func, index, values)
        return target, tuple(item.args) + args, {**item.keywords, **kwargs}
    name = getattr(item, "__name__", "")
    if name.isidentifier() and getattr(item, "__module__", None):
        return item, values, {}

    def step(*args: Any, **kwargs: Any) -> Any:  # a lambda or a callable object, under a usable name
        return item(*args, **kwargs)

    step.__name__ = step.__qualname__ = f"exec_sequence_{index}"
    step.__wrapped__ = item  # type: ignore[attr-defined]
    return step, values, {}


def _check_coverage(model: nn.Module, names: list[str]) -> None:
    prefixes = tuple(f"{n}." for n in names if n)
    missing = [p for p, _ in model.named_parameters() if not p.startswith(prefixes)]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise TraceError(
            f"exec_sequence leaves {len(missing)} parameter(s) of {type(model).__name__} outside every "
            f"listed module, so they would not be trained: {shown}. List the modules that own them "
            "(a callable that uses a parameter hides it from the pipeline)."
        )


def trace_sequence(
    model: nn.Module, exec_sequence: Sequence[str | Callable[..., Any]], example_inputs: tuple
) -> fx.GraphModule:
    """The graph of ``exec_sequence`` run as a chain on ``example_inputs``, rooted at ``model``."""
    items = list(exec_sequence)
    if not items:
        raise TraceError("exec_sequence is empty; list module names or callables in execution order")
    modules = dict(model.named_modules())
    graph = fx.Graph()
    inputs = [graph.placeholder(name) for name in _input_names(model, len(example_inputs))]
    for p in inputs:
        p.meta[MODULE_KEY] = ""
    value: Any = None
    for i, item in enumerate(items):
        args = tuple(inputs) if i == 0 else (value,)
        if isinstance(item, str):
            if not item or item not in modules:
                close = difflib.get_close_matches(item, [m for m in modules if m], n=5)
                raise TraceError(
                    f"exec_sequence[{i}] = {item!r} is not a submodule of {type(model).__name__}; "
                    f"close matches: {', '.join(close) if close else 'none'}"
                )
            node = graph.call_module(item, args)
            node.meta[MODULE_KEY] = item
        elif callable(item):
            node = graph.call_function(*_function_call(item, i, args))
            node.meta[MODULE_KEY] = ""
        else:
            raise TraceError(
                f"exec_sequence[{i}] is a {type(item).__name__}; give a module name or a callable"
            )
        value = node
    out = graph.output(value)
    out.meta[MODULE_KEY] = ""
    _check_coverage(model, [m for m in items if isinstance(m, str)])
    return fx.GraphModule(model, graph, class_name=type(model).__name__)
