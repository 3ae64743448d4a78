"""Training-step pieces that span the mesh: data-parallel gradient averaging, global
gradient-norm clipping, and the fp16 dynamic loss scale whose skip decision every rank shares.

Their collectives wait through the active failure monitor, so that a failed peer raises
instead of hanging (see [Note: collective waits] in failure/monitor.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..failure.monitor import synced, wait_works
from ..runtime.grad_buffers import flat_view

__all__ = ["average_gradients", "sum_gradients", "reduce_sequence_parallel_grads", "global_grad_norm",
           "clip_gradients", "LossScaler"]

BUCKET_BYTES = 25 * 1024 * 1024


def _buckets(params: Sequence[torch.nn.Parameter], limit: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in params:
        g = p.grad
        if g is None:
            continue
        if current and (size + g.numel() * g.element_size() > limit or g.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += g.numel() * g.element_size()
    if current:
        buckets.append(current)
    return buckets


def average_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None, size: int) -> None:
    """Average ``.grad`` over ``group`` (the dp replicas) in flat buckets, all in flight at once."""
    if group is None or size == 1:
        return
    sum_gradients(params, group, divide_by=size, what="gradient all-reduce over the data-parallel replicas")


def sum_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, *, divide_by: int = 1,
                  what: str = "gradient all-reduce") -> None:
    """Sum ``.grad`` over ``group`` (then divide by ``divide_by``) in flat buckets, all in flight
    at once; ``what`` names the all-reduce in errors. A bucket whose gradients are views of one
    buffer back to back is reduced in place; any other is copied into a flat tensor and back
    ([Note: gradients as views of one buffer] in runtime/grad_buffers.py)."""
    pending = []
    for bucket in _buckets(list(params), BUCKET_BYTES):
        flat = flat_view(bucket)
        copied = flat is None
        if copied:
            flat = _flatten_dense_tensors(bucket)
        if divide_by != 1:
            flat.div_(divide_by)
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket if copied else None))
    if pending:
        wait_works([work for work, _, _ in pending], what, group, pending[0][1].device)
    for _, flat, bucket in pending:  # one multi-tensor copy a bucket on a GPU, not one per gradient
        if bucket is not None:
            torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))


def reduce_sequence_parallel_grads(named_parameters: Any, plan: Any, group: Any) -> None:
    """Sum over the tp ``group`` the gradients of the parameters a sequence-parallel ``plan``
    applies to each rank's own samples (``plan.sequence_parallel_params``; see [Note: sequence
    parallelism] in shard/layout.py), after backward and before the optimizer, in flat buckets.
    Every tp rank must call it."""
    wanted = set(getattr(plan, "sequence_parallel_params", ()))
    if not wanted or group is None or dist.get_world_size(group) == 1:
        return
    sum_gradients([p for name, p in named_parameters if name in wanted], group,
                  what="sequence-parallel gradient all-reduce over the tp ranks")


def global_grad_norm(
    counted: Sequence[torch.nn.Parameter], groups: Sequence[dist.ProcessGroup | None], device: torch.device
) -> torch.Tensor:
    """L2 norm of the gradients of the whole model.

    ``counted`` are this rank's parameters that it alone contributes: its tp shards and, for
    tensors replicated over tp, those of tp rank 0 only; ``groups`` are summed over (pp, tp).
    dp replicas hold equal gradients after averaging and are not summed over.
    """
    grads = [p.grad.detach() for p in counted if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32, device=device)
    # One read of each gradient, in multi-tensor kernels grouped by device and dtype: one norm
    # kernel per tensor took 4.3 ms of ViT-L/16's step (296 tensors) on an H200, these 1.75 ms
    # (benchmarks/optimizer_step_gpu.py, results/2026-11-27-h200-optimizer-step.json).
    groups_by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups_by_kind.setdefault((g.device, g.dtype), []).append(g)
    low = (torch.float16, torch.bfloat16)
    for (_, dtype), tensors in groups_by_kind.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32 if dtype in low else None)
        total = total + torch.stack(norms).float().square().sum().to(device)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            wait_works([dist.all_reduce(total, group=group, async_op=True)],
                       f"all-reduce of the gradient norm over ranks {dist.get_process_group_ranks(group)}",
                       group, device)
    return total.sqrt()


def clip_gradients(params: Iterable[torch.nn.Parameter], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients as ``torch.nn.utils.clip_grad_norm_`` does, given the global norm."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))


@dataclass
class LossScaler:
    """fp16 dynamic loss scale: backs off on overflow, grows after ``growth_interval`` good steps."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0  # updates since the last back-off or growth

    def found_inf(self, params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None,
                  device: torch.device) -> bool:
        """Unscale gradients in place; True on every rank if any rank saw an inf or NaN."""
        flag = torch.zeros((), dtype=torch.float32, device=device)
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)
                flag = torch.maximum(flag, (~torch.isfinite(p.grad)).any().float())
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            wait_works([dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)],
                       "all-reduce of the fp16 overflow flag", group, device)
        return bool(synced(flag, "the fp16 overflow flag").item())

    def update(self, skipped: bool) -> None:
        if skipped:
            self.scale = max(self.scale * self.backoff_factor, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0 and math.isfinite(self.scale * self.growth_factor):
            self.scale *= self.growth_factor
