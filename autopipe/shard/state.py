"""Parameter shards: cut a full tensor for one tp rank, and rebuild it from every rank's shard.

The same cut serves the rewrite (sliced copies of a model's parameters) and checkpoints
(``shard_state_dict`` to load a full checkpoint, ``gather_full_state_dict`` to save one).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import CheckpointError
from ..failure.monitor import wait_works
from .plan import ParamShard, ShardPlan, SplitFn

__all__ = ["shard_tensor", "merge_shards", "gather_shards", "shard_state_dict", "gather_full_state_dict"]


def shard_tensor(t: torch.Tensor, ps: ParamShard, tp_rank: int, tp: int, custom: SplitFn | None = None) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of the full tensor ``t`` (a view where possible; not a copy)."""
    if custom is not None:
        return custom(t, tp_rank, tp)
    if ps.dim is None:
        return t
    size = t.shape[ps.dim]
    # [outer, tp, rest]: each of the ``outer`` stacked blocks gives this rank its piece.
    blocks = t.unflatten(ps.dim, (ps.outer, tp, size // (ps.outer * tp)))
    return blocks.select(ps.dim + 1, tp_rank).flatten(ps.dim, ps.dim + 1)


def merge_shards(shards: list[torch.Tensor], ps: ParamShard, custom: SplitFn | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (inverse of :func:`shard_tensor`)."""
    if custom is not None:
        merge = getattr(custom, "merge", None)
        if merge is None:
            raise CheckpointError(
                f"custom split {getattr(custom, '__name__', custom)!r} has no merge(shards) attribute, so "
                "its full tensor cannot be rebuilt; set split.merge = lambda shards: ... on the function"
            )
        return merge(shards)
    if ps.dim is None:
        return shards[0]
    local = shards[0].shape[ps.dim]
    blocks = [s.unflatten(ps.dim, (ps.outer, local // ps.outer)) for s in shards]
    return torch.stack(blocks, dim=ps.dim + 1).flatten(ps.dim, ps.dim + 2)


def shard_state_dict(full_sd: Mapping[str, torch.Tensor], shard_plan: ShardPlan, tp_rank: int) -> dict[str, torch.Tensor]:
    """Rank ``tp_rank``'s state_dict from a full (unsharded) one, for ``load_state_dict``."""
    out = {}
    for name, t in full_sd.items():
        ps = shard_plan.params.get(name)
        if ps is not None and tuple(t.shape) != ps.shape:
            raise CheckpointError(f"'{name}' has shape {list(t.shape)} in the checkpoint and "
                                  f"{list(ps.shape)} in the model")
        out[name] = t if ps is None else shard_tensor(t, ps, tp_rank, shard_plan.tp,
                                                      shard_plan.custom_splits.get(name)).contiguous()
    return out


def gather_full_state_dict(sharded_gm: nn.Module, shard_plan: ShardPlan, group: Any = None) -> dict[str, torch.Tensor]:
    """The full state_dict (original names and shapes) on every rank of the tp ``group``.

    Collective: every tp rank must call it (its waits watch for failed ranks inside a step of a
    ParallelModel). Replicated tensors are taken from this rank.
    """
    out = {}
    for name, local in sharded_gm.state_dict().items():
        ps = shard_plan.params.get(name)
        if ps is None or not ps.sharded or shard_plan.tp == 1:
            out[name] = local.detach().clone()
            continue
        out[name] = gather_shards(local, ps, shard_plan.tp, shard_plan.custom_splits.get(name), group,
                                  f"all-gather of '{name}' over the tp ranks")
    return out


def gather_shards(local: torch.Tensor, ps: ParamShard, tp: int, custom: SplitFn | None, group: Any,
                  what: str) -> torch.Tensor:
    """The full tensor from this rank's shard ``local`` and its tp peers' (collective over
    ``group``; ``what`` names the wait in errors)."""
    if group is None and not dist.is_initialized():
        raise CheckpointError(f"{what}: the tensor is split over tp={tp} ranks; gathering it needs a process group")
    parts = [torch.empty_like(local) for _ in range(tp)]
    work = dist.all_gather(parts, local.detach().contiguous(), group=group, async_op=True)
    wait_works([work], what, group, local.device)
    return merge_shards(parts, ps, custom)
