"""Which CUDA-graph slot each micro-batch of one stage holds, and when it may take it.

[Note: slots taken at the receive]
A stage's received activations can land straight in the static inputs of the slot that its
forward will replay, with no copy, if that slot is free when the receive is posted: the slot's
previous micro-batch has run its backward (which reads the static inputs it saved), and the
receive is queued behind that backward. So a receive reserves a slot when it is posted, if one
is free; otherwise the forward takes one when it runs, and the message lands in a pooled buffer
(or, through a shared-memory link, is copied out of the ring straight into the slot: see
[Note: graph slots as boundaries] in graphs.py).

Reservations go in the order of the stage's forwards: once a micro-batch's receive found no
free slot, later ones do not reserve either, until that micro-batch's forward has taken its
slot. A stage's forwards run in micro-batch order, so a forward without a reservation finds
every earlier forward done and no later one holding a slot; the slots it needs are then at most
those a stage holds at once by the schedule (``stage_slots``), and one is free.
"""
from __future__ import annotations

from autopipe.errors import ScheduleError

__all__ = ["SlotTable"]


class SlotTable:
    """The slots of one captured stage, ``slots`` in all, held by micro-batch."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.reset()

    def reset(self) -> None:
        """Frees every slot (also those a failed step still held)."""
        self._free = list(range(self.slots))[::-1]
        self._held: dict[int, int] = {}  # micro-batch -> slot, reserved or taken
        self._waiting: set[int] = set()  # micro-batches whose receive found no slot

    def reserve(self, mb: int) -> int | None:
        """At the posting of micro-batch ``mb``'s receive: a free slot for its forward, or None
        where none is free or an earlier micro-batch is still waiting for one."""
        if mb in self._held:
            return self._held[mb]
        if self._waiting or not self._free:
            self._waiting.add(mb)
            return None
        slot = self._held[mb] = self._free.pop()
        return slot

    def take(self, mb: int) -> int:
        """At micro-batch ``mb``'s forward: its reserved slot, else a free one."""
        if mb in self._held:
            return self._held[mb]
        if not self._free:
            raise ScheduleError(f"micro-batch {mb} finds none of the stage's {self.slots} CUDA-graph slots "
                                f"free (held: {sorted(self._held)}); the schedule holds more micro-batches "
                                f"at once than its slots were counted for")
        self._waiting.discard(mb)
        slot = self._held[mb] = self._free.pop()
        return slot

    def holds(self, mb: int) -> int | None:
        """The slot micro-batch ``mb`` holds, if any."""
        return self._held.get(mb)

    def release(self, mb: int) -> int:
        """At micro-batch ``mb``'s backward: frees its slot and returns it."""
        slot = self._held.pop(mb)
        self._free.append(slot)
        return slot
