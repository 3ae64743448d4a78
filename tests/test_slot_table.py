"""Which CUDA-graph slot each micro-batch takes (runtime/slot_table.py): reservations at a
receive's posting never leave a later forward without a slot, in every schedule's program."""
from __future__ import annotations

import pytest

from autopipe.errors import ScheduleError
from autopipe.runtime.program import Compute, compile_program
from autopipe.runtime.schedule import ActionKind, stage_slots
from autopipe.runtime.slot_table import SlotTable


def test_reservations_follow_the_forwards_order() -> None:
    table = SlotTable(2)
    assert table.reserve(0) is not None and table.reserve(1) is not None
    assert table.reserve(2) is None  # none free
    assert table.reserve(3) is None  # micro-batch 2 waits: 3 may not go before it
    table.take(0)
    table.release(0)
    assert table.reserve(3) is None  # a slot is free, but 2 still waits for it
    slot = table.take(2)
    assert table.holds(2) == slot and table.reserve(3) is None  # none free again
    table.release(1)
    assert table.take(3) is not None
    with pytest.raises(ScheduleError, match="micro-batch 4 finds none of the stage's 2 CUDA-graph slots"):
        table.take(4)
    table.reset()
    assert table.reserve(4) is not None and table.holds(2) is None


CASES = [("gpipe", 2, 4, 1), ("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2),
         ("interleaved_1f1b", 2, 8, 4), ("interleaved_1f1b", 4, 8, 2)]


@pytest.mark.parametrize("schedule,pp,m,chunks", CASES)
@pytest.mark.parametrize("lead", [1, 2])
def test_every_forward_finds_a_slot_and_a_reserved_one_was_free_at_the_receive(
        schedule: str, pp: int, m: int, chunks: int, lead: int) -> None:
    """Replays each rank's program as the driver runs it: a receive of activations reserves a slot
    when posted, a forward takes one, a backward frees it. No forward finds none free, and a slot
    reserved at a receive had run its last backward before (so the receive may overwrite it)."""
    reserved = 0
    for rank in range(pp):
        slots = stage_slots(schedule, pp, m, chunks, rank)
        tables = {s: SlotTable(n) for s, n in slots.items()}
        last_backward: dict[tuple[int, int], int] = {}  # (stage, slot) -> step of its last backward
        holder: dict[tuple[int, int], int | None] = {}  # (stage, slot) -> micro-batch holding it
        for i, step in enumerate(compile_program(schedule, pp, m, chunks, rank, lead)):
            if isinstance(step, Compute):
                table = tables[step.stage]
                if step.forward:
                    slot = table.take(step.microbatch)
                    assert holder.get((step.stage, slot)) in (None, step.microbatch)
                    holder[(step.stage, slot)] = step.microbatch
                else:
                    slot = table.release(step.microbatch)
                    holder[(step.stage, slot)] = None
                    last_backward[(step.stage, slot)] = i
                continue
            for t in step.transfers:
                if t.kind is ActionKind.RECV_ACT:
                    slot = tables[t.stage].reserve(t.microbatch)
                    if slot is not None:
                        reserved += 1
                        assert holder.get((t.stage, slot)) is None  # free: its backward came before
                        holder[(t.stage, slot)] = t.microbatch
        assert all(table.holds(mb) is None for table in tables.values() for mb in range(m))
    if schedule == "gpipe":  # a slot per micro-batch: every receive lands in its slot
        assert reserved == m * (pp - 1) * chunks
