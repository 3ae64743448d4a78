"""``trace()``: turn an unmodified model into the autopipe graph, trying each route in order.

Routes: ``"fx"`` (torch.fx symbolic tracing with leaves), ``"export"`` (torch.export, for models
fx cannot capture, such as every transformers 5.x vision model) and ``"sequence"`` (an explicit
execution sequence, for models no tracer captures). The route taken is recorded.
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ..graph import MODULE_KEY, keep_buffer_persistence, value_of
from .export_route import trace_export
from .fx_route import LeafSpec, trace_fx_modes
from .manual_route import trace_sequence
from .shapes import propagate_shapes

__all__ = ["TracedModel", "trace", "ROUTES"]

ROUTES = ("fx", "export", "sequence")

# One element of an execution sequence: a module's qualified name or a callable on the last value.
SequenceItem = str | Callable[..., Any]


@dataclass
class TracedModel:
    """A model as a graph. See [Note: the autopipe graph] in autopipe/graph.py."""

    gm: fx.GraphModule
    route: str
    out_spec: pytree.TreeSpec
    input_shapes: list[tuple[int, ...]]
    input_dtypes: list[torch.dtype]
    attempts: dict[str, str] = field(default_factory=dict)  # route -> why it failed
    # The graph of eval() mode where the model's own forward branches on self.training; ``gm``
    # is then the graph of train() mode. None where one graph serves both modes.
    # See [Note: one graph per mode] in autopipe/stages/mode_plan.py.
    eval_traced: "TracedModel | None" = None

    def unflatten_output(self, leaves: Sequence[Any]) -> Any:
        return pytree.tree_unflatten(list(leaves), self.out_spec)


def _bind_unused_placeholders(gm: fx.GraphModule, n_inputs: int) -> None:
    """Placeholders past the given inputs take their default value (timm's ``attn_mask=None``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) < n_inputs:
        raise TraceError(
            f"example_inputs has {n_inputs} values but the model's forward takes "
            f"{len(placeholders)} positional inputs ({', '.join(p.target for p in placeholders)}); "
            f"pass one micro-batch of each input."
        )
    for p in placeholders[n_inputs:]:
        if p.target.startswith("*"):  # *args, **kwargs: none given (transformers' **kwargs)
            p.replace_all_uses_with({} if p.target.startswith("**") else ())  # type: ignore[arg-type]
            gm.graph.erase_node(p)
            continue
        if not p.args:
            raise TraceError(
                f"the model's forward needs input '{p.target}' but example_inputs has only "
                f"{n_inputs} values; pass it in example_inputs."
            )
        default = p.args[0]
        p.replace_all_uses_with(default)  # type: ignore[arg-type]
        gm.graph.erase_node(p)
    for node in list(gm.graph.nodes):  # fx's guards on the defaults it traced with (concrete_args)
        if node.target is fx._symbolic_trace._assert_is_none and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _unbound_defaults(model: nn.Module, n_inputs: int) -> dict[str, Any]:
    """The model's positional parameters past the given inputs, with their non-tensor defaults:
    fx traces with them fixed, so ``if mask is not None`` takes the branch the default takes."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {p.name: p.default for p in positional[n_inputs:]
            if p.default is not p.empty and not isinstance(p.default, torch.Tensor)}


def _flatten_output(gm: fx.GraphModule) -> pytree.TreeSpec:
    """Make the output node return a flat tuple of tensor nodes; return the original structure."""
    graph = gm.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")

    def expand(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            raise TraceError(f"the model returns a constant ({arg!r}); autopipe needs tensor outputs")
        val = value_of(arg)
        if isinstance(val, torch.Tensor):
            return arg
        if isinstance(val, (tuple, list)):
            with graph.inserting_before(out_node):
                items = []
                for i, v in enumerate(val):
                    item = graph.call_function(operator.getitem, (arg, i))
                    item.meta["val"] = v
                    item.meta[MODULE_KEY] = arg.meta.get(MODULE_KEY, "")
                    items.append(expand(item))
            if hasattr(val, "_fields"):  # a namedtuple (torchvision's InceptionOutputs)
                return type(val)(*items)
            return type(val)(items) if isinstance(val, tuple) else items
        raise TraceError(
            f"the model output '{arg.name}' is a {type(val).__name__}, not a tensor or a tuple of tensors"
        )

    structure = pytree.tree_map(expand, out_node.args[0])
    leaves, spec = pytree.tree_flatten(structure)
    out_node.args = (tuple(leaves),)
    gm.recompile()
    return spec


# [Note: caches filled while tracing]
# Some forwards cache what they compute on the module: timm's LeViT attention keeps its bias
# table per device in eval mode. Traced, such a cache is filled with an fx proxy or a fake
# tensor, and the model would go on returning fake tensors to its owner, and stale proxies to
# the next trace. Every module's own attributes (not its parameters, buffers or children) are
# therefore put back as they were once a route has run, dictionaries emptied and refilled in
# place (hook handles hold a reference to their dictionary).
_MODULE_STATE = ("_parameters", "_buffers", "_modules")


@contextlib.contextmanager
def _attributes_kept(model: nn.Module) -> Iterator[None]:
    saved = [(m, k, v, dict(v) if isinstance(v, dict) else None)
             for m in model.modules() for k, v in vars(m).items() if k not in _MODULE_STATE]
    try:
        yield
    finally:
        for m, key, value, contents in saved:
            if m.__dict__.get(key) is not value:
                m.__dict__[key] = value
            if contents is not None and (len(value) != len(contents) or any(
                    value.get(k, _MISSING) is not v for k, v in contents.items())):
                value.clear()
                value.update(contents)


_MISSING = object()


def _where(exc: BaseException) -> str:
    """The innermost source line outside torch and autopipe that the traceback passes through."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if "/torch/" not in f.filename and "/autopipe/" not in f.filename
    ]
    module = getattr(exc, "autopipe_module", None)
    parts = []
    if module:
        parts.append(f"in module '{module}'")
    if frames:
        f = frames[-1]
        parts.append(f"at {f.filename}:{f.lineno} `{(f.line or '').strip()}`")
    return " ".join(parts)


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    route: str = "auto",
    leaf_modules: Iterable[LeafSpec] = (),
    exec_sequence: Sequence[SequenceItem] | None = None,
) -> TracedModel:
    """Trace ``model`` on one micro-batch of ``example_inputs`` into a :class:`TracedModel`.

    ``route="auto"`` tries fx, then export; an ``exec_sequence`` selects the sequence route.
    Tracing needs no weights: a model built on the meta device plans like a real one.
    """
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise TraceError(
            "example_inputs must be a non-empty tuple of the model's positional inputs for one "
            f"micro-batch, e.g. (torch.randn(8, 3, 224, 224),); got {type(example_inputs).__name__}"
        )
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"example_inputs[{i}] is a {type(x).__name__}; autopipe needs tensors")
    if route not in ("auto",) + ROUTES:
        raise TraceError(f"unknown route {route!r}; use one of 'auto', {', '.join(map(repr, ROUTES))}")
    leaf_modules = tuple(leaf_modules)
    if exec_sequence is not None:
        route = "sequence"
    order = ("fx", "export") if route == "auto" else (route,)

    attempts: dict[str, str] = {}
    for name in order:
        try:
            with _attributes_kept(model):
                graphs = _ROUTE_FNS[name](model, tuple(example_inputs), leaf_modules, exec_sequence)
        except TraceError:
            raise
        except Exception as exc:
            attempts[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} {_where(exc)}".strip()
            continue
        traced = [
            TracedModel(gm=gm, route=name, out_spec=spec, input_shapes=[tuple(x.shape) for x in example_inputs],
                        input_dtypes=[x.dtype for x in example_inputs], attempts=attempts)
            for gm, spec in graphs
        ]
        for t in traced:
            keep_buffer_persistence(t.gm, model)
        traced[0].eval_traced = traced[1] if len(traced) > 1 else None
        return traced[0]
    detail = "\n".join(f"  - {r}: {why}" for r, why in attempts.items())
    raise TraceError(
        f"no tracing route could capture {type(model).__name__}:\n{detail}\n"
        "Fixes: mark the module that fails as a leaf (leaf_modules=[MyBlock] or ['blocks.3']), "
        "or give the execution sequence yourself (exec_sequence=['stem', 'layer1', ..., 'fc'])."
    )


# A route's graphs: one, or the train-mode graph and the eval-mode graph (trace_fx_modes).
Graphs = list[tuple[fx.GraphModule, pytree.TreeSpec]]


def _fx(model: nn.Module, inputs: tuple, leaves: tuple, _seq: Any) -> Graphs:
    train, evaluation = trace_fx_modes(model, leaves, concrete_args=_unbound_defaults(model, len(inputs)))
    graphs = []
    for gm in (train, evaluation):
        if gm is not None:
            _bind_unused_placeholders(gm, len(inputs))
            propagate_shapes(gm, inputs)
            graphs.append((gm, _flatten_output(gm)))
    return graphs


def _export(model: nn.Module, inputs: tuple, leaves: tuple, _seq: Any) -> Graphs:
    gm, spec = trace_export(model, inputs, leaves)
    propagate_shapes(gm, inputs)
    return [(gm, spec)]


def _sequence(model: nn.Module, inputs: tuple, _leaves: tuple, seq: Any) -> Graphs:
    if seq is None:
        raise TraceError("route='sequence' needs exec_sequence=[module names or callables, in order]")
    gm = trace_sequence(model, seq, inputs)
    propagate_shapes(gm, inputs)
    return [(gm, _flatten_output(gm))]


_ROUTE_FNS: dict[str, Callable[..., Graphs]] = {
    "fx": _fx,
    "export": _export,
    "sequence": _sequence,
}
