"""``batchnorm="sync"``: BatchNorm layers normalise each micro-batch over the dp replicas together.

[Note: sync batch norm]
SyncBatchNorm semantics over the data-parallel group: in train(), a BatchNorm layer normalises
micro-batch ``i`` with the mean and variance of micro-batch ``i`` of every dp replica together,
and the gradient flows through those statistics to every replica. This is what torch's
``nn.SyncBatchNorm`` over the dp group computes for each call. A pipeline calls a layer once per
micro-batch, so the normalisation batch is ``dp * B / m`` samples; with ``microbatches=1`` it is
the global batch, and the whole step (losses, gradients, parameters, running statistics) equals
one process training on the global batch. Running statistics are deferred as under "deferred"
(see [Note: deferred batch norm]): they are the global batch's, committed once per step.

torch's own ``nn.SyncBatchNorm`` does not fit here: its kernels (``batch_norm_stats``...) exist for
CUDA only, so it cannot run over gloo on CPU; it updates the running statistics at every call (once
per micro-batch); and ``convert_sync_batchnorm`` turns timm's ``BatchNormAct2d`` into a plain
SyncBatchNorm, dropping its activation. The same computation is written here with torch ops and
the project's traceable all-gather (shard/collectives.py), so it runs on CPU and GPU alike and
compiles into the stage: per channel, each replica's micro-batch mean and biased variance are
gathered (one all-gather of ``2 C`` values per layer and micro-batch; its backward a
reduce-scatter) and combined with equal weights (every replica's micro-batch has the same size).
Collectives run inside the stage, so "sync" is refused with ``cuda_graphs=True``, as tp is.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from autopipe.shard.collectives import all_gather_tp, register_group

__all__ = ["sync_batch_norm", "synchronise"]

GROUP = "autopipe.batchnorm.dp"  # the name the traceable collectives look the dp group up by


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    group: str, size: int) -> torch.Tensor:
    """BatchNorm of ``x`` (N, C, ...) in training, with the statistics of every replica's ``x``."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # statistics in fp32 under autocast
    var, mean = torch.var_mean(xf, dim=[0, *range(2, x.dim())], correction=0)
    stats = all_gather_tp(torch.stack([mean, var]), 0, group, size).view(size, 2, -1)
    means = stats[:, 0]
    mean = means.mean(0)
    var = stats[:, 1].mean(0) + (means - mean).pow(2).mean(0)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shape = [1, -1] + [1] * (x.dim() - 2)
    y = (xf - mean.view(shape)) * scale.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y.to(x.dtype)


def _forward(m: nn.modules.batchnorm._BatchNorm, original: object, size: int, x: torch.Tensor) -> torch.Tensor:
    if not m.training:
        return original(x)  # type: ignore[operator]
    y = sync_batch_norm(x, m.weight, m.bias, m.eps, GROUP, size)
    # timm's BatchNormAct2d: what its SyncBatchNormAct adds after the norm.
    for tail in ("drop", "act"):
        if type(m).forward is not nn.modules.batchnorm._BatchNorm.forward and hasattr(m, tail):
            y = getattr(m, tail)(y)
    return y


def synchronise(m: nn.modules.batchnorm._BatchNorm, dp_group: dist.ProcessGroup) -> None:
    """Make ``m`` normalise over ``dp_group`` in train() (an instance ``forward``: its parameters,
    buffers and state_dict names stay). ``check_batchnorm`` vetted its class."""
    register_group(GROUP, dp_group)
    m.forward = functools.partial(_forward, m, m.forward, dist.get_world_size(dp_group))
