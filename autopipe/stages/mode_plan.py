"""``follow_plan()``: the plan of a model's eval-mode graph, cut where its train-mode plan cuts.

[Note: one graph per mode]
fx evaluates ``self.training`` when it traces. A submodule whose graph differs between the
modes becomes a leaf that runs its own forward in whatever mode it is in, so one graph serves
both. The model's own forward cannot be a leaf: a model that branches on ``self.training``
itself (GoogLeNet and Inception v3 return their auxiliary logits in training only; GhostNet and
SENet apply dropout before the classifier) is traced once per mode (``trace_fx_modes``), and
the two graphs differ only in what that forward does.

- The train-mode graph is partitioned: training is what the balance is for, and it is the
  plan reported.
- The eval-mode graph follows that plan: each of its nodes goes to the stage holding the same
  node of the train graph (the same op, target and module, the same occurrence), a node that
  the train graph lacks to the stage of its latest input. Every module therefore runs on the
  stage that holds its parameters, and the stages cut the model at the same modules.
- A boundary may carry other tensors in each mode (the auxiliary logits travel to the last
  stage in training only), so each mode has its own boundary specs and output structure.
- Both graphs come from one model, so the eval stages read the train stages' parameters,
  buffers and leaf modules, the same objects (``emit.share_state``): an optimizer step or a
  checkpoint load reaches both, and ``full_state_dict`` reads the train stages as always.
- Which graph runs follows the mode, as in PyTorch: ``pm.train()`` selects the train graph and
  ``pm.eval()`` the eval graph, for ``train_step`` and ``eval_step`` alike (a backward through
  the eval graph is a backward in eval mode).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Hashable

import torch.fx as fx

from ..errors import PartitionError
from ..graph import is_tensor_node, owning_module, value_of
from ..tracer import TracedModel
from ..partition.plan import CutTensor, PartitionPlan
from .mlp_pieces import cut_mlps

__all__ = ["follow_plan"]


def _key(node: fx.Node) -> tuple[Hashable, ...]:
    target: Any = node.target
    try:
        hash(target)
    except TypeError:
        target = str(target)
    return node.op, target, owning_module(node)


def _keyed(graph: fx.Graph) -> dict[fx.Node, tuple[Hashable, ...]]:
    """Each node's identity across graphs of one model: (op, target, module, occurrence)."""
    seen: Counter = Counter()
    out = {}
    for node in graph.nodes:
        key = _key(node)
        out[node] = key + (seen[key],)
        seen[key] += 1
    return out


def _state_names(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The parameters (and buffers) a node holds: its leaf module's, or the attribute it reads."""
    if node.op == "call_module":
        prefix = f"{node.target}."
        module = gm.get_submodule(node.target)
        return [prefix + n for n, _ in module.named_parameters()] + [prefix + n for n, _ in module.named_buffers()]
    if node.op == "get_attr":
        return [str(node.target)]
    return []


def _assign(src: fx.GraphModule, stage_of: dict[str, int], dst: fx.GraphModule) -> dict[fx.Node, int]:
    """A stage for each node of ``dst``, following the stages of ``src``'s nodes."""
    matched = {key: stage_of[n.name] for n, key in _keyed(src.graph).items() if n.name in stage_of}
    stage: dict[fx.Node, int] = {}
    floating: list[fx.Node] = []  # no inputs and no counterpart: placed by their users
    for node, key in _keyed(dst.graph).items():
        if node.op == "output":
            continue
        inputs = [stage[a] for a in node.all_input_nodes if a in stage]
        if node.op == "placeholder":
            stage[node] = 0
        elif key in matched:
            stage[node] = max([matched[key], *inputs])
        else:
            stage[node] = max(inputs, default=0)
            if not node.all_input_nodes:
                floating.append(node)
    last = max(stage_of.values(), default=0)
    for node in reversed(floating):
        stage[node] = min((stage[u] for u in node.users if u in stage), default=last)
    return stage


def _check_state(src: fx.GraphModule, stage_of: dict[str, int], dst: fx.GraphModule,
                 stage: dict[fx.Node, int]) -> None:
    held = {name: stage_of[n.name] for n in src.graph.nodes if n.name in stage_of
            for name in _state_names(src, n)}
    for node, s in stage.items():
        for name in _state_names(dst, node):
            if held.get(name, s) != s:
                raise PartitionError(
                    f"the eval-mode graph needs '{name}' (node '{node.name}') on stage {s}, but the train-mode "
                    f"graph holds it on stage {held[name]}: the two graphs cannot be cut alike there. Pass "
                    "split points (balance=[module names]) at modules both modes run in the same order"
                )


def _cut(node: fx.Node) -> CutTensor:
    v = value_of(node)
    return CutTensor(node.name, tuple(v.shape), str(v.dtype).removeprefix("torch."), v.numel() * v.element_size())


def _crossing(dst: fx.GraphModule, stage: dict[fx.Node, int], k: int) -> list[CutTensor]:
    """Tensors made on stages <= k that a later stage reads (or the model returns)."""
    output = dst.graph.output_node()
    out = []
    for node in dst.graph.nodes:
        if node not in stage or stage[node] > k or node.op == "get_attr" or not is_tensor_node(node):
            continue
        later = any(u is output or (u in stage and stage[u] > k) for u in node.users)
        if later:
            out.append(_cut(node))
    return out


def follow_plan(traced: TracedModel, plan: PartitionPlan, other: TracedModel) -> tuple[TracedModel, PartitionPlan]:
    """The graph ``other`` (cut into ``plan.mlp_pieces`` as ``traced`` was) and its plan: each
    node on the stage of its counterpart in ``traced``; see [Note: one graph per mode].

    Stage costs are those of ``plan``; the nodes and the tensors crossing each boundary are
    ``other``'s. Raises :class:`PartitionError` when a module would move to another stage.
    """
    src = cut_mlps(traced, plan.mlp_pieces).gm
    other = cut_mlps(other, plan.mlp_pieces)
    dst = other.gm
    stage_of = plan.stage_of()
    stage = _assign(src, stage_of, dst)
    _check_state(src, stage_of, dst, stage)
    last = plan.num_stages - 1
    stages = []
    for s in plan.stages:
        inputs = _crossing(dst, stage, s.index - 1) if s.index else []
        outputs = _crossing(dst, stage, s.index) if s.index < last else []
        stages.append(dataclasses.replace(
            s, nodes=[n.name for n in dst.graph.nodes if stage.get(n) == s.index], inputs=inputs,
            outputs=outputs, cut_bytes=sum(c.nbytes for c in outputs)))
    return other, dataclasses.replace(plan, stages=stages)
