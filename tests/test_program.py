"""A rank's program (runtime/program.py): typed steps that run every action of the rank's
schedule once, in posting order, with the transfers between two computes posted together."""
from __future__ import annotations

import dataclasses

import pytest

from autopipe.runtime.program import Compute, PointToPoint, Transfers, compile_program
from autopipe.runtime.schedule import ActionKind, rank_actions
from autopipe.runtime.streams import posting_order


@pytest.mark.parametrize("schedule,pp,m,chunks", [("1f1b", 2, 4, 1), ("gpipe", 3, 3, 1),
                                                  ("interleaved_1f1b", 2, 4, 2), ("forward_only", 4, 2, 1)])
def test_the_program_runs_the_posting_order(schedule: str, pp: int, m: int, chunks: int) -> None:
    for rank in range(pp):
        program = compile_program(schedule, pp, m, chunks, rank)
        flat = []
        for step in program:
            if isinstance(step, Compute):
                flat.append((ActionKind.FORWARD if step.forward else ActionKind.BACKWARD, step.stage, step.microbatch))
            else:
                assert isinstance(step, Transfers) and step.transfers
                flat += [(t.kind, t.stage, t.microbatch) for t in step.transfers]
        expected = [(a.kind, a.stage, a.microbatch) for a in posting_order(rank_actions(schedule, pp, m, chunks, rank))]
        assert flat == expected
        # Never two transfer steps in a row: the transfers between two computes go together.
        assert not any(isinstance(a, Transfers) and isinstance(b, Transfers) for a, b in zip(program, program[1:]))


def test_a_transfer_names_its_peer_and_direction() -> None:
    program = compile_program("1f1b", 2, 1, 1, 0)
    transfers = [t for step in program if isinstance(step, Transfers) for t in step.transfers]
    # The gradient's receive is posted ahead of the forward (see [Note: transfer streams]).
    assert [(t.kind, t.peer, t.send) for t in transfers] == [(ActionKind.RECV_GRAD, 1, False),
                                                              (ActionKind.SEND_ACT, 1, True)]
    assert transfers[1].what == "send of stage 0's output (micro-batch 0) to pipeline rank 1"
    assert isinstance(program[1], Compute) and program[1].forward
    with pytest.raises(dataclasses.FrozenInstanceError):
        transfers[1].peer = 0  # type: ignore[misc]
    assert isinstance(transfers[1], PointToPoint)
