"""The pricing rules: what one node of each kind computes, moves and saves for backward, read
from the shapes of its operands and output. ``cost.py`` holds the tables that pick a rule per
node and turns a rule's :class:`Work` into a ``NodeCost`` by [Note: cost conventions].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from torch.utils import _pytree as pytree

from autopipe.graph import tensor_bytes, tensor_values, value_of
from autopipe.memory_format import channels_last_dense

__all__ = ["Op", "Work", "Rule", "STAT_BYTES", "BROADCAST", "SCALE", "DEFAULT"] + [
    "view", "maybe_copy", "copy", "matmul", "einsum", "conv", "sdpa", "native_mha", "norm", "elementwise",
    "dropout", "embedding", "pool", "reduction", "linear_module", "mha_module"]

STAT_BYTES = 4  # norm statistics are fp32 whatever the activation dtype


@dataclass
class Op:
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

    @property
    def differentiable(self) -> bool:
        """Whether gradients flow: a floating output from floating inputs or weights (comparisons,
        index arithmetic and argmax have no backward)."""
        return any(t.is_floating_point() for t in tensor_values(self.out)) and (
            bool(self.weights) or any(t.is_floating_point() for t in self.activations))

    def floating_bytes(self) -> int:
        """Bytes of the floating-point activations: what a rule saves for backward."""
        return sum(tensor_bytes(t) for t in self.activations if t.is_floating_point())


@dataclass
class Work:
    """A rule's answer; ``_assemble`` turns it into a NodeCost by the shared conventions."""

    kind: str
    flops: float = 0.0
    bwd_flops: float | None = None  # None: flops * _BWD_RATIO[kind] (1 if absent)
    saved: int = 0
    reads: float | None = None  # None: every activation and weight is read once
    family: str = ""
    min_dim: int = 0
    fwd_free: bool = False  # launches nothing forward: a view whose backward copies
    bwd_bytes: float | None = None  # None: by [Note: cost conventions]; 0 with no bwd_flops: no kernel
    shape: str = ""  # the kernel's exact shape, where a calibration may know it by name (convolutions)
    strided: bool = False  # a convolution with a stride over one ([Note: strided depthwise] in calibration.py)


Rule = Callable[[Op], Work]


def view(op: Op) -> Work:
    return Work("view")


def copy(op: Op) -> Work:
    # clone passes its gradient through. roll computes each element's source index, forward and
    # backward: about 3x a plain copy's time per byte on an H100 (Swin's shifted windows).
    return Work("copy", bwd_bytes=0.0 if op.name == "clone" else None, family="roll" if op.name == "roll" else "")


def maybe_copy(op: Op) -> Work:
    # .contiguous() and .to() return their input when it already fits; meta and fake
    # tensors keep strides, so the propagated values tell (LayerNorm2d's output, for one,
    # is channels-last, and permuting it back gives a contiguous tensor).
    x, y = (op.activations[0] if op.activations else None), op.out_tensor
    same = x is not None and (x.shape, x.stride(), x.dtype, x.device) == (y.shape, y.stride(), y.dtype, y.device)
    if same:
        return Work("view")
    # contiguous() passes its gradient through; a cast casts it back.
    return Work("copy", bwd_bytes=0.0 if op.name == "contiguous" else None)


def _tensor_operands(node: fx.Node) -> int:
    # Counted with repeats: x * x saves x, x * gamma saves x (gamma is alive anyway).
    return sum(1 for a in pytree.tree_leaves((node.args, node.kwargs))
               if isinstance(a, fx.Node) and isinstance(value_of(a), torch.Tensor))


def elementwise(flops_per_element: float = 1.0, saves: str = "inputs", family: str = "") -> Rule:
    """saves: "inputs" (floating inputs), "output", "operands" (both, if two tensors), "none".
    family: the kernel's, where it is not a plain elementwise one ("softmax": a row reduction)."""

    def rule(op: Op) -> Work:
        out = op.out_tensor
        saved = {
            "inputs": lambda: op.floating_bytes(),
            "output": lambda: tensor_bytes(out),
            "operands": lambda: op.floating_bytes() if _tensor_operands(op.node) >= 2 else 0,
            "none": lambda: 0,
        }[saves]()
        kernel = (SCALE if _learned_scale(op.node, out) else BROADCAST) if _broadcast_with_gradient(op.node, out) \
            else family
        return Work("elementwise", flops_per_element * out.numel(), saved=saved, family=kernel)

    return rule


# [Note: broadcast operands]
# An elementwise op whose smaller operand is broadcast over its output and learns (ConvNeXt's
# layer scale ``x * gamma``, EfficientNet's squeeze-excite gate, ViT's position embedding, Swin's
# relative position bias) sums its gradient over the broadcast dims in backward: a reduction
# over the whole output, not an elementwise kernel. On an H100 ConvNeXt-B's layer scales take
# 180 us backward at 128 images against 30 us priced as elementwise. Such an op is a family of
# its own (BROADCAST: "elementwise:broadcast/64MiB"), fitted apart. An operand that gets no
# gradient (a buffer, a constant, the model's input; Swin's attention mask) does not count.
BROADCAST = "broadcast"
# A learned scale of a few elements (ConvNeXt's layer scale: a parameter of C elements over
# N x H x W x C) sums each over the whole output, a reduction of few long columns: in the H200's
# calibration rows ConvNeXt's took 2.2-3.5x backward what the broadcast family's factor priced,
# MobileNetV3's and RegNetY's squeeze-excite gates 1.1-2.7x. Such an op is a family of its own
# (SCALE: "elementwise:scale/64MiB").
SCALE, SCALE_ELEMENTS = "scale", 4096


def _broadcast_with_gradient(node: fx.Node, out: torch.Tensor) -> bool:
    for arg in node.all_input_nodes:
        value = value_of(arg)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and 0 < value.numel() < out.numel() \
                and _gets_gradient(arg):
            return True
    return False


def _learned_scale(node: fx.Node, out: torch.Tensor) -> bool:
    """Whether an operand of ``node`` is a parameter of at most SCALE_ELEMENTS elements,
    broadcast over its output (through ops of one tensor input)."""
    for arg in node.all_input_nodes:
        value = value_of(arg)
        if isinstance(value, torch.Tensor) and 0 < value.numel() <= min(SCALE_ELEMENTS, out.numel() - 1) \
                and _is_parameter(_origin(arg)):
            return True
    return False


def _gets_gradient(node: fx.Node) -> bool:
    """Whether ``node``'s value gets a gradient: it comes, through ops of one tensor input
    (reshape, unsqueeze, expand...), from a parameter or from a computed activation."""
    node = _origin(node)
    return node.op != "placeholder" and (node.op != "get_attr" or _is_parameter(node))


def _origin(node: fx.Node) -> fx.Node:
    """The node ``node``'s value comes from through ops of one tensor input (at most 8)."""
    for _ in range(8):
        inputs = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
        if node.op not in ("call_function", "call_method") or len(inputs) != 1:
            break
        node = inputs[0]
    return node


def _is_parameter(node: fx.Node) -> bool:
    if node.op != "get_attr":
        return False
    try:
        node.graph.owning_module.get_parameter(str(node.target))
    except AttributeError:
        return False
    return True


def reduction(saves_input: bool) -> Rule:
    def rule(op: Op) -> Work:
        x = op.arg(0, "input", "self")
        return Work("reduction", x.numel(), saved=op.floating_bytes() if saves_input else 0)

    return rule


def _contract(op: Op, k: int, *, batched: bool = False) -> Work:
    out = op.out_tensor
    n = out.shape[-1] if out.dim() else 1
    # A batched product's rows (tokens) bound its efficiency; a linear layer's rows are every
    # leading dim, batch included, and do not (they are many): its weight's shape does.
    dims = (out.shape[-2] if out.dim() > 1 else 1, n, k) if batched else (n, k)
    return Work("matmul", 2.0 * out.numel() * k, saved=op.floating_bytes(), family="gemm",
                 min_dim=int(min(dims)))


def matmul(first: int, *names: str, batched: bool = False) -> Rule:
    # The output numel covers batch broadcasting and 1-D operands; k is the contracted size.
    return lambda op: _contract(op, op.arg(first, *names).shape[-1], batched=batched)


def linear_module(op: Op) -> Work:
    return _contract(op, op.module.weight.shape[1])  # not in_features: a tp shard's is the original's


def _conv_flops(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> float:
    # As torch.utils.flop_counter: every weight element meets every output (input, when
    # transposed) position once; weight is [C_out, C_in/groups, *k] ([C_in, C_out/groups, *k]).
    spatial = w.dim() - 2
    batch = math.prod(x.shape[: x.dim() - spatial - 1])  # 1 for an unbatched input
    positions = math.prod((x if transposed else out).shape[x.dim() - spatial :])
    return 2.0 * batch * math.prod(w.shape) * positions


def conv(op: Op) -> Work:
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
    # A depthwise conv (one input channel per group) runs on vector units, memory-bound; other
    # grouped convs run kernels of their own ([Note: grouped convolutions] in calibration.py).
    depthwise = groups > 1 and (w.shape[0] if transposed else w.shape[1]) == 1
    family = "dwconv" if depthwise else "gconv" if groups > 1 else "conv"
    shape = _conv_shape(op, x, w, groups)
    return Work("matmul", _conv_flops(x, w, op.out_tensor, transposed), saved=op.floating_bytes(),
                 family=family, min_dim=int(min(per_group, w.shape[1])), shape=shape, strided=conv_strided(shape))


def _conv_shape(op: Op, x: torch.Tensor, w: torch.Tensor, groups: int) -> str:
    """A convolution's exact shape: input, weight, stride, padding, dilation, groups and the
    input's layout ([Note: kernels off their class] in calibration.py)."""
    if op.module is not None:
        geometry = (op.module.stride, op.module.padding, op.module.dilation)
    else:
        geometry = tuple(op.arg(i, name, default=d) for i, name, d in
                         ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1)))
    layout = "nhwc" if channels_last_dense(x) else "nchw"

    def listed(v: Any) -> str:  # an int stride, padding or dilation holds for every spatial dim
        return ",".join(map(str, v if isinstance(v, (tuple, list, torch.Size)) else [v] * (w.dim() - 2)))

    fields = (("x", x.shape), ("w", w.shape), *zip("spd", geometry))
    return " ".join([*(f"{k}={listed(v)}" for k, v in fields), f"g={groups}", layout])


def conv_strided(shape: str) -> bool:
    """Whether a convolution of shape ``shape`` (``_conv_shape``'s string) strides over more than
    one position in some spatial dim; False for any other string."""
    stride = next((tok[2:] for tok in shape.split() if tok.startswith("s=")), "")
    return any(v.isdigit() and int(v) > 1 for v in stride.split(","))


def _groups(op: Op) -> int:
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


def einsum(op: Op) -> Work:
    equation = op.node.args[0]
    operands = [value_of(a) for a in pytree.tree_leaves(op.node.args[1:]) if isinstance(a, fx.Node)]
    if len(operands) != 2:
        return DEFAULT(op)
    # Two operands: one multiply-add per combination of all indices (kept and contracted).
    macs = math.prod(_einsum_sizes(equation, operands).values())
    return Work("matmul", 2.0 * macs, saved=op.floating_bytes(), family="gemm")


def sdpa(op: Op) -> Work:
    q, k, v = op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value")
    out = op.out_tensor
    bh = math.prod(out.shape[:-2])  # batch x query heads (GQA keys broadcast to them)
    scores = bh * q.shape[-2] * k.shape[-2]
    e, ev = q.shape[-1], v.shape[-1]
    saved = op.floating_bytes() + tensor_bytes(out) + bh * q.shape[-2] * STAT_BYTES
    return Work("attention", 2.0 * scores * (e + ev), 2.0 * scores * (3 * e + 2 * ev), saved)


def _mha_work(op: Op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              embed: int, heads: int, batch_first: bool, need_weights: bool) -> Work:
    n = 1 if q.dim() == 2 else q.shape[0 if batch_first else 1]
    tq, tk = q.numel() // q.shape[-1], k.numel() // k.shape[-1]  # tokens: n*L and n*S
    proj = 2.0 * embed * (tq * q.shape[-1] + tk * k.shape[-1] + tk * v.shape[-1] + tq * embed)
    attn = 4.0 * tq * (tk // n) * embed  # QK^T and PV over all heads
    item = q.element_size()
    saved = op.floating_bytes() + item * embed * (2 * tq + 2 * tk)
    saved += heads * tq * (tk // n) * item if need_weights else heads * tq * STAT_BYTES
    return Work("attention", proj + attn, 2.0 * (proj + attn), saved)


def mha_module(op: Op) -> Work:
    m = op.module
    need = bool(op.arg(4, "need_weights", default=True))
    return _mha_work(op, op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value"),
                     m.embed_dim, m.num_heads, m.batch_first, need)


def native_mha(op: Op) -> Work:
    need = bool(op.arg(10, "need_weights", default=True))
    return _mha_work(op, op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value"),
                     op.arg(3, "embed_dim"), op.arg(4, "num_head"), True, need)


_ROW_NORMS = ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")

# [Note: short rows]
# A layer norm's kernel reduces each row (the elements one statistic covers) with a block of
# threads, so its speed follows the row's length as well as its bytes. In the H200's
# calibration rows (channels-last, bf16 autocast), the forward layer norms over rows of 96-128
# elements (ConvNeXt's and Swin's first stage) took 1.9-3.0x what their class of bytes priced,
# over 192-256 1.35-1.9x, over 512 1.0-1.34x, over 1024-2048 0.8-1.2x: one factor per bytes
# bucket averaged them, and ConvNeXt-B's first two of eight stages at 32 images ran 1.2x their
# price on the GPU alone. So a row norm's ``min_dim`` is its row length, and rows of SHORT_ROW
# elements or fewer are a class of their own ("norm:row:short/64MiB"); a table fitted without
# them prices them as the row norms of their bytes.


def _norm_groups(op: Op, x: torch.Tensor) -> int:
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


def norm(op: Op) -> Work:
    x = op.arg(0, "input")
    stats = 1 if isinstance(op.module, nn.RMSNorm) or "rms" in op.name else 2
    saved = tensor_bytes(x) + stats * STAT_BYTES * _norm_groups(op, x)
    batch = isinstance(op.module, nn.modules.batchnorm._BatchNorm) or "batch_norm" in op.name
    # A batch norm's parallelism is its channels (one reduction over N x H x W each): 64
    # channels over large maps leave most of a GPU idle, whatever the bytes.
    # A row norm's kernel gives each row (the elements one statistic covers) a block of threads:
    # short rows leave them idle ([Note: short rows]).
    return Work("norm", 5.0 * op.out_tensor.numel(), saved=saved, family="batch" if batch else "row",
                min_dim=_norm_groups(op, x) if batch else x.numel() // max(_norm_groups(op, x), 1))


def dropout(op: Op) -> Work:
    # A module's cost is its training cost; a function's train flag was fixed when traced.
    if op.module is not None:
        p, train = op.module.p, True
    else:
        p = op.arg(1, "p", default=0.5)
        train = op.arg(2, "train", "training", default=True)
    if p == 0 or train is False:
        return Work("view")  # ATen returns its input: no kernel, no mask
    n = op.out_tensor.numel()
    return Work("elementwise", 2.0 * n, saved=n)  # bool mask, 1 byte per element


def embedding(op: Op) -> Work:
    out = op.out_tensor
    indices = [t for t in op.activations + op.weights if not t.is_floating_point()]
    index_bytes = sum(tensor_bytes(t) for t in indices)
    # Reads the gathered rows, not the whole table; backward scatter-adds one row per token.
    return Work("copy", 0.0, float(out.numel()), index_bytes, index_bytes + tensor_bytes(out))


def pool(max_pool: bool) -> Rule:
    def rule(op: Op) -> Work:
        x = op.arg(0, "input")
        saved = tensor_bytes(x) + (8 * op.out_tensor.numel() if max_pool else 0)
        return Work("reduction", x.numel(), saved=saved, family="pool")

    return rule


DEFAULT: Rule = elementwise(1.0, "inputs")
