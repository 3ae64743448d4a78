"""Point-to-point transfers of the tensors at a stage boundary, with shapes known from the plan.

No shape is exchanged at run time: receive buffers come from :class:`TensorSpec` lists and are
recycled through a :class:`BufferPool`. Peers are pipeline ranks; global ranks are looked up once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from autopipe.errors import ConfigError, InputError
from autopipe.memory_format import channels_last_dense
from autopipe.runtime.host_links import SharedLinks

__all__ = [
    "TensorSpec", "Transfer", "Handle", "Link", "P2P", "BufferPool", "LINK_MAX_CTAS", "one_host",
    "ring_links", "link_options", "link_groups", "world_links", "floating_indices", "check_boundary",
]  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and layout of one tensor crossing a stage boundary, for one micro-batch.
    ``channels_last``: a 4-D tensor of a model in channels-last layout travels and lands in it
    (see [Note: boundary layout] in autopipe/memory_format.py)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    channels_last: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "channels_last", bool(self.channels_last) and len(self.shape) == 4)

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device, memory_format=self.memory_format)

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` dense in this spec's layout (a copy only where it is not), as it is sent."""
        return x.contiguous(memory_format=self.memory_format)

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


def _wire(x: torch.Tensor) -> torch.Tensor:
    """What travels for ``x``: itself, or for a channels-last tensor the NHWC view of its memory
    (contiguous; gloo sends and receives contiguous tensors only). Both ends of a transfer hold
    tensors of the same spec, so both take the same view."""
    if channels_last_dense(x):
        return x.permute(0, 2, 3, 1)
    return x


def floating_indices(specs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """Positions of the tensors that carry a gradient back (integer and bool tensors do not)."""
    return tuple(i for i, spec in enumerate(specs) if spec.dtype.is_floating_point)


def check_boundary(tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], stage: int, mb: int) -> None:
    """Raises InputError unless stage ``stage`` returned exactly the planned ``specs``.

    The receiver preallocated its buffers from the plan, so anything else would arrive
    truncated or hang the transfer.
    """
    if len(tensors) == len(specs) and all(
        isinstance(t, torch.Tensor) and t.shape == s.shape and t.dtype == s.dtype
        for t, s in zip(tensors, specs)
    ):
        return
    given = ", ".join(
        str(TensorSpec(tuple(t.shape), t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
        for t in tensors
    )
    raise InputError(
        f"stage {stage} returned [{given}] for micro-batch {mb}, but the plan says "
        f"[{', '.join(map(str, specs))}]; the inputs likely differ in shape from the example the "
        f"plan was made with"
    )


class Transfer(NamedTuple):
    """One message: ``tensors`` to or from pipeline rank ``peer``; ``what`` names it in errors."""

    send: bool
    tensors: Sequence[torch.Tensor]
    peer: int
    what: str


class Handle:
    """The works of one posted :class:`Transfer`; holding it keeps its tensors alive."""

    __slots__ = ("works", "tensors", "peer", "what", "send")

    def __init__(self, works: list, transfer: Transfer) -> None:
        self.works = works
        self.tensors = transfer.tensors
        self.peer = transfer.peer
        self.what = transfer.what
        self.send = transfer.send


Link = tuple[int, int]  # (sending pipeline rank, receiving pipeline rank)


def ring_links(pp: int) -> list[Link]:
    """The directed links between neighbouring pipeline ranks, the wrap-around included (the
    last rank feeds rank 0's next chunk in interleaved schedules), in one fixed order."""
    if pp < 2:
        return []
    return sorted({(r, (r + 1) % pp) for r in range(pp)} | {((r + 1) % pp, r) for r in range(pp)})


LINK_MAX_CTAS: int | None = None  # thread blocks (SMs) an NCCL link may use; None: NCCL's choice


def link_options() -> object | None:
    """The NCCL options of a link's process group: at most ``LINK_MAX_CTAS`` thread blocks, each
    one SM taken from the stages while a transfer waits for its peer. ``None`` (the backend's
    defaults) off NCCL or when ``LINK_MAX_CTAS`` is ``None``."""
    if LINK_MAX_CTAS is None or dist.get_backend() != "nccl" or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = int(LINK_MAX_CTAS)
    return options


def link_groups(pipelines: Sequence[Sequence[int]]) -> dict[Link, dist.ProcessGroup]:
    """One two-rank process group per directed link of every pipeline; see [Note: transfer
    streams] in streams.py. Collective: every process of the world calls it with the same
    ``pipelines`` (each the global ranks of one pipeline, by pipeline rank), since every
    process takes part in creating every group. Returns the links of this process's pipeline,
    keyed by pipeline ranks."""
    me = dist.get_rank()
    mine: dict[Link, dist.ProcessGroup] = {}
    options = link_options()
    for ranks in pipelines:
        for a, b in ring_links(len(ranks)):
            group = dist.new_group(sorted((ranks[a], ranks[b])), pg_options=options)
            if me in ranks:
                mine[(a, b)] = group
    return mine


def one_host(ranks: Sequence[int]) -> bool:
    """Whether the global ``ranks`` share one host, as torchrun numbers them (hosts hold
    ``LOCAL_WORLD_SIZE`` consecutive ranks each); ``False`` without ``LOCAL_WORLD_SIZE``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    return local > 0 and len({r // local for r in ranks}) == 1


class P2P:
    """Posts non-blocking sends and receives between the ranks of one pipeline, each directed
    link on its own process group (see [Note: transfer streams] in streams.py).

    ``group`` is the pp process group (``None``: the default group); ``links`` maps each
    directed link (pipeline ranks) to its group, from :func:`link_groups`. Peers are pipeline
    ranks, translated to global ranks once, here.
    """

    def __init__(self, group: dist.ProcessGroup | None, links: dict[Link, dist.ProcessGroup]) -> None:
        self.group = group
        world = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self._global = [dist.get_global_rank(world, r) for r in range(dist.get_world_size(group))]
        self.links = links
        self.shared: SharedLinks | None = None  # set by StepTransfers.connect where they are used

    @property
    def one_host(self) -> bool:
        """Whether every rank of the pipeline runs on this host, by torchrun's numbering (global
        rank // ``LOCAL_WORLD_SIZE``); ``False`` when the launcher does not say."""
        return one_host(self._global)

    def global_rank(self, peer: int) -> int:
        return self._global[peer]

    def link(self, send: bool, peer: int) -> dist.ProcessGroup:
        key = (self.rank, peer) if send else (peer, self.rank)
        try:
            return self.links[key]
        except KeyError:
            raise ConfigError(f"no process group for the link from pipeline rank {key[0]} to {key[1]}; "
                              f"build the links with autopipe.runtime.p2p.link_groups") from None

    def post(self, transfers: Sequence[Transfer]) -> list[Handle]:
        """Posts every transfer, in order: through the shared-memory links where they carry it
        (see [Note: shared-memory links] in host_links.py), else each tensor as one isend/irecv
        on its link; one handle per transfer."""
        handles = []
        for t in transfers:
            wire = [_wire(x) for x in t.tensors]
            if self.shared is not None and self.shared.carries(t.send, t.peer, wire):
                handles.append(Handle(self.shared.post(t.send, t.peer, wire, t.what), t))
                continue
            op, group, peer = dist.isend if t.send else dist.irecv, self.link(t.send, t.peer), self._global[t.peer]
            handles.append(Handle([op(x, peer, group=group) for x in wire], t))
        return handles

    def connect(self, links: Sequence[Link], device: torch.device, wait: Callable[[list, str], None]) -> None:
        """Brings up ``links`` (those this rank's schedule uses; every rank passes the ones it
        shares with its peers) by one small message each, in one global order: NCCL creates a
        link's communicator at its first message and blocks both ends until the other arrives,
        so first messages in schedule order could wait on each other across links."""
        probe = torch.zeros(1, device=device)
        for a, b in sorted(links):
            if self.rank not in (a, b):
                continue
            send = self.rank == a
            peer = b if send else a
            work = (dist.isend if send else dist.irecv)(probe, self._global[peer], group=self.link(send, peer))
            wait([work], f"start-up message on the link from pipeline rank {a} to {b}")


class BufferPool:
    """Receive buffers allocated on ``device`` from specs, recycled by key once released."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._free: dict[object, list[list[torch.Tensor]]] = {}
        self._zeros: dict[tuple, torch.Tensor] = {}

    def acquire(self, key: object, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        """Buffers for ``specs``: a set released under ``key`` if there is one, else new ones."""
        free = self._free.get(key)
        if free:
            return free.pop()
        return [s.empty(self.device) for s in specs]

    def release(self, key: object, buffers: list[torch.Tensor], live: Sequence[torch.Tensor | None] = ()) -> None:
        """Returns ``buffers`` to the pool unless one shares memory with a tensor in ``live``.

        The caller names what may still alias the buffers (a stage output that is its input
        passed through, a gradient autograd stored as it came); such a set is left to the
        garbage collector rather than overwritten by the next receive.
        """
        held = {t.untyped_storage().data_ptr() for t in live if t is not None}
        if any(b.untyped_storage().data_ptr() in held for b in buffers):
            return
        self._free.setdefault(key, []).append(buffers)

    def zeros(self, spec: TensorSpec) -> torch.Tensor:
        """A shared zero tensor, sent for a gradient autograd left as None (never written)."""
        key = (tuple(spec.shape), spec.dtype)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = torch.zeros(key[0], dtype=spec.dtype, device=self.device)
        return z


def world_links(group: dist.ProcessGroup | None) -> dict[Link, dist.ProcessGroup]:
    """The links of a pipeline spanning every process; a smaller pipeline group needs its links
    built by every process of the world (link_groups), so the caller must pass them."""
    world = dist.get_world_size()
    if dist.get_world_size(group) != world:
        raise ConfigError(
            f"pp_group has {dist.get_world_size(group)} of the {world} processes: build the pipelines' links "
            f"on every process with autopipe.runtime.p2p.link_groups(pipelines) and pass links=")
    ranks = [dist.get_global_rank(group if group is not None else dist.group.WORLD, r) for r in range(world)]
    return link_groups([ranks])
