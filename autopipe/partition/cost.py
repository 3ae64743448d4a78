"""Per-node cost of an autopipe graph: FLOPs, memory traffic, parameters, saved activations.

Every node of a graph that follows [Note: the autopipe graph] is priced from the shapes in
``node.meta["val"]`` alone (meta or fake tensors), so planning needs no weights and no device.
"""
from __future__ import annotations

import builtins
import inspect
import itertools
import math
import operator
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from autopipe.errors import ConfigError
from autopipe.graph import tensor_bytes, tensor_values, value_bytes, value_of
from autopipe.tracer.fx_route import in_mode, trace_fx
from autopipe.tracer.shapes import to_meta

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
]

# [Note: cost conventions]
# FLOPs count a multiply-add as 2, as torch.utils.flop_counter does, and ignore bias adds, so
# a Linear is exactly 2 * tokens * in * out and a Conv 2 * N * prod(weight.shape) * prod(spatial).
# Bytes: fwd_bytes = distinct tensors read (weights included) + the output written.
#   bwd_bytes = grad of the output read + one grad written per tensor read in forward
#   + saved activations read back. A node with no floating-point output, or with neither a
#   floating-point input nor a weight, has no backward (bwd_* = 0, saved_bytes = 0).
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

MATMUL_KINDS = frozenset({"matmul", "attention"})  # run on matmul units (tensor cores)
FREE_KINDS = frozenset({"view", "none"})  # launch no work: 0 FLOPs, 0 bytes, no overhead
_BWD_RATIO = {"matmul": 2.0, "attention": 2.0, "norm": 2.0}
_STAT_BYTES = 4  # norm statistics are fp32 whatever the activation dtype


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
    # ``family`` is "gemm", "conv", "dwconv" (depthwise), "batch" or "row" (norms by what they
    # normalise over) or "" (other kernels); ``min_dim`` what bounds a kernel's parallelism,
    # never the batch: a linear layer's smaller weight dimension, a batched product's smallest of
    # M, N, K, a conv's channels in or out per group (a stem's 3 input channels starve it), a
    # batch norm's channels.
    family: str = ""
    min_dim: int = 0


@dataclass
class _Op:
    """What a rule sees: the node, its leaf module, its tensor operands and its output."""

    node: fx.Node
    name: str  # the rule-table key that matched ("linear", "conv", ...)
    module: nn.Module | None
    activations: list[torch.Tensor]  # distinct tensors produced by computing nodes
    weights: list[torch.Tensor]  # parameters/buffers: the module's own, or get_attr operands
    out: Any

    def arg(self, i: int, *names: str, default: Any = None) -> Any:
        """Value of positional argument ``i`` or of the first keyword in ``names``."""
        if i < len(self.node.args):
            a = self.node.args[i]
        else:
            a = next((self.node.kwargs[n] for n in names if n in self.node.kwargs), default)
        return value_of(a) if isinstance(a, fx.Node) else a

    @property
    def out_tensor(self) -> torch.Tensor:
        # ATen variants (native_layer_norm, flash attention...) return tuples; the first
        # tensor is the result, the rest are statistics.
        return next(tensor_values(self.out))

    def floating_bytes(self) -> int:
        """Bytes of the floating-point activations: what a rule saves for backward."""
        return sum(tensor_bytes(t) for t in self.activations if t.is_floating_point())


@dataclass
class _Work:
    """A rule's answer; ``_assemble`` turns it into a NodeCost by the shared conventions."""

    kind: str
    flops: float = 0.0
    bwd_flops: float | None = None  # None: flops * _BWD_RATIO[kind] (1 if absent)
    saved: int = 0
    reads: float | None = None  # None: every activation and weight is read once
    family: str = ""
    min_dim: int = 0


Rule = Callable[[_Op], _Work]


def _view(op: _Op) -> _Work:
    return _Work("view")


def _copy(op: _Op) -> _Work:
    return _Work("copy")


def _maybe_copy(op: _Op) -> _Work:
    # .contiguous() and .to() return their input when it already fits; meta and fake
    # tensors keep strides, so the propagated values tell (LayerNorm2d's output, for one,
    # is channels-last, and permuting it back gives a contiguous tensor).
    x, y = (op.activations[0] if op.activations else None), op.out_tensor
    same = x is not None and (x.shape, x.stride(), x.dtype, x.device) == (y.shape, y.stride(), y.dtype, y.device)
    return _Work("view" if same else "copy")


def _getitem(op: _Op) -> _Work:
    # Slicing is a view; indexing with a tensor gathers into a new tensor.
    index = op.arg(1, "idx")
    return _Work("copy" if any(True for _ in tensor_values(index)) else "view")


def _tensor_operands(node: fx.Node) -> int:
    # Counted with repeats: x * x saves x, x * gamma saves x (gamma is alive anyway).
    return sum(1 for a in pytree.tree_leaves((node.args, node.kwargs))
               if isinstance(a, fx.Node) and isinstance(value_of(a), torch.Tensor))


def _elementwise(flops_per_element: float = 1.0, saves: str = "inputs") -> Rule:
    """saves: "inputs" (floating inputs), "output", "operands" (both, if two tensors), "none"."""

    def rule(op: _Op) -> _Work:
        out = op.out_tensor
        saved = {
            "inputs": lambda: op.floating_bytes(),
            "output": lambda: tensor_bytes(out),
            "operands": lambda: op.floating_bytes() if _tensor_operands(op.node) >= 2 else 0,
            "none": lambda: 0,
        }[saves]()
        return _Work("elementwise", flops_per_element * out.numel(), saved=saved)

    return rule


def _reduction(saves_input: bool) -> Rule:
    def rule(op: _Op) -> _Work:
        x = op.arg(0, "input", "self")
        return _Work("reduction", x.numel(), saved=op.floating_bytes() if saves_input else 0)

    return rule


def _contract(op: _Op, k: int, *, batched: bool = False) -> _Work:
    out = op.out_tensor
    n = out.shape[-1] if out.dim() else 1
    # A batched product's rows (tokens) bound its efficiency; a linear layer's rows are every
    # leading dim, batch included, and do not (they are many): its weight's shape does.
    dims = (out.shape[-2] if out.dim() > 1 else 1, n, k) if batched else (n, k)
    return _Work("matmul", 2.0 * out.numel() * k, saved=op.floating_bytes(), family="gemm",
                 min_dim=int(min(dims)))


def _matmul(first: int, *names: str, batched: bool = False) -> Rule:
    # The output numel covers batch broadcasting and 1-D operands; k is the contracted size.
    return lambda op: _contract(op, op.arg(first, *names).shape[-1], batched=batched)


def _linear_module(op: _Op) -> _Work:
    return _contract(op, op.module.weight.shape[1])  # not in_features: a tp shard's is the original's


def _conv_flops(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> float:
    # As torch.utils.flop_counter: every weight element meets every output (input, when
    # transposed) position once; weight is [C_out, C_in/groups, *k] ([C_in, C_out/groups, *k]).
    spatial = w.dim() - 2
    batch = math.prod(x.shape[: x.dim() - spatial - 1])  # 1 for an unbatched input
    positions = math.prod((x if transposed else out).shape[x.dim() - spatial :])
    return 2.0 * batch * math.prod(w.shape) * positions


def _conv(op: _Op) -> _Work:
    x = op.arg(0, "input")
    if op.module is not None:
        w, transposed = op.module.weight, bool(op.module.transposed)
    else:
        w = op.arg(1, "weight")
        transposed = op.name.startswith("conv_transpose") or (
            op.name in ("convolution", "_convolution") and bool(op.arg(6, "transposed")))
    # The implicit GEMM's N (output channels per group) and K (input channels per group x kernel).
    groups = max(_groups(op), 1)
    per_group = w.shape[1] if transposed else w.shape[0] // groups
    # A depthwise conv (one input channel per group) runs on vector units, memory-bound.
    depthwise = groups > 1 and (w.shape[0] if transposed else w.shape[1]) == 1
    return _Work("matmul", _conv_flops(x, w, op.out_tensor, transposed), saved=op.floating_bytes(),
                 family="dwconv" if depthwise else "conv", min_dim=int(min(per_group, w.shape[1])))


def _groups(op: _Op) -> int:
    if op.module is not None:
        return int(op.module.groups)
    index = {"convolution": 8, "_convolution": 8}.get(op.name, 6)
    return int(op.arg(index, "groups", default=1) or 1)


def _einsum_sizes(equation: str, operands: list[torch.Tensor]) -> dict[Any, int]:
    sizes: dict[Any, int] = {}
    terms = equation.replace(" ", "").split("->")[0].split(",")
    for term, t in zip(terms, operands):
        before, _, after = term.partition("...")
        n_ellipsis = t.dim() - len(before) - len(after)
        # Ellipsis dims are keyed from the right so that broadcast dims line up.
        keys = [*before, *(("...", n_ellipsis - i) for i in range(n_ellipsis)), *after]
        for key, size in zip(keys, t.shape):
            sizes[key] = max(sizes.get(key, 1), int(size))
    return sizes


def _einsum(op: _Op) -> _Work:
    equation = op.node.args[0]
    operands = [value_of(a) for a in pytree.tree_leaves(op.node.args[1:]) if isinstance(a, fx.Node)]
    if len(operands) != 2:
        return _DEFAULT(op)
    # Two operands: one multiply-add per combination of all indices (kept and contracted).
    macs = math.prod(_einsum_sizes(equation, operands).values())
    return _Work("matmul", 2.0 * macs, saved=op.floating_bytes(), family="gemm")


def _sdpa(op: _Op) -> _Work:
    q, k, v = op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value")
    out = op.out_tensor
    bh = math.prod(out.shape[:-2])  # batch x query heads (GQA keys broadcast to them)
    scores = bh * q.shape[-2] * k.shape[-2]
    e, ev = q.shape[-1], v.shape[-1]
    saved = op.floating_bytes() + tensor_bytes(out) + bh * q.shape[-2] * _STAT_BYTES
    return _Work("attention", 2.0 * scores * (e + ev), 2.0 * scores * (3 * e + 2 * ev), saved)


def _mha_work(op: _Op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              embed: int, heads: int, batch_first: bool, need_weights: bool) -> _Work:
    n = 1 if q.dim() == 2 else q.shape[0 if batch_first else 1]
    tq, tk = q.numel() // q.shape[-1], k.numel() // k.shape[-1]  # tokens: n*L and n*S
    proj = 2.0 * embed * (tq * q.shape[-1] + tk * k.shape[-1] + tk * v.shape[-1] + tq * embed)
    attn = 4.0 * tq * (tk // n) * embed  # QK^T and PV over all heads
    item = q.element_size()
    saved = op.floating_bytes() + item * embed * (2 * tq + 2 * tk)
    saved += heads * tq * (tk // n) * item if need_weights else heads * tq * _STAT_BYTES
    return _Work("attention", proj + attn, 2.0 * (proj + attn), saved)


def _mha_module(op: _Op) -> _Work:
    m = op.module
    need = bool(op.arg(4, "need_weights", default=True))
    return _mha_work(op, op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value"),
                     m.embed_dim, m.num_heads, m.batch_first, need)


def _native_mha(op: _Op) -> _Work:
    need = bool(op.arg(10, "need_weights", default=True))
    return _mha_work(op, op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value"),
                     op.arg(3, "embed_dim"), op.arg(4, "num_head"), True, need)


_ROW_NORMS = ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")


def _norm_groups(op: _Op, x: torch.Tensor) -> int:
    """How many groups the norm keeps statistics for (rows, N * groups, channels)."""
    m, name = op.module, op.name
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or name in _ROW_NORMS:
        shape = m.normalized_shape if m is not None else op.arg(1, "normalized_shape")
        return x.numel() // math.prod(shape)
    if isinstance(m, nn.GroupNorm) or name in ("group_norm", "native_group_norm"):
        groups = m.num_groups if m is not None else op.arg(6 if name.startswith("native") else 1)
        return (x.shape[0] if x.dim() > 1 else 1) * groups
    if isinstance(m, nn.modules.instancenorm._InstanceNorm) or name == "instance_norm":
        return x.shape[0] * x.shape[1] if x.dim() > 2 else x.shape[0]
    return x.shape[1] if x.dim() > 1 else x.shape[0]  # batch norm: one per channel


def _norm(op: _Op) -> _Work:
    x = op.arg(0, "input")
    stats = 1 if isinstance(op.module, nn.RMSNorm) or "rms" in op.name else 2
    saved = tensor_bytes(x) + stats * _STAT_BYTES * _norm_groups(op, x)
    batch = isinstance(op.module, nn.modules.batchnorm._BatchNorm) or "batch_norm" in op.name
    # A batch norm's parallelism is its channels (one reduction over N x H x W each): 64
    # channels over large maps leave most of a GPU idle, whatever the bytes.
    return _Work("norm", 5.0 * op.out_tensor.numel(), saved=saved, family="batch" if batch else "row",
                 min_dim=_norm_groups(op, x) if batch else 0)


def _dropout(op: _Op) -> _Work:
    # A module's cost is its training cost; a function's train flag was fixed when traced.
    if op.module is not None:
        p, train = op.module.p, True
    else:
        p = op.arg(1, "p", default=0.5)
        train = op.arg(2, "train", "training", default=True)
    if p == 0 or train is False:
        return _Work("view")  # ATen returns its input: no kernel, no mask
    n = op.out_tensor.numel()
    return _Work("elementwise", 2.0 * n, saved=n)  # bool mask, 1 byte per element


def _embedding(op: _Op) -> _Work:
    out = op.out_tensor
    indices = [t for t in op.activations + op.weights if not t.is_floating_point()]
    index_bytes = sum(tensor_bytes(t) for t in indices)
    # Reads the gathered rows, not the whole table; backward scatter-adds one row per token.
    return _Work("copy", 0.0, float(out.numel()), index_bytes, index_bytes + tensor_bytes(out))


def _pool(max_pool: bool) -> Rule:
    def rule(op: _Op) -> _Work:
        x = op.arg(0, "input")
        saved = tensor_bytes(x) + (8 * op.out_tensor.numel() if max_pool else 0)
        return _Work("reduction", x.numel(), saved=saved, family="pool")

    return rule


_DEFAULT: Rule = _elementwise(1.0, "inputs")

# The dispatch table for call_function and call_method nodes. Keys are op names shared by
# ATen overloads (aten.add_.Tensor -> "add"), Tensor methods (x.add_ -> "add") and the
# torch / torch.nn.functional / operator callables listed in FUNCTION_NAMES.
# Extend it with NAMED_RULES["my_op"] = rule; a rule maps an _Op to a _Work.
NAMED_RULES: dict[str, Rule] = {
    **dict.fromkeys(
        ["view", "_unsafe_view", "reshape", "view_as", "reshape_as", "permute", "transpose", "t",
         "flatten", "unflatten", "expand", "expand_as", "squeeze", "unsqueeze", "select", "slice",
         "narrow", "split", "split_with_sizes", "chunk", "tensor_split", "unbind", "detach",
         "alias", "as_strided", "movedim", "swapaxes", "swapdims", "size", "dim", "numel",
         "sym_size", "getattr", "lift_fresh_copy", "identity"], _view),
    "getitem": _getitem,
    **dict.fromkeys(["contiguous", "to", "type_as", "float", "half", "bfloat16", "double", "type"],
                    _maybe_copy),
    **dict.fromkeys(["cat", "concat", "concatenate", "stack", "clone", "copy", "_to_copy", "pad",
                     "constant_pad_nd", "repeat", "tile", "roll", "index_select", "flip"], _copy),
    **dict.fromkeys(["linear", "mm"], _matmul(0, "input", "self")),
    **dict.fromkeys(["matmul", "bmm"], _matmul(0, "input", "self", batched=True)),
    "addmm": _matmul(1, "mat1"),
    "baddbmm": _matmul(1, "batch1", batched=True),
    "einsum": _einsum,
    **dict.fromkeys(["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                     "conv_transpose3d", "convolution", "_convolution"], _conv),
    **dict.fromkeys(["scaled_dot_product_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu"], _sdpa),
    "_native_multi_head_attention": _native_mha,
    **dict.fromkeys(["layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm",
                     "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                     "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                     "group_norm", "native_group_norm", "instance_norm"], _norm),
    **dict.fromkeys(["softmax", "_softmax", "log_softmax", "_log_softmax"], _elementwise(5.0, "output")),
    **dict.fromkeys(["relu", "sigmoid", "tanh", "elu", "hardtanh", "relu6"], _elementwise(1.0, "output")),
    **dict.fromkeys(["gelu", "silu", "mish", "softplus", "hardswish", "hardsigmoid",
                     "leaky_relu", "prelu"], _elementwise(4.0, "inputs")),
    **dict.fromkeys(["add", "sub", "rsub", "neg", "radd"], _elementwise(1.0, "none")),
    **dict.fromkeys(["mul", "div", "truediv", "floordiv"], _elementwise(1.0, "operands")),
    **dict.fromkeys(["dropout", "native_dropout", "feature_dropout", "alpha_dropout",
                     "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"], _dropout),
    "embedding": _embedding,
    **dict.fromkeys(["max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                     "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
                     "adaptive_max_pool3d"], _pool(True)),
    **dict.fromkeys(["avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                     "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
                     "_adaptive_avg_pool3d"], _pool(False)),
    **dict.fromkeys(["sum", "mean", "nansum"], _reduction(False)),
    **dict.fromkeys(["amax", "amin", "var", "std", "norm", "logsumexp", "prod", "cumsum"],
                    _reduction(True)),
}


def _function_names() -> dict[Callable[..., Any], str]:
    # torch.<name>, F.<name> and operator.<name> for every rule name, plus the odd aliases.
    names: dict[Callable[..., Any], str] = {}
    for name in NAMED_RULES:
        for namespace in (torch, F, operator):
            fn = getattr(namespace, name, None)
            if callable(fn) and not isinstance(fn, type):
                names.setdefault(fn, name)
    names.update({
        operator.iadd: "add", operator.isub: "sub", operator.imul: "mul",
        operator.itruediv: "div", operator.matmul: "matmul", operator.getitem: "getitem",
        builtins.getattr: "getattr",
    })
    return names


FUNCTION_NAMES: dict[Callable[..., Any], str] = _function_names()

# Leaf modules, matched along the MRO so that subclasses (timm's LayerNorm2d, MHA's
# NonDynamicallyQuantizableLinear) inherit their base's rule.
MODULE_RULES: dict[type, Rule] = {
    nn.Linear: _linear_module,
    nn.modules.conv._ConvNd: _conv,
    nn.LayerNorm: _norm, nn.RMSNorm: _norm, nn.GroupNorm: _norm,
    nn.modules.batchnorm._BatchNorm: _norm, nn.modules.instancenorm._InstanceNorm: _norm,
    nn.MultiheadAttention: _mha_module,
    nn.Embedding: _embedding,
    nn.modules.dropout._DropoutNd: _dropout,
    nn.Identity: _view, nn.Flatten: _view, nn.Unflatten: _view,
    nn.Softmax: NAMED_RULES["softmax"], nn.LogSoftmax: NAMED_RULES["softmax"],
    **dict.fromkeys([nn.ReLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.Hardtanh], NAMED_RULES["relu"]),
    **dict.fromkeys([nn.GELU, nn.SiLU, nn.Mish, nn.Softplus, nn.Hardswish, nn.Hardsigmoid,
                     nn.LeakyReLU, nn.PReLU], NAMED_RULES["gelu"]),
    nn.modules.pooling._MaxPoolNd: _pool(True), nn.modules.pooling._AdaptiveMaxPoolNd: _pool(True),
    nn.modules.pooling._AvgPoolNd: _pool(False), nn.modules.pooling._AdaptiveAvgPoolNd: _pool(False),
}

_warned_modules: set[type] = set()


def _canonical(name: str) -> str:
    # In-place variants cost what their out-of-place op costs: add_ -> add, relu_ -> relu.
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _module_rule(module: nn.Module) -> tuple[str, Rule] | None:
    for cls in type(module).__mro__:
        if cls in MODULE_RULES:
            return cls.__name__, MODULE_RULES[cls]
    return None


def _rule_for(node: fx.Node, module: nn.Module | None) -> tuple[str, Rule]:
    if node.op == "call_module":
        found = _module_rule(module) if module is not None else None
        if found is not None:
            return found
        if module is not None and any(True for _ in module.parameters()) and type(module) not in _warned_modules:
            _warned_modules.add(type(module))
            warnings.warn(f"autopipe cost: no rule for leaf module {type(module).__qualname__} "
                          f"(node {node.name}, target {node.target}); costed as elementwise. "
                          f"Add one: autopipe.partition.cost.MODULE_RULES[{type(module).__name__}] = rule",
                          stacklevel=3)
        return "module", _DEFAULT
    if node.op == "call_method":
        name = _canonical(str(node.target))
    elif isinstance(node.target, torch._ops.OpOverload):
        name = _canonical(node.target.name().split("::", 1)[-1].split(".", 1)[0])
    elif isinstance(node.target, torch._ops.OpOverloadPacket):
        name = _canonical(str(node.target).split(".", 1)[-1])
    else:
        name = FUNCTION_NAMES.get(node.target, "") if _hashable(node.target) else ""
    return name, NAMED_RULES.get(name, _DEFAULT)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _owned_params(gm: fx.GraphModule, node: fx.Node) -> list[nn.Parameter]:
    try:
        if node.op == "call_module":
            return list(gm.get_submodule(node.target).parameters())  # recursive, deduplicated
        if node.op == "get_attr":
            return [gm.get_parameter(node.target)]
    except AttributeError:  # a buffer, a constant, or a target that is not a module
        pass
    return []


def _make_op(gm: fx.GraphModule, node: fx.Node, name: str, module: nn.Module | None) -> _Op:
    activations: list[torch.Tensor] = []
    weights: list[torch.Tensor] = list(module.parameters()) if module is not None else []
    seen: set[fx.Node] = set()
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node) and a not in seen:
            seen.add(a)
            (weights if a.op == "get_attr" else activations).extend(tensor_values(value_of(a)))
    return _Op(node, name, module, activations, weights, value_of(node))


def _assemble(op: _Op, work: _Work, params: list[nn.Parameter]) -> NodeCost:
    out_bytes = value_bytes(op.out)
    param_count = sum(p.numel() for p in params)
    param_bytes = sum(tensor_bytes(p) for p in params)
    shape = dict(family=work.family, min_dim=work.min_dim)
    if work.kind in FREE_KINDS:
        return NodeCost(0.0, 0.0, 0.0, 0.0, param_count, param_bytes, 0, out_bytes, work.kind, **shape)
    reads = work.reads if work.reads is not None else sum(
        tensor_bytes(t) for t in op.activations + op.weights)
    # Gradients flow from a floating output to floating inputs or weights; comparisons,
    # index arithmetic and argmax have no backward and keep nothing.
    differentiable = any(t.is_floating_point() for t in tensor_values(op.out)) and (
        bool(op.weights) or any(t.is_floating_point() for t in op.activations))
    if not differentiable:
        return NodeCost(float(work.flops), 0.0, float(reads + out_bytes), 0.0,
                        param_count, param_bytes, 0, out_bytes, work.kind, **shape)
    bwd_flops = work.bwd_flops if work.bwd_flops is not None else _BWD_RATIO.get(work.kind, 1.0) * work.flops
    return NodeCost(float(work.flops), float(bwd_flops), float(reads + out_bytes),
                    float(out_bytes + reads + work.saved), param_count, param_bytes,
                    int(work.saved), out_bytes, work.kind, **shape)


def _node_cost(gm: fx.GraphModule, node: fx.Node, params: list[nn.Parameter]) -> NodeCost:
    free = _Op(node, node.op, None, [], [], value_of(node))
    if node.op in ("placeholder", "get_attr", "output"):
        return _assemble(free, _Work("none"), params)
    module = None
    if node.op == "call_module":
        try:
            module = gm.get_submodule(node.target)
        except AttributeError:
            pass
    if not any(True for _ in tensor_values(value_of(node))):
        return _assemble(free, _Work("none"), params)  # shapes, asserts, guards: no tensor work
    if module is not None and _module_rule(module) is None and any(True for _ in module.children()):
        parts = _composite_parts(node, module)
        if parts is not None:
            return _composite(parts, params, value_of(node))
    name, rule = _rule_for(node, module)
    op = _make_op(gm, node, name, module)
    try:
        work = rule(op)
    except (AttributeError, IndexError, TypeError, ValueError, RuntimeError, StopIteration) as e:
        warnings.warn(f"autopipe cost: rule {name!r} failed on node {node.name} "
                      f"({node.op} {node.target}): {e!r}; costed as elementwise", stacklevel=2)
        work = _DEFAULT(op)
    return _assemble(op, work, params)


# [Note: composite modules]
# A call_module node whose module has no rule but has children is a block that a route kept
# opaque: the sequence route's items (ResNet's layer1, an nn.Sequential of Bottlenecks), a
# user's leaf_modules, or a module whose forward branches on self.training (timm's Swin
# WindowAttention, LeViT's Attention). It is priced by what it runs: the module alone is
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
        n.meta["val"] = to_meta(super().run_node(n))
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
