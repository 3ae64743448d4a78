"""Route (a): torch.fx symbolic tracing with module leaves.

Leaves are the modules autopipe reasons about as a whole (``nn.Linear``, convolutions, norms,
``nn.MultiheadAttention``...): every module of the ``torch.nn`` namespace as fx does by default,
the modules timm registers as untraceable, every module whose traced graph differs between
``train()`` and ``eval()`` (stochastic depth with p > 0, say: so one graph serves both modes),
and whatever the user adds. A model whose own forward branches on ``self.training`` gets one
graph per mode (:func:`trace_fx_modes`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import re
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import TraceError
from ..graph import MODULE_KEY

__all__ = ["LeafSpec", "LeafTracer", "trace_fx", "trace_fx_modes", "in_mode", "default_autowrap_functions"]

# The attribute name fx gives a tensor that is neither a parameter nor a buffer.
_TENSOR_CONSTANT = re.compile(r"_tensor_constant\d+")

# A leaf is named by a module type or by a qualified-name prefix ("blocks.3.attn").
LeafSpec = type | str


def _timm_notrace() -> tuple[set[type], set[Callable[..., Any]]]:
    try:
        from timm.layers import _fx as timm_fx
    except ImportError:
        return set(), set()
    modules = set(getattr(timm_fx, "_leaf_modules", ()))
    functions = set(getattr(timm_fx, "_autowrap_functions", ()))
    return modules, functions


def default_autowrap_functions() -> tuple[Callable[..., Any], ...]:
    return tuple(_timm_notrace()[1])


class LeafTracer(fx.Tracer):
    """An fx tracer whose leaves are chosen as the module docstring says."""

    def __init__(self, leaf_modules: Iterable[LeafSpec] = (), autowrap_functions: Sequence[Callable] = ()):
        super().__init__(autowrap_functions=tuple(default_autowrap_functions()) + tuple(autowrap_functions))
        leaves = list(leaf_modules)
        self._leaf_types = tuple(x for x in leaves if isinstance(x, type)) + tuple(_timm_notrace()[0])
        self._leaf_names = tuple(x for x in leaves if isinstance(x, str))
        # The qualified name of the module being traced when tracing fails (for the error).
        self.failed_module: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            return False
        if self._leaf_types and isinstance(m, self._leaf_types):
            return True
        if any(module_qualified_name == n or module_qualified_name.startswith(n + ".") for n in self._leaf_names):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:
                self.failed_module = self.path_of_module(m)
            raise


def _innermost_module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def _trace_once(model: nn.Module, leaves: Sequence[LeafSpec], autowrap: Sequence[Callable],
                concrete_args: dict[str, Any] | None = None) -> fx.Graph:
    tracer = LeafTracer(leaves, autowrap)
    try:
        return tracer.trace(model, concrete_args)
    except Exception as exc:
        exc.autopipe_module = tracer.failed_module  # type: ignore[attr-defined]
        raise


def _signatures_by_module(graph: fx.Graph, root: nn.Module) -> dict[str, list[str]]:
    """Each owning module's node signatures (op, target, constant arguments), in order.

    A tensor that is neither a parameter nor a buffer (a view of one: timm's Swin indexes its
    bias table by ``self.relative_position_index.view(-1)``) becomes a ``_tensor_constant<i>``
    attribute of the root, a new tensor numbered after those an earlier trace left there: it
    is named here by what it holds, so that two traces that differ only in that match.
    """

    def const(a: Any) -> str:
        return "%" if isinstance(a, fx.Node) else repr(a)

    def target(node: fx.Node) -> str:
        if node.op == "get_attr" and _TENSOR_CONSTANT.fullmatch(str(node.target)):
            return _constant_signature(getattr(root, node.target, None))
        return str(node.target)

    out: dict[str, list[str]] = {}
    for node in graph.nodes:
        args = fx.node.map_aggregate((node.args, node.kwargs), const)
        out.setdefault(_innermost_module(node), []).append(f"{node.op}:{target(node)}:{args}")
    return out


def _constant_signature(value: Any) -> str:
    """A tensor constant by its shape, dtype and values (by shape and dtype alone on the meta
    device, which holds no values)."""
    if not isinstance(value, torch.Tensor):
        return f"constant {value!r}"
    described = f"tensor constant {tuple(value.shape)} {value.dtype}"
    if value.device.type == "meta":
        return described
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{described} {hashlib.sha1(data).hexdigest()}"


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """``model.train(training)`` for a while; every module gets its own flag back after (a
    frozen norm inside a training model stays frozen)."""
    flags = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def _mode_dependent_modules(model: nn.Module, leaves: Sequence[LeafSpec], autowrap: Sequence[Callable],
                            concrete_args: dict[str, Any] | None = None) -> list[str]:
    """Modules whose traced graph differs between train() and eval(): they must become leaves.

    fx evaluates ``self.training`` at trace time, so a module that branches on it would be
    frozen in one mode; as a leaf it runs its own forward and follows ``model.train(mode)``.
    ``""`` (the model itself) is among them when its own forward differs.
    """
    with in_mode(model, True):
        train = _signatures_by_module(_trace_once(model, leaves, autowrap, concrete_args), model)
    with in_mode(model, False):
        evaluation = _signatures_by_module(_trace_once(model, leaves, autowrap, concrete_args), model)
    differing = [m for m in train.keys() | evaluation.keys() if train.get(m) != evaluation.get(m)]
    # Keep the outermost of nested differing modules: the leaf swallows its children.
    differing.sort(key=len)
    chosen: list[str] = []
    for m in differing:
        if not any(m == c or m.startswith(c + ".") for c in chosen):
            chosen.append(m)
    return chosen


def _graph_module(model: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    for node in gm.graph.nodes:
        if node.op == "call_module":
            node.meta[MODULE_KEY] = node.target
        else:
            node.meta[MODULE_KEY] = _innermost_module(node)
    return gm


def _leaves_no_constants(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fx keeps a tensor that is neither a parameter nor a buffer as a ``_tensor_constant<i>``
    attribute of the traced root; ``fn(model, ...)`` leaves none of them on the user's model
    (its graph modules hold their own)."""

    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        before = set(vars(model))
        try:
            return fn(model, *args, **kwargs)
        finally:
            for name in set(vars(model)) - before:
                if _TENSOR_CONSTANT.fullmatch(name):
                    delattr(model, name)

    return wrapper


@_leaves_no_constants
def trace_fx(
    model: nn.Module,
    leaf_modules: Iterable[LeafSpec] = (),
    autowrap_functions: Sequence[Callable] = (),
    *,
    both_modes: bool = True,
    concrete_args: dict[str, Any] | None = None,
) -> fx.GraphModule:
    """Symbolically trace ``model``; raises whatever fx raises (the caller reports it).

    With ``both_modes`` the graph serves train() and eval() alike (modules whose graph differs
    between them become leaves; a root that differs is refused: see :func:`trace_fx_modes`);
    without, the model is traced as it is, in its current mode (the cost model reads such
    graphs; nothing runs them). ``concrete_args`` fixes non-tensor inputs (``mask=None``) as
    fx's own argument does.
    """
    leaves = list(leaf_modules)
    if both_modes:
        dependent = _mode_dependent_modules(model, leaves, autowrap_functions, concrete_args)
        if "" in dependent:
            raise TraceError(
                f"{type(model).__name__}.forward itself branches on self.training, so one traced graph "
                "cannot serve train() and eval(); trace it with trace_fx_modes (one graph per mode)"
            )
        leaves += dependent
    return _graph_module(model, _trace_once(model, leaves, autowrap_functions, concrete_args))


@_leaves_no_constants
def trace_fx_modes(
    model: nn.Module,
    leaf_modules: Iterable[LeafSpec] = (),
    autowrap_functions: Sequence[Callable] = (),
    *,
    concrete_args: dict[str, Any] | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """The graph of train() mode, and the graph of eval() mode where the model's own forward
    branches on ``self.training`` (None where one graph serves both modes).

    Submodules whose graph differs between the modes are leaves in both graphs, as in
    :func:`trace_fx`; so the two graphs differ only in what the model's forward does itself
    (GoogLeNet's auxiliary heads, a dropout before the classifier). See [Note: one graph per
    mode] in autopipe/stages/mode_plan.py.
    """
    leaves = list(leaf_modules)
    dependent = _mode_dependent_modules(model, leaves, autowrap_functions, concrete_args)
    leaves += [m for m in dependent if m]
    if "" not in dependent:
        return _graph_module(model, _trace_once(model, leaves, autowrap_functions, concrete_args)), None
    graphs = []
    for training in (True, False):
        with in_mode(model, training):
            graphs.append(_graph_module(model, _trace_once(model, leaves, autowrap_functions, concrete_args)))
    return graphs[0], graphs[1]
