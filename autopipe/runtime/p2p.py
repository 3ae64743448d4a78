"""Point-to-point transfers of the tensors at a stage boundary, with shapes known from the plan.

No shape is exchanged at run time: receive buffers come from :class:`TensorSpec` lists and are
recycled through a :class:`BufferPool`. Peers are pipeline ranks; global ranks are looked up once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from autopipe.errors import InputError

__all__ = ["TensorSpec", "Transfer", "Handle", "P2P", "BufferPool", "floating_indices", "check_boundary"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor crossing a stage boundary, for one micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


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


class P2P:
    """Posts batched non-blocking sends and receives between the ranks of the pipeline group.

    ``group`` is the pp process group (``None``: the default group); peers are given as ranks
    in that group and translated to global ranks once, here.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        world = group if group is not None else dist.group.WORLD
        self._global = [dist.get_global_rank(world, r) for r in range(dist.get_world_size(group))]

    def global_rank(self, peer: int) -> int:
        return self._global[peer]

    def post(self, transfers: Sequence[Transfer]) -> list[Handle]:
        """Posts every transfer in one ``batch_isend_irecv``, in order; one handle each.

        See [Note: coalesced transfers]: on backends that coalesce (NCCL) the batch completes
        as one, so every handle holds all its works; gloo returns one work per tensor.
        """
        ops = [
            dist.P2POp(dist.isend if t.send else dist.irecv, x, self._global[t.peer], self.group)
            for t in transfers
            for x in t.tensors
        ]
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) != len(ops):
            return [Handle(works, t) for t in transfers]
        handles, at = [], 0
        for t in transfers:
            handles.append(Handle(works[at : at + len(t.tensors)], t))
            at += len(t.tensors)
        return handles


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
        return [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]

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


# [Note: coalesced transfers]
# All transfers between two consecutive computes of a rank are posted in one
# batch_isend_irecv. On NCCL the two directions between a pair of ranks share one stream, so in
# 1F1B's steady state "send activation, then receive gradient" on one rank and "send gradient,
# then receive activation" on its neighbour would wait on each other if posted as separate
# operations; in one group NCCL progresses them together (what Megatron's
# send_forward_recv_backward and torch's Schedule1F1B do). Order inside the batch follows the
# schedule, which keeps per-pair FIFO order matched (see schedule.py's [Note: transfer order]).
