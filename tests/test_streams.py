"""Posting order and the stream model of [Note: transfer streams]: no schedule can deadlock on
per-link streams, while one stream per rank deadlocks (so the model can tell); the receive lead
and the links' NCCL options."""
from __future__ import annotations

import pytest

from autopipe.errors import ScheduleError
from autopipe.runtime import p2p, streams
from autopipe.runtime.p2p import one_host
from autopipe.runtime.program import Transfers, compile_program
from autopipe.runtime.schedule import SCHEDULES, Action, ActionKind, all_rank_actions, simulate
from autopipe.runtime.streams import delay_sends, posting_order, receive_lead, send_delays, stream_deadlock

COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)
RECEIVES = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)
SENDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)


def _configs():
    for schedule in SCHEDULES:
        for pp in (2, 3, 4, 8):
            for chunks in (1,) if schedule == "1f1b" else (1, 2, 3, 4, 8):
                for m in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16):
                    try:
                        yield schedule, pp, m, chunks, all_rank_actions(schedule, pp, m, chunks)
                    except ScheduleError:
                        continue


def test_receives_move_one_compute_ahead_and_nothing_else_moves():
    actions = all_rank_actions("1f1b", 2, 4, 1)[1]
    order = posting_order(actions)
    assert sorted(map(str, order)) == sorted(map(str, actions))
    assert [a for a in order if a.kind not in RECEIVES] == [a for a in actions if a.kind not in RECEIVES]
    assert [a for a in order if a.kind in RECEIVES] == [a for a in actions if a.kind in RECEIVES]
    computes = [a for a in actions if a.kind in COMPUTE]
    for a in order:
        if a.kind in RECEIVES:
            consumer = ActionKind.FORWARD if a.kind is ActionKind.RECV_ACT else ActionKind.BACKWARD
            c = next(i for i, x in enumerate(computes) if (x.kind, x.stage, x.microbatch) ==
                     (consumer, a.stage, a.microbatch))
            # Posted after exactly max(0, c - 1) computes.
            assert sum(x.kind in COMPUTE for x in order[: order.index(a)]) == max(0, c - 1)
    assert posting_order(actions, lead=0) == actions
    with pytest.raises(ValueError, match="lead"):
        posting_order(actions, lead=-1)


def test_no_schedule_deadlocks_on_per_link_streams():
    checked = 0
    for schedule, pp, m, chunks, actions in _configs():
        for lead in (0, 1):
            blocked = stream_deadlock([posting_order(a, lead) for a in actions], pp)
            assert blocked == [], (schedule, pp, m, chunks, lead, blocked)
            checked += 1
    assert checked > 500


@pytest.mark.parametrize("schedule,pp,m,chunks", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                                  ("interleaved_1f1b", 2, 4, 8)])
def test_one_stream_per_rank_deadlocks(schedule, pp, m, chunks):
    actions = all_rank_actions(schedule, pp, m, chunks)
    blocked = stream_deadlock([posting_order(a, 0) for a in actions], pp, one_stream=True)
    assert len(blocked) == pp and all("SEND" in b for b in blocked)


def test_a_receive_without_its_send_blocks():
    actions = all_rank_actions("gpipe", 2, 2, 1)
    sender = [a for a in actions[0] if a.kind is not ActionKind.SEND_ACT or a.microbatch == 0]
    # Rank 1 never gets micro-batch 1, so rank 0 never gets the gradient of micro-batch 0.
    assert stream_deadlock([sender, actions[1]], 2) == ["rank 0 blocked at RECV_GRAD s0 mb0",
                                                       "rank 1 blocked at RECV_ACT s1 mb1"]


def test_receives_are_posted_just_in_time_only_between_gpus_of_one_host(monkeypatch):
    monkeypatch.setattr(streams, "RECEIVE_LEAD", None)
    assert receive_lead(cuda=True, one_host=True) == 0
    assert receive_lead(cuda=True, one_host=False) == 1  # between hosts a transfer needs both ends posted
    assert receive_lead(cuda=False, one_host=True) == 1  # gloo moves a message while both ends wait
    monkeypatch.setattr(streams, "RECEIVE_LEAD", 2)
    assert receive_lead(cuda=True, one_host=True) == 2


def test_sends_are_delayed_only_where_receives_are_posted_just_in_time(monkeypatch):
    monkeypatch.setattr(streams, "DELAY_SENDS", None)
    assert delay_sends(cuda=True, one_host=True)
    assert not delay_sends(cuda=True, one_host=False)
    assert not delay_sends(cuda=False, one_host=True)
    monkeypatch.setattr(streams, "DELAY_SENDS", False)
    assert not delay_sends(cuda=True, one_host=True)
    # The lead reaches the program: an interleaved rank posts its receives later with lead 0.
    early, late = compile_program("interleaved_1f1b", 2, 4, 2, 1, 1), compile_program("interleaved_1f1b", 2, 4, 2, 1, 0)
    assert early != late
    assert sorted(map(str, _transfers(early))) == sorted(map(str, _transfers(late)))


def _transfers(program):
    return [t for step in program if isinstance(step, Transfers) for t in step.transfers]


def test_a_pipeline_is_on_one_host_by_torchruns_numbering(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert one_host([0, 1, 2, 3]) and one_host([5, 6])
    assert not one_host([3, 4])
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not one_host([0, 1])  # a launcher that does not say: not known to share a host


def test_link_groups_cap_their_thread_blocks_only_on_nccl(monkeypatch):
    monkeypatch.setattr(p2p, "LINK_MAX_CTAS", 3)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")
    assert p2p.link_options() is None
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "nccl")
    options = p2p.link_options()
    if hasattr(p2p.dist, "ProcessGroupNCCL"):
        assert options.config.max_ctas == 3
    else:  # a build without NCCL has no options to give
        assert options is None
    monkeypatch.setattr(p2p, "LINK_MAX_CTAS", None)
    assert p2p.link_options() is None


def test_sends_wait_for_later_computes_only_where_the_peer_is_not_ready_and_keep_their_order():
    """[Note: send timing]: an interleaved rank 0 (pp=2, 4 chunks, 4 micro-batches) posts some
    sends behind later computes, each still ending a forward before its consumer starts in the
    simulation; 1F1B has nothing to delay; sends never overtake each other."""
    actions = all_rank_actions("interleaved_1f1b", 2, 4, 4)
    delays = send_delays(actions, 2, 4)
    assert sum(d > 0 for d in delays[0].values()) >= 10
    times = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0}
    start = simulate(actions, 2, 4, durations=times).start
    computes = [a for a in actions[0] if a.kind in COMPUTE]
    for send, d in delays[0].items():
        forward = send.kind is ActionKind.SEND_ACT
        kind = ActionKind.FORWARD if forward else ActionKind.BACKWARD
        consumer = Action(kind, send.stage + (1 if forward else -1), send.microbatch)
        last = computes[computes.index(Action(kind, send.stage, send.microbatch)) + d]  # the compute it follows
        assert start[last][1] + times[last.kind] <= start[consumer][1] - (1.0 if d else -1e9)
    assert not any(d for d in send_delays(all_rank_actions("1f1b", 2, 8, 1), 2, 1)[0].values())
    order = posting_order(actions[0], 0, delays[0])
    sends = [a for a in actions[0] if a.kind in SENDS]
    assert [a for a in order if a.kind in SENDS] == sends
    assert [a for a in order if a.kind not in SENDS] == [a for a in posting_order(actions[0], 0) if a.kind not in SENDS]
    # The 2-rank training test delays sends too (tests/test_driver.py: 2 chunks, 4 micro-batches).
    assert sum(d > 0 for d in send_delays(all_rank_actions("interleaved_1f1b", 2, 4, 2), 2, 2)[0].values()) >= 5
    delayed = compile_program("interleaved_1f1b", 2, 4, 4, 0, 0, delay_sends=True)
    assert delayed != compile_program("interleaved_1f1b", 2, 4, 4, 0, 0)
    assert sorted(map(str, _transfers(delayed))) == sorted(map(str, _transfers(compile_program(
        "interleaved_1f1b", 2, 4, 4, 0, 0))))


def test_no_schedule_deadlocks_with_its_sends_delayed():
    checked = 0
    for schedule, pp, m, chunks, actions in _configs():
        if m > 8:
            continue
        delays = send_delays(actions, pp, chunks)
        for lead in (0, 1):
            blocked = stream_deadlock([posting_order(a, lead, d) for a, d in zip(actions, delays)], pp)
            assert blocked == [], (schedule, pp, m, chunks, lead, blocked)
            checked += 1
    assert checked > 300
