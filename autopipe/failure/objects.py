"""Python objects gathered over a process group with watched waits.

``torch.distributed.all_gather_object`` blocks in C++ until every rank answers; this one posts
the same two all-gathers (sizes, then padded bytes) and waits through the active failure
monitor, so a failed or absent rank raises PipelineFailure instead of hanging (see
[Note: collective waits] in monitor.py).
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from autopipe.failure.monitor import synced, wait_works

__all__ = ["all_gather_objects"]


def all_gather_objects(obj: Any, group: dist.ProcessGroup, device: torch.device, what: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), in the group's rank order; ``device`` is where the
    bytes travel (the backend's device: CUDA for NCCL). Collective over ``group``."""
    n = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(n)]
    wait_works([dist.all_gather(sizes, size, group=group, async_op=True)], f"{what} (sizes)", group, device)
    lengths = [int(s.item()) for s in synced(torch.cat(sizes), what).cpu()]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(n)]
    wait_works([dist.all_gather(parts, padded, group=group, async_op=True)], what, group, device)
    return [pickle.loads(synced(p, what)[:length].cpu().numpy().tobytes()) for p, length in zip(parts, lengths)]
