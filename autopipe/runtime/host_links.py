"""Point-to-point transfers between the processes of one host through memory that both address:
on GPUs the receiving GPU's memory, written by the sender's copy engines (CUDA IPC); on CPUs a
file in /dev/shm. They run beside the backend's links and carry every message that fits.

[Note: shared-memory links]
An NCCL transfer is a kernel on each end that holds its SMs from its start until the peer's
kernel has moved the data ([Note: receive lead] and [Note: send timing] in streams.py): posted
early, it slows the stages beside it; posted just in time, the receiver waits for the copy.
Between the GPUs of one host the sender can instead write a message straight into memory of
the receiving GPU with an asynchronous copy: the copy engines move it over NVLink, no SM is
held, and it needs nothing from the receiver's stream. Each directed link gets a ring of
``slots`` slots of ``slot_bytes`` in the receiver's memory:

- the receiver allocates the ring (slots: the most messages its sender can be ahead of it on
  the link in any program the driver may run, by the schedule alone: ``ring_slots``; bytes: the
  largest stage boundary) and shares it through the store, with a "copied out" interprocess
  event per slot and a counters file in /dev/shm holding, per slot, the number of the last
  message written into it and of the last copied out of it;
- the sender of message n (numbered per link from 1) takes slot (n - 1) % slots; it waits on
  the host until the message that last held the slot was copied out (its counter), and on its
  copy stream for that copy's event, then copies each tensor into the slot behind the compute
  that made it, records the slot's "written" event and sets the slot's written counter to n;
- the receiver, when the compute that needs message n is next, waits on the host until the
  slot's written counter reads n (the copy is queued), makes its compute stream wait for the
  "written" event, copies the tensors out into its pooled receive buffers (a copy within the
  device), records its "copied out" event and sets that counter.
A counter is set only after the event record it announces has been queued, so no event is
waited on before the record it stands for. The message that last held a slot is ``slots``
messages back, and by the schedule its consumer runs before anything that the send of the new
one waits for, however fast each rank runs: so within a step a send never waits for its slot,
on the host or on the GPU (across steps it may wait for the receiver to finish the step before,
which needs nothing from the sender), and no two ranks can wait on each other. (Interleaved 1F1B with pp=2 carries 28
messages a step on each link and is never more than 4 ahead; ViT-L/16's 77 MB boundaries then
take 0.3 GB a link.) A message larger than a slot (micro-batches larger than planned) goes
over the backend's link; both ends decide it alike from the message's specs. A ring either end
cannot set up (GPUs without peer access, memory that cannot be shared) is dropped by both, with
a warning, and the link stays the backend's. Host waits poll
through the failure monitor: a peer that died raises PipelineFailure instead of hanging.

On CPUs the same ring lies in a file in /dev/shm, the copies are synchronous, and no event is
needed; the counters are read and written with pread/pwrite, whose kernel entry orders them
after the data on every architecture.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import pickle
import uuid
import warnings
import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from autopipe.errors import ConfigError, ScheduleError
from autopipe.runtime.program import compile_program, messages_ahead
from autopipe.runtime.schedule import validate

__all__ = ["SHARED_LINKS", "ALIGN", "shared_links", "SharedLinks", "message_bytes", "slot_bytes", "ring_slots"]

# None: shared_links' rule; True/False: on/off wherever the ranks share a host. The environment's
# AUTOPIPE_SHARED_LINKS=1/0 sets it for a launch.
SHARED_LINKS: bool | None = {"1": True, "0": False}.get(os.environ.get("AUTOPIPE_SHARED_LINKS", ""))
ALIGN = 256  # bytes: each tensor of a message starts at a multiple of this in its slot

Poll = Callable[[Callable[[], bool], str], None]  # waits until done() (FailureMonitor.poll)


def shared_links(cuda: bool, one_host: bool) -> bool:
    """Whether a pipeline's transfers go through shared memory ([Note: shared-memory links]):
    between CUDA devices of one host by default; on CPUs only when ``SHARED_LINKS`` is True."""
    if not one_host:
        return False
    if SHARED_LINKS is not None:
        return SHARED_LINKS
    return cuda


def message_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes a message of ``tensors`` (as they travel: dense) takes in a slot."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


@functools.lru_cache(maxsize=256)
def _messages_ahead(schedule: str, pp: int, m: int, chunks: int) -> tuple[tuple[tuple[int, int], int], ...]:
    programs = [compile_program(schedule, pp, m, chunks, r) for r in range(pp)]
    return tuple(sorted(messages_ahead(programs).items()))


def ring_slots(schedule: str, pp: int, microbatches: int, chunks: int, *,
               fewer: bool = True) -> dict[tuple[int, int], int]:
    """Slots per directed link (sending pipeline rank, receiving one): the most messages ahead
    (:func:`~autopipe.runtime.program.messages_ahead`) over every program a driver of
    ``schedule`` may run: training and evaluation at ``microbatches`` and, with ``fewer``, at
    every smaller number (a batch smaller than planned runs fewer), sends posted at once (where
    receives are posted does not matter: a message is taken when its consumer starts)."""
    slots: dict[tuple[int, int], int] = {}
    for name in dict.fromkeys((schedule, "forward_only")):
        for m in range(1 if fewer else microbatches, microbatches + 1):
            try:
                validate(name, pp, m, chunks)
            except ScheduleError:
                continue
            for link, n in _messages_ahead(name, pp, m, chunks):
                slots[link] = max(slots.get(link, 1), n)
    return slots


def slot_bytes(boundaries: Sequence[Sequence]) -> int:
    """The bytes of a slot that holds any of ``boundaries`` (each a list of TensorSpec: the
    tensors between two stages for one micro-batch); gradients travel in the same or less."""
    return max((sum(_aligned(math.prod(s.shape) * s.dtype.itemsize) for s in specs) for specs in boundaries),
               default=ALIGN) or ALIGN


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Counters:
    """Per slot, the last message written into it (row 0) and copied out of it (row 1), in a
    file both ends open; read and written with pread/pwrite."""

    def __init__(self, path: str, slots: int, create: bool) -> None:
        self.path, self.slots = path, slots
        self.fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        if create:
            os.ftruncate(self.fd, 16 * slots)

    def get(self, row: int, slot: int) -> int:
        return int.from_bytes(os.pread(self.fd, 8, 8 * (row * self.slots + slot)), "little")

    def set(self, row: int, slot: int, n: int) -> None:
        os.pwrite(self.fd, int(n).to_bytes(8, "little"), 8 * (row * self.slots + slot))


class _Ring:
    """One link's slots, as one end sees them: ``area`` (uint8, ``slots * slot_bytes``), the
    counters, and on CUDA the slots' "written" and "copied out" events."""

    def __init__(self, area: torch.Tensor, slots: int, slot_bytes: int, counters: _Counters) -> None:
        self.area, self.slots, self.slot_bytes, self.counters = area, slots, slot_bytes, counters
        self.count = 0  # messages numbered so far on this end
        self.written: list = []
        self.copied: list = []

    def views(self, slot: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The slot's memory laid out as ``tensors`` (dense), one after the other."""
        views, at = [], slot * self.slot_bytes
        for t in tensors:
            n = t.numel() * t.element_size()
            views.append(self.area[at:at + n].view(t.dtype).view(t.shape))
            at += _aligned(n)
        return views


class _Sent:
    """A message copied into the peer's slot: done once the slot's "written" event is."""

    def __init__(self, event: torch.cuda.Event | None, device: torch.device) -> None:
        self.event, self.device = event, device

    def ready(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """The current stream waits for the copy (its tensors may then be reused)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)


class _Receipt:
    """Message ``n`` of ``ring``, bound for ``buffers``: ready once the sender queued its copy;
    ``wait()`` then copies it out on the current stream and frees the slot."""

    def __init__(self, ring: _Ring, n: int, buffers: Sequence[torch.Tensor]) -> None:
        self.ring, self.n, self.buffers = ring, n, buffers
        self.slot = (n - 1) % ring.slots
        self.done = False

    def ready(self) -> bool:
        return self.ring.counters.get(0, self.slot) >= self.n

    def is_completed(self) -> bool:
        return self.done

    def redirect(self, buffers: Sequence[torch.Tensor]) -> bool:
        """Copies the message out into ``buffers`` (laid out as the ones it was bound for)
        instead, if it is not copied out yet; returns whether it will be."""
        if self.done:
            return False
        self.buffers = buffers
        return True

    def wait(self) -> None:
        if self.done:
            return
        ring, slot = self.ring, self.slot
        stream = torch.cuda.current_stream(ring.area.device) if ring.written else None
        if stream is not None:
            stream.wait_event(ring.written[slot])
        for buffer, view in zip(self.buffers, ring.views(slot, self.buffers)):
            buffer.copy_(view)
        if stream is not None:
            ring.copied[slot].record(stream)
        ring.counters.set(1, slot, self.n)
        self.done = True


class SharedLinks:
    """The shared-memory links of one pipeline rank; see [Note: shared-memory links]. Build with
    :meth:`connect`; :meth:`carries` says which messages go through them, :meth:`post` posts one."""

    def __init__(self, device: torch.device, poll: Poll) -> None:
        self.device, self.poll = device, poll
        self.inbox: dict[int, _Ring] = {}  # peer -> ring of the link peer -> this rank
        self.outbox: dict[int, _Ring] = {}  # peer -> ring of the link this rank -> peer
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._files: list[str] = []
        self._fds: list[int] = []  # the counters files' descriptors, closed with these links
        self._closer = weakref.finalize(self, _close, self._fds, self._files)

    @classmethod
    def connect(cls, *, device: torch.device, store: dist.Store, key: str, rank: int,
                receives: dict[int, int], sends: Sequence[int], slot_bytes: int, poll: Poll,
                timeout: float) -> SharedLinks:
        """Builds the links this rank receives on (``receives``: peer -> slots) and sends on
        (peers), exchanging their memory through ``store`` under ``key``. Collective over the
        ranks of the links: each end calls it with the same ``key``."""
        if slot_bytes <= 0:
            raise ConfigError(f"slot_bytes must be positive, got {slot_bytes!r}")
        links = cls(torch.device(device), poll)
        # Events are made on the current device.
        with torch.cuda.device(links.device) if links.device.type == "cuda" else contextlib.nullcontext():
            links._exchange(store, key, rank, receives, sends, slot_bytes, timeout)
        return links

    def _exchange(self, store: dist.Store, key: str, rank: int, receives: dict[int, int], sends: Sequence[int],
                  slot_bytes: int, timeout: float) -> None:
        """See :meth:`connect`: three rounds through the store, none waiting on a later one."""
        wait = datetime.timedelta(seconds=timeout)
        # A ring that one end cannot make or open (GPUs without peer access, memory that cannot be
        # shared) is published as None: both ends then leave that link to the backend.
        for peer, slots in sorted(receives.items()):  # 1: every receiver shares its ring
            shared = self._attempt(lambda: self._make_ring(peer, slots, slot_bytes), self.inbox, peer, peer, rank)
            store.set(f"{key}/{peer}-{rank}/ring", pickle.dumps(shared))
        for peer in sorted(sends):  # 2: every sender opens the ring and shares its events
            k = f"{key}/{rank}-{peer}/ring"
            store.wait([k], wait)
            ring = pickle.loads(store.get(k))
            events = None if ring is None else \
                self._attempt(lambda: self._open_ring(peer, ring), self.outbox, peer, rank, peer)
            store.set(f"{key}/{rank}-{peer}/events", pickle.dumps(events))
        for peer in sorted(p for p in receives if p in self.inbox):  # 3: every receiver opens the sender's events
            k = f"{key}/{peer}-{rank}/events"
            store.wait([k], wait)
            events = pickle.loads(store.get(k))
            if events is None:  # the sender could not open the ring: both ends leave the link to the backend
                del self.inbox[peer]
                continue
            self.inbox[peer].written = self._events(events)
        _unlink(self._files)  # both ends have opened the files: they live as long as they are open

    @staticmethod
    def _attempt(make: Callable[[], object], rings: dict, peer: int, sender: int, receiver: int) -> object:
        """``make()``, or None with a warning where it fails (the ring for ``peer`` dropped)."""
        try:
            return make()
        except (RuntimeError, OSError) as exc:
            rings.pop(peer, None)
            warnings.warn(f"the shared-memory link from pipeline rank {sender} to {receiver} could not be set up "
                          f"({type(exc).__name__}: {exc}); its messages go over the backend's link "
                          f"(AUTOPIPE_SHARED_LINKS=0 turns these links off)", RuntimeWarning, stacklevel=3)
            return None

    def _make_ring(self, peer: int, slots: int, slot_bytes: int) -> dict:
        """This rank's ring for the link from ``peer``, and what the sender needs to open it."""
        name = f"/dev/shm/autopipe-{uuid.uuid4().hex}"
        counters = _Counters(name + "-counters", slots, create=True)
        self._files.append(counters.path)
        self._fds.append(counters.fd)
        shared: dict = {"slots": slots, "slot_bytes": slot_bytes, "counters": counters.path}
        size = slots * slot_bytes
        if self.device.type == "cuda":
            area = torch.empty(size, dtype=torch.uint8, device=self.device)
            shared["area"] = area.untyped_storage()._share_cuda_()
        else:
            self._files.append(name)
            area = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
            shared["area"] = name
        ring = self.inbox[peer] = _Ring(area, slots, slot_bytes, counters)
        if self.device.type == "cuda":
            ring.copied = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            shared["copied"] = [bytes(e.ipc_handle()) for e in ring.copied]
        return shared

    def _open_ring(self, peer: int, shared: dict) -> list[bytes]:
        """Opens ``peer``'s ring for the link to it; returns this end's "written" events' handles."""
        slots, size = shared["slots"], shared["slots"] * shared["slot_bytes"]
        if self.device.type == "cuda":
            # Opened as memory of this rank's device (peer access): copies into it are then
            # plain copies on this device's streams, moved by the copy engines over NVLink.
            _, handle, nbytes, offset, *rest = shared["area"]
            storage = torch.UntypedStorage._new_shared_cuda(self.device.index, handle, nbytes, offset, *rest)
            area = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)[:size]
        else:
            area = torch.from_file(shared["area"], shared=True, size=size, dtype=torch.uint8)
        counters = _Counters(shared["counters"], slots, False)
        self._fds.append(counters.fd)
        ring = self.outbox[peer] = _Ring(area, slots, shared["slot_bytes"], counters)
        if self.device.type != "cuda":
            return []
        ring.copied = self._events(shared["copied"])
        ring.written = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        self._streams[peer] = torch.cuda.Stream(self.device)
        return [bytes(e.ipc_handle()) for e in ring.written]

    def _events(self, handles: Sequence[bytes]) -> list:
        if self.device.type != "cuda":
            return []
        return [torch.cuda.Event.from_ipc_handle(self.device, h) for h in handles]


    def carries(self, send: bool, peer: int, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the message of ``tensors`` to (``send``) or from ``peer`` goes through here."""
        ring = (self.outbox if send else self.inbox).get(peer)
        return ring is not None and message_bytes(tensors) <= ring.slot_bytes

    def post(self, send: bool, peer: int, tensors: Sequence[torch.Tensor], what: str) -> list:
        """Sends ``tensors`` (dense) to ``peer`` now, or numbers a receive into them; returns
        the message's one work (``ready()``, ``wait()``, ``is_completed()``)."""
        ring = self.outbox[peer] if send else self.inbox[peer]
        ring.count += 1
        n = ring.count
        if not send:
            return [_Receipt(ring, n, tensors)]
        slot = (n - 1) % ring.slots
        if n > ring.slots:  # the slot's last message must have been copied out
            self.poll(lambda: ring.counters.get(1, slot) >= n - ring.slots, f"{what} (a free slot)")
        if self.device.type != "cuda":
            for view, t in zip(ring.views(slot, tensors), tensors):
                view.copy_(t)
            ring.counters.set(0, slot, n)
            return [_Sent(None, self.device)]
        stream = self._streams[peer]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # behind the compute that made them
        if n > ring.slots:
            stream.wait_event(ring.copied[slot])
        with torch.cuda.stream(stream):
            for view, t in zip(ring.views(slot, tensors), tensors):
                view.copy_(t)
            ring.written[slot].record(stream)
        ring.counters.set(0, slot, n)
        return [_Sent(ring.written[slot], self.device)]

    def close(self) -> None:
        """Closes the counters files (the rings' memory goes with the last reference to it)."""
        self._closer()


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    paths.clear()


def _close(fds: list[int], paths: list[str]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()
    _unlink(paths)
