"""Schedules are checked by replaying every rank's actions in :func:`simulate`, no processes."""
from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import ScheduleError
from autopipe.runtime import schedule as schedule_module
from autopipe.runtime.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    all_rank_actions,
    interleaved_rounds,
    max_in_flight_bound,
    rank_actions,
    simulate,
    theoretical_bubble,
    timetable,
    validate,
)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
RECEIVES = (RECV_ACT, RECV_GRAD)


def is_valid(schedule: str, pp: int, m: int, chunks: int) -> bool:
    try:
        validate(schedule, pp, m, chunks)
    except ScheduleError:
        return False
    return True


def configs() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, m, chunks): m below, at, above and between multiples of pp."""
    out = []
    for schedule in SCHEDULES:
        for pp in (1, 2, 3, 4, 8):
            for chunks in (1, 2, 3):
                for m in sorted({1, 2, pp - 1, pp, pp + 1, pp + 2, 2 * pp, 2 * pp + 2, 3 * pp - 1, 3 * pp}):
                    if m >= 1 and is_valid(schedule, pp, m, chunks):
                        out.append((schedule, pp, m, chunks))
    return out


def closed_form_steps(schedule: str, pp: int, m: int, chunks: int) -> int:
    forward = (chunks - 1) * max(m, pp) + m + pp - 1
    return forward if schedule == "forward_only" else 2 * forward


def peer(a: Action, pp: int) -> int:
    ahead = a.kind in (SEND_ACT, RECV_GRAD)
    return (a.stage + (1 if ahead else -1)) % pp


def check_schedule(schedule: str, pp: int, m: int, chunks: int) -> None:
    stages = pp * chunks
    actions = all_rank_actions(schedule, pp, m, chunks)
    assert len(actions) == pp
    training = schedule != "forward_only"

    # Every forward (and backward) of every stage and micro-batch once, on the stage's rank.
    for kind in (F, B) if training else (F,):
        runs = Counter((r, a.stage, a.microbatch) for r, acts in enumerate(actions) for a in acts if a.kind is kind)
        assert runs == Counter((s % pp, s, mb) for s in range(stages) for mb in range(m)), kind
    if not training:
        assert not any(a.kind in (B, SEND_GRAD, RECV_GRAD) for acts in actions for a in acts)

    # Transfers only between different ranks; every send has its receive on the peer.
    sends, recvs = Counter(), Counter()
    for r, acts in enumerate(actions):
        for a in acts:
            if a.kind in (F, B):
                continue
            assert peer(a, pp) != r, f"rank {r} transfers {a} to itself"
            if a.kind is SEND_ACT:
                sends[(r, peer(a, pp), RECV_ACT, a.stage + 1, a.microbatch)] += 1
            elif a.kind is SEND_GRAD:
                sends[(r, peer(a, pp), RECV_GRAD, a.stage - 1, a.microbatch)] += 1
            else:
                recvs[(peer(a, pp), r, a.kind, a.stage, a.microbatch)] += 1
    assert sends == recvs
    assert max(sends.values(), default=1) == 1

    # Each receive sits right before the compute that consumes it.
    for acts in actions:
        for a, nxt in zip(acts, acts[1:]):
            if a.kind in RECEIVES:
                assert nxt == Action(F if a.kind is RECV_ACT else B, a.stage, a.microbatch)

    sim = simulate(actions, pp, chunks)
    assert sim.completed and not sim.deadlock, sim.deadlock
    assert not sim.fifo_violations, sim.fifo_violations
    assert not sim.dependency_violations, sim.dependency_violations

    # Data order, in simulated time.
    at = {a: t for a, (_, t) in sim.start.items()}
    for s in range(stages):
        for mb in range(m):
            f = Action(F, s, mb)
            if s > 0:
                assert at[f] > at[Action(F, s - 1, mb)]
            if training:
                b = Action(B, s, mb)
                assert at[b] > at[f]
                if s < stages - 1:
                    assert at[b] > at[Action(B, s + 1, mb)]

    for r in range(pp):
        assert sim.max_in_flight[r] == max_in_flight_bound(schedule, pp, m, chunks, r)
        assert rank_actions(schedule, pp, m, chunks, r) == actions[r]

    assert sim.steps == closed_form_steps(schedule, pp, m, chunks)
    work = m * chunks * (2 if training else 1)
    assert 1 - work / sim.steps == pytest.approx(theoretical_bubble(schedule, pp, m, chunks))


@pytest.mark.parametrize("schedule,pp,m,chunks", configs())
def test_schedule_runs(schedule: str, pp: int, m: int, chunks: int) -> None:
    check_schedule(schedule, pp, m, chunks)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    schedule=st.sampled_from(SCHEDULES),
    pp=st.integers(1, 6),
    m=st.integers(1, 14),
    chunks=st.integers(1, 3),
)
def test_schedule_sweep(schedule: str, pp: int, m: int, chunks: int) -> None:
    if is_valid(schedule, pp, m, chunks):
        check_schedule(schedule, pp, m, chunks)
    else:
        with pytest.raises(ScheduleError):
            all_rank_actions(schedule, pp, m, chunks)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 9, 17])
def test_1f1b_warmup_and_memory(pp: int, m: int) -> None:
    actions = all_rank_actions("1f1b", pp, m, 1)
    sim = simulate(actions, pp, 1)
    assert sim.steps == 2 * (m + pp - 1)
    for r, acts in enumerate(actions):
        compute = [a.kind for a in acts if a.kind in (F, B)]
        warmup = compute.index(B) - 1 if m > pp - r - 1 else m
        assert warmup == min(pp - r - 1, m)
        assert sim.max_in_flight[r] == min(pp - r, m)
        if m >= pp:
            assert sim.max_in_flight[r] == pp - r
        if m > pp:
            assert max_in_flight_bound("1f1b", pp, m, 1, r) < max_in_flight_bound("gpipe", pp, m, 1, r) == m


def test_gpipe_order() -> None:
    acts = [a for a in rank_actions("gpipe", 2, 3, 2, rank=1) if a.kind in (F, B)]
    assert [str(a) for a in acts] == [
        "F1.0", "F1.1", "F1.2", "F3.0", "F3.1", "F3.2",  # chunk-major forwards
        "B3.0", "B3.1", "B3.2", "B1.0", "B1.1", "B1.2",  # last chunk first, micro-batches ascending
    ]


def test_interleaved_order_and_warmup() -> None:
    pp, m, chunks = 4, 8, 2
    rounds, per_round = interleaved_rounds(pp, m)
    assert (rounds, per_round) == (2, 4)
    for r in range(pp):
        compute = [a for a in rank_actions("interleaved_1f1b", pp, m, chunks, r) if a.kind in (F, B)]
        fwd = [(a.stage, a.microbatch) for a in compute if a.kind is F]
        bwd = [(a.stage, a.microbatch) for a in compute if a.kind is B]
        assert fwd == [(c * pp + r, k * 4 + i) for k in range(2) for c in (0, 1) for i in range(4)]
        assert bwd == [(c * pp + r, k * 4 + i) for k in range(2) for c in (1, 0) for i in range(4)]
        # Megatron: (pp - r - 1) * 2 + (v - 1) * per_round forwards before the first 1F1B pair.
        warmup = (pp - r - 1) * 2 + (chunks - 1) * per_round
        assert [a.kind for a in compute].index(B) == warmup + 1


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for pp, m in [(1, 3), (4, 6), (4, 9)]:
        assert all_rank_actions("interleaved_1f1b", pp, m, 1) == all_rank_actions("1f1b", pp, m, 1)


def test_no_transfers_on_one_rank() -> None:
    acts = rank_actions("interleaved_1f1b", 1, 5, 3, rank=0)
    assert {a.kind for a in acts} == {F, B}
    check_schedule("interleaved_1f1b", 1, 5, 3)


def test_pp2_pair_carries_activations_and_gradients_in_order() -> None:
    actions = all_rank_actions("interleaved_1f1b", 2, 4, 2)
    sent = [a for a in actions[0] if a.kind in (SEND_ACT, SEND_GRAD)]
    assert {a.kind for a in sent} == {SEND_ACT, SEND_GRAD}
    check_schedule("interleaved_1f1b", 2, 4, 2)


def test_action_str() -> None:
    assert str(Action(F, 2, 5)) == "F2.5"
    assert str(Action(B, 0, 1)) == "B0.1"
    assert str(Action(RECV_ACT, 1, 3)) == "RECV_ACT s1 mb3"
    assert ActionKind("F") is F


def test_docstring_timetables_are_current() -> None:
    for schedule, m, chunks in [("1f1b", 6, 1), ("interleaved_1f1b", 4, 2)]:
        drawn = timetable(simulate(all_rank_actions(schedule, 4, m, chunks), 4, chunks), 4, chunks)
        for line in drawn.splitlines():
            assert "    " + line + "\n" in schedule_module.__doc__


# Errors


def test_1f1b_rejects_chunks() -> None:
    with pytest.raises(ScheduleError, match=r"chunks=2.*interleaved_1f1b"):
        validate("1f1b", 4, 8, 2)


def test_interleaved_names_nearest_valid_counts() -> None:
    with pytest.raises(ScheduleError, match=r"microbatches=9 .* pp=4.*use microbatches=8 or 10"):
        rank_actions("interleaved_1f1b", 4, 9, 2, rank=0)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_interleaved_valid_counts(pp: int) -> None:
    valid = [m for m in range(1, 6 * pp) if is_valid("interleaved_1f1b", pp, m, 2)]
    assert all(m in valid for m in range(1, 2 * pp))  # one round: any m below 2 * pp
    assert all(m % max(1, m // pp) == 0 for m in valid)
    for m in set(range(1, 6 * pp)) - set(valid):
        with pytest.raises(ScheduleError) as info:
            validate("interleaved_1f1b", pp, m, 2)
        below, above = map(int, re.search(r"use microbatches=(\d+) or (\d+)", str(info.value)).groups())
        assert below < m < above
        assert is_valid("interleaved_1f1b", pp, below, 2) and is_valid("interleaved_1f1b", pp, above, 2)
        assert not any(is_valid("interleaved_1f1b", pp, n, 2) for n in range(below + 1, above) if n != m)


@pytest.mark.parametrize(
    "pp,m,chunks,name",
    [(0, 4, 1, "pp=0"), (-2, 4, 1, "pp=-2"), (2, 0, 1, "microbatches=0"), (2, -1, 1, "microbatches=-1"), (2, 4, 0, "chunks=0")],
)
def test_rejects_non_positive(pp: int, m: int, chunks: int, name: str) -> None:
    for schedule in SCHEDULES:
        with pytest.raises(ScheduleError, match=re.escape(name)):
            all_rank_actions(schedule, pp, m, chunks)


def test_lists_every_problem_at_once() -> None:
    with pytest.raises(ScheduleError) as info:
        validate("zigzag", 0, -1, 1)
    assert all(s in str(info.value) for s in ("pp=0", "microbatches=-1", "'zigzag'", "gpipe"))


def test_rank_out_of_range() -> None:
    with pytest.raises(ScheduleError, match=r"rank=4 .* pp=4"):
        rank_actions("1f1b", 4, 8, 1, rank=4)


# The checker itself: it must catch what it claims to catch.


def test_simulate_catches_fifo_violation() -> None:
    actions = all_rank_actions("gpipe", 2, 2, 1)
    recvs = [i for i, a in enumerate(actions[1]) if a.kind is RECV_ACT]
    i, j = recvs[0], recvs[1]
    actions[1][i], actions[1][j] = actions[1][j], actions[1][i]
    assert simulate(actions, 2, 1).fifo_violations


def test_simulate_catches_deadlock() -> None:
    actions = all_rank_actions("1f1b", 2, 2, 1)
    actions[0] = [a for a in actions[0] if a != Action(SEND_ACT, 0, 1)]
    sim = simulate(actions, 2, 1)
    assert not sim.completed
    assert sim.deadlock == ["rank 0 blocked at RECV_GRAD s0 mb1", "rank 1 blocked at RECV_ACT s1 mb1"]


def test_simulate_catches_dependency_violation() -> None:
    acts = [Action(B, 0, 0), Action(F, 1, 0), Action(F, 0, 0)]
    sim = simulate([acts], 1, 2)
    assert any("before its forward" in v for v in sim.dependency_violations)
    assert any("F1.0 before its input" in v for v in sim.dependency_violations)


def test_action_lists_are_the_callers_own_though_the_schedule_is_built_once():
    from autopipe.runtime.schedule import all_rank_actions, rank_actions, stage_slots

    first = all_rank_actions("interleaved_1f1b", 2, 4, 2)
    first[0].clear()
    rank_actions("interleaved_1f1b", 2, 4, 2, 1).clear()
    stage_slots("interleaved_1f1b", 2, 4, 2, 0).clear()
    again = all_rank_actions("interleaved_1f1b", 2, 4, 2)
    assert len(again[0]) == len(again[1]) > 0
    assert rank_actions("interleaved_1f1b", 2, 4, 2, 1) == again[1]
    assert stage_slots("interleaved_1f1b", 2, 4, 2, 0)
