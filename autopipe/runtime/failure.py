"""Failure propagation: when one pipeline rank fails, every other rank raises instead of hanging.

A failing rank writes one record into the process group's store; every wait polls its work and,
now and then, the store. See [Note: failure propagation].
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from typing import Iterator, Sequence

import torch.distributed as dist

from autopipe.errors import PipelineFailure

__all__ = ["FailureMonitor", "Pending", "failure_key", "DEFAULT_DEADLINE"]

# [Note: failure propagation]
# A pipeline rank blocks only while waiting for a message (or the end-of-step loss broadcast),
# and the peer it waits on may be waiting on a third rank that has failed. So:
# * A rank that raises inside a step records ``"<pp rank>|<ExcType>: <message>"`` under one key
#   of the store every rank already shares (the default store of torch.distributed, or one
#   passed in) and re-raises its own exception. Only the first record is kept (``store.add``
#   on a counter elects the writer), so the root cause wins over the failures it triggers.
# * No wait blocks blindly: every ``interval`` seconds (0.2) it reads the key and raises
#   PipelineFailure("pipeline rank 1 failed: ValueError: bad batch"), and past ``deadline``
#   (default 300 s) it raises a PipelineFailure naming the message and its peer rank.
# * How a wait learns that its work finished depends on the backend. NCCL (and other
#   accelerator backends) answer ``work.is_completed()`` truthfully: the wait polls it with
#   short, growing sleeps (50 us up to 0.5 ms). Gloo's send/recv works only complete inside
#   ``work.wait()``, which cannot be interrupted, so on CPU a daemon thread calls ``wait()``
#   while the caller sleeps on an Event in ``interval`` slices. Sends are handed to a second
#   thread when posted, so that their tensors are let go as soon as they are delivered.
# * A process that dies writes nothing: its neighbours see gloo's connection error (or
#   nothing, on NCCL) or reach the deadline; either way they record their own failure, which
#   releases the ranks further away.
# A finished wait costs one is_completed() call (or one Event wait), and the store is read only
# by ranks that are already blocked, so a healthy pipeline pays nearly nothing. After a
# failure the group's messages are out of step (and a waiter thread may stay blocked): the
# record is kept, every later step of this driver fails at once, and the job should restart
# its processes.

# [Note: stream-side waits]
# On NCCL, ``work.wait()`` makes the current CUDA stream wait for the transfer and returns at
# once. Polling ``is_completed()`` on the host instead would block the Python thread until the
# data arrived and leave the GPU idle while the next stage's kernels are launched. So the
# driver waits for its per-micro-batch transfers on the stream and polls (watching the store
# and the deadline) only once per step, at the loss broadcast: a failed peer is still noticed
# within a bounded time, one step later at most.

DEFAULT_DEADLINE = 300.0
_MAX_MESSAGE = 2000
_instances: Counter[str] = Counter()


def failure_key(group: dist.ProcessGroup | None) -> str:
    """A store key unique to this group and to the n-th driver built on it in this process.

    Every rank of the group builds its drivers in the same order, so the n-th drivers of all
    ranks agree on the key, and a failure of one driver does not poison the next one.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    name = "-".join(map(str, ranks))
    _instances[name] += 1
    return f"autopipe/failure/{name}/{_instances[name]}"


class FailureMonitor:
    """Records this rank's failure and waits on works while watching for other ranks' failures.

    ``rank`` is this rank's pipeline rank; ``store`` the store shared by the group (None: no
    peers, as with pp = 1: waits then only time out). ``threaded`` waits through helper
    threads, for backends whose works complete only inside ``wait()`` (gloo).
    """

    def __init__(
        self,
        rank: int,
        store: dist.Store | None,
        key: str,
        *,
        deadline: float = DEFAULT_DEADLINE,
        interval: float = 0.2,
        threaded: bool = False,
    ) -> None:
        self.rank = rank
        self.store = store
        self.key = key
        self.deadline = deadline
        self.interval = interval
        self.failed: PipelineFailure | None = None
        # Gloo's p2p works complete only inside wait(): see [Note: failure propagation].
        self._recvs = _Waiter("autopipe-recv-wait") if threaded else None
        self._sends = _Waiter("autopipe-send-wait") if threaded else None

    def _failure(self, rank: int, message: str) -> PipelineFailure:
        exc = PipelineFailure(f"pipeline rank {rank} failed: {message}")
        exc.failed_rank = rank  # type: ignore[attr-defined]
        return exc

    def check(self) -> None:
        """Raises PipelineFailure if any rank recorded a failure under this monitor's key."""
        if self.failed is not None:
            raise self.failed
        if self.store is None:
            return
        try:
            if not self.store.check([self.key]):
                return
            raw = self.store.get(self.key).decode("utf-8", "replace")
        except Exception as exc:  # the store's host process may have died
            self.failed = self._failure(self.rank, f"the store is unreachable ({exc}); a rank may have died")
            raise self.failed from exc
        rank, _, message = raw.partition("|")
        self.failed = self._failure(int(rank), message)
        raise self.failed

    def record(self, exc: BaseException) -> None:
        """Writes ``exc`` as this rank's failure, unless it is another rank's failure relayed."""
        if getattr(exc, "failed_rank", self.rank) != self.rank or self.store is None:
            return
        message = f"{type(exc).__name__}: {exc}"[:_MAX_MESSAGE]
        try:
            if self.store.add(self.key + "/count", 1) == 1:
                self.store.set(self.key, f"{self.rank}|{message}")
        except Exception:  # noqa: BLE001 - never mask the original error
            pass
        if self.failed is None:
            self.failed = self._failure(self.rank, message)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Runs one step: refuses to start after a failure; records any exception raised inside."""
        if self.failed is not None:
            raise self.failed
        try:
            yield
        except BaseException as exc:
            self.record(exc)
            raise

    def start(self, works: Sequence[dist.Work]) -> Pending:
        """Begins watching ``works`` now (sends: their tensors can go once ``done()``)."""
        if self._sends is None:
            return Pending(works, None)
        return Pending(works, self._sends.submit(works))

    def wait(self, works: Sequence[dist.Work] | Pending, what: str, *, on_stream: bool = False) -> None:
        """Waits for ``works``; ``what`` names them and their peer ("receive of ... from rank 1").

        Raises PipelineFailure when another rank recorded a failure, when the work itself
        fails (a peer's connection closed), or after ``deadline`` seconds. With ``on_stream``
        and an accelerator backend (not ``threaded``), the wait is queued on the current
        stream and the host goes on at once: see [Note: stream-side waits].
        """
        pending = works if isinstance(works, Pending) else Pending(works, None)
        if on_stream and self._recvs is None:
            if self.failed is not None:
                raise self.failed
            for work in pending.works:
                work.wait()
            return
        if pending.ticket is None and self._recvs is not None and not pending.done():
            pending.ticket = self._recvs.submit(pending.works)
        if pending.ticket is not None:
            self._await(pending.ticket, what)
            return
        for work in pending.works:
            if not work.is_completed():
                self._poll(work, what)
            try:
                work.wait()
            except Exception as exc:
                raise self._lost(f"{what} failed: {exc}") from exc

    def _await(self, ticket: _Ticket, what: str) -> None:
        start = time.perf_counter()
        while not ticket.wait(self.interval):
            self.check()
            if time.perf_counter() - start > self.deadline:
                raise self._timeout(what)
        if ticket.error is not None:
            raise self._lost(f"{what} failed: {ticket.error}") from ticket.error

    def _poll(self, work: dist.Work, what: str) -> None:
        start = time.perf_counter()
        check_at, sleep = start + self.interval, 5e-5
        while not work.is_completed():
            time.sleep(sleep)
            sleep = min(sleep * 2, 5e-4)
            now = time.perf_counter()
            if now >= check_at:
                check_at = now + self.interval
                self.check()
                if now - start > self.deadline:
                    raise self._timeout(what)

    def _timeout(self, what: str) -> PipelineFailure:
        return self._lost(
            f"{what} timed out after {self.deadline:g} s; that rank may have died or hung "
            f"(raise deadline= if stages are this slow)"
        )

    def _lost(self, message: str) -> PipelineFailure:
        # This rank's own failure: guard() records it, which releases the ranks behind it.
        exc = PipelineFailure(message)
        exc.failed_rank = self.rank  # type: ignore[attr-defined]
        return exc


class _Ticket(threading.Event):
    """Set by a waiter thread once its works are done; ``error`` if one raised."""

    error: BaseException | None = None


class Pending:
    """Works being watched; ``done()`` never blocks."""

    __slots__ = ("works", "ticket")

    def __init__(self, works: Sequence[dist.Work], ticket: _Ticket | None) -> None:
        self.works = works
        self.ticket = ticket

    def done(self) -> bool:
        if self.ticket is not None:
            return self.ticket.is_set()
        return all(w.is_completed() for w in self.works)


class _Waiter:
    """A daemon thread calling ``wait()`` on the works it is given, one after the other."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None

    def submit(self, works: Sequence[dist.Work]) -> _Ticket:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        ticket = _Ticket()
        self._queue.put((works, ticket))
        return ticket

    def _run(self) -> None:
        while True:
            works, ticket = self._queue.get()
            try:
                for work in works:
                    work.wait()  # releases the GIL
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                ticket.error = exc
            ticket.set()
