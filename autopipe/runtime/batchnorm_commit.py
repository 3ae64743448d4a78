"""The end of a step for deferred BatchNorm statistics: every layer's running statistics updated
at once (see [Note: deferred batch norm] in batchnorm.py).

[Note: one commit for every layer]
Folding the collected sums into each layer's running statistics, layer by layer, took some
twenty small ops a layer: ResNet-50's 53 norms made 2862 ATen ops and 2.5 ms of host time a
commit on this 2-core CPU (``python benchmarks/batchnorm_cost.py --commit-only``), many of them a
kernel launch on a GPU. The layers of a rank are
concatenated instead (their sums, counts and running statistics, grouped by device and dtype)
and the same arithmetic runs once over all channels, each channel reading its layer's counts
and momentum through an index; what must touch every layer's own tensors (the copies back, the
zeroing, ``num_batches_tracked``) goes through ``torch._foreach_*``, one multi-tensor kernel
per few dozen tensors on a GPU (a loop of single ops on a CPU). On this CPU a ResNet-50 commit
now takes 579 ATen ops and 1.5 ms; on a GPU its kernel launches should fall from about a
thousand to about fifty (not yet measured). Elementwise it is the same sequence of operations
as torch's rule for one layer, so the statistics are the same to the bit (tests/test_batchnorm.py).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["commit_statistics"]

Norm = nn.modules.batchnorm._BatchNorm


@torch.no_grad()
def commit_statistics(norms: Sequence[Norm], sums: str, counts: str, dp_group: dist.ProcessGroup | None,
                      dp: int) -> None:
    """Fold each layer's collected ``sums`` (buffer name; the sums over micro-batches of the
    shift from the running mean, of its square and of the variance) and ``counts``
    (micro-batches, elements per channel) into its running statistics, over the ``dp`` replicas
    of ``dp_group`` (one all-gather), and zero them. Layers in eval() keep their statistics."""
    groups: dict[tuple[torch.device, torch.dtype], list[Norm]] = {}
    for m in norms:
        groups.setdefault((m.running_mean.device, m.running_mean.dtype), []).append(m)
    for group in groups.values():  # the same order on every rank: the same model
        mean, var, n, index = _batch_statistics(group, sums, counts)
        if dp > 1:
            mean, var, n = _over_replicas(mean, var, n, index, dp_group, dp)
        _update([m.training for m in group], group, mean, var, n, index)
        torch._foreach_zero_([getattr(m, sums) for m in group] + [getattr(m, counts) for m in group])


def _batch_statistics(group: list[Norm], sums: str, counts: str) -> tuple[torch.Tensor, ...]:
    """Every channel's mean and biased variance of this replica's mini-batch, the elements per
    channel of each layer, and each channel's layer (the micro-batches are of equal size, so
    their means and variances weigh alike)."""
    s1, s2, v = torch.cat([getattr(m, sums) for m in group], dim=1)
    k, n = torch.stack([getattr(m, counts) for m in group]).unbind(1)
    index = _channel_layers(group[0].running_mean.device, tuple(m.running_mean.numel() for m in group))
    k = k.clamp_min(1)[index]
    shift = s1 / k
    running = torch.cat([m.running_mean for m in group])
    return running + shift, (v / k + s2 / k - shift * shift).clamp_min(0), n, index


_INDEX: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _channel_layers(device: torch.device, sizes: tuple[int, ...]) -> torch.Tensor:
    """Each channel's layer, for layers of ``sizes`` channels: made once (on the host, where its
    length is known without a wait on the device) per device and sizes."""
    if (device, sizes) not in _INDEX:
        _INDEX[(device, sizes)] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)
    return _INDEX[(device, sizes)]


def _over_replicas(mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor, index: torch.Tensor,
                   dp_group: dist.ProcessGroup | None, dp: int) -> tuple[torch.Tensor, ...]:
    """The statistics of the global batch from every replica's, weighted by element counts
    (Chan's parallel variance)."""
    c = mean.numel()
    flat = torch.cat([mean, var, n])
    parts = [torch.empty_like(flat) for _ in range(dp)]
    dist.all_gather(parts, flat, group=dp_group)
    gathered = torch.stack(parts)  # (dp, 2 C + layers)
    means, vars_, ns = gathered[:, :c], gathered[:, c:2 * c], gathered[:, 2 * c:]
    total_n = ns.sum(0)
    w = (ns / total_n.clamp_min(1))[:, index]
    total = (w * means).sum(0)
    return total, (w * (vars_ + (means - total) ** 2)).sum(0), total_n


def _update(training: list[bool], group: list[Norm], mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor,
            index: torch.Tensor) -> None:
    """torch's running-statistics rule, once per layer in train(): ``r = (1 - f) r + f x`` with
    f the momentum, or 1 / num_batches_tracked for ``momentum=None`` (a cumulative average);
    the variance unbiased by the layer's element count."""
    nc = n[index]
    var = var * nc / (nc - 1).clamp_min(1)
    kept = [m for m, t in zip(group, training) if t]
    if not kept:
        return
    torch._foreach_add_([m.num_batches_tracked for m in kept], 1)
    # Per layer: f, and 1 - f as torch's rule computes it (from a Python float, or from a tensor).
    given = torch.tensor([[m.momentum or 0.0 for m in group], [1 - (m.momentum or 0.0) for m in group],
                          [m.momentum is None for m in group]], dtype=mean.dtype).to(mean.device)
    cumulative = given[2] > 0
    f = torch.where(cumulative, 1.0 / torch.stack([m.num_batches_tracked for m in group]).to(mean.dtype), given[0])
    keep = torch.where(cumulative, 1 - f, given[1])
    f, keep = f[index], keep[index]
    sizes = [m.running_mean.numel() for m in group]
    for name, new in (("running_mean", mean), ("running_var", var)):
        old = torch.cat([getattr(m, name) for m in group])
        updated = (old * keep + new * f).split(sizes)
        torch._foreach_copy_([getattr(m, name) for m in kept],
                             [u for u, t in zip(updated, training) if t])
