"""Shape propagation on fake tensors: fills ``node.meta["val"]`` without running real kernels.

Works for models on the meta device (planning a model too big for the machine) and for real
models alike: parameters are turned into fake tensors on the fly, so nothing is allocated.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ..graph import MODULE_KEY
from ..memory_format import channels_last_dense

__all__ = ["propagate_shapes", "to_meta", "as_the_gpu_lays_it_out"]

# [Note: a convolution's layout as the GPU makes it]
# The traced values' strides say which layout each tensor crosses a stage boundary in ([Note:
# boundary layout] in memory_format.py). A convolution on the GPU (cuDNN) writes channels-last
# where its input or its weight is channels-last; the meta and CPU kernels that shape
# propagation runs may not: ResNet's 7x7 stem over 3 channels comes out plain contiguous there.
# Its maps would then cross a boundary NCHW and reach the next stage's batch norm on its NCHW
# kernel (128 x 64 x 112 x 112 in bf16 on an H200: 4.46 ms forward and backward, 1.19 ms in
# NHWC). So a convolution's traced output is laid out as cuDNN lays it out; the ops after it
# (norms, activations, pooling, residual adds) keep that layout as they would on the GPU.
_CONV_FUNCTIONS = {torch.conv2d, torch.nn.functional.conv2d, torch.ops.aten.convolution.default,
                   torch.ops.aten.conv2d.default}


# Fused attention on the GPU (flash, memory-efficient) writes its (B, heads, tokens, dim) output
# as (B, tokens, heads, dim): the transpose and reshape that merge the heads after it are
# views there, where the meta and CPU math kernels would make them copies.
_ATTENTION_FUNCTIONS = {torch.nn.functional.scaled_dot_product_attention,
                        torch.ops.aten.scaled_dot_product_attention.default}


def _as_fused_attention_writes_it(result: Any) -> Any:
    if isinstance(result, torch.Tensor) and result.dim() == 4:
        return result.transpose(1, 2).contiguous().transpose(1, 2)
    return result


def _channels_last(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and channels_last_dense(t)


def _is_convolution(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` runs a 2-d convolution (an ``nn.Conv2d`` or a conv function)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), nn.Conv2d)
    return node.op == "call_function" and node.target in _CONV_FUNCTIONS


def as_the_gpu_lays_it_out(interpreter: fx.Interpreter, node: fx.Node, result: Any) -> Any:
    """``result`` of ``node`` as ``interpreter`` ran it; of a convolution, channels-last where its
    input or weight is (see [Note: a convolution's layout as the GPU makes it]); of fused
    attention, tokens before heads."""
    gm = interpreter.module
    if node.op == "call_function" and node.target in _ATTENTION_FUNCTIONS:
        return _as_fused_attention_writes_it(result)
    if not _is_convolution(gm, node):
        return result
    if not (isinstance(result, torch.Tensor) and result.dim() == 4) or _channels_last(result):
        return result
    args, _ = interpreter.fetch_args_kwargs_from_env(node)
    weight = gm.get_submodule(str(node.target)).weight if node.op == "call_module" else \
        (args[1] if len(args) > 1 else None)
    if _channels_last(args[0] if args else None) or _channels_last(weight):
        return result.contiguous(memory_format=torch.channels_last)
    return result


def to_meta(value: Any) -> Any:
    """Replace every tensor in ``value`` by a meta tensor of the same shape, stride and dtype."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
        return x

    return pytree.tree_map(convert, value)


class _Propagator(fx.Interpreter):
    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # A batch norm's output is its input's shape and dtype. Running it in fake mode reads
        # ``num_batches_tracked`` as a Python float where momentum is None, which torch 2.11's
        # fake tensors refuse (DataDependentOutputException); the shape needs no statistics.
        module = self.fetch_attr(target)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and args and isinstance(args[0], torch.Tensor):
            return torch.empty_like(args[0])
        return super().call_module(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = as_the_gpu_lays_it_out(self, n, super().run_node(n))
        except Exception as exc:  # name the node: the raw error rarely does
            where = n.meta.get(MODULE_KEY) or "the model's top level"
            raise TraceError(
                f"shape propagation failed at node '{n.name}' ({n.op} {n.target}) in {where}: "
                f"{type(exc).__name__}: {exc}. Check that example_inputs are one micro-batch of the "
                f"shape the model expects."
            ) from exc
        n.meta["val"] = to_meta(result)
        return result


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Run ``gm`` on fake copies of ``example_inputs``, recording every node's value in its meta.

    Returns the (meta) output value.
    """
    # Fake mode runs ops on real tensors alone for real: a train-mode batch norm would bump the
    # model's num_batches_tracked. Buffers are swapped for copies while the graph runs.
    buffers = {f"gm.{n}": b.clone() for n, b in gm.named_buffers()}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_inputs = [
            mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs
        ]
        out = torch.func.functional_call(_Running(gm), buffers, tuple(fake_inputs))
    return to_meta(out)


class _Running(nn.Module):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any) -> Any:
        return _Propagator(self.gm).run(*args)
