"""The tables that pick a pricing rule (op_rules.py) for a node: by ATen or method name, by
Python function, by leaf module class. Register a rule for a module of your own with
``autopipe.partition.cost.MODULE_RULES[MyModule] = rule``.
"""
from __future__ import annotations

import builtins
import operator
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .op_rules import (DEFAULT, Rule, conv, copy, dropout, einsum, elementwise, embedding, linear_module, matmul,
                       maybe_copy, mha_module, native_mha, norm, pool, reduction, sdpa, view)
from .view_rules import expand, getitem, index, reshape, split

__all__ = ["NAMED_RULES", "FUNCTION_NAMES", "MODULE_RULES", "rule_for", "module_rule"]


# The dispatch table for call_function and call_method nodes. Keys are op names shared by
# ATen overloads (aten.add_.Tensor -> "add"), Tensor methods (x.add_ -> "add") and the
# torch / torch.nn.functional / operator callables listed in FUNCTION_NAMES.
# Extend it with NAMED_RULES["my_op"] = rule; a rule maps an Op to a Work.
NAMED_RULES: dict[str, Rule] = {
    **dict.fromkeys(
        ["permute", "transpose", "t", "squeeze", "unsqueeze", "detach", "alias", "as_strided", "movedim",
         "swapaxes", "swapdims", "size", "dim", "numel", "sym_size", "getattr", "lift_fresh_copy", "identity"],
        view),
    # Views that copy where the strides forbid a view, or in backward: [Note: views that copy].
    **dict.fromkeys(["view", "_unsafe_view", "reshape", "view_as", "reshape_as", "flatten", "unflatten"], reshape),
    **dict.fromkeys(["split", "split_with_sizes", "chunk", "tensor_split", "unbind"], split),
    **dict.fromkeys(["select", "slice", "narrow"], index),
    **dict.fromkeys(["expand", "expand_as"], expand),
    "getitem": getitem,
    **dict.fromkeys(["contiguous", "to", "type_as", "float", "half", "bfloat16", "double", "type"],
                    maybe_copy),
    **dict.fromkeys(["cat", "concat", "concatenate", "stack", "clone", "copy", "_to_copy", "pad",
                     "constant_pad_nd", "repeat", "tile", "roll", "index_select", "flip"], copy),
    **dict.fromkeys(["linear", "mm"], matmul(0, "input", "self")),
    **dict.fromkeys(["matmul", "bmm"], matmul(0, "input", "self", batched=True)),
    "addmm": matmul(1, "mat1"),
    "baddbmm": matmul(1, "batch1", batched=True),
    "einsum": einsum,
    **dict.fromkeys(["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                     "conv_transpose3d", "convolution", "_convolution"], conv),
    **dict.fromkeys(["scaled_dot_product_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu"], sdpa),
    "_native_multi_head_attention": native_mha,
    **dict.fromkeys(["layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm",
                     "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                     "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                     "group_norm", "native_group_norm", "instance_norm"], norm),
    **dict.fromkeys(["softmax", "_softmax", "log_softmax", "_log_softmax"], elementwise(5.0, "output", "softmax")),
    **dict.fromkeys(["relu", "sigmoid", "tanh", "elu", "hardtanh", "relu6"], elementwise(1.0, "output")),
    **dict.fromkeys(["gelu", "silu", "mish", "softplus", "hardswish", "hardsigmoid",
                     "leaky_relu", "prelu"], elementwise(4.0, "inputs")),
    **dict.fromkeys(["add", "sub", "rsub", "neg", "radd"], elementwise(1.0, "none")),
    **dict.fromkeys(["mul", "div", "truediv", "floordiv"], elementwise(1.0, "operands")),
    **dict.fromkeys(["dropout", "native_dropout", "feature_dropout", "alpha_dropout",
                     "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"], dropout),
    "embedding": embedding,
    **dict.fromkeys(["max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                     "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
                     "adaptive_max_pool3d"], pool(True)),
    **dict.fromkeys(["avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                     "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
                     "_adaptive_avg_pool3d"], pool(False)),
    **dict.fromkeys(["sum", "mean", "nansum"], reduction(False)),
    **dict.fromkeys(["amax", "amin", "var", "std", "norm", "logsumexp", "prod", "cumsum"],
                    reduction(True)),
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
    nn.Linear: linear_module,
    nn.modules.conv._ConvNd: conv,
    nn.LayerNorm: norm, nn.RMSNorm: norm, nn.GroupNorm: norm,
    nn.modules.batchnorm._BatchNorm: norm, nn.modules.instancenorm._InstanceNorm: norm,
    nn.MultiheadAttention: mha_module,
    nn.Embedding: embedding,
    nn.modules.dropout._DropoutNd: dropout,
    nn.Identity: view, nn.Flatten: reshape, nn.Unflatten: reshape,
    nn.Softmax: NAMED_RULES["softmax"], nn.LogSoftmax: NAMED_RULES["softmax"],
    **dict.fromkeys([nn.ReLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.Hardtanh], NAMED_RULES["relu"]),
    **dict.fromkeys([nn.GELU, nn.SiLU, nn.Mish, nn.Softplus, nn.Hardswish, nn.Hardsigmoid,
                     nn.LeakyReLU, nn.PReLU], NAMED_RULES["gelu"]),
    nn.modules.pooling._MaxPoolNd: pool(True), nn.modules.pooling._AdaptiveMaxPoolNd: pool(True),
    nn.modules.pooling._AvgPoolNd: pool(False), nn.modules.pooling._AdaptiveAvgPoolNd: pool(False),
}

_warned_modules: set[type] = set()


def _canonical(name: str) -> str:
    # In-place variants cost what their out-of-place op costs: add_ -> add, relu_ -> relu.
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def module_rule(module: nn.Module) -> tuple[str, Rule] | None:
    for cls in type(module).__mro__:
        if cls in MODULE_RULES:
            return cls.__name__, MODULE_RULES[cls]
    return None


def rule_for(node: fx.Node, module: nn.Module | None) -> tuple[str, Rule]:
    if node.op == "call_module":
        found = module_rule(module) if module is not None else None
        if found is not None:
            return found
        if module is not None and any(True for _ in module.parameters()) and type(module) not in _warned_modules:
            _warned_modules.add(type(module))
            warnings.warn(f"autopipe cost: no rule for leaf module {type(module).__qualname__} "
                          f"(node {node.name}, target {node.target}); costed as elementwise. "
                          f"Add one: autopipe.partition.cost.MODULE_RULES[{type(module).__name__}] = rule",
                          stacklevel=3)
        return "module", DEFAULT
    if node.op == "call_method":
        name = _canonical(str(node.target))
    elif isinstance(node.target, torch._ops.OpOverload):
        name = _canonical(node.target.name().split("::", 1)[-1].split(".", 1)[0])
    elif isinstance(node.target, torch._ops.OpOverloadPacket):
        name = _canonical(str(node.target).split(".", 1)[-1])
    else:
        name = FUNCTION_NAMES.get(node.target, "") if _hashable(node.target) else ""
    return name, NAMED_RULES.get(name, DEFAULT)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
