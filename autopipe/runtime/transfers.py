"""The pipeline driver's point-to-point traffic: what one rank sends and receives in a step.

Tensors bound for another pipeline rank (stage outputs, gradients of stage inputs) wait in the
outbox until the program posts their send; receives land in pooled buffers of the planned specs
(no shape crosses the wire, see p2p.py) and wait, posted, until the compute that needs them
takes them; a posted send keeps its tensors alive until the backend has delivered them.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import torch
from torch.distributed.distributed_c10d import _get_default_store

from autopipe.errors import ScheduleError
from autopipe.failure.monitor import FailureMonitor, failure_key
from autopipe.runtime.host_links import SharedLinks
from autopipe.runtime.p2p import P2P, BufferPool, Link, TensorSpec, Transfer
from autopipe.runtime.program import PointToPoint, Step, Transfers
from autopipe.runtime.schedule import ActionKind
from autopipe.runtime.timeline import Timeline

__all__ = ["StepTransfers"]


class StepTransfers:
    """The sends and receives of one rank's steps over ``p2p`` (None with one pipeline rank,
    where every tensor is handed over in memory), waited on through ``monitor`` and, for
    receives, timed on ``timeline``; receive buffers are allocated on ``device``."""

    def __init__(self, p2p: P2P | None, device: torch.device, monitor: FailureMonitor,
                 timeline: Timeline | None) -> None:
        self.p2p, self.monitor, self.timeline = p2p, monitor, timeline
        self.pool = BufferPool(device)
        # Where a receive lands, if not in a pooled buffer: (kind, stage, mb, specs) -> the
        # tensors or None; see [Note: graph slots as boundaries] in graphs.py.
        self.destination: Callable[[ActionKind, int, int, list[TensorSpec]], list[torch.Tensor] | None] | None = None
        self.reset()

    def connect(self, programs: Sequence[list[Step]], pp_rank: int, *,
                shared: tuple[dict[Link, int], int] | None = None) -> None:
        """Brings up the directed links that ``programs`` (pipeline rank ``pp_rank``'s) send or
        receive on; see :meth:`~autopipe.runtime.p2p.P2P.connect`. With ``shared``, (slots per
        link from :func:`~autopipe.runtime.host_links.ring_slots`, bytes per slot), also their
        shared-memory links, exchanged through the monitor's store (see [Note: shared-memory
        links] in host_links.py). Collective over the pipeline."""
        used: set[Link] = set()
        for step in (step for program in programs for step in program):
            if isinstance(step, Transfers):
                for t in step.transfers:
                    used.add((pp_rank, t.peer) if t.send else (t.peer, pp_rank))
        self.p2p.connect(sorted(used), self.pool.device, self.monitor.wait)
        if shared is not None:
            slots, nbytes = shared
            store = self.monitor.store if self.monitor.store is not None else _get_default_store()
            self.p2p.shared = SharedLinks.connect(
                device=self.pool.device, store=store,
                key=failure_key(self.p2p.group).replace("/failure/", "/links/"), rank=pp_rank,
                receives={a: slots.get((a, b), 1) for a, b in used if b == pp_rank},
                sends=[b for a, b in used if a == pp_rank], slot_bytes=nbytes,
                poll=self.monitor.poll, timeout=self.monitor.deadline)

    def close(self) -> None:
        """Lets go of the shared-memory links, if any."""
        if self.p2p is not None and self.p2p.shared is not None:
            self.p2p.shared.close()

    def reset(self) -> None:
        """Forgets the step's transfers (also those a failed step left)."""
        self.outbox: dict[tuple[int, int], Sequence[torch.Tensor]] = {}  # (stage, mb) -> tensors to send
        self._recv: dict[tuple, tuple] = {}  # (kind, stage, mb) -> (buffers, handle)
        self._sends: deque = deque()  # (Pending, Handle, key) of posted sends, oldest first
        self._sent: dict[tuple, tuple] = {}  # key (kind, stage, mb) -> (Pending, Handle) of a send not known done
        self._foreign: set[tuple] = set()  # (kind, stage, mb) of receives into the caller's tensors
        self._posted: set[tuple] = set()  # (kind, stage, mb) of the sends posted
        self._keys: Sequence[object] = []
        self._specs: Sequence[list[list[TensorSpec]]] = []
        self._grads: dict[int, tuple[int, ...]] = {}

    def start(self, keys: Sequence[object], specs: Sequence[list[list[TensorSpec]]],
              grads: dict[int, tuple[int, ...]]) -> None:
        """Begins a step: micro-batch mb's receive buffers are pooled under ``keys[mb]`` and
        shaped by its boundary specs ``specs[mb]``; stage s receives the gradients of its
        outputs ``grads[s]`` (the floating ones) only."""
        self._keys, self._specs, self._grads = keys, specs, grads

    def post(self, batch: Sequence[PointToPoint]) -> None:
        """Posts ``batch`` in order: sends from the outbox, receives into pooled buffers."""
        while self._sends and self._sends[0][0].done():
            self._sent.pop(self._sends.popleft()[2], None)  # lets go of the delivered tensors
        transfers, receives = [], []
        for t in batch:
            kind, s, mb = t.kind, t.stage, t.microbatch
            if t.send:
                tensors = [spec.packed(x) for x, spec in zip(self.outbox.pop((s, mb)), self._sent_specs(kind, s, mb))]
            else:
                specs = self._received_specs(kind, s, mb)
                tensors = self.destination(kind, s, mb, specs) if self.destination is not None else None
                if tensors is not None:
                    self._foreign.add((kind, s, mb))
                else:
                    tensors = self.pool.acquire(self._key(kind, s, mb), specs)
                receives.append((len(transfers), (kind, s, mb), tensors))
            transfers.append(Transfer(t.send, tensors, t.peer, t.what))
        handles = self.p2p.post(transfers)
        for i, key, tensors in receives:
            self._recv[key] = (tensors, handles[i])
        # The handle keeps the sent tensors alive until the backend is done with them.
        for t, h in zip(batch, handles):
            if h.send:
                key = (t.kind, t.stage, t.microbatch)
                self._posted.add(key)
                self._sent[key] = (self.monitor.start(h.works), h)
                self._sends.append((*self._sent[key], key))

    def received(self, kind: ActionKind, s: int, mb: int, *,
                 into: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """The buffers of the receive ``kind`` of stage ``s``, micro-batch ``mb``, once arrived
        (the wait is timed); None if none was posted (the tensors came in memory). ``into``:
        tensors of the same layout where a message not yet copied out of a shared-memory link
        lands instead of its pooled buffers."""
        if (kind, s, mb) not in self._recv:
            return None
        buffers, handle = self._recv.pop((kind, s, mb))
        works = handle.works
        if (into is not None and (kind, s, mb) not in self._foreign and len(works) == 1
                and hasattr(works[0], "redirect") and works[0].redirect(into)):
            self.pool.release(self._key(kind, s, mb), buffers)
            self._foreign.add((kind, s, mb))
            buffers = into
        mark = self.timeline.begin() if self.timeline is not None else None
        self.monitor.wait(handle.works, handle.what, on_stream=True)
        if self.timeline is not None:
            self.timeline.end(mark, kind.value, s, mb)
        return buffers

    def release(self, kind: ActionKind, s: int, mb: int, buffers: list[torch.Tensor],
                live: Sequence[torch.Tensor | None]) -> None:
        """Returns the buffers of a receive to the pool unless a tensor in ``live`` shares
        their memory (see :meth:`~autopipe.runtime.p2p.BufferPool.release`) or they were the
        caller's (a destination's, or ``into``)."""
        if (kind, s, mb) in self._foreign:
            self._foreign.discard((kind, s, mb))
            return
        self.pool.release(self._key(kind, s, mb), buffers, live=live)

    def fence(self, kind: ActionKind, s: int, mb: int) -> None:
        """Makes the current stream wait until the send ``kind`` of stage ``s``, micro-batch
        ``mb``, has read its tensors (if it was posted in this step); for sends through a
        shared-memory link, whose copy needs nothing from the peer. Raises ScheduleError if that
        send was not posted yet: what it would read is about to be overwritten."""
        if (kind, s, mb) not in self._posted:
            what = "inputs' gradients" if kind is ActionKind.SEND_GRAD else "outputs"
            raise ScheduleError(f"the send of stage {s}'s {what} (micro-batch {mb}) must be posted before they "
                                f"are overwritten, and is not; post sends at once (no send delays) where their "
                                f"tensors are lent")
        sent = self._sent.pop((kind, s, mb), None)
        if sent is not None:
            self.monitor.wait(sent[0], sent[1].what, on_stream=True)

    def through_shared_memory(self, peer: int) -> bool:
        """Whether this rank's messages of the planned sizes to pipeline rank ``peer`` go
        through a shared-memory link ([Note: shared-memory links] in host_links.py)."""
        return self.p2p is not None and self.p2p.shared is not None and peer in self.p2p.shared.outbox

    def finish(self) -> None:
        """Waits until every posted send has been delivered."""
        while self._sends:
            pending, handle, key = self._sends.popleft()
            self._sent.pop(key, None)
            self.monitor.wait(pending, handle.what, on_stream=True)

    def _received_specs(self, kind: ActionKind, s: int, mb: int) -> list[TensorSpec]:
        """The specs of the receive ``kind`` of stage ``s``: its inputs' (activations) or the
        floating ones of its outputs' (gradients)."""
        if kind is ActionKind.RECV_ACT:
            return self._specs[mb][s - 1]
        specs = self._specs[mb][s]
        return [specs[i] for i in self._grads[s]]

    def _sent_specs(self, kind: ActionKind, s: int, mb: int) -> list[TensorSpec]:
        """The specs the peer received stage ``s``'s sent tensors into: its outputs' (activations)
        or, for gradients, the floating ones of its inputs'."""
        if kind is ActionKind.SEND_ACT:
            return self._specs[mb][s]
        return [spec for spec in self._specs[mb][s - 1] if spec.floating]

    def _key(self, kind: ActionKind, s: int, mb: int) -> tuple:
        return ("act" if kind is ActionKind.RECV_ACT else "grad", s, self._keys[mb])
