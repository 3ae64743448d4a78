"""Leaf modules the rewrite puts in place of sharded ones, under the same qualified names.

Row-parallel layers leave their bias out of ``forward``: the bias is added once, after the
all-reduce, by a graph node (adding it on every rank before the sum would count it tp times).
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .rng import tp_dropout

__all__ = [
    "RowParallelLinear",
    "RowParallelConv1d",
    "RowParallelConv2d",
    "RowParallelConv3d",
    "ShardedMultiheadAttention",
    "TPDropout",
    "copy_module",
]


def copy_module(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A shallow copy whose parameter, buffer and child dicts are its own (and optionally of
    class ``cls``, a subclass of the original's base with a different ``forward``)."""
    new = copy.copy(module)
    for k, v in vars(module).items():  # parameters, buffers, children, hooks: not shared
        if isinstance(v, (dict, set, list)):
            new.__dict__[k] = copy.copy(v)
    if cls is not None:
        new.__class__ = cls
    return new


class RowParallelLinear(nn.Linear):
    """``x @ W_local.T``: a partial sum; ``self.bias`` is added by the graph after the all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelConv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight, None)


class RowParallelConv2d(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight, None)


class RowParallelConv3d(nn.Conv3d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight, None)


ROW_CLASSES: dict[type, type] = {
    nn.Linear: RowParallelLinear,
    nn.modules.linear.NonDynamicallyQuantizableLinear: RowParallelLinear,
    nn.Conv1d: RowParallelConv1d,
    nn.Conv2d: RowParallelConv2d,
    nn.Conv3d: RowParallelConv3d,
}


class TPDropout(nn.Module):
    """Dropout drawing from this tp rank's stream. See [Note: dropout under tensor parallelism]."""

    def __init__(self, p: float, tp_rank: int):
        super().__init__()
        self.p, self.tp_rank = float(p), int(tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_dropout(x, self.p, self.training, self.tp_rank)

    def extra_repr(self) -> str:
        return f"p={self.p}, tp_rank={self.tp_rank}"


class _OutProj(nn.Module):
    """``out_proj`` of a sharded attention: holds ``weight`` [E, E/tp] and the full ``bias``."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None):
        super().__init__()
        self.weight = weight
        self.bias = bias


class ShardedMultiheadAttention(nn.Module):
    """This tp rank's heads of an ``nn.MultiheadAttention``; returns ``(partial output, None)``.

    ``in_proj_weight`` holds the q, k and v rows of the local heads (see [Note: head-aware
    qkv slicing] in rules.py) and ``out_proj.weight`` the matching input columns, so the
    output is a partial sum that the graph all-reduces before adding ``out_proj.bias``.
    """

    def __init__(self, original: nn.MultiheadAttention, tp: int, tp_rank: int, tensors: dict[str, nn.Parameter]):
        super().__init__()
        self.embed_dim = original.embed_dim
        self.global_heads = original.num_heads
        self.num_heads = original.num_heads // tp
        self.head_dim = original.head_dim
        self.dropout = original.dropout
        self.batch_first = original.batch_first
        self.tp_rank = tp_rank
        self.in_proj_weight = tensors["in_proj_weight"]
        self.in_proj_bias = tensors.get("in_proj_bias")
        self.out_proj = _OutProj(tensors["out_proj.weight"], tensors.get("out_proj.bias"))

    def _mask(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
              b: int, dtype: torch.dtype) -> torch.Tensor | None:
        def additive(m: torch.Tensor) -> torch.Tensor:  # nn.MultiheadAttention: True = masked out
            return torch.zeros_like(m, dtype=dtype).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)

        mask = None
        if attn_mask is not None:
            m = additive(attn_mask)
            if m.dim() == 3:  # (B * heads, L, S): keep this rank's heads
                lo = self.tp_rank * self.num_heads
                m = m.view(b, self.global_heads, *m.shape[1:])[:, lo:lo + self.num_heads]
            mask = m
        if key_padding_mask is not None:
            kp = additive(key_padding_mask)[:, None, None, :]
            mask = kp if mask is None else mask + kp
        return mask

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, Any]:
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        w = self.in_proj_weight.chunk(3)
        bias = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        b, n, s = query.shape[0], query.shape[1], key.shape[1]
        h, d = self.num_heads, self.head_dim
        q = F.linear(query, w[0], bias[0]).view(b, n, h, d).transpose(1, 2)
        k = F.linear(key, w[1], bias[1]).view(b, s, h, d).transpose(1, 2)
        v = F.linear(value, w[2], bias[2]).view(b, s, h, d).transpose(1, 2)
        mask = self._mask(attn_mask, key_padding_mask, b, q.dtype)
        if self.training and self.dropout > 0.0:
            # Heads are sharded: the attention-probability mask comes from this rank's stream.
            scores = q @ k.transpose(-2, -1) / math.sqrt(d)
            if mask is not None:
                scores = scores + mask
            elif is_causal:
                scores = scores.masked_fill(torch.ones(n, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            probs = tp_dropout(scores.softmax(-1), self.dropout, True, self.tp_rank)
            out = probs @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None)
        out = F.linear(out.transpose(1, 2).reshape(b, n, h * d), self.out_proj.weight)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, heads={self.num_heads} of {self.global_heads}, tp_rank={self.tp_rank}"
