"""Mixed precision for linear layers: weights cast once per step, weight gradients made in fp32.

[Note: weight casts]
Under autocast every ``nn.Linear`` casts its fp32 weight and bias to bf16 on each call, and
its backward makes the weight gradient in bf16, then casts it to fp32 for ``.grad``. A
pipeline stage calls each layer once per micro-batch, so with m micro-batches these casts
run m times per step: for ViT-L in micro-batches of 32 on an H200 they are about a tenth of
the GPU's time (benchmarks/microbatch_efficiency.py: the bf16 copy and fp32 copy kernels).

``WeightCasts.install`` gives each plain ``nn.Linear`` of a stage a low-precision copy of
its weight and bias and a forward that reads it; ``refresh`` recasts every copy, once per
step, before the first micro-batch (``ParallelModel`` calls it at each train and eval step).
The backward computes the weight gradient directly in fp32 from the bf16 operands (one
GEMM with fp32 output, ``torch.mm(..., out_dtype=torch.float32)`` on CUDA), which autograd
adds to ``.grad`` as before; the bias gradient is summed in fp32. Row-parallel layers
(shard/modules.py: the same GEMM, their bias added after the all-reduce) take the same path.

Forward results equal autocast's bit for bit (the same casts feed the same GEMM); weight
gradients are at least as precise (they are not rounded to bf16 before being accumulated).
The copies are plain tensors, never reallocated, so CUDA graphs capture reads of them and
``refresh`` (outside any graph) updates what the replays read. Other subclasses that
override ``forward`` keep autocast's path.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.nn as nn
import torch.fx
import torch.nn.functional as F

from autopipe.shard.modules import RowParallelLinear

__all__ = ["WeightCasts"]

_mm_out_dtype: bool | None = None  # whether torch.mm takes out_dtype here (CUDA, torch >= 2.8)


def _probe_mm_out_dtype(device: torch.device) -> None:
    """Finds out once, outside any traced or captured region, whether ``torch.mm`` makes fp32
    output from bf16 operands on ``device`` (``_mm_fp32`` then reads a constant)."""
    global _mm_out_dtype
    if device.type != "cuda" or _mm_out_dtype is not None:
        return
    a = torch.zeros(2, 2, device=device, dtype=torch.bfloat16)
    try:
        _mm_out_dtype = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):  # no out_dtype in this torch, or not for these operands
        _mm_out_dtype = False


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of low-precision operands, accumulated and returned in fp32."""
    if a.is_cuda and _mm_out_dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


# [Note: a gradient in rows]
# The input gradient is one GEMM over the gradient's rows, never ``grad @ weight`` on the
# gradient as it comes. A gradient whose leading dimensions do not fold into rows without a
# copy (ConvNeXt's last blocks: the global pool hands back an NCHW gradient, which reaches
# ``mlp.fc2`` through the NHWC permutation, (N, 7, 7, C) with strides (49 C, 7, 1, 49)) sends
# ``torch.matmul`` down its batched path: the weight broadcast over N x 7 rows of 7 and one bmm
# of M = 7 products. On an H100 at 128 images that bmm took 0.90 ms for each of ConvNeXt-B's
# three stage-3 ``fc2`` (benchmarks/stage_kernels.py); copied into rows, the stage holding them
# (the last of 8) went from 14.94 to 12.26 ms, in line with the seven stages before it.
class _CastLinear(torch.autograd.Function):
    """``F.linear`` on the low-precision copies; gradients for the fp32 weight and bias."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_low: torch.Tensor, bias_low: torch.Tensor | None) -> torch.Tensor:
        x_low = x.to(weight_low.dtype)
        ctx.save_for_backward(x_low, weight_low)
        ctx.has_bias = bias is not None
        return F.linear(x_low, weight_low, bias_low)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x_low, weight_low = ctx.saved_tensors
        grad = grad.to(weight_low.dtype)
        grad_x = grad_w = grad_b = None
        rows = grad.reshape(-1, grad.shape[-1])  # see [Note: a gradient in rows]
        if ctx.needs_input_grad[0]:
            grad_x = (rows @ weight_low).view(*grad.shape[:-1], weight_low.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = _mm_fp32(rows.t(), x_low.reshape(-1, x_low.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_b, None, None


# ``input`` as nn.Linear.forward names it, for callers that pass it by keyword.
def _forward(module: nn.Linear, weight_low: torch.Tensor, bias_low: torch.Tensor | None,
             input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return _CastLinear.apply(input, module.weight, module.bias, weight_low, bias_low)


def _forward_without_bias(module: nn.Linear, weight_low: torch.Tensor, _: None,
                          input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return _CastLinear.apply(input, module.weight, None, weight_low, None)


def _linear_forwards() -> dict:
    # RowParallelLinear's bias is added after the all-reduce.
    return {nn.Linear.forward: _forward, RowParallelLinear.forward: _forward_without_bias}


_FORWARDS = _linear_forwards()


def _called_modules(stage: nn.Module) -> list[nn.Module]:
    """The leaf modules a stage's graph calls (a module used only by another's forward, as
    MultiheadAttention uses its out_proj, is not called)."""
    if not isinstance(stage, torch.fx.GraphModule):
        return []
    return [stage.get_submodule(n.target) for n in stage.graph.nodes if n.op == "call_module"]


class WeightCasts:
    """The low-precision copies of a stage set's linear layers; see [Note: weight casts]."""

    def __init__(self, params: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
        self.params, self.copies = params, copies

    @classmethod
    def install(cls, stages: Iterable[nn.Module], dtype: torch.dtype) -> "WeightCasts":
        """Point every plain ``nn.Linear`` with floating weights in ``stages`` at a ``dtype`` copy."""
        params: list[torch.Tensor] = []
        copies: list[torch.Tensor] = []
        seen: set[int] = set()
        for stage in stages:
            for module in _called_modules(stage):
                forward = _FORWARDS.get(type(module).forward)
                if forward is None or id(module) in seen or not module.weight.is_floating_point():
                    continue
                seen.add(id(module))
                _probe_mm_out_dtype(module.weight.device)
                weight, bias = module.weight, module.bias if forward is _forward else None
                low = [torch.empty_like(p, dtype=dtype) if p is not None else None for p in (weight, bias)]
                module.forward = functools.partial(forward, module, *low)  # the instance's own
                for p, c in zip((weight, bias), low):
                    if p is not None:
                        params.append(p)
                        copies.append(c)
        casts = cls(params, copies)
        casts.refresh()
        return casts

    def __len__(self) -> int:
        return len(self.params)

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast every copy from its parameter (after the optimizer or a load changed them)."""
        if self.params:
            torch._foreach_copy_(self.copies, self.params)
