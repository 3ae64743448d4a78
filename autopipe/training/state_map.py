"""The state map: each tensor of this rank's stages as part of the unmodified model's
state_dict: its full key, the MLP piece the stage holds (stages/mlp_pieces.py) and the
tensor-parallel split (shard/state.py). ``full_state_dict``, ``load_full_state_dict`` and the
checkpoints all go through it. See docs/architecture.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..shard.plan import ParamShard, SplitFn
from ..shard.state import gather_shards, shard_tensor
from ..stages.piece_state import PieceParam, piece_params

__all__ = ["StateEntry", "state_map", "stage_map", "local_full_state", "load_local_state"]


@dataclass(frozen=True)
class StateEntry:
    """A stage's state_dict key ``key`` is ``piece`` of the model's ``full`` (None: all of it),
    split over ``tp`` ranks by ``split`` (None: replicated)."""

    key: str
    full: str
    piece: PieceParam | None = None
    split: ParamShard | None = None
    custom: SplitFn | None = None
    tp: int = 1

    @property
    def stored(self) -> str:
        """The name checkpoints save it under (see [Note: checkpoint layout])."""
        return self.piece.stored if self.piece is not None else self.full

    def gather(self, local: torch.Tensor, group: Any, what: str) -> torch.Tensor:
        """The tensor over every tp rank from this rank's ``local`` (collective when split)."""
        if self.split is None:
            return local
        return gather_shards(local, self.split, self.tp, self.custom, group, what)

    def cut(self, whole: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Rank ``tp_rank``'s part of ``whole`` (the piece over every tp rank)."""
        return whole if self.split is None else shard_tensor(whole, self.split, tp_rank, self.tp, self.custom)


def state_map(keys: Iterable[str], shard_plan: Any, mlp_pieces: Mapping[str, Any]) -> dict[str, StateEntry]:
    """Stage key -> :class:`StateEntry` for ``keys`` (state_dict or parameter names)."""
    pieces = piece_params(mlp_pieces) if mlp_pieces else {}
    out = {}
    for key in keys:
        piece = pieces.get(key)
        ps = shard_plan.params.get(key) if shard_plan is not None else None
        split = ps if ps is not None and ps.sharded and shard_plan.tp > 1 else None
        out[key] = StateEntry(key, piece.full if piece is not None else key, piece, split,
                              shard_plan.custom_splits.get(key) if split is not None else None,
                              shard_plan.tp if split is not None else 1)
    return out


def stage_map(stages: Mapping[int, nn.Module], shard_plan: Any, mlp_pieces: Mapping[str, Any]) -> dict[str, StateEntry]:
    """The state map of every key of ``stages``' state_dicts."""
    return state_map((k for s in sorted(stages) for k in stages[s].state_dict()), shard_plan, mlp_pieces)


def local_full_state(stages: Mapping[int, nn.Module], shard_plan: Any, tp_group: Any) -> dict[str, torch.Tensor]:
    """These stages' state with tp shards merged (collective over ``tp_group`` where a tensor
    is split), on CPU, under the stages' keys (an MLP piece stays a piece)."""
    entries = stage_map(stages, shard_plan, {})
    out: dict[str, torch.Tensor] = {}
    for s in sorted(stages):
        for k, v in stages[s].state_dict().items():
            full = entries[k].gather(v, tp_group, f"all-gather of '{k}' over the tp ranks")
            out[k] = full.detach().cpu().clone()
    return out


def load_local_state(stages: Mapping[int, nn.Module], state_dict: Mapping[str, torch.Tensor], shard_plan: Any,
                     tp_rank: int, mlp_pieces: Mapping[str, Any]) -> None:
    """Load these stages from full (unsharded) tensors keyed by the model's names: each takes
    its MLP piece and its tp shard."""
    entries = stage_map(stages, shard_plan, mlp_pieces)
    for s in sorted(stages):
        sub = {}
        for k in stages[s].state_dict():
            e = entries[k]
            whole = e.piece.of(state_dict[e.full]) if e.piece is not None else state_dict[e.full]
            ps = shard_plan.params.get(k) if shard_plan is not None else None
            if ps is not None and tuple(whole.shape) != ps.shape:
                raise CheckpointError(f"'{k}' has shape {list(whole.shape)} in the checkpoint and "
                                      f"{list(ps.shape)} in the model")
            sub[k] = e.cut(whole, tp_rank).contiguous() if ps is not None else whole
        stages[s].load_state_dict(sub, strict=True)
