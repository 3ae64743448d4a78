"""Threads that wait for works which complete only inside ``wait()`` (gloo's send/recv), so
that the caller can watch for failures meanwhile; see [Note: failure propagation] in monitor.py.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Sequence

import torch.distributed as dist

__all__ = ["Ticket", "Pending", "Waiter"]


class Ticket(threading.Event):
    """Set by a waiter thread once its works are done; ``error`` if one raised."""

    error: BaseException | None = None


class Pending:
    """Works being watched; ``done()`` never blocks."""

    __slots__ = ("works", "ticket")

    def __init__(self, works: Sequence[dist.Work], ticket: Ticket | None) -> None:
        self.works = works
        self.ticket = ticket

    def done(self) -> bool:
        if self.ticket is not None:
            return self.ticket.is_set()
        return all(w.is_completed() for w in self.works)


class Waiter:
    """A daemon thread calling ``wait()`` on the works it is given, one after the other.

    The thread ends when :meth:`close` is called or the Waiter is collected (it holds only
    the queue): a process that builds many pipelines keeps no idle threads of the old ones.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._stop = weakref.finalize(self, self._queue.put, None)

    def submit(self, works: Sequence[dist.Work]) -> Ticket:
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._queue,), name=self._name, daemon=True)
            self._thread.start()
        ticket = Ticket()
        self._queue.put((works, ticket))
        return ticket

    def close(self) -> None:
        """Ends the thread once the works given so far are waited on."""
        self._stop()


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        works, ticket = job
        try:
            for work in works:
                work.wait()  # releases the GIL
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            ticket.error = exc
        ticket.set()
