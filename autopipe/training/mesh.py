"""The (pp, dp, tp) process mesh: degrees checked against the world size, groups from DeviceMesh.

Rank layout: tp innermost (neighbouring ranks share the fastest links), then dp, then pp:
``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import ConfigError, positive_int
from ..runtime.p2p import link_groups

__all__ = ["ParallelDims", "Mesh", "build_mesh"]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; ``dp`` is derived from the world size."""

    pp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "world_size"):
            positive_int(name, getattr(self, name))
        if self.world_size % (self.pp * self.tp):
            valid = [self.pp * self.tp * k for k in range(1, 5)]
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of pp * tp = {self.pp} * {self.tp} = "
                f"{self.pp * self.tp}; dp = world_size / (pp * tp) must be whole. Launch "
                f"{', '.join(map(str, valid))}... processes, or change pp/tp"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def describe(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp} (tp innermost, then dp, then pp)"

    def name(self, rank: int) -> str:
        """How messages name a rank: "rank 5 (pp 1, dp 0, tp 1)"."""
        pp_rank, dp_rank, tp_rank = self.coords(rank)
        return f"rank {rank} (pp {pp_rank}, dp {dp_rank}, tp {tp_rank})"


@dataclass
class Mesh:
    dims: ParallelDims
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    device: torch.device
    # One group per directed link between pipeline ranks (see [Note: transfer streams]).
    links: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)


def default_device() -> torch.device:
    """This rank's GPU where CUDA is available and the process group can carry CUDA tensors
    (any backend but gloo alone, whose sends take CPU tensors only); else the CPU."""
    gloo_only = dist.is_initialized() and dist.get_backend() == "gloo"
    if torch.cuda.is_available() and not gloo_only:
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def build_mesh(dims: ParallelDims, device: torch.device) -> Mesh:
    """Collective: every rank calls it after the degrees were checked locally."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank() if dist.is_initialized() else 0
    pp_rank, dp_rank, tp_rank = dims.coords(rank)
    if dims.world_size == 1:
        return Mesh(dims, 0, 0, 0, 0, None, None, None, device)
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
    pipelines = [[dims.rank_of(p, d, t) for p in range(dims.pp)] for d in range(dims.dp) for t in range(dims.tp)]
    return Mesh(
        dims, rank, pp_rank, dp_rank, tp_rank,
        pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"), tp_group=mesh.get_group("tp"),
        device=device, links=link_groups(pipelines) if dims.pp > 1 else {},
    )


def release_groups(mesh: Mesh, *others: dist.ProcessGroup | None) -> None:
    """Destroys the process groups of ``mesh`` and ``others`` (never the default group), after a
    barrier, so that no rank still uses one another has destroyed. Collective over the world."""
    if not dist.is_initialized():
        return
    default = dist.distributed_c10d._get_default_group()
    groups = [mesh.pp_group, mesh.dp_group, mesh.tp_group, *mesh.links.values(), *others]
    mine = {id(g): g for g in groups
            if g is not None and g is not default and g is not dist.GroupMember.NON_GROUP_MEMBER}
    dist.barrier()
    for group in mine.values():
        dist.destroy_process_group(group)
