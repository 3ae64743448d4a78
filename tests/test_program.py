"""A rank's program (runtime/program.py): typed steps that run every action of the rank's
schedule once, in posting order, with the transfers between two computes posted together."""
from __future__ import annotations

import dataclasses
import random

import pytest

from autopipe.runtime.program import Compute, PointToPoint, Transfers, compile_program, messages_ahead
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


def _ahead_in_a_run(programs: list[list], pick) -> dict[tuple[int, int], int]:
    """Runs every rank's program with sends that never wait, choosing the next rank to move with
    ``pick(runnable)``; the most messages each link's sender had posted that the receiver had
    not taken (a message is taken when its consumer's compute starts)."""
    pp = len(programs)
    flat = [[(r, step) for step in program for step in ([step] if isinstance(step, Compute) else step.transfers)]
            for r, program in enumerate(programs)]
    posted: dict[tuple, int] = {}
    taken: dict[tuple[int, int], int] = {}
    sent: dict[tuple[int, int], int] = {}
    most: dict[tuple[int, int], int] = {}
    wanted = [dict() for _ in range(pp)]  # per rank: (forward, stage, mb) -> receive keys
    at = [0] * pp

    def key(r: int, t: PointToPoint) -> tuple:
        forward = t.kind in (ActionKind.SEND_ACT, ActionKind.RECV_ACT)
        stage = t.stage + (1 if forward else -1) if t.send else t.stage
        return ((r, t.peer) if t.send else (t.peer, r), forward, stage, t.microbatch)

    def ready(r: int) -> bool:
        _, step = flat[r][at[r]]
        if isinstance(step, Compute):
            return all(k in posted for k in wanted[r].get((step.forward, step.stage, step.microbatch), ()))
        return True

    while any(at[r] < len(flat[r]) for r in range(pp)):
        runnable = [r for r in range(pp) if at[r] < len(flat[r]) and ready(r)]
        assert runnable, "the programs deadlock"
        r = pick(runnable)
        _, step = flat[r][at[r]]
        at[r] += 1
        if isinstance(step, Compute):
            for k in wanted[r].pop((step.forward, step.stage, step.microbatch), ()):
                taken[k[0]] = taken.get(k[0], 0) + 1
        elif step.send:
            k = key(r, step)
            posted[k] = 1
            sent[k[0]] = sent.get(k[0], 0) + 1
            most[k[0]] = max(most.get(k[0], 0), sent[k[0]] - taken.get(k[0], 0))
        else:
            k = key(r, step)
            wanted[r].setdefault((step.kind is ActionKind.RECV_ACT, step.stage, step.microbatch), []).append(k)
    return most


@pytest.mark.parametrize("schedule,pp,m,chunks", [("1f1b", 2, 4, 1), ("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1),
                                                  ("interleaved_1f1b", 2, 4, 4), ("interleaved_1f1b", 4, 8, 2),
                                                  ("interleaved_1f1b", 3, 6, 2), ("forward_only", 3, 4, 2)])
def test_messages_ahead_bounds_every_run_and_some_run_reaches_it(schedule: str, pp: int, m: int, chunks: int) -> None:
    programs = [compile_program(schedule, pp, m, chunks, r, lead=0) for r in range(pp)]
    bound = messages_ahead(programs)
    reached: dict[tuple[int, int], int] = {}
    rng = random.Random(0)
    picks = [lambda rs: rng.choice(rs) for _ in range(60)]
    picks += [lambda rs, a=a: a if a in rs else min(rs) for a in range(pp)]  # one rank as far ahead as it can
    picks += [lambda rs, a=a: max((r for r in rs if r != a), default=a) for a in range(pp)]  # one as far behind
    for pick in picks:
        for link, n in _ahead_in_a_run(programs, pick).items():
            assert n <= bound[link], (link, n, bound[link])
            reached[link] = max(reached.get(link, 0), n)
    assert reached == bound  # tight: some run has each link that far ahead
    with pytest.raises(ValueError, match="cannot run to their end"):
        messages_ahead([programs[0]] + [[] for _ in programs[1:]])
