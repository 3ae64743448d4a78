"""Materialise pipeline stages from a plan: one ``fx.GraphModule`` per stage.

Each stage holds only the parameters and buffers its nodes use, under their original
state_dict names. Its inputs are the tensors crossing the cut before it and its outputs the
tensors crossing the cut after it, both in the plan's order; the last stage returns the
model's flattened outputs. Non-tensor values made in an earlier stage (sizes, flags) are
constants of the plan's micro-batch shape and are baked in. A plan that cuts linear layers
into row pieces (``plan.mlp_pieces``) is emitted from the graph with those pieces.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import PartitionError
from ..graph import MODULE_KEY, keep_buffer_persistence, resolve_attr, value_of
from ..partition.plan import PartitionPlan
from ..tracer import TracedModel
from .mlp_pieces import cut_mlps

__all__ = ["emit_stage", "emit_stages", "run_chain", "share_state"]

_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow}


def _mutates_first_arg(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(node.target), "inplace", False))
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCTIONS or node.kwargs.get("inplace") is True:
            return True
        overload = getattr(node.target, "_schema", None)
        return overload is not None and overload.name.split("::")[-1].endswith("_")
    return False


# [Note: received tensors mutated in place]
# The driver hands a stage its received activations as autograd leaves that require grad, and
# autograd refuses an in-place op on such a leaf or on a view of it. The tensor an in-place op
# reaches is often not the received one itself: timm's ResNet sends the stem's output into
# ``drop_block`` (an ``nn.Identity`` when disabled) and then into an in-place ReLU. So every
# node that may return its first input itself or a view of it (identity and dropout modules,
# parameter-free modules of other libraries, views, reshapes, in-place ops) is followed from
# the received tensor, and the tensor is cloned once at the stage's entry when any of those
# aliases is mutated in place. Following a module that computes a new tensor only costs a
# needless copy; missing an alias costs the step.
_VIEWS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose", "t",
    "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select", "unbind", "split", "chunk",
    "tensor_split", "contiguous", "detach", "as_strided", "movedim", "moveaxis", "swapaxes",
    "getitem", "unfold", "diagonal", "to", "type", "type_as", "float", "alias", "identity",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
}


def _op_name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    schema = getattr(target, "_schema", None)
    if schema is not None:  # aten.view.default and the like, from the export route
        return schema.name.split("::")[-1]
    return str(getattr(target, "__name__", ""))


def _may_alias_first_arg(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` may return its first input itself, or a view of it."""
    if _mutates_first_arg(node, gm):
        return True  # an in-place op returns what it changed
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, (torch.nn.Identity, torch.nn.modules.dropout._DropoutNd)):
            return True
        # DropPath, DropBlock and other regularisers return their input where disabled.
        own_library = type(module).__module__.startswith("torch.")
        return not own_library and not any(True for _ in module.parameters())
    return node.op in ("call_method", "call_function") and _op_name(node) in _VIEWS


def _mutated_through_aliases(start: fx.Node, members: set[str], gm: fx.GraphModule) -> bool:
    """Whether a node of the stage mutates ``start``, or an alias of it, in place."""
    stack, aliases = [start], {start}
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.name not in members or not user.args or user.args[0] is not node:
                continue
            if _mutates_first_arg(user, gm):
                return True
            if _may_alias_first_arg(user, gm) and user not in aliases:
                aliases.add(user)
                stack.append(user)
    return False


def _constant(value: Any, node: fx.Node) -> Any:
    """A non-tensor value of an earlier stage, as a constant of this one."""
    if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value)):
        raise PartitionError(
            f"node '{node.name}' holds tensors inside a {type(value).__name__} and cannot cross a "
            "stage boundary; this is a bug in the cut constraints, please report it with the model"
        )
    return pytree.tree_map(lambda v: tuple(v) if isinstance(v, torch.Size) else v, value)


# [Note: received layout]
# A tensor crosses a stage boundary as contiguous bytes (send and receive buffers are plain
# contiguous tensors), so a value the model made in channels_last layout (timm's ConvNeXt:
# a depthwise convolution reads the permute back from its channels-last MLP) arrives in NCHW.
# The same convolution then takes another kernel: on an H200 in bf16 the backward of a ConvNeXt-B
# depthwise convolution at the start of a stage took 1.9 ms where it took 0.45 ms inside one,
# and the stage times followed where the cuts fell. The receiving stage puts such a value back
# in its traced layout first: one copy, read and written once.
def _received_layout(value: Any) -> torch.memory_format | None:
    """The layout to restore on a received ``value``: channels_last (3d) where it was made in
    that layout and is not also plain contiguous (size-1 dimensions make it both)."""
    if not isinstance(value, torch.Tensor) or value.is_contiguous():
        return None
    for dims, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if value.dim() == dims and value.is_contiguous(memory_format=fmt):
            return fmt
    return None


def _fresh_name(base: str, taken: Any) -> str:
    """A name for a node the stage adds that no node of the model has: created before the
    model's nodes are copied in, a name of theirs would push one of them to another name, and
    kernel times are read by node name (measure/kernels.py)."""
    name = base
    while name in taken:
        name += "_"
    return name


def emit_stage(traced: TracedModel, plan: PartitionPlan, index: int) -> fx.GraphModule:
    """The GraphModule of stage ``index``; call it with the stage's inputs in plan order."""
    src = cut_mlps(traced, plan.mlp_pieces).gm
    by_name = {n.name: n for n in src.graph.nodes}
    stage = plan.stages[index]
    members = set(stage.nodes)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}

    for cut in stage.inputs:
        ph = graph.placeholder(cut.name)
        ph.meta.update(by_name[cut.name].meta)
        env[by_name[cut.name]] = ph
        layout = _received_layout(value_of(by_name[cut.name]))
        if layout is not None:  # see [Note: received layout]
            restored = graph.create_node("call_method", "contiguous", (ph,), {"memory_format": layout},
                                         name=_fresh_name(f"{cut.name}_layout", by_name))
            restored.meta.update(ph.meta)
            env[by_name[cut.name]] = restored

    # A received tensor is an autograd leaf: an in-place op on it, or on a view or an identity
    # of it, would fail, so copy it first. See [Note: received tensors mutated in place].
    mutated = [original for original in env if _mutated_through_aliases(original, members, src)]
    for original in mutated:
        clone = graph.create_node("call_function", torch.clone, (env[original],),
                                  name=_fresh_name(f"{original.name}_copy", by_name))
        clone.meta.update(original.meta)
        env[original] = clone

    def lookup(n: fx.Node) -> Any:
        if n in env:
            return env[n]
        if n.op == "get_attr":  # parameters are copied into every stage that reads them
            copy = graph.get_attr(n.target)
            copy.meta.update(n.meta)
            env[n] = copy
            return copy
        if n.name in members:
            raise PartitionError(f"node '{n.name}' is used before it is computed in stage {index}")
        value = value_of(n)
        if isinstance(value, torch.Tensor):
            raise PartitionError(
                f"stage {index} needs tensor '{n.name}' (from module '{n.meta.get(MODULE_KEY, '')}') "
                "but it is not among the stage's inputs; the plan does not match this graph"
            )
        return _constant(value, n)

    for name in stage.nodes:
        node = by_name[name]
        if node.op == "get_attr":  # materialised where used, so a stage holds only what it reads
            continue
        if node.op == "placeholder":
            if index != 0:
                raise PartitionError(f"input '{name}' placed in stage {index}; inputs belong to stage 0")
            env[node] = graph.placeholder(node.target)
            env[node].meta.update(node.meta)
            continue
        env[node] = graph.node_copy(node, lookup)

    if index == plan.num_stages - 1:
        out_node = next(n for n in src.graph.nodes if n.op == "output")
        results = tuple(lookup(n) for n in out_node.args[0])
    else:
        results = tuple(lookup(by_name[c.name]) for c in stage.outputs)
    graph.output(results)
    gm = fx.GraphModule(src, graph, class_name=f"Stage{index}")
    keep_buffer_persistence(gm, src)
    # Sizes computed here for later stages only are baked there: drop them and their modules.
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.delete_all_unused_submodules()
    gm.meta["autopipe_stage"] = index
    return gm


def emit_stages(traced: TracedModel, plan: PartitionPlan, indices: Iterable[int] | None = None) -> dict[int, fx.GraphModule]:
    """Stage modules by index (all stages, or the given ones: a rank builds only its own)."""
    wanted = range(plan.num_stages) if indices is None else indices
    traced = cut_mlps(traced, plan.mlp_pieces)  # once, not once per stage
    return {i: emit_stage(traced, plan, i) for i in wanted}


def share_state(stage: fx.GraphModule, owner: fx.GraphModule) -> fx.GraphModule:
    """Point ``stage``'s leaf modules, parameters and buffers at ``owner``'s of the same names
    (the eval-mode stage of a train-mode stage: see [Note: one graph per mode] in
    autopipe/stages/mode_plan.py); what ``owner`` lacks stays ``stage``'s own."""
    for node in stage.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        theirs = resolve_attr(owner, str(node.target))
        parent_path, _, field = str(node.target).rpartition(".")
        parent = stage.get_submodule(parent_path)
        if isinstance(theirs, torch.nn.Module) and node.op == "call_module":
            setattr(parent, field, theirs)
        elif isinstance(theirs, torch.nn.Parameter):
            parent.register_parameter(field, theirs)
        elif isinstance(theirs, torch.Tensor) and field in parent._buffers:
            parent._buffers[field] = theirs  # keeps the buffer's persistence
    return stage


def run_chain(stages: Sequence[torch.nn.Module], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run the stages one after another in this process (the single-process reference)."""
    values: tuple[Any, ...] = tuple(inputs)
    for stage in stages:
        values = tuple(stage(*values))
    return values
