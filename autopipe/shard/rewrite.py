"""``apply_sharding()``: the graph of one tp rank, built from a plan by a mechanical rewrite.

The input model and graph are left alone: the result holds sliced copies of the parameters
under their original names, collective nodes, local shape constants and local shapes in meta.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import ConfigError
from ..graph import MODULE_KEY, keep_buffer_persistence
from ..tracer import TracedModel
from ..tracer.shapes import propagate_shapes
from . import ops
from .collectives import COLLECTIVES, register_group
from .modules import ROW_CLASSES, ShardedMultiheadAttention, TPDropout, copy_module
from .plan import ShardPlan
from .rng import tp_dropout
from .state import shard_tensor

__all__ = ["apply_sharding"]


class _Tensors:
    """Sliced (or cloned) copies of the original tensors, one per original tensor object."""

    def __init__(self, plan: ShardPlan, tp_rank: int):
        self.plan, self.rank = plan, tp_rank
        self.memo: dict[int, torch.Tensor] = {}  # tied parameters stay tied

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.memo:
            return self.memo[id(t)]
        ps = self.plan.params.get(name)
        local = t.detach()
        if ps is not None:
            local = shard_tensor(local, ps, self.rank, self.plan.tp, self.plan.custom_splits.get(name))
        local = local.clone(memory_format=torch.contiguous_format)
        new = nn.Parameter(local, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else local
        self.memo[id(t)] = new
        return new


def _copy_tree(m: nn.Module, prefix: str, tensors: _Tensors, cls: type | None = None) -> nn.Module:
    new = copy_module(m, cls)
    for k, p in m._parameters.items():
        new._parameters[k] = None if p is None else tensors(prefix + k, p)
    for k, b in m._buffers.items():
        new._buffers[k] = None if b is None else tensors(prefix + k, b)
    for k, child in m._modules.items():
        new._modules[k] = None if child is None else _copy_tree(child, f"{prefix}{k}.", tensors)
    if isinstance(new, nn.Linear):  # sizes of the local shard, as its repr and callers expect
        new.out_features, new.in_features = new.weight.shape
    return new


def _leaf(src: fx.GraphModule, target: str, kind: str | None, plan: ShardPlan, rank: int,
          tensors: _Tensors) -> nn.Module:
    m = src.get_submodule(target)
    if kind == "row":
        return _copy_tree(m, target + ".", tensors, ROW_CLASSES[type(m)])
    if kind == "mha":
        named = dict(m.named_parameters())
        local = {k: tensors(f"{target}.{k}", p) for k, p in named.items()}
        return ShardedMultiheadAttention(m, plan.tp, rank, local)
    if kind == "tp_dropout":
        new = TPDropout(m.p, rank)
        new.train(m.training)
        return new
    return _copy_tree(m, target + ".", tensors)


def _place(root: nn.Module, path: str, obj: Any, persistent: bool = True) -> None:
    *prefix, field = path.split(".")
    owner = root
    for part in prefix:
        child = getattr(owner, part, None)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(obj, nn.Module):
        owner.add_module(field, obj)
    elif isinstance(obj, nn.Parameter):
        owner.register_parameter(field, obj)
    elif isinstance(obj, torch.Tensor):
        owner.register_buffer(field, obj, persistent=persistent)
    else:
        setattr(owner, field, obj)


def _resolve(src: fx.GraphModule, path: str) -> tuple[Any, bool]:
    owner_path, _, field = path.rpartition(".")
    owner = src.get_submodule(owner_path) if owner_path else src
    return getattr(owner, field), field not in getattr(owner, "_non_persistent_buffers_set", ())


def _has(root: nn.Module, path: str) -> bool:
    owner_path, _, field = path.rpartition(".")
    try:
        return hasattr(root.get_submodule(owner_path) if owner_path else root, field)
    except AttributeError:
        return False


def _size_slot(node: fx.Node) -> tuple[list[Any], Any]:
    """The sizes a view/reshape/expand/split node writes, and a function storing new ones."""
    name, args = ops.op_name(node), list(node.args)
    if name in ("split", "split_with_sizes"):
        scalar = not isinstance(args[1], (list, tuple))
        sizes = [args[1]] if scalar else list(args[1])

        def store_split(new: list[Any]) -> None:
            args[1] = new[0] if scalar else type(node.args[1])(new)
            node.args = tuple(args)
        return sizes, store_split
    packed = len(args) == 2 and isinstance(args[1], (list, tuple))
    sizes = list(args[1]) if packed else args[1:]

    def store(new: list[Any]) -> None:
        node.args = (args[0], type(args[1])(new)) if packed else (args[0], *new)
    return sizes, store


def apply_sharding(traced: TracedModel, shard_plan: ShardPlan, tp_rank: int, *,
                   group: Any = None, group_name: str = "tp") -> TracedModel:
    """The TracedModel of tp rank ``tp_rank``: sliced parameters, collectives, local shapes.

    ``group`` is the tp process group, registered under ``group_name`` (collectives look it up by
    that name at run time), or a name to register later with ``register_group`` (a graph built
    in one process and run in another); ``None`` makes them identity, for planning and reports.
    """
    plan, tp = shard_plan, shard_plan.tp
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp:
        raise ConfigError(f"tp_rank must be in [0, {tp}), got {tp_rank!r}")
    if isinstance(group, str):  # registered later, in the process that runs the graph
        gname: str | None = group
    elif group is not None:
        register_group(group_name, group)
        gname = group_name
    else:
        gname = None
    src = traced.gm
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(src.graph, env)
    by_name = {old.name: new for old, new in env.items()}
    by_name[src.graph.output_node().name] = graph.output(out)
    for node in graph.nodes:
        if isinstance(node.type, str):  # a postponed annotation: torch 2.11 cannot pickle the module
            node.type = None

    # Modules and tensors, sliced for this rank, on a fresh tree under the original names.
    tensors, root = _Tensors(plan, tp_rank), nn.Module()
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, []).append(node)
    for target in sorted(calls, key=lambda t: t.count(".")):
        kinds = {plan.swaps.get(n.name) for n in calls[target]}
        if kinds == {"tp_dropout", None}:  # shared with a replicated region: a second module
            _place(root, target + "_tp", _leaf(src, target, "tp_dropout", plan, tp_rank, tensors))
            for n in calls[target]:
                if plan.swaps.get(n.name):
                    n.target = target + "_tp"
            kinds = {None}
        _place(root, target, _leaf(src, target, kinds.pop(), plan, tp_rank, tensors))
    for node in graph.nodes:
        if node.op == "get_attr":
            obj, persistent = _resolve(src, node.target)
            if not _has(root, node.target):  # else it lives in a leaf module copied above
                _place(root, node.target, tensors(node.target, obj) if isinstance(obj, torch.Tensor) else obj, persistent)
        elif node.op == "call_function" and plan.swaps.get(node.name) == "tp_dropout":
            node.args = (node.args[0], ops.arg(node, 1, "p", 0.5), ops.arg(node, 2, "training", True), tp_rank)
            node.kwargs, node.target = {}, tp_dropout

    _edit_shapes(graph, plan, by_name)  # see [Note: locating the split dim across a reshape] in ops.py
    _insert_collectives(graph, plan, by_name, gname)
    gm = fx.GraphModule(root, graph, class_name=type(src).__name__)
    keep_buffer_persistence(gm, src)  # torch 2.11 copies every get_attr tensor as persistent
    gm.training = src.training
    gm.graph.lint()
    gm.recompile()
    device = next((t.device for t in list(gm.parameters()) + list(gm.buffers())), torch.device("cpu"))
    inputs = [torch.zeros(s, dtype=d, device=device) for s, d in zip(traced.input_shapes, traced.input_dtypes)]
    propagate_shapes(gm, inputs)
    return TracedModel(gm=gm, route=traced.route, out_spec=traced.out_spec, input_shapes=list(traced.input_shapes),
                       input_dtypes=list(traced.input_dtypes), attempts=dict(traced.attempts))


def _edit_shapes(graph: fx.Graph, plan: ShardPlan, by_name: dict[str, fx.Node]) -> None:
    """Shape constants made local (``//tp``), whole again (``*tp``) or replaced."""
    tp = plan.tp
    for edit in plan.shape_edits:
        node = by_name[edit.node]
        sizes, store = _size_slot(node)
        if edit.new in ("//tp", "*tp"):
            op = operator.floordiv if edit.new == "//tp" else operator.mul
            with graph.inserting_before(node):
                local = graph.call_function(op, (sizes[edit.index], tp))
            local.meta[MODULE_KEY] = node.meta.get(MODULE_KEY, "")
            sizes[edit.index] = local
        else:
            sizes[edit.index] = edit.new
        store(sizes)


def _insert_collectives(graph: fx.Graph, plan: ShardPlan, by_name: dict[str, fx.Node], gname: str | None) -> None:
    """Each planned collective after its source node (and a row-parallel bias added after it)."""
    tp = plan.tp
    for c in plan.collectives:
        src_node = by_name[c.src]
        kind = COLLECTIVES[c.kind]
        with graph.inserting_after(src_node):
            last = graph.create_node("call_function", kind.fn, kind.args(src_node, c.dim, gname, tp), {}, name=c.name)
        last.meta[MODULE_KEY] = c.module
        if c.bias is not None:
            with graph.inserting_after(last):
                bias = graph.get_attr(c.bias)
            bias.meta[MODULE_KEY] = c.module
            if c.bias_trailing:  # bias[:, None, None] for a 2-d conv's [N, C, H, W]
                with graph.inserting_after(bias):
                    bias = graph.call_function(operator.getitem, (bias, (slice(None),) + (None,) * c.bias_trailing))
                bias.meta[MODULE_KEY] = c.module
            with graph.inserting_after(bias):
                added = graph.call_function(operator.add, (last, bias))
            added.meta[MODULE_KEY] = c.module
            last = added
        for u in c.users:
            by_name[u].replace_input_with(src_node, last)
        by_name[c.name] = last  # a later collective may take its output (see layout.add_collective)
