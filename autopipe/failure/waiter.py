"""Threads that wait for works which complete only inside ``wait()`` (gloo's send/recv), so
that the caller can watch for failures meanwhile; see [Note: failure propagation] in monitor.py.
"""
from __future__ import annotations

import queue
import threading
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
    """A daemon thread calling ``wait()`` on the works it is given, one after the other."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None

    def submit(self, works: Sequence[dist.Work]) -> Ticket:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        ticket = Ticket()
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
