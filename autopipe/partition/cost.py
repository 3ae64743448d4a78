"""Per-node cost of an autopipe graph: FLOPs, memory traffic, parameters, saved activations.

Every node of a graph that follows [Note: the autopipe graph] is priced from the shapes in
``node.meta["val"]`` alone (meta or fake tensors), so planning needs no weights and no device.
"""
from __future__ import annotations

import inspect
import itertools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopipe.errors import ConfigError
from autopipe.graph import tensor_bytes, tensor_values, value_bytes, value_of
from autopipe.memory_format import channels_last_dense
from autopipe.tracer.fx_route import in_mode, trace_fx
from autopipe.tracer.shapes import as_the_gpu_lays_it_out, to_meta

from .op_rules import DEFAULT, Op, Work
from .rule_tables import FUNCTION_NAMES, MODULE_RULES, NAMED_RULES, module_rule, rule_for

__all__ = [
    "NodeCost",
    "node_cost",
    "graph_costs",
    "training_state_bytes",
    "OPTIMIZER_STATES",
    "NAMED_RULES",
    "FUNCTION_NAMES",
    "MODULE_RULES",
    "MATMUL_KINDS",
    "FREE_KINDS",
    "LAYOUT_FAMILIES",
]

# [Note: cost conventions]
# FLOPs count a multiply-add as 2, as torch.utils.flop_counter does, and ignore bias adds, so
# a Linear is exactly 2 * tokens * in * out and a Conv 2 * N * prod(weight.shape) * prod(spatial).
# Bytes: fwd_bytes = distinct tensors read (weights included) + the output written.
#   bwd_bytes = grad of the output read + one grad written per tensor read in forward
#   + saved activations read back. A node with no floating-point output, or with neither a
#   floating-point input nor a weight, has no backward (bwd_* = 0, saved_bytes = 0). A rule may
#   say otherwise (``Work.fwd_free``, ``Work.bwd_bytes``): a view that copies only in backward,
#   contiguous() whose backward passes the gradient through ([Note: views that copy]).
# Backward FLOPs, by kind:
#   "matmul" (linear, conv, matmul, bmm, einsum): 2x fwd, grad of the input plus grad of the
#     weight (or of both operands); the first layer's unneeded input grad is not subtracted.
#   "attention" SDPA: 2*B*H*L*S*(3E + 2Ev), the flash backward that recomputes the scores
#     (2.5x fwd when E == Ev); nn.MultiheadAttention: 2x fwd (its default need_weights path
#     runs explicit bmm + softmax, no recompute).
#   "norm": 2x fwd. Everything else: 1x fwd.
# saved_bytes, what autograd keeps alive until backward (tensors that are parameters or
# buffers never count; they are alive anyway):
#   linear/conv/matmul/einsum: their activation operands.      views, getitem: nothing.
#   SDPA: q, k, v (and a tensor mask), the output and an fp32 logsumexp; a fused kernel keeps
#     no L x S matrix. nn.MultiheadAttention: q/k/v inputs, the three projections, the
#     context and, when need_weights (its default), the H x L x S probabilities.
#   norms: the input + fp32 statistics per normalised group (mean and rstd; rstd for RMS).
#   activations: one tensor of the output's size (relu/sigmoid/tanh keep their output,
#     gelu/silu their input). softmax: its output. dropout: a 1-byte mask per element.
#   max pool: input + int64 indices; avg pool: input. add/sub, cat and copies, sum/mean: nothing.
#   mul/div of two tensors: both. Unknown ops: their floating inputs (err towards memory).
# Unknown ops cost 1 FLOP per output element (vector units) and read/write their tensors.

LAYOUT_FAMILIES = frozenset({"conv", "gconv", "dwconv", "batch", "pool"})  # kernels that differ by layout
MATMUL_KINDS = frozenset({"matmul", "attention"})  # run on matmul units (tensor cores)
FREE_KINDS = frozenset({"view", "none"})  # launch no work: 0 FLOPs, 0 bytes, no overhead
_BWD_RATIO = {"matmul": 2.0, "attention": 2.0, "norm": 2.0}


@dataclass(frozen=True)
class NodeCost:
    """What one node costs per micro-batch; see [Note: cost conventions] in cost.py.

    ``kind`` says which units do the FLOPs (``MATMUL_KINDS`` or vector) and whether the node
    launches work at all (``FREE_KINDS`` do not). A module costed by what it runs (kind
    ``"composite"``, see [Note: composite modules]) lists its inner kernels in ``parts``.
    """

    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    param_count: int
    param_bytes: int
    saved_bytes: int
    out_bytes: int
    kind: str = "elementwise"
    parts: tuple[NodeCost, ...] = ()
    # What a calibration table keys its efficiencies on (see partition/calibration.py):
    # ``family`` is "gemm", "conv", "gconv" (grouped), "dwconv" (depthwise), "batch" or "row"
    # (norms by what they normalise over) or "" (other kernels); ``min_dim`` what bounds a
    # kernel's parallelism, never the batch: a linear layer's smaller weight dimension, a batched
    # product's smallest of M, N, K, a conv's channels in or out per group (a stem's 3 input
    # channels starve it), a batch norm's channels, a row norm's row length.
    family: str = ""
    min_dim: int = 0
    # Whether the kernel runs on maps laid out channels-last (NHWC): only for the families whose
    # kernels differ by layout (LAYOUT_FAMILIES: convolutions, batch norms, pooling). A
    # calibration keeps their factors apart ([Note: kernel layout] in partition/calibration.py).
    channels_last: bool = False
    # The kernel's exact shape where its rule names it (convolutions): a calibration prices the
    # shapes it measured far from their class by their own time ([Note: kernels off their class]).
    shape: str = ""
    # A convolution with a stride over one: a depthwise one runs kernels of its own, at any batch
    # size (``shape`` is dropped at another), so its class is kept apart ([Note: strided depthwise]).
    strided: bool = False


def _owned_params(gm: fx.GraphModule, node: fx.Node) -> list[nn.Parameter]:
    try:
        if node.op == "call_module":
            return list(gm.get_submodule(node.target).parameters())  # recursive, deduplicated
        if node.op == "get_attr":
            return [gm.get_parameter(node.target)]
    except AttributeError:  # a buffer, a constant, or a target that is not a module
        pass
    return []


def _make_op(gm: fx.GraphModule, node: fx.Node, name: str, module: nn.Module | None) -> Op:
    activations: list[torch.Tensor] = []
    weights: list[torch.Tensor] = list(module.parameters()) if module is not None else []
    seen: set[fx.Node] = set()
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node) and a not in seen:
            seen.add(a)
            (weights if a.op == "get_attr" else activations).extend(tensor_values(value_of(a)))
    return Op(node, name, module, activations, weights, value_of(node))


def _assemble(op: Op, work: Work, params: list[nn.Parameter]) -> NodeCost:
    out_bytes = value_bytes(op.out)
    param_count = sum(p.numel() for p in params)
    param_bytes = sum(tensor_bytes(p) for p in params)
    shape = dict(family=work.family, min_dim=work.min_dim, channels_last=_channels_last_kernel(op, work),
                 shape=work.shape, strided=work.strided)
    if work.kind in FREE_KINDS:
        return NodeCost(0.0, 0.0, 0.0, 0.0, param_count, param_bytes, 0, out_bytes, work.kind, **shape)
    reads = work.reads if work.reads is not None else sum(
        tensor_bytes(t) for t in op.activations + op.weights)
    if not op.differentiable:  # no backward, nothing kept
        return NodeCost(float(work.flops), 0.0, float(reads + out_bytes), 0.0,
                        param_count, param_bytes, 0, out_bytes, work.kind, **shape)
    bwd_flops = work.bwd_flops if work.bwd_flops is not None else _BWD_RATIO.get(work.kind, 1.0) * work.flops
    bwd_bytes = work.bwd_bytes if work.bwd_bytes is not None else out_bytes + reads + work.saved
    fwd_flops, fwd_bytes = (0.0, 0.0) if work.fwd_free else (float(work.flops), float(reads + out_bytes))
    return NodeCost(fwd_flops, float(bwd_flops), fwd_bytes, float(bwd_bytes), param_count, param_bytes,
                    int(work.saved), out_bytes, work.kind, **shape)


def _channels_last_kernel(op: Op, work: Work) -> bool:
    """Whether ``op`` runs a kernel of a layout-sensitive family on channels-last maps: its first
    4-D activation is channels-last (its 4-D weight, where it reads no 4-D activation)."""
    if work.family not in LAYOUT_FAMILIES:
        return False
    maps = [t for t in op.activations if t.dim() == 4][:1] or [t for t in op.weights if t.dim() == 4][:1]
    return bool(maps) and channels_last_dense(maps[0])


def _node_cost(gm: fx.GraphModule, node: fx.Node, params: list[nn.Parameter]) -> NodeCost:
    free = Op(node, node.op, None, [], [], value_of(node))
    if node.op in ("placeholder", "get_attr", "output"):
        return _assemble(free, Work("none"), params)
    module = None
    if node.op == "call_module":
        try:
            module = gm.get_submodule(node.target)
        except AttributeError:
            pass
    if not any(True for _ in tensor_values(value_of(node))):
        return _assemble(free, Work("none"), params)  # shapes, asserts, guards: no tensor work
    if module is not None and module_rule(module) is None and any(True for _ in module.children()):
        parts = _composite_parts(node, module)
        if parts is not None:
            return _composite(parts, params, value_of(node))
    name, rule = rule_for(node, module)
    op = _make_op(gm, node, name, module)
    try:
        work = rule(op)
    except (AttributeError, IndexError, TypeError, ValueError, RuntimeError, StopIteration) as e:
        warnings.warn(f"autopipe cost: rule {name!r} failed on node {node.name} "
                      f"({node.op} {node.target}): {e!r}; costed as elementwise", stacklevel=2)
        work = DEFAULT(op)
    cost = _assemble(op, work, params)
    inner = _norm_followers(node, module) if work.kind == "norm" else ()
    return _composite((cost, *inner), params, op.out) if inner else cost


# [Note: norms with an activation]
# timm's BatchNormAct2d (EfficientNet, MobileNetV3, RegNet, every ConvNormAct), GroupNormAct and
# LayerNormAct are norm modules, so the norm rule prices them, but their forward runs the norm,
# then their own ``drop`` and ``act`` children: two or three kernels, one pass over the map each
# way for every child that is not an Identity. Priced as the norm alone, EfficientNet-B0's
# batch norms took 1.29x their price on an H100, and a table fitted on them charged the
# activations' time to every batch norm of their class. So a norm module's children
# that launch work are kernels of their own: each priced by its rule on the norm's output (the
# same shape and dtype as its input), the node a composite of the norm and them.


def _norm_followers(node: fx.Node, module: nn.Module | None) -> tuple[NodeCost, ...]:
    """The costs of what a norm module runs after its norm (timm's ``drop`` and ``act``
    children), each on the node's output; see [Note: norms with an activation]."""
    if module is None:
        return ()
    out = value_of(node)
    values = list(tensor_values(out))
    parts = []
    for child in module.children():
        if isinstance(child, nn.Identity) or (isinstance(child, nn.modules.dropout._DropoutNd) and child.p == 0):
            continue
        found = module_rule(child)
        rule_name, rule = found if found is not None else ("module", DEFAULT)
        op = Op(node, rule_name, child, values[:1], list(child.parameters()), out)
        try:
            work = rule(op)
        except (AttributeError, IndexError, TypeError, ValueError, RuntimeError, StopIteration):
            work = DEFAULT(op)
        if work.kind not in FREE_KINDS:
            parts.append(_assemble(op, work, list(child.parameters())))
    return tuple(parts)


# [Note: composite modules]
# A call_module node whose module has no rule but has children is a block that a route kept
# opaque: the sequence route's items (ResNet's layer1, an nn.Sequential of Bottlenecks), a
# user's leaf_modules, or a module whose traced graph follows self.training (LeViT's
# Attention, which caches its bias in eval()). It is priced by what it runs: the module alone is
# traced with the fx route's leaves, in train mode and with its non-tensor arguments fixed
# (``mask=None``), the node's input values (meta tensors) are propagated through it on the
# meta device, and every inner node is costed by the rules above. Its totals (FLOPs, bytes,
# saved bytes) are the inner sums, so it costs what the fx graph of the same block costs;
# its parameters are its own, all of them (see _owned_params); out_bytes is its output.
# One summed NodeCost would need one kind, and a block mixing convs (matmul units) with
# norms and activations (vector units, memory-bound) has none that prices it right, so the
# inner nodes that launch work are kept in ``parts`` and DeviceProfile.node_time times each.
# A module that cannot be traced or propagated is costed as an unknown leaf (elementwise,
# with its warning). Inner costs are cached per module object, training flag and inputs.

_composite_cache: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[NodeCost, ...] | None]] = (
    weakref.WeakKeyDictionary())


class _MetaPropagator(fx.Interpreter):
    """Runs a graph on meta tensors, recording node.meta["val"]; weights are read as meta."""

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return to_meta(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        m = self.fetch_attr(target)
        state = {k: to_meta(v) for k, v in itertools.chain(m.named_parameters(), m.named_buffers())}
        return torch.func.functional_call(m, state, tuple(args), kwargs)

    def run_node(self, n: fx.Node) -> Any:
        n.meta["val"] = to_meta(as_the_gpu_lays_it_out(self, n, super().run_node(n)))
        return n.meta["val"]


def _inputs_key(module: nn.Module, inputs: tuple) -> Any:
    leaves, spec = pytree.tree_flatten(inputs)
    sig = tuple((tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                for x in leaves)
    return module.training, str(spec), sig


def _bound_inputs(node: fx.Node, module: nn.Module) -> dict[str, Any] | None:
    """``node``'s values by ``module.forward``'s parameter names, defaults filled in."""
    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return None
    bound.apply_defaults()
    return {k: value_of(a) if isinstance(a, fx.Node) else a for k, a in bound.arguments.items()}


def _composite_parts(node: fx.Node, module: nn.Module) -> tuple[NodeCost, ...] | None:
    """The launched inner costs of ``module`` on ``node``'s inputs; None if it cannot be traced."""
    bound = _bound_inputs(node, module)
    if bound is None:
        return None
    inputs = tuple(bound.values())
    cache = _composite_cache.setdefault(module, {})
    key = _inputs_key(module, inputs)
    if key not in cache:
        modes = {m: m.training for m in module.modules()}
        # In train mode (what a train step runs; LeViT's attention reads a cache in eval mode
        # that fx cannot trace), non-tensor inputs fixed (Swin's mask=None).
        concrete = {k: v for k, v in bound.items() if not isinstance(v, torch.Tensor)}
        try:
            with in_mode(module, True):
                inner = trace_fx(module, both_modes=False, concrete_args=concrete)
            _MetaPropagator(inner).run(*inputs)
        except Exception:  # untraceable, data-dependent, ...: the unknown-leaf fallback
            cache[key] = None
        else:
            cache[key] = tuple(p for c in graph_costs(inner).values() for p in (c.parts or (c,))
                               if p.kind not in FREE_KINDS)
        finally:
            for m, training in modes.items():
                m.training = training
    return cache[key]


def _composite(parts: tuple[NodeCost, ...], params: list[nn.Parameter], out: Any) -> NodeCost:
    def total(field: str) -> Any:
        return sum(getattr(p, field) for p in parts)

    return NodeCost(float(total("fwd_flops")), float(total("bwd_flops")), float(total("fwd_bytes")),
                    float(total("bwd_bytes")), sum(p.numel() for p in params),
                    sum(tensor_bytes(p) for p in params), int(total("saved_bytes")), value_bytes(out),
                    "composite", parts)


def node_cost(gm: fx.GraphModule, node: fx.Node) -> NodeCost:
    """Cost of ``node`` alone; it owns every parameter its leaf module or get_attr holds.

    Use :func:`graph_costs` for a whole graph: it counts a shared parameter only once.
    """
    return _node_cost(gm, node, _owned_params(gm, node))


def graph_costs(gm: fx.GraphModule) -> dict[str, NodeCost]:
    """Cost of every node, keyed by ``node.name``, in graph order.

    A parameter reached by several nodes (a module called twice, tied weights) is owned by
    the first of them in topological order, so param_count sums to the model's parameters.
    """
    seen: set[int] = set()
    costs: dict[str, NodeCost] = {}
    for node in gm.graph.nodes:
        params = [p for p in _owned_params(gm, node) if id(p) not in seen]
        seen.update(id(p) for p in params)
        costs[node.name] = _node_cost(gm, node, params)
    return costs


# Optimizer state tensors per parameter, each kept in fp32.
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1}


def training_state_bytes(param_bytes: int, optimizer: str = "adamw", *,
                         param_dtype: torch.dtype = torch.float32) -> int:
    """Bytes that training keeps per stage for ``param_bytes`` of parameters.

    Parameters + gradients (both in ``param_dtype``) + optimizer moments in fp32 (adamw/adam:
    two, sgd with momentum: one). fp32 master weights of mixed precision are not included.
    """
    states = OPTIMIZER_STATES.get(optimizer.lower())
    if states is None:
        raise ConfigError(f"unknown optimizer {optimizer!r} for training_state_bytes; known: "
                          f"{', '.join(sorted(OPTIMIZER_STATES))}")
    numel = param_bytes // param_dtype.itemsize
    return 2 * param_bytes + states * 4 * numel
