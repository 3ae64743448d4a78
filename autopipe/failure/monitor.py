"""Failure propagation: when one rank fails, every other rank raises instead of hanging.

A failing rank writes one record into the process group's store; every wait polls its work and,
now and then, the store. See [Note: failure propagation] and [Note: collective waits].
"""
from __future__ import annotations

import contextlib
import datetime
import time
from collections import Counter
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from autopipe.errors import AutopipeError, PipelineFailure
from autopipe.failure import exit_hook
from autopipe.failure.arrival import absent
from autopipe.failure.backend_errors import brief, lost_peer
from autopipe.failure.waiter import Pending, Ticket, Waiter

__all__ = [
    "FailureMonitor", "Pending", "failure_key", "active", "brief", "lost_peer", "host_waits", "wait_works", "synced",
    "DEFAULT_DEADLINE",
]  # fmt: skip

# [Note: failure propagation]
# A rank blocks only while waiting for a message, a collective or a host sync, and the peer it
# waits on may be waiting on a third rank that has failed. So:
# * A rank that raises inside a step records ``"<rank>|<name>|<ExcType>: <message>"`` under one
#   key of the store every rank already shares (the default store of torch.distributed, or one
#   passed in) and re-raises its own exception. Only the first record is kept (``store.add``
#   on a counter elects the writer), so the root cause wins over the failures it triggers.
#   A ParallelModel's key spans the whole world (every pipeline, tp and dp rank), so a failure
#   anywhere reaches every rank, named: "rank 1 (pp 0, dp 0, tp 1) failed: ValueError: bad batch".
# * No wait blocks blindly: every ``interval`` seconds (0.2) it reads the key and raises
#   that PipelineFailure, and past ``deadline`` (default 300 s) it raises a PipelineFailure
#   naming what it waited for. A raw error met while another rank's record exists (gloo's
#   "Connection closed by peer" once the failed process exits) is raised as that record.
# * How a wait learns that its work finished depends on the backend. NCCL (and other
#   accelerator backends) answer ``work.is_completed()`` truthfully: the wait polls it with
#   short, growing sleeps (50 us up to 0.5 ms). Gloo's send/recv works only complete inside
#   ``work.wait()``, which cannot be interrupted, so on CPU a daemon thread calls ``wait()``
#   while the caller sleeps on an Event in ``interval`` slices. Sends are handed to a second
#   thread when posted, so that their tensors are let go as soon as they are delivered.
#   Collectives are waited on as [Note: collective waits] says.
# * A process that dies writes nothing: its neighbours see gloo's connection error (or
#   nothing, on NCCL) or reach the deadline; either way they record their own failure, which
#   releases the ranks further away. Gloo may raise that error where a transfer or collective
#   is posted rather than waited on; ``cause()`` types it as a PipelineFailure all the same.
# A finished wait costs one is_completed() call (or one Event wait), and the store is read only
# by ranks that are already blocked, so a healthy pipeline pays nearly nothing. After a
# failure the group's messages are out of step (and a waiter thread may stay blocked): the
# record is kept, every later step fails at once, and the job should restart its processes
# (see [Note: exit after a failure] in exit_hook.py).

# [Note: stream-side waits]
# On NCCL, ``work.wait()`` makes the current CUDA stream wait for the transfer and returns at
# once. Polling ``is_completed()`` on the host instead would block the Python thread until the
# data arrived and leave the GPU idle while the next stage's kernels are launched. So the
# driver waits for its per-micro-batch transfers on the stream and polls (watching the store
# and the deadline) only once per step, at the loss broadcast: a failed peer is still noticed
# within a bounded time, one step later at most.

# [Note: collective waits]
# Tensor-parallel collectives, the data-parallel gradient all-reduce, the norms of clipping and
# the loss broadcast wait through the monitor of the step that runs them (``active()``):
# * On gloo a collective runs on the process group's own worker thread and its work completes
#   there, so ``work.wait(timeout)`` returns as soon as it is done (no polling, no sleep: a
#   healthy wait costs what ``wait()`` costs) and, while a peer is missing, wakes every
#   ``interval`` to read the store. (Its send/recv works are different: a timed-out wait
#   breaks the pair, hence the threads above.)
# * On NCCL the host never blocks on a collective: ``work.wait()`` queues the wait on the
#   stream. The host blocks only where it reads a value (a norm, the loss, a state_dict
#   moved to the CPU); there ``sync()`` polls a CUDA event instead, watching the store. A
#   failed peer's collective then stays stuck on the GPU, and the host still raises.
# Compiled stages trace the collectives into their graphs (see [Note: traceable collectives]);
# their waits are not watched: on gloo a failed peer is noticed when its process exits (gloo
# closes its connections), on NCCL at the next watched wait (the loss broadcast).
# Why waits that watch, rather than a failed rank aborting its communicators: gloo's works and
# process groups do not abort (``abort()`` releases neither a blocked wait nor a peer; measured
# on torch 2.14), and aborting an NCCL communicator does not release the kernels its peers
# have queued. A watched wait works alike on both, and costs nothing until a peer is late.
# The collective APIs users call on every rank (full_state_dict, save/load_checkpoint) start
# with ``arrive()``: a barrier over the store with the deadline, so that one rank calling one
# alone raises a PipelineFailure naming the ranks that did not come, instead of hanging.

DEFAULT_DEADLINE = 300.0
_MAX_MESSAGE = 2000
_instances: Counter[str] = Counter()
_ACTIVE: list[FailureMonitor] = []  # monitors of the steps running now, innermost last


def failure_key(group: dist.ProcessGroup | None) -> str:
    """A store key unique to this group and to the n-th driver built on it in this process.

    Every rank of the group builds its drivers in the same order, so the n-th drivers of all
    ranks agree on the key, and a failure of one driver does not poison the next one.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    name = "-".join(map(str, ranks))
    _instances[name] += 1
    return f"autopipe/failure/{name}/{_instances[name]}"


def _shared(works: Sequence) -> bool:
    """Whether ``works`` are messages of shared-memory links (runtime/host_links.py)."""
    return bool(works) and all(hasattr(w, "ready") for w in works)


def active() -> FailureMonitor | None:
    """The monitor of the step running now (inside :meth:`FailureMonitor.guard`), if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def host_waits(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether a collective on ``group`` over tensors on ``device`` blocks the host (gloo)."""
    return device.type == "cpu" or dist.get_backend(group) == "gloo"


def wait_works(works: Sequence[dist.Work], what: str, group: dist.ProcessGroup | None,
               device: torch.device) -> None:
    """Waits for collective ``works`` through the active monitor (plainly without one)."""
    monitor = active()
    if monitor is None:
        for work in works:
            work.wait()
        return
    monitor.wait_collective(works, what, host=host_waits(group, device))


def synced(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` once the work queued for it is done, waited through the active monitor: read it
    (``.item()``, ``.cpu()``) without blocking behind a collective a failed peer never joined."""
    monitor = active()
    if monitor is not None:
        monitor.sync(t, what)
    return t


class FailureMonitor:
    """Records this rank's failure and waits on works while watching for other ranks' failures.

    ``rank`` identifies this rank among the ``size`` ranks sharing ``key`` (a ParallelModel's
    monitor: the global rank; a pipeline driver's own: its pipeline rank) and ``name`` says
    who it is in messages ("pipeline rank 1" by default); ``store`` the store they share (None:
    no peers, as with pp = 1: waits then only time out). ``threaded`` waits for send/recv works
    through helper threads, for backends whose works complete only inside ``wait()`` (gloo).
    """

    def __init__(
        self,
        rank: int,
        store: dist.Store | None,
        key: str,
        *,
        name: str | None = None,
        size: int = 1,
        deadline: float = DEFAULT_DEADLINE,
        interval: float = 0.2,
        threaded: bool = False,
    ) -> None:
        self.rank = rank
        self.store = store
        self.key = key
        self.name = name if name is not None else f"pipeline rank {rank}"
        self.size = size
        self.deadline = deadline
        self.interval = interval
        self.failed: PipelineFailure | None = None
        self._calls = 0  # collective API calls, see arrive()
        self._previous: str | None = None  # the store keys of the last call that every rank made
        # Gloo's p2p works complete only inside wait(): see [Note: failure propagation].
        self._recvs = Waiter("autopipe-recv-wait") if threaded else None
        self._sends = Waiter("autopipe-send-wait") if threaded else None

    @classmethod
    def for_world(cls, name: str, *, deadline: float, threaded: bool) -> FailureMonitor:
        """A monitor every process of the world shares (a ParallelModel's): its key is the
        n-th one built over the world, so every process must build them in the same order."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls(0, None, "", name=name, deadline=deadline, threaded=threaded)
        return cls(dist.get_rank(), _get_default_store(), failure_key(None), name=name,
                   size=dist.get_world_size(), deadline=deadline, threaded=threaded)

    # ------------------------------------------------------------------------- records
    def _failure(self, rank: int, name: str, message: str) -> PipelineFailure:
        exc = PipelineFailure(f"{name} failed: {message}")
        exc.failed_rank = rank  # type: ignore[attr-defined]
        return exc

    def _recorded(self) -> PipelineFailure | None:
        """Another rank's recorded failure (kept as this monitor's), or None; never raises."""
        if self.failed is not None or self.store is None:
            return self.failed
        try:
            if not self.store.check([self.key]):
                return None
            raw = self.store.get(self.key).decode("utf-8", "replace")
        except Exception as exc:  # noqa: BLE001 - the store's host process may have died
            self.failed = self._failure(self.rank, self.name,
                                        f"the store is unreachable ({brief(exc)}); a rank may have died")
        else:
            rank, name, message = raw.split("|", 2)
            self.failed = self._failure(int(rank), name, message)
        exit_hook.install()
        return self.failed

    def check(self) -> None:
        """Raises PipelineFailure if any rank recorded a failure under this monitor's key."""
        failed = self._recorded()
        if failed is not None:
            raise failed

    def record(self, exc: BaseException) -> None:
        """Writes ``exc`` as this rank's failure, unless a failure (this rank's or another's
        relayed) is known already. Without peers (no store) nothing is kept: no one can wait."""
        if self.failed is not None or getattr(exc, "failed_rank", self.rank) != self.rank or self.store is None:
            return
        message = f"{type(exc).__name__}: {exc}"[:_MAX_MESSAGE]
        try:
            if self.store.add(self.key + "/count", 1) == 1:
                self.store.set(self.key, f"{self.rank}|{self.name}|{message}")
        except Exception:  # noqa: BLE001 - never mask the original error
            pass
        self.failed = self._failure(self.rank, self.name, message)
        exit_hook.install()

    def cause(self, exc: BaseException) -> BaseException:
        """What to raise for ``exc``: the failure another rank recorded first when ``exc`` is
        an untyped error (likely its consequence: a connection its process closed); else a
        PipelineFailure where ``exc`` is the backend's own report of a lost peer (raised where
        a transfer or collective is posted, not waited on); else ``exc``."""
        if isinstance(exc, (AutopipeError, KeyboardInterrupt)) or not isinstance(exc, Exception):
            return exc
        failed = self._recorded()
        if failed is not None and getattr(failed, "failed_rank", None) != self.rank:
            return failed
        if lost_peer(exc):
            return self._lost(f"a transfer or collective failed: {brief(exc)}; a peer process may have died")
        return exc

    @contextlib.contextmanager
    def guard(self, *, record: bool = True) -> Iterator[None]:
        """Runs one step: refuses to start after a failure; records any exception raised inside
        (with ``record``); makes this monitor the one collectives wait through (``active()``)."""
        if self.failed is not None:
            raise self.failed
        _ACTIVE.append(self)
        try:
            yield
        except BaseException as exc:
            cause = self.cause(exc)
            if record:
                self.record(cause)
            if cause is not exc:
                raise cause from exc
            raise
        finally:
            _ACTIVE.pop()

    # ------------------------------------------------------------------------- waits
    def close(self) -> None:
        """Ends the threads that wait on gloo's transfers (after the works given so far)."""
        for waiter in filter(None, (self._recvs, self._sends)):
            waiter.close()

    def start(self, works: Sequence[dist.Work]) -> Pending:
        """Begins watching ``works`` now (sends: their tensors can go once ``done()``)."""
        if self._sends is None or _shared(works):
            return Pending(works, None)
        return Pending(works, self._sends.submit(works))

    def wait(self, works: Sequence[dist.Work] | Pending, what: str, *, on_stream: bool = False) -> None:
        """Waits for send/recv ``works``; ``what`` names them and their peer ("receive of ...
        from rank 1").

        Raises PipelineFailure when another rank recorded a failure, when the work itself
        fails (a peer's connection closed), or after ``deadline`` seconds. With ``on_stream``
        and an accelerator backend (not ``threaded``), the wait is queued on the current
        stream and the host goes on at once: see [Note: stream-side waits].
        """
        pending = works if isinstance(works, Pending) else Pending(works, None)
        if _shared(pending.works):  # see [Note: shared-memory links] in autopipe/runtime/host_links.py
            if self.failed is not None:
                raise self.failed
            for work in pending.works:
                if not work.ready():
                    self.poll(work.ready, what)
                work.wait()
            return
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
                self.poll(work.is_completed, what)
            try:
                work.wait()
            except Exception as exc:
                raise self._lost(f"{what} failed: {brief(exc)}") from exc

    def wait_collective(self, works: Sequence[dist.Work], what: str, *, host: bool) -> None:
        """Waits for collective ``works``: on the host in ``interval`` slices where the backend
        blocks the host (``host``: gloo), else on the current stream; see [Note: collective waits]."""
        if self.failed is not None:
            raise self.failed
        if not host:
            for work in works:
                work.wait()
            return
        start, piece = time.perf_counter(), datetime.timedelta(seconds=self.interval)
        for work in works:
            while True:
                try:
                    work.wait(piece)
                    break
                except Exception:  # noqa: BLE001 - a timed-out slice, or the work failed
                    if work.is_completed():
                        try:
                            work.wait()  # raises the work's own error, if it failed
                        except Exception as exc:  # noqa: BLE001 - a peer's connection closed
                            raise self._lost(f"{what} failed: {brief(exc)}") from exc
                        break
                self.check()
                if time.perf_counter() - start > self.deadline:
                    raise self._timeout(what)

    def sync(self, t: torch.Tensor, what: str) -> None:
        """Returns once the work queued so far for ``t`` (a CUDA tensor) is done, so that reading
        it cannot block forever behind a collective a failed peer never joined."""
        if t.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        if not event.query():
            self.poll(event.query, what)

    def arrive(self, what: str) -> None:
        """Returns once every rank sharing the key called ``what`` as its n-th collective call;
        past the deadline records and raises a PipelineFailure naming the ranks that did not."""
        if self.failed is not None:
            raise self.failed
        if self.store is None or self.size <= 1:
            return
        self._calls += 1
        base = f"{self.key}/calls/{self._calls}"
        self.store.set(f"{base}/rank{self.rank}", what)
        if self.store.add(f"{base}/{what}/count", 1) == self.size:
            self.store.set(f"{base}/{what}/all", "1")
            if self._previous is not None:  # every rank is past the previous call: its keys can go
                self.store.delete_key(f"{self._previous}/count")
                self.store.delete_key(f"{self._previous}/all")
        start, piece = time.perf_counter(), datetime.timedelta(seconds=self.interval)
        while True:
            try:
                self.store.wait([f"{base}/{what}/all"], piece)
                # Read only by ranks that wait in vain, which no rank does once all came.
                self.store.delete_key(f"{base}/rank{self.rank}")
                self._previous = f"{base}/{what}"
                return
            except Exception:  # noqa: BLE001 - a timed-out slice
                pass
            self.check()
            if time.perf_counter() - start > self.deadline:
                failure = self._lost(absent(self.store, self.size, base, what, self.deadline))
                self.record(failure)  # releases the ranks waiting for this one elsewhere
                raise failure

    def _await(self, ticket: Ticket, what: str) -> None:
        start = time.perf_counter()
        while not ticket.wait(self.interval):
            self.check()
            if time.perf_counter() - start > self.deadline:
                raise self._timeout(what)
        if ticket.error is not None:
            raise self._lost(f"{what} failed: {brief(ticket.error)}") from ticket.error

    def poll(self, done: Callable[[], bool], what: str) -> None:
        """Returns once ``done()``; past the deadline, or once another rank recorded a failure,
        raises PipelineFailure (``what`` names what was waited for)."""
        start = time.perf_counter()
        check_at, sleep = start + self.interval, 5e-5
        while not done():
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
        # Another rank's recorded failure explains this one; else it is this rank's own:
        # guard() records it, which releases the ranks behind it.
        failed = self._recorded()
        if failed is not None:
            return failed
        exc = PipelineFailure(message)
        exc.failed_rank = self.rank  # type: ignore[attr-defined]
        return exc
