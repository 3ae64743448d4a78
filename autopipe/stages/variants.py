"""Stages for micro-batches of another size, cut where the plan cuts.

[Note: stage variants]
The plan is made for one micro-batch of the example's size. A step on micro-batches of
another size (the last incomplete batch of an epoch, an evaluation batch, an uneven split)
needs this rank's stages and every boundary's shape at that size; see [Note: other batch
sizes] in runtime/batch_shapes.py for how the driver uses them. They come from the graph again:

* fx and sequence routes: the graph is shape-generic (sizes are read from tensors), so a
  copy of it is run on meta tensors of the new size (:func:`repropagate`). The sizes a stage
  hands to a later one are constants of that later stage (emit.py bakes them in), so stages
  are emitted again from the re-propagated graph; a stage whose code comes out the same is
  the planned stage itself.
* export route: torch.export bakes the size into the graph (views of literal shapes), so
  the model is traced again at the new size, from a meta copy taken before autopipe changed
  any module (:func:`meta_copy`), sharded again for this tp rank and cut into the plan's MLP
  pieces. The new graph is matched to the planned one node by node (op and target), and the
  plan, renamed to the new nodes, cuts it where it cut before. Meta kernels return
  contiguous layouts where the planned trace's CPU kernels did not (attention outputs), so
  export records ``contiguous()`` calls there that the planned graph lacks: such extra
  calls are dropped, as they were no-ops in the planned trace.

Either way the new stages are rebuilt on the planned stages (``fx.GraphModule(planned,
graph)``): they call the planned stages' own modules and read their own parameters and
buffers, so an optimizer over ``pm.parameters()`` trains them, and weight casts, hooks and
devices are those of the planned stages. Boundary shapes are read from the new graph's
values. Nothing here communicates: every rank derives the same shapes from the same graph.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import InputError
from ..graph import keep_buffer_persistence
from ..partition.plan import CutTensor, PartitionPlan
from ..shard import apply_sharding, plan_sharding
from ..tracer import TracedModel, trace
from ..tracer.shapes import to_meta
from .emit import emit_stages
from .mlp_pieces import cut_mlps

__all__ = ["meta_copy", "repropagate", "export_retracer", "planned_size_only", "emit_variant", "boundary_values"]


class _ClassForward(nn.Module):
    """Runs ``module`` by its class's ``forward``: an instance's own ``forward`` (weight casts,
    runtime/weight_casts.py) reads real low-precision copies, which meta inputs cannot meet."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


class _MetaRun(fx.Interpreter):
    """Runs a graph on meta tensors, recording ``node.meta["val"]``; parameters and buffers
    are read as meta copies, so the real ones (on any device) are neither read nor changed."""

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return to_meta(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        m = self.fetch_attr(target)
        state = {f"module.{k}": to_meta(v) for k, v in itertools.chain(m.named_parameters(), m.named_buffers())}
        return torch.func.functional_call(_ClassForward(m), state, tuple(args), kwargs)

    def run_node(self, n: fx.Node) -> Any:
        n.meta["val"] = to_meta(super().run_node(n))
        return n.meta["val"]


def _inputs_at(traced: TracedModel, size: int) -> tuple[list[tuple[int, ...]], list[torch.Tensor]]:
    shapes = [(size, *s[1:]) for s in traced.input_shapes]
    return shapes, [torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, traced.input_dtypes)]


def repropagate(traced: TracedModel, size: int) -> TracedModel:
    """A copy of ``traced`` (the same modules and tensors) with its values propagated for
    micro-batches of ``size`` samples; for shape-generic graphs (fx and sequence routes)."""
    gm = traced.gm
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    copied.meta.update(gm.meta)  # e.g. which MLP pieces it is cut into
    copied.training = gm.training
    keep_buffer_persistence(copied, gm)
    shapes, inputs = _inputs_at(traced, size)
    try:
        _MetaRun(copied).run(*inputs)
    except Exception as exc:  # noqa: BLE001 - becomes the message
        raise InputError(f"micro-batches of {size} samples do not run through the traced model "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                         f"use micro-batches of {traced.input_shapes[0][0]} samples, as planned") from None
    return TracedModel(gm=copied, route=traced.route, out_spec=traced.out_spec, input_shapes=shapes,
                       input_dtypes=list(traced.input_dtypes), attempts=dict(traced.attempts))


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (nothing is
    allocated for them). Take it before anything changes the model's modules."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


_CONTIGUOUS = torch.ops.aten.contiguous.default


def _matched(planned: fx.Graph, new: fx.GraphModule) -> dict[str, str] | None:
    """Planned node name -> ``new``'s node doing the same (op, target), in order; extra
    ``contiguous()`` calls in ``new`` are dropped. None when the graphs differ otherwise."""
    names: dict[str, str] = {}
    theirs = list(new.graph.nodes)
    i = 0
    for node in planned.nodes:
        while i < len(theirs) and (theirs[i].op, theirs[i].target) != (node.op, node.target) \
                and theirs[i].target is _CONTIGUOUS:
            extra = theirs[i]
            extra.replace_all_uses_with(extra.args[0])
            new.graph.erase_node(extra)
            i += 1
        if i == len(theirs) or (theirs[i].op, theirs[i].target) != (node.op, node.target):
            return None
        _same_devices(node, theirs[i])
        names[node.name] = theirs[i].name
        i += 1
    new.recompile()
    return names if i == len(theirs) else None


def _same_devices(planned: fx.Node, node: fx.Node) -> None:
    """Factory calls traced on meta name the meta device (``arange(17, device=meta)``): give
    them the device the planned node names at the same place."""
    def pick(mine: Any, theirs: Any) -> Any:
        return theirs if isinstance(mine, torch.device) and mine.type == "meta" else mine

    node.args = tuple(pick(a, planned.args[k] if k < len(planned.args) else a) for k, a in enumerate(node.args))
    node.kwargs = {k: pick(v, planned.kwargs.get(k, v)) for k, v in node.kwargs.items()}


def _renamed(plan: PartitionPlan, names: dict[str, str]) -> PartitionPlan:
    def cuts(cs: list[CutTensor]) -> list[CutTensor]:
        return [dataclasses.replace(c, name=names[c.name]) for c in cs]

    stages = [dataclasses.replace(s, nodes=[names[n] for n in s.nodes], inputs=cuts(s.inputs), outputs=cuts(s.outputs))
              for s in plan.stages]
    return dataclasses.replace(plan, stages=stages)


def planned_size_only(why: str) -> Callable[[int], tuple[TracedModel, PartitionPlan]]:
    """A ``retrace`` that refuses every other size, saying ``why``."""
    def retrace(size: int) -> tuple[TracedModel, PartitionPlan]:
        raise InputError(f"micro-batches of {size} samples need the model traced again at that size, and {why}; "
                         "use micro-batches of the planned size")

    return retrace


def export_retracer(template: nn.Module, traced: TracedModel, plan: PartitionPlan, *,
                    leaf_modules: Iterable[Any], tp: int, tp_rank: int, shard_rules: Sequence[Any] | None,
                    sequence_parallel: bool) -> Callable[[int], tuple[TracedModel, PartitionPlan]]:
    """``retrace(size)``: the export route's graph at ``size`` samples per micro-batch (sharded
    for this tp rank, cut into the plan's MLP pieces) and the plan renamed to its nodes."""
    leaves = tuple(leaf_modules)

    def retrace(size: int) -> tuple[TracedModel, PartitionPlan]:
        _, inputs = _inputs_at(traced, size)
        new = trace(template, tuple(inputs), route="export", leaf_modules=leaves)
        if tp > 1:
            new = apply_sharding(new, plan_sharding(new, tp, rules=shard_rules, sequence_parallel=sequence_parallel),
                                 tp_rank, group="tp")
        new = cut_mlps(new, plan.mlp_pieces)
        names = _matched(traced.gm.graph, new.gm)
        if names is None:
            raise InputError(
                f"torch.export traced {type(template).__name__} into another graph for micro-batches of {size} "
                f"samples than for the planned {traced.input_shapes[0][0]}, so the plan's cuts do not apply "
                f"to it; use micro-batches of {traced.input_shapes[0][0]} samples")
        return new, _renamed(plan, names)

    return retrace


def emit_variant(traced: TracedModel, plan: PartitionPlan, stages: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """This rank's stages emitted from ``traced`` (the graph at another size), rebuilt on the
    planned ``stages``; a stage whose code is unchanged is the planned one."""
    out: dict[int, nn.Module] = {}
    for i, fresh in emit_stages(traced, plan, sorted(stages)).items():
        planned = stages[i]
        if isinstance(planned, fx.GraphModule) and fresh.code == planned.code:
            out[i] = planned
            continue
        stage = fx.GraphModule(planned, fresh.graph, class_name=type(fresh).__name__)
        keep_buffer_persistence(stage, planned)
        stage.meta.update(fresh.meta)
        stage.training = planned.training
        out[i] = stage
    return out


def boundary_values(traced: TracedModel, plan: PartitionPlan) -> list[list[torch.Tensor]]:
    """The (meta) values crossing each stage boundary in ``traced`` (cut into the plan's MLP
    pieces, as the stages are), in the plan's order."""
    by_name = {n.name: n for n in cut_mlps(traced, plan.mlp_pieces).gm.graph.nodes}
    return [[by_name[c.name].meta["val"] for c in plan.stages[k].outputs] for k in range(plan.num_stages - 1)]
