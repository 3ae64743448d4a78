"""The layout 4-D tensors cross stage boundaries in.

[Note: boundary layout]
A convolutional model moved to channels-last (``model.to(memory_format=torch.channels_last)``)
runs its convolutions and batch norms on NHWC kernels, far faster on GPUs (ResNet-50's first
batch norm, 32 x 64 x 112 x 112 in bf16 on an H200: 1.15 ms forward and backward in NCHW, 0.33
ms in NHWC). A stage boundary must not undo it: a received activation laid out NCHW makes the
next stage's first batch norm take its NCHW kernel and its first convolution convert its input.
So a tensor crosses a boundary in the layout the trace made it in (``boundary_layout``): one
made channels-last is sent, received and handed on in channels-last (``TensorSpec.channels_last``),
its gradient too, and any other travels plain contiguous; the profiler's timer hands stages
their inputs the same way. The rule is the value's, not the model's: in a channels-last ViT or
Swin, attention's (B, heads, tokens, dim) products and Swin's (B, H, W, C) maps are 4-D too,
and laid out channels-last they would reach attention and layer norms with their last
dimension strided (ViT-B/16 on an H200, 32 images, a stage starting at a block's attention:
2.76 ms against 1.79 ms). Every rank traces the same model, so every rank reaches the same
answer. The model's own inputs travel channels-last where the model's weights are
(``channels_last_model``). A convolution's traced output is laid out as cuDNN writes it, whatever
the meta or CPU kernel that propagated shapes wrote ([Note: a convolution's layout as the GPU
makes it] in tracer/shapes.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["channels_last_model", "channels_last_dense", "boundary_layout"]


def channels_last_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a 4-D tensor laid out channels-last and not also plain contiguous."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def channels_last_model(module: nn.Module) -> bool:
    """Whether ``module``'s 4-D parameters (convolution weights) are laid out channels-last:
    all of them, and at least one that is not also plain contiguous (a 1x1 kernel is both)."""
    weights = [p for p in module.parameters() if p.dim() == 4]
    if not weights or not all(p.is_contiguous(memory_format=torch.channels_last) for p in weights):
        return False
    return any(channels_last_dense(p) for p in weights)


def boundary_layout(value: object) -> torch.memory_format:
    """The layout a tensor crossing a stage boundary travels in: channels-last where its traced
    (meta) ``value`` was made dense in it, plain contiguous otherwise ([Note: boundary layout])."""
    if isinstance(value, torch.Tensor) and channels_last_dense(value):
        return torch.channels_last
    return torch.contiguous_format
