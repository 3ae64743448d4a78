"""Gradient tensors laid out as views of one buffer, and the buffer a run of them lies in.

[Note: gradients as views of one buffer]
The gradient all-reduce works on flat buckets. Gradients that autograd allocated lie anywhere,
so each bucket is copied into a flat tensor (``_flatten_dense_tensors``) and back (a view per
gradient, then one multi-tensor copy): two passes over every gradient, and host work per
gradient. Traced on two H200s (ResNet-50, dp=2, one micro-batch of 128 a rank, CUDA graphs;
benchmarks/pipeline_trace_gpu.py --dp 2) the step's end took 6.6-10.5 ms of host time for
1.2 ms of GPU work, the flatten and the views back 1.1-2.4 ms of it. Captured stages keep
their ``.grad`` tensors for good (the graphs add into them), so they are made views of one
buffer, in parameter order (``flat_gradients``), like DDP's ``gradient_as_bucket_view``: a
bucket of them is one tensor already, and is divided and all-reduced where it lies. Each view
has its parameter's strides (a channels-last convolution weight gets a channels-last gradient),
as autograd's gradient layout contract asks: a gradient laid out otherwise is added into with
mismatched strides at every backward, and torch warns that it "may impair performance".

Eager stages whose gradients are all-reduced (dp > 1) get the same layout (``GradientViews``,
prepared before each step's backward): autograd adds into an existing ``.grad`` in place, so the
views stay the gradients. On two gloo processes (ResNet-18, dp=2, 45 MB of gradients in 62
tensors), the all-reduce as the runtime did it, flatten, all-reduce and copy back, took 42-90 ms
against 31 ms for the all-reduce of one flat tensor of the same size.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["GradientViews", "flat_gradients", "flat_view"]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places of its storage, in some
    order of its dimensions (plain contiguous, channels-last, or any permutation of them)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def flat_gradients(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Zeroed gradient tensors for ``params`` that are consecutive views of one buffer per dtype,
    in the order of ``params``, each laid out as its parameter and holding the gradient it had. Buckets of such
    gradients are all-reduced in place ([Note: gradients as views of one buffer])."""
    views: list[torch.Tensor] = []
    offsets: dict[torch.dtype, int] = {}
    for p in params:
        offsets[p.dtype] = offsets.get(p.dtype, 0) + p.numel()
    flats = {dtype: torch.zeros(n, dtype=dtype, device=params[0].device) for dtype, n in offsets.items()}
    at = dict.fromkeys(offsets, 0)
    with torch.no_grad():
        for p in params:
            view = flats[p.dtype][at[p.dtype]:at[p.dtype] + p.numel()]
            view = view.as_strided(p.shape, p.stride()) if _dense(p) else view.view_as(p)
            at[p.dtype] += p.numel()
            if p.grad is not None:
                view.copy_(p.grad)
            views.append(view)
    return views


def flat_view(bucket: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor that ``bucket`` (same dtype) lies in back to back, or None."""
    first = bucket[0]
    storage = first.untyped_storage()
    start = end = first.storage_offset()
    for g in bucket:
        if not _dense(g) or g.storage_offset() != end or g.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += g.numel()
    return first.new_empty(0).set_(storage, start, (end - start,))


class GradientViews:
    """``.grad`` tensors for ``params`` that are views of one buffer (``flat_gradients``), kept
    for good: :meth:`prepare` hands each parameter its view back before a backward."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(dict.fromkeys(p for p in params if p.requires_grad))  # tied ones once
        self.views = flat_gradients(self.params) if self.params else []
        self._buffers = [_whole(v) for v in {v.untyped_storage().data_ptr(): v for v in self.views}.values()]

    def prepare(self) -> None:
        """Every parameter's ``.grad`` is its view again, holding the gradient it had (zero where
        it had none: ``zero_grad()`` sets them to None by default)."""
        with torch.no_grad():
            if all(p.grad is None for p in self.params):
                for flat in self._buffers:  # one pass per buffer, not one per gradient
                    flat.zero_()
                for p, kept in zip(self.params, self.views):
                    p.grad = kept
                return
            for p, kept in zip(self.params, self.views):
                if p.grad is kept:
                    continue
                if p.grad is None:
                    kept.zero_()
                else:
                    kept.copy_(p.grad)
                p.grad = kept


def _whole(view: torch.Tensor) -> torch.Tensor:
    """The whole flat buffer ``view`` lies in."""
    storage = view.untyped_storage()
    return view.new_empty(0).set_(storage, 0, (storage.nbytes() // view.element_size(),))
