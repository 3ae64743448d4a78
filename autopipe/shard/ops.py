"""What the sharding passes know about ops: names, module kinds, elementwise behaviour.

One table for both tracing routes: fx nodes call ``torch``/``operator`` functions and tensor
methods, export nodes call ATen overloads; both are reduced to one canonical op name.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = []

LINEAR_TYPES: tuple[type, ...] = (nn.Linear,)
CONV_TYPES: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
BATCHNORM_TYPES: tuple[type, ...] = (nn.modules.batchnorm._BatchNorm,)
DROPOUT_TYPES: tuple[type, ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)
ACTIVATION_TYPES: tuple[type, ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardswish,
    nn.Hardsigmoid, nn.Hardtanh, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.Threshold, nn.LogSigmoid,
)
# Per-sample masks (stochastic depth) must agree across the shards of one sample: these
# keep the default generator even on sharded activations.
SAMPLEWISE_NAMES = ("DropPath", "StochasticDepth")

POINTWISE = frozenset({
    "add", "sub", "mul", "div", "truediv", "floordiv", "neg", "pow", "radd", "rsub", "rmul",
    "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "gelu", "relu", "relu_",
    "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "clamp", "clip", "erf", "sin",
    "cos", "where", "masked_fill", "hardswish", "hardsigmoid", "mish", "softplus", "leaky_relu",
    "elu", "selu", "celu", "relu6", "hardtanh", "logsigmoid", "contiguous", "clone", "to",
    "float", "half", "bfloat16", "double", "type", "type_as", "detach", "alias", "_to_copy",
})
DROPOUT_FUNCTIONS = frozenset({"dropout", "dropout_", "feature_dropout", "alpha_dropout"})
RESHAPES = frozenset({"view", "reshape", "_unsafe_view"})
SHAPE_ONLY = frozenset({"flatten", "squeeze", "unsqueeze"})
PERMUTES = frozenset({"permute", "transpose", "swapaxes", "t"})
SPLITS = frozenset({"unbind", "split", "chunk", "split_with_sizes"})
JOINS = frozenset({"cat", "concat", "concatenate", "stack"})
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
MATMUL = frozenset({"matmul", "bmm"})
LAYER_NORMS = frozenset({"layer_norm", "native_layer_norm"})
SDPA = frozenset({"scaled_dot_product_attention"})
SIZE_QUERIES = frozenset({"size", "sym_size", "dim", "getattr"})


def op_name(node: fx.Node) -> str:
    """Canonical name of a call_function/call_method target: ``aten.view.default`` -> ``view``."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::", 1)[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).split(".", 1)[-1]
    return getattr(target, "__name__", str(target))


def is_aten_pointwise(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags


def module_of(node: fx.Node, gm: fx.GraphModule) -> nn.Module | None:
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def is_dropout(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return isinstance(module_of(node, gm), DROPOUT_TYPES)
    return node.op in ("call_function", "call_method") and op_name(node) in DROPOUT_FUNCTIONS


def is_samplewise(node: fx.Node, gm: fx.GraphModule) -> bool:
    return node.op == "call_module" and type(module_of(node, gm)).__name__ in SAMPLEWISE_NAMES


def is_elementwise(node: fx.Node, gm: fx.GraphModule) -> bool:
    """An op acting on each element alone (broadcasting allowed): it keeps any sharding."""
    if node.op == "call_module":
        m = module_of(node, gm)
        return isinstance(m, ACTIVATION_TYPES + DROPOUT_TYPES) or is_samplewise(node, gm)
    if node.op not in ("call_function", "call_method"):
        return False
    name = op_name(node)
    if name in DROPOUT_FUNCTIONS:
        return True
    return name in POINTWISE or is_aten_pointwise(node)


def is_linear(node: fx.Node, gm: fx.GraphModule) -> bool:
    return node.op == "call_module" and isinstance(module_of(node, gm), LINEAR_TYPES)


def is_conv(node: fx.Node, gm: fx.GraphModule) -> bool:
    m = module_of(node, gm)
    return isinstance(m, CONV_TYPES) and m.groups == 1  # type: ignore[union-attr]


def is_batchnorm(node: fx.Node, gm: fx.GraphModule) -> bool:
    return isinstance(module_of(node, gm), BATCHNORM_TYPES)


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` given by keyword or at position ``index``."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def param_inputs(node: fx.Node) -> list[fx.Node]:
    """The ``get_attr`` inputs of a node (the parameters a call_function uses)."""
    return [a for a in node.all_input_nodes if a.op == "get_attr"]


# [Note: locating the split dim across a reshape]
# A split activation is described by (dim, outer): dim `dim` holds `outer` stacked blocks,
# each cut into tp contiguous pieces (outer=3 after a fused qkv, else 1). A reshape keeps
# the flat order, so the split lands on the first output dim j whose prefix product equals
# the input prefix product (dims before `dim`) times a divisor q of `outer`, and whose size
# is a multiple of tp * outer/q: that dim is cut into tp pieces, and the size written for it
# in the graph (an int, or a node computed from x.shape) is divided by tp. timm's
# (B, N, 3C) -> (B, N, 3, heads, hd) lands on `heads` (q = 3); (B, N, heads, hd) -> (B, N, C)
# lands on C. Sizes that already are local (read from a split tensor's shape) stay as they are.

def locate_split(src: tuple[int, ...], out: tuple[int, ...], dim: int, outer: int, tp: int) -> tuple[int, int] | None:
    """Where dim ``dim`` (``outer`` blocks, each cut in ``tp``) of shape ``src`` lands in the
    reshape to ``out``: ``(output dim, its outer)``, or None if no output dim holds the cut."""
    pin, prefix = math.prod(src[:dim]), 1
    for j, size in enumerate(out):
        if prefix % pin == 0 and outer % (prefix // pin) == 0 and size > 1:
            rest = outer // (prefix // pin)
            if size % (tp * rest) == 0:
                return j, rest
        prefix *= size
    return None


def indexed_dim(index: Any, ndim: int, dim: int) -> int | None:
    """Where dim ``dim`` of an ``ndim``-d tensor goes under ``x[index]``; None if indexed."""
    items = list(index) if isinstance(index, tuple) else [index]
    ellipsis = ndim - sum(1 for i in items if i is not None and i is not Ellipsis)
    out_dim = in_dim = 0
    for it in items:
        if it is Ellipsis:
            if in_dim <= dim < in_dim + ellipsis:
                return out_dim + dim - in_dim
            in_dim, out_dim = in_dim + ellipsis, out_dim + ellipsis
        elif it is None:
            out_dim += 1
        elif in_dim == dim:
            return out_dim if it == slice(None) else None
        else:
            in_dim, out_dim = in_dim + 1, out_dim + (0 if isinstance(it, int) else 1)
    return out_dim + dim - in_dim
