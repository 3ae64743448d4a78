"""The stages of one graph as the pipeline driver holds them: the modules, the tensors between
them, and the stages at other micro-batch sizes; checked against the pipeline's layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.runtime.batch_shapes import Shapes
from autopipe.runtime.p2p import TensorSpec

__all__ = ["StageSet", "check_layout"]


@dataclass
class StageSet:
    """The stages of one graph with the tensors between them (``boundary_specs[k]``: between
    stages k and k + 1, one micro-batch), what makes the model's output of the last one's, and
    the stages at other micro-batch sizes (``variants``; see [Note: other batch sizes])."""

    stages: dict[int, nn.Module]
    boundary_specs: Sequence[Sequence[TensorSpec]]
    postprocess: Callable[[tuple[torch.Tensor, ...]], Any]
    variants: Callable[[int], Shapes] | None = None


def check_layout(stages: dict[int, nn.Module], boundary_specs: Sequence, pp: int, chunks: int,
                  pp_rank: int, group: dist.ProcessGroup | None) -> None:
    n = pp * chunks
    local = [s for s in range(n) if s % pp == pp_rank]
    if sorted(stages) != local:
        raise ConfigError(f"pipeline rank {pp_rank} of pp={pp} with chunks={chunks} holds stages {local}, "
                          f"but was given stages {sorted(stages)}")
    if len(boundary_specs) != n - 1:
        raise ConfigError(f"{n} stages have {n - 1} boundaries, got {len(boundary_specs)} boundary_specs")
    if pp > 1 and not dist.is_initialized():
        raise ConfigError(f"pp={pp} needs torch.distributed; call dist.init_process_group first")
    if pp > 1 and (dist.get_world_size(group) != pp or dist.get_rank(group) != pp_rank):
        raise ConfigError(f"pp_group has {dist.get_world_size(group)} ranks and this process is its rank "
                          f"{dist.get_rank(group)}, but pp={pp} and pp_rank={pp_rank} were given")
