"""Measured costs (autopipe/measure, partition/measured.py, partition/calibration.py), on CPU.

What is timed on a CPU is a CPU, so these tests check the machinery: that kernel times land on
the nodes that launched them, that profiles tile the graph, are cached, checked and refused
with typed errors, that the closed loop converges on a known truth, that every rank of a
multi-process run plans alike, and that the calibration and the reports carry both figures.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.errors import ConfigError, ProfileError
from autopipe.measure import MeasureOptions, ProfileCache, RunSetup, profile_graph, segment_starts
from autopipe.measure import _groups, _planned
from autopipe.measure.closed_loop import UNPROFILED
from autopipe.measure import profile as profile_module
from autopipe.measure.closed_loop import _chains, move_boundaries, refine
from autopipe.partition.balance import least_imbalance
from autopipe.partition.cuts import cut_candidates
from autopipe.partition.partitioner import partition_at
from autopipe.measure.kernels import node_times
from autopipe.partition.calibration import (FLOPS, Calibration, class_of, kernel_kind, load_calibration, plain_class,
                                           split_by_bound)
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import PROFILES, DeviceProfile
from autopipe.partition.measured import MeasuredCosts, Segment, fingerprint, spread
from autopipe.partition.partitioner import analytic_seconds
from autopipe.stages import plan_stages
from autopipe.tracer import trace
from tests.distributed import run_distributed
from tests.models import timm_vit

CPU = RunSetup("cpu", reps=2, warmup=1)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(64, 256), nn.Dropout(0.0), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def _vit_traced(batch: int = 4):
    torch.manual_seed(0)
    return trace(timm_vit(), (torch.randn(batch, 3, 32, 32),))


# ------------------------------------------------------------------------------ node times
def test_kernel_times_land_on_the_nodes_that_launched_them():
    traced = trace(_Mlp(), (torch.randn(512, 64),))
    x = torch.randn(512, 64)
    times = node_times(traced.gm, [x], [True], torch.device("cpu"), None, reps=2)
    forward, backward = {n: t[0] for n, t in times.device.items()}, {n: t[1] for n, t in times.device.items()}
    assert forward["fc1"] > 0 and forward["fc2"] > 0 and backward["fc1"] > 0 and backward["fc2"] > 0
    # nn.Dropout(0.0) returns its input and makes no autograd node: fc2's backward, which
    # records the same sequence number, must not be credited to it.
    assert backward.get("drop", 0.0) == 0.0
    assert backward["fc2"] > 0.2 * forward["fc2"]


def test_profile_tiles_the_graph_and_prices_every_node(tmp_path):
    traced = _vit_traced()
    measured = profile_graph(traced, CPU, segments=6)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    assert measured.segments[0].start == 0 and measured.segments[-1].end == len(order)
    assert all(a.end == b.start for a, b in zip(measured.segments, measured.segments[1:]))
    assert set(measured.node_seconds) == set(order)
    linears = [n.name for n in traced.gm.graph.nodes if n.op == "call_module" and "fc1" in n.name]
    assert all(measured.node_seconds[n] > 0 for n in linears)
    assert measured.fingerprint == fingerprint(traced.gm) and measured.device == "cpu"
    assert set(measured.node_detail) >= set(linears)
    # A plan priced by it carries the source and the profile's times (no MLP pieces: a piece's
    # new nodes are priced by the model, not the profile).
    plan = plan_stages(traced, 2, device="cpu", measured=measured, split_mlps=False)
    assert plan.cost_source["source"] == "measured" and plan.cost_source["device"] == "cpu"
    assert sum(s.compute_time for s in plan.stages) == pytest.approx(
        sum(measured.node_seconds.values()) + 2 * measured.stage_overhead)
    again = MeasuredCosts.load(_saved(measured, tmp_path / "p.json"))
    assert again == measured


def _saved(measured: MeasuredCosts, path) -> str:
    measured.save(path)
    return str(path)


def test_segments_start_where_work_was_done():
    traced = _vit_traced()
    starts = segment_starts(traced, 10**6, "cpu")
    seconds = analytic_seconds(traced, "cpu")
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    for a, b in zip(starts, starts[1:] + [len(order)]):
        assert sum(seconds[n] for n in order[a:b]) > 0  # no segment of views alone
    assert len(segment_starts(traced, 5, "cpu")) == 5


def test_a_cached_profile_is_not_timed_again(tmp_path, monkeypatch):
    traced = _vit_traced()
    cache = ProfileCache(tmp_path)
    first = profile_graph(traced, CPU, segments=4, cache=cache)

    def no_timing(*a, **k):
        raise AssertionError("a cached profile was timed again")

    monkeypatch.setattr(profile_module, "time_stages", no_timing)
    second = profile_graph(traced, CPU, segments=4, cache=cache)
    assert second == first
    other = _vit_traced(batch=2)  # another shape: another key, so it would be timed
    with pytest.raises(AssertionError, match="timed again"):
        profile_graph(other, CPU, segments=4, cache=cache)


def test_a_corrupt_cache_file_is_a_typed_error_and_is_kept(tmp_path):
    traced = _vit_traced()
    cache = ProfileCache(tmp_path)
    measured = profile_graph(traced, CPU, segments=4, cache=cache)
    path = cache.path(measured.key(), 4)
    with open(path, "w") as f:
        f.write('{"schema": 1, "segments": [')
    with pytest.raises(ProfileError, match="corrupt.*delete it"):
        profile_graph(traced, CPU, segments=4, cache=cache)
    assert open(path).read().startswith('{"schema": 1')  # nothing lost behind the user's back


def test_a_profile_of_another_graph_shape_or_setup_is_refused():
    traced = _vit_traced()
    measured = profile_graph(traced, CPU, segments=4)
    with pytest.raises(ProfileError, match="fingerprint.*\n.*input_shapes"):
        plan_stages(_vit_traced(batch=2), 2, device="cpu", measured=measured)
    deeper = trace(timm_vit(depth=3), (torch.randn(4, 3, 32, 32),))
    with pytest.raises(ProfileError, match="fingerprint"):
        plan_stages(deeper, 2, device="cpu", measured=measured)
    with pytest.raises(ProfileError, match="mode: profile has 'eager', this plan needs 'graphs'"):
        measured.check({"mode": "graphs", "device": "cpu"})
    with pytest.raises(ProfileError, match="device: profile has 'cpu'"):
        measured.check({"device": "NVIDIA H100 80GB HBM3"})


def test_no_accelerator_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfileError, match="no CUDA device.*autopipe profile"):
        RunSetup("cuda", "eager")
    with pytest.raises(ProfileError, match="graphs.*needs a CUDA device"):
        RunSetup("cpu", "graphs")


def test_spread_follows_the_model_inside_a_segment():
    segs = [Segment(0, 2, 3.0, 1.0), Segment(2, 3, 1.0, 1.0)]
    out = spread(segs, ["a", "b", "c"], [1.0, 3.0, 0.0])
    assert out == {"a": 1.0, "b": 3.0, "c": 2.0}
    assert spread([Segment(0, 2, 2.0, 0.0)], ["a", "b"], [0.0, 0.0]) == {"a": 1.0, "b": 1.0}
    with pytest.raises(ProfileError, match="do not tile"):
        spread([Segment(0, 1, 1.0, 0.0)], ["a", "b"], [1.0, 1.0])


# ------------------------------------------------------------------------------ closed loop
def _synthetic(traced, hidden_seed: int = 1):
    """A profile of the analytic times, and a 'device' whose segments run at hidden speeds."""
    base = {k: v for k, v in analytic_seconds(traced, "h100").items() if k != "output"}
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    starts = segment_starts(traced, 8, "h100")
    segs = [Segment(a, b, sum(base[n] for n in order[a:b]), 0.0) for a, b in zip(starts, starts[1:] + [len(order)])]
    measured = MeasuredCosts(fingerprint(traced.gm), [list(s) for s in traced.input_shapes], "float32", "eager",
                             "cpu", torch.__version__, segs, base)
    gen = torch.Generator().manual_seed(hidden_seed)
    hidden = (0.5 + 1.5 * torch.rand(len(segs), generator=gen)).tolist()
    group_of = _groups(traced, measured)
    fixed = 0.05 * sum(base.values()) / 4

    def device(plan):
        return [sum((hidden[k] if k != UNPROFILED else 1.0) * s for k, s in by.items()) + fixed
                for by in _planned(traced, plan, measured, group_of)]

    def replan(factors, **kw):
        seconds = {n: s * factors[group_of[n]] for n, s in base.items()}
        return plan_stages(traced, 4, device="h100", measured=dataclasses.replace(measured, node_seconds=seconds), **kw)

    return measured, device, replan, group_of, hidden


def test_the_closed_loop_reaches_the_balance_of_the_true_costs():
    traced = trace(timm_vit(depth=8), (torch.randn(4, 3, 32, 32),))
    measured, device, replan, group_of, hidden = _synthetic(traced)
    first = plan_stages(traced, 4, device="h100", measured=measured)
    start = max(device(first)) / (sum(device(first)) / 4)
    truth = replan([hidden[k] for k in range(len(hidden))])
    best_possible = max(device(truth)) / (sum(device(truth)) / 4)
    plan = refine(first, groups=len(measured.segments), target=1.0, rounds=4,
                  planned=lambda p: _planned(traced, p, measured, group_of),
                  measure=device, replan=replan)
    assert start > best_possible + 0.05  # the profile alone is off
    assert plan.measured_imbalance <= best_possible + 0.01
    assert [r["round"] for r in plan.refinement] == list(range(len(plan.refinement)))
    assert all(s.measured_time is not None for s in plan.stages)
    # The plan kept is the one whose slowest stage is fastest at a common pace: the least max/mean.
    assert plan.measured_imbalance == pytest.approx(min(r["measured_imbalance"] for r in plan.refinement))


def test_the_closed_loop_holds_when_the_pace_changes_between_timings():
    """A host whose pace changes from one timing to the next (every stage of a timing 1x-1.8x):
    the rounds' times are taken at the first round's pace and the kept plan is judged by its own
    max/mean, so the loop ends where a steady host takes it."""
    traced = trace(timm_vit(depth=8), (torch.randn(4, 3, 32, 32),))
    measured, device, replan, group_of, _ = _synthetic(traced)
    first = plan_stages(traced, 4, device="h100", measured=measured)
    kwargs = dict(groups=len(measured.segments), target=1.0, rounds=4, replan=replan,
                  planned=lambda p: _planned(traced, p, measured, group_of))
    steady = refine(first, measure=device, **kwargs)
    paces = iter([1.0, 1.8, 1.1, 1.6, 1.3])

    def drifting(plan):
        pace = next(paces)
        return [pace * t for t in device(plan)]

    first = plan_stages(traced, 4, device="h100", measured=measured)
    drifted = refine(first, measure=drifting, **kwargs)
    truth = device(drifted)
    assert [s.nodes for s in drifted.stages] == [s.nodes for s in steady.stages]
    assert max(truth) / (sum(truth) / 4) == pytest.approx(steady.measured_imbalance)


def test_the_closed_loop_stops_at_its_target_and_checks_its_arguments():
    traced = trace(timm_vit(depth=4), (torch.randn(4, 3, 32, 32),))
    measured, device, replan, group_of, _ = _synthetic(traced)
    plan = plan_stages(traced, 4, device="h100", measured=measured)
    kwargs = dict(groups=len(measured.segments), planned=lambda p: _planned(traced, p, measured, group_of),
                  measure=device, replan=replan)
    done = refine(plan, target=10.0, rounds=3, **kwargs)
    assert len(done.refinement) == 1
    with pytest.raises(ConfigError, match="target 0.9"):
        refine(plan, target=0.9, **kwargs)
    with pytest.raises(ConfigError, match="rounds"):
        refine(plan, rounds=-1, **kwargs)


def test_boundary_moves_balance_by_timing_two_stages_at_a_time():
    """A device on which later nodes cost up to 2.5x what the profile says: moving boundaries,
    judged by the stages each move changes (two, or a chain's run), reaches the best split of
    the true costs."""
    traced = trace(timm_vit(depth=8), (torch.randn(4, 3, 32, 32),))
    measured, *_ = _synthetic(traced)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    base = measured.node_seconds
    weight = {n: 1.0 + 1.5 * k / len(order) for k, n in enumerate(order)}

    def true(stage):
        return sum(base.get(n, 0.0) * weight[n] for n in stage.nodes)

    plan = plan_stages(traced, 4, device="h100", measured=measured)
    for stage in plan.stages:
        stage.measured_time = true(stage)
    before = plan.measured_imbalance
    timed = []

    def measure(p, stages):
        timed.append(list(stages))
        return [true(p.stages[i]) for i in stages]

    allowed = cut_candidates(traced)
    out = move_boundaries(plan, order=order, allowed=allowed, seconds=[base.get(n, 0.0) for n in order],
                          measure=measure, target=1.0, moves=16,
                          cut_at=lambda starts: partition_at(traced, starts, device="h100", measured=measured))
    floor = least_imbalance([base.get(n, 0.0) * weight[n] for n in order], 4, allowed_cuts=allowed)
    assert before > 1.3
    # Single moves stop at 1.038 here, where no boundary can give a neighbour less than the gap
    # across it; chains of boundaries reach the floor.
    assert out.measured_imbalance <= floor + 0.002
    assert all(s.measured_time == pytest.approx(true(s)) for s in out.stages)  # every stage's time is its own
    # Two neighbours at a time, or the run of stages that a chain of boundaries changed.
    assert timed and all(t == list(range(t[0], t[0] + len(t))) and len(t) >= 2 for t in timed)
    assert any(r["kept"] and len(r["stages"]) > 2 for r in out.refinement if "move" in r)
    moves = [r for r in out.refinement if "move" in r]
    assert len(moves) == len(timed) <= 16
    slowest = max(s.measured_time for s in plan.stages)
    for r in moves:  # a kept move never makes the slowest stage slower
        if r["kept"]:
            assert max(r["measured"]) < slowest + 1e-12
    # At the target already: nothing is timed.
    again = move_boundaries(out, order=order, allowed=allowed, seconds=[0.0] * len(order), measure=measure,
                            cut_at=None, target=10.0)
    assert again is out and len(timed) == len(moves)


def test_chains_run_to_every_faster_stage_the_fastest_first():
    """ViT-B/16's 8 stages as an H200 timed them eagerly (ms): the chain to the fastest stage
    (1) crosses five stages, and shorter chains to the other fast ones (0, 5) are tried after it;
    those to stages over the mean (2, 6) last."""
    times = [5.88, 5.82, 6.14, 6.04, 6.01, 5.89, 6.24, 6.35]
    starts = [0, 10, 20, 30, 40, 50, 60, 70]
    prefix = np.arange(81, dtype=float)  # 80 nodes of a second each, a cut allowed after any
    chains = _chains(starts, times, 7, prefix, [True] * 80)
    assert [far for far, _ in chains] == [1, 0, 5, 4, 3, 2, 6]  # the mean is 6.046
    for far, new in chains:  # each boundary from the far stage's end to the slowest's start, one node on
        assert new == [s + (1 if far < b <= 7 else 0) for b, s in enumerate(starts)]
    # a stage of one node gives it and takes the next
    narrow = [0, 10, 20, 21, 30, 40, 50, 70]
    assert dict(_chains(narrow, times, 7, prefix, [True] * 80))[1] == [0, 10, 21, 22, 31, 41, 51, 71]
    # towards a slowest stage before them, every boundary moves back
    assert dict(_chains(starts, times[::-1], 0, prefix, [True] * 80))[6] == [0, 9, 19, 29, 39, 49, 59, 70]
    # no chain where a boundary has no allowed cut before the next one (none from 12 to 35 here:
    # stage 2's chain moves its end past them, to 36)
    walled = [True] * 11 + [False] * 24 + [True] * 45
    assert sorted(dict(_chains(starts, times, 7, prefix, walled))) == [2, 3, 4, 5, 6]
    # none to a stage as slow as the slowest
    assert 6 not in dict(_chains(starts, times[:6] + [6.35, 6.35], 7, prefix, [True] * 80))


def test_a_chain_to_a_stage_over_the_mean_moves_work_where_every_step_towards_the_mean_costs():
    """[Note: chains to stages over the mean], on a chain of 40 layers: stages 0-2 over the mean,
    stage 3 under it; a boundary at node 29 costs both its stages 1.5 s (two tensors cross
    there). The only step towards stage 3 lands there, and the slowest stage's first node is
    more than the gap to stage 1; a chain to stage 0 moves node 20 to stage 1 and node 10 to
    stage 0, and balances within 1.05."""
    seconds = [1.0] * 40
    seconds[5], seconds[10], seconds[15], seconds[20], seconds[25], seconds[35] = 1.2, 0.3, 1.9, 0.5, 2.1, 0.01
    model = nn.Sequential(*[nn.ReLU() for _ in range(39)])
    traced = trace(model, (torch.randn(2, 4),))
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    assert len(order) == 40
    position = {n: k for k, n in enumerate(order)}

    def true(plan, i):
        start = position[plan.stages[i].nodes[0]]
        end = position[plan.stages[i + 1].nodes[0]] if i + 1 < len(plan.stages) else 40
        return sum(seconds[start:end]) + (1.5 if 29 in (start, end) else 0.0)

    def cut_at(starts):
        plan = partition_at(traced, starts, device="h100")
        for i, stage in enumerate(plan.stages):
            stage.measured_time = true(plan, i)
        return plan

    plan = cut_at([0, 10, 20, 30])
    assert [round(s.measured_time, 2) for s in plan.stages] == [10.2, 10.2, 10.6, 9.01]
    out = move_boundaries(plan, order=order, allowed=[True] * 40, seconds=seconds, target=1.0, moves=16,
                          measure=lambda p, stages: [true(p, i) for i in stages], cut_at=cut_at)
    moves = [r for r in out.refinement if "move" in r]
    assert not moves[0]["kept"] and moves[0]["stage_starts"][3] == order[29]  # the step towards stage 3
    kept = [r for r in moves if r["kept"]]
    assert kept and kept[0]["stages"] == [0, 1, 2]  # the chain to stage 0
    assert kept[0]["stage_starts"][1:3] == [order[11], order[21]]
    assert out.measured_imbalance <= 1.05 < plan.measured_imbalance


def test_boundary_moves_judge_both_plans_in_one_timing_when_the_pace_changes():
    """``paired``: the current plan and the moved one are timed together, and the move is kept by
    that one timing. Each timing here runs at its own pace (1x-1.8x); pairs of stages judged
    against times from other timings keep moves that do not help, paired timings do not."""
    traced = trace(timm_vit(depth=8), (torch.randn(4, 3, 32, 32),))
    measured, *_ = _synthetic(traced)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    base = measured.node_seconds
    weight = {n: 1.0 + 1.5 * k / len(order) for k, n in enumerate(order)}
    allowed = cut_candidates(traced)
    floor = least_imbalance([base.get(n, 0.0) * weight[n] for n in order], 4, allowed_cuts=allowed)

    def true(stage):
        return sum(base.get(n, 0.0) * weight[n] for n in stage.nodes)

    def balance(pair):
        gen = torch.Generator().manual_seed(3)
        plan = plan_stages(traced, 4, device="h100", measured=measured)
        for stage in plan.stages:
            stage.measured_time = true(stage)
        calls = []

        def pace():
            return 1.0 + 0.8 * float(torch.rand((), generator=gen))

        def measure(p, stages):
            calls.append(("measure", p))
            at = pace()
            return [at * true(p.stages[i]) for i in stages]

        def paired(p, q):
            calls.append(("paired", p, q))
            at = pace()
            return [at * true(s) for s in p.stages], [at * true(s) for s in q.stages]

        out = move_boundaries(plan, order=order, allowed=allowed, seconds=[base.get(n, 0.0) for n in order],
                              measure=measure, target=1.0, moves=16, paired=paired if pair else None,
                              cut_at=lambda starts: partition_at(traced, starts, device="h100", measured=measured))
        truth = [true(s) for s in out.stages]
        return max(truth) / (sum(truth) / 4), calls, out

    both, calls, out = balance(True)
    assert calls and all(c[0] == "paired" for c in calls)  # never a timing of one plan alone
    moves = [r for r in out.refinement if "move" in r]
    assert len(moves) == len(calls)
    kept = [k for k, r in enumerate(moves) if r["kept"]]
    for k, r in enumerate(moves):  # the current plan of each timing: the last kept move's plan
        current = calls[k][1]
        assert r["stages"] == [0, 1, 2, 3] and len(r["current"]) == 4
        assert [s.nodes[0] for s in current.stages] == (moves[max(x for x in kept if x < k)]["stage_starts"]
                                                        if any(x < k for x in kept) else
                                                        [s.nodes[0] for s in calls[0][1].stages])
    # the kept plan's times are its own timing's, at that timing's pace
    ratio = [s.measured_time / true(s) for s in out.stages]
    assert max(ratio) == pytest.approx(min(ratio))
    assert both <= floor + 0.04
    pairs, _, _ = balance(False)
    assert pairs > both + 0.05


def test_moved_plans_are_priced_by_the_corrected_profile(monkeypatch):
    """A device on which each segment of the profile runs at its own hidden speed (0.6x-1.6x):
    the plan the loop returns after moving boundaries is priced by the profile as the rounds'
    timings corrected it, not by the raw profile, so its prices follow the device."""
    traced = trace(timm_vit(depth=8), (torch.randn(4, 3, 32, 32),))
    measured, *_ = _synthetic(traced)
    group_of = _groups(traced, measured)
    gen = torch.Generator().manual_seed(5)
    hidden = (0.6 + torch.rand(len(measured.segments), generator=gen)).tolist()

    def true(stage):
        return sum(measured.node_seconds.get(n, 0.0) * hidden[group_of[n]] for n in stage.nodes)

    def fake_time_plan(traced_, plan, setup, group=None, stages=None):
        times = [true(s) for s in plan.stages]
        return times if stages is None else [times[i] for i in stages]

    monkeypatch.setattr(autopipe.measure, "time_plan", fake_time_plan)
    monkeypatch.setattr(autopipe.measure, "_time_both", lambda traced_, p, q, setup, scale: (
        fake_time_plan(traced_, p, setup), fake_time_plan(traced_, q, setup)))
    plan = autopipe.measure.measured_plan(traced, CPU, dict(pp=4, device="h100"), measured=measured,
                                          options=MeasureOptions(reps=2, warmup=1, rounds=1, moves=8, target=1.0))
    assert any(r.get("kept") for r in plan.refinement if "move" in r)  # the kept plan was moved
    raw = [sum(measured.node_seconds.get(n, 0.0) for n in s.nodes) + measured.stage_overhead for s in plan.stages]
    truth = [true(s) for s in plan.stages]
    error = max(abs(s.compute_time - t) / t for s, t in zip(plan.stages, truth))
    assert max(abs(r - t) / t for r, t in zip(raw, truth)) > 0.15  # the raw profile is far off

    assert error < 0.05
    assert "calibrated" in plan.refinement[-1]  # the fit over every timing, the moves' included
    last = [r for r in plan.refinement if r.get("kept")][-1]
    assert [s.nodes[0] for s in plan.stages] == last["stage_starts"]  # repriced, not re-cut
    assert [s.measured_time for s in plan.stages] == pytest.approx(truth)


def test_at_the_host_pace_the_moved_plan_is_judged_against_the_rounds_plan(monkeypatch):
    """Moves kept in a slow spell of some stages can leave a plan slower than the one they moved:
    at the host's pace the loop times the two together at the end and keeps the faster. Here the
    moves (stood in for) end at a plan whose first stages are heavier; the rounds' plan is kept,
    with its times from that last timing."""
    from autopipe.partition.partitioner import partition

    traced = trace(timm_vit(depth=8), (torch.randn(4, 3, 32, 32),))
    measured, *_ = _synthetic(traced)

    def true(plan):
        return [sum(measured.node_seconds.get(n, 0.0) for n in s.nodes) for s in plan.stages]

    def worse(plan, *, order, cut_at, **kwargs):  # every boundary three nodes later
        position = {n: k for k, n in enumerate(order)}
        moved = cut_at([0] + [position[s.nodes[0]] + 3 for s in plan.stages[1:]])
        moved.refinement = plan.refinement + [{"move": 1, "stages": [0, 1, 2, 3], "measured": true(moved),
                                               "current": true(plan), "kept": True,
                                               "stage_starts": [s.nodes[0] for s in moved.stages],
                                               "current_starts": [s.nodes[0] for s in plan.stages]}]
        for stage, t in zip(moved.stages, true(moved)):
            stage.measured_time = t
        return moved

    pairs = []
    monkeypatch.setattr(autopipe.measure.loop_moves, "move_boundaries", worse)
    monkeypatch.setattr(autopipe.measure, "plan_stages", lambda t, **kw: partition(t, **kw))
    monkeypatch.setattr(autopipe.measure, "time_plan", lambda t, plan, s, group=None, stages=None: true(plan))
    monkeypatch.setattr(autopipe.measure, "_time_both",
                        lambda t, p, q, s, scale: pairs.append((p, q)) or ([0.9 * x for x in true(p)],
                                                                            [0.9 * x for x in true(q)]))
    options = MeasureOptions(reps=2, warmup=1, rounds=0, moves=1, target=1.0)
    plan = autopipe.measure.measured_plan(traced, CPU, dict(pp=4, device="h100"), measured=measured, options=options)
    rounds = partition(traced, pp=4, device="h100", measured=measured)
    assert len(pairs) == 1 and [s.nodes[0] for s in pairs[0][0].stages] == [s.nodes[0] for s in rounds.stages]
    moved = pairs[0][1]
    assert max(true(moved)) > max(true(rounds))  # the moves' plan is the slower
    assert plan.refinement[-2]["judged_moves"] is False
    assert [s.nodes[0] for s in plan.stages] == [s.nodes[0] for s in rounds.stages]
    assert [s.measured_time for s in plan.stages] == pytest.approx([0.9 * x for x in true(rounds)])


def test_measure_options_check_the_moves():
    traced = _vit_traced()
    with pytest.raises(ConfigError, match="boundary moves"):
        autopipe.measure.measured_plan(traced, CPU, dict(pp=2), options=MeasureOptions(moves=-1),
                                       measured=profile_graph(traced, CPU, segments=2))


# ------------------------------------------------------------------------------ calibration
def test_calibration_classes_and_table():
    costs = graph_costs(trace(nn.Sequential(nn.Conv2d(3, 64, 7, 2), nn.BatchNorm2d(64), nn.ReLU(),
                                            nn.Conv2d(64, 64, 3, groups=64), nn.Flatten(), nn.Linear(64 * 11 * 11, 10)),
                              (torch.randn(2, 3, 32, 32),)).gm)
    classes = {n: class_of(c) for n, c in costs.items() if c.kind not in ("view", "none")}
    assert classes["_0"] == "conv/4"  # a stem: 3 input channels
    assert classes["_1"] == "norm:batch/64ch"
    assert classes["_3"].startswith("dwconv/")
    for name, gpu in (("h100", "NVIDIA H100"), ("h200", "NVIDIA H200")):
        table = load_calibration(name)
        assert table is not None and table.device.startswith(gpu)  # fitted on the GPU it names
        assert all(f >= 0 for pair in table.factors.values() for f in pair)
        assert table.fit["error"]["graphs"]["leave_one_model_out"]  # the fit reports its error
        assert PROFILES[name].calibration == table
    with pytest.raises(ConfigError, match="not a calibration table"):
        Calibration.from_dict({"schema": 1, "device": "x", "factors": {"gemm/64": [-1, 1]}, "launch": [0, 0],
                               "host": [0, 0]})


class _ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


def _layout_probe(channels_last: bool, **trace_kwargs) -> dict:
    """Class of each launched node of a small convolutional model in either layout."""
    torch.manual_seed(0)
    block = _ConvBlock()
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), block,
                          nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(64 * 16 * 16, 10))
    x = torch.randn(8, 3, 32, 32)  # 8192 rows a channel: not a short reduction
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    costs = graph_costs(trace(model, (x,), **trace_kwargs).gm)
    return {n: [class_of(p) for p in (c.parts or (c,)) if p.kind not in ("view", "none")]
            for n, c in costs.items() if c.kind not in ("view", "none")}


def test_a_channels_last_kernel_has_a_class_of_its_own():
    """[Note: kernel layout]: convolutions, batch norms and pooling over channels-last maps are
    classes apart, also inside a block priced by its parts; other kernels keep their class."""
    plain, nhwc = _layout_probe(False), _layout_probe(True)
    assert plain["_0"] == ["conv/4"] and nhwc["_0"] == ["conv-nhwc/4"]  # a stem: 3 channels in
    assert plain["_1"] == ["norm:batch/64ch"] and nhwc["_1"] == ["norm:batch-nhwc/64ch"]
    assert nhwc["_2"] == plain["_2"] and "nhwc" not in nhwc["_2"][0]  # ReLU: any layout
    assert nhwc["_4"][0].startswith("dwconv-nhwc/") and nhwc["_5"][0].startswith("reduction:pool-nhwc/")
    assert "nhwc" not in nhwc["_7"][0]  # the linear layer
    block = _layout_probe(True, leaf_modules=[_ConvBlock])["_3"]  # a composite: conv, norm and ReLU inside
    assert block[:2] == ["conv-nhwc/64", "norm:batch-nhwc/64ch"], block


def test_a_batch_norm_over_few_rows_is_a_kind_of_its_own():
    """[Note: short reductions]: a channels-last batch norm over 7x7 maps of 32 images (1568
    rows) has a class and a launch time of its own; over 128 images, or in NCHW, it has not."""
    def norm_class(images: int, channels_last: bool = True) -> str:
        model, x = nn.Sequential(nn.BatchNorm2d(512)), torch.randn(images, 512, 7, 7)
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        (cost,) = [c for c in graph_costs(trace(model, (x,)).gm).values() if c.family == "batch"]
        return class_of(cost)

    assert norm_class(32) == "norm:batch-nhwc:short/512ch" and kernel_kind(norm_class(32)) == "norm:batch-nhwc:short"
    assert norm_class(128) == "norm:batch-nhwc/512ch" and norm_class(32, channels_last=False) == "norm:batch/512ch"
    table = Calibration("gpu", {}, launch=(0.0, 0.0), host=(0.0, 0.0), launches={"norm:batch-nhwc:short": (30e-6, 20e-6)})
    profile = dataclasses.replace(PROFILES["h100"], calibration=table, mode="graphs")
    model = nn.Sequential(nn.BatchNorm2d(512)).to(memory_format=torch.channels_last)
    x = torch.randn(32, 512, 7, 7).contiguous(memory_format=torch.channels_last)
    (cost,) = [c for c in graph_costs(trace(model, (x,)).gm).values() if c.family == "batch"]
    assert profile.node_time(cost) >= 30e-6 and profile.node_time(cost, backward=True) >= 20e-6


def test_a_table_without_channels_last_rows_prices_them_as_nchw():
    costs = graph_costs(trace(nn.Sequential(nn.Conv2d(64, 64, 3), nn.BatchNorm2d(64)).to(
        memory_format=torch.channels_last), (torch.randn(2, 64, 16, 16).contiguous(
            memory_format=torch.channels_last),)).gm)
    conv = next(c for c in costs.values() if c.family == "conv")
    assert conv.channels_last and class_of(conv) == "conv-nhwc/64" and plain_class(class_of(conv)) == "conv/64"
    plain = Calibration("gpu", {"conv/64": (2.0, 3.0)}, launch=(1e-6, 2e-6), host=(0.0, 0.0),
                        launches={"conv": (5e-6, 6e-6)})
    assert plain.factor("conv-nhwc/64", True) == 3.0 and plain.launch_time("conv-nhwc/64", False) == 5e-6
    both = dataclasses.replace(plain, factors={**plain.factors, "conv-nhwc/64": (0.5, 0.7)},
                               launches={**plain.launches, "conv-nhwc": (1e-6, 1e-6)})
    assert both.factor("conv-nhwc/64", False) == 0.5 and both.factor("conv/64", False) == 2.0
    assert both.launch_time("conv-nhwc/64", True) == 1e-6
    profile = DeviceProfile("p", 1e12, 1e11, 1e11, 1e9, 1e-5, 5e-6, calibration=both).with_mode("graphs")
    nchw = dataclasses.replace(conv, channels_last=False)
    assert profile.node_time(conv) < profile.node_time(nchw)  # its own, smaller factor


def test_a_grouped_convolution_has_a_kind_of_its_own_priced_as_dense_without_rows():
    """[Note: grouped convolutions]: groups of several channels are "gconv", depthwise ones
    "dwconv"; a table without grouped rows prices a grouped kernel by the dense class of its shape
    (factor, compute factor and launch), a table with them by its own."""
    model = nn.Sequential(nn.Conv2d(64, 64, 3, groups=8), nn.Conv2d(64, 64, 3, groups=64), nn.Conv2d(64, 64, 1),
                          nn.Conv2d(64, 64, 3, groups=16))
    costs = graph_costs(trace(model.to(memory_format=torch.channels_last), (torch.randn(2, 64, 16, 16).contiguous(
        memory_format=torch.channels_last),)).gm)
    grouped, depthwise, dense, thin = (costs[f"_{i}"] for i in range(4))
    assert (grouped.family, depthwise.family, dense.family) == ("gconv", "dwconv", "conv")
    assert class_of(grouped) == "gconv-nhwc/16" and class_of(dense) == "conv-nhwc/64"  # 8 channels a group
    assert class_of(thin) == "gconv-nhwc/4" and split_by_bound(class_of(thin))
    dense_only = Calibration("gpu", {"conv-nhwc/16": (2.0, 3.0), "conv/4": (4.0, 5.0), "conv/4" + FLOPS: (6.0, 7.0)},
                             launch=(1e-6, 2e-6), host=(0.0, 0.0), launches={"conv-nhwc": (5e-6, 6e-6)})
    assert dense_only.factor("gconv-nhwc/16", True) == 3.0 and dense_only.launch_time("gconv-nhwc/16", False) == 5e-6
    assert dense_only.factor("gconv-nhwc/4", False) == 4.0 and dense_only.flops_factor("gconv-nhwc/4", True) == 7.0
    own = dataclasses.replace(dense_only, factors={**dense_only.factors, "gconv-nhwc/16": (9.0, 9.5)},
                              launches={**dense_only.launches, "gconv-nhwc": (1e-5, 1e-5)})
    assert own.factor("gconv-nhwc/16", True) == 9.5 and own.launch_time("gconv-nhwc/16", True) == 1e-5
    assert own.factor("conv-nhwc/16", True) == 3.0  # the dense class keeps its own
    profile = DeviceProfile("p", 1e12, 1e11, 1e11, 1e9, 1e-5, 5e-6, calibration=dense_only).with_mode("graphs")
    as_dense = dataclasses.replace(grouped, family="conv")
    assert profile.node_time(grouped) == profile.node_time(as_dense)
    assert dataclasses.replace(profile, calibration=own).node_time(grouped) > profile.node_time(grouped)


def test_a_calibrated_profile_prices_launches_by_mode():
    cal = Calibration("gpu", {"gemm/>1024": (2.0, 3.0)}, launch=(1e-6, 2e-6), host=(50e-6, 80e-6),
                      stage={"graphs": 1e-4})
    profile = DeviceProfile("p", 1e12, 1e11, 1e11, 1e9, 1e-5, 5e-6, calibration=cal)
    big = graph_costs(trace(nn.Linear(2048, 2048), (torch.randn(4096, 2048),)).gm)
    node = next(c for c in big.values() if c.kind == "matmul")
    roofline = max(node.fwd_flops / 1e12, node.fwd_bytes / 1e11)
    graphs = profile.with_mode("graphs")
    assert graphs.node_time(node) == pytest.approx(2.0 * roofline + 1e-6)
    assert profile.with_mode("eager").node_time(node) == pytest.approx(max(2.0 * roofline + 1e-6, 50e-6))
    assert DeviceProfile.from_json(json.loads(json.dumps(graphs.to_json()))) == graphs
    with pytest.raises(ConfigError, match="execution mode 'fast'"):
        profile.with_mode("fast")


def test_a_cut_costs_the_stages_beside_it_their_boundary_copies():
    """[Note: boundary copies]: replayed stages pay the table's seconds per byte of what crosses
    each of their cuts, as compute, and the balancer sees it; a mode without a rate pays none."""
    from autopipe.partition.cuts import cut_dag

    traced = _vit_traced(batch=8)
    cal = Calibration("gpu", {}, launch=(1e-6, 1e-6), host=(0.0, 0.0), boundary={"graphs": 1e-9})
    profile = DeviceProfile("p", 1e12, 1e11, 1e11, 1e9, 1e-5, 5e-6, calibration=cal)
    cut = cut_dag(traced, graph_costs(traced.gm), torch.bfloat16).cut_bytes
    starts = [0, 12, 30]
    plans = {m: partition_at(traced, starts, device=profile.with_mode(m), activation_dtype=torch.bfloat16)
             for m in ("graphs", "eager")}
    copies = [cut[11], cut[11] + cut[29], cut[29]]
    for stage, nbytes in zip(range(3), copies):
        graphs, eager = plans["graphs"].stages[stage], plans["eager"].stages[stage]
        assert nbytes > 0
        assert graphs.compute_time - eager.compute_time == pytest.approx(1e-9 * nbytes)
        assert graphs.cost - eager.cost == pytest.approx(1e-9 * nbytes)
    with pytest.raises(ConfigError, match="boundary"):
        Calibration.from_dict(dict(json.loads(cal.to_json()), boundary={"graphs": -1.0}))
    assert Calibration.from_dict(json.loads(cal.to_json())) == cal


def test_the_fit_finds_the_boundary_copies_rate():
    """calibrate_device.fit recovers a segment's fixed cost and its seconds per boundary byte
    from rows whose segments take their nodes' time plus both."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import calibrate_device

    rng = np.random.default_rng(0)
    nodes, segs = [], []
    for k in range(40):
        t, launched = float(rng.uniform(50e-6, 500e-6)), int(rng.integers(1, 400))
        row = {"model": "m", "microbatch": 32, "node": f"n{k}"}
        for d in ("fwd", "bwd"):
            row[d] = {"features": {"gemm/64": t}, "kernels": launched, "kinds": {"gemm": launched}, "device": t,
                      "host": 0.0}
        nodes.append(row)
    for k in range(20):
        nbytes = float(rng.uniform(1e6, 4e8))
        own = sum(2 * nodes[i]["fwd"]["device"] for i in (2 * k, 2 * k + 1))
        launches = sum(2 * nodes[i]["fwd"]["kernels"] for i in (2 * k, 2 * k + 1))
        segs.append({"model": "m", "microbatch": 32, "nodes": [2 * k, 2 * k + 1], "boundary_bytes": nbytes,
                     "graphs": own + 90e-6 + nbytes / 0.8e12 + 0.5e-6 * launches, "eager": own + 300e-6})
    model = calibrate_device.fit(nodes, segs)
    assert model["boundary"]["graphs"] == pytest.approx(1 / 0.8e12, rel=0.1)
    assert model["overhead"]["graphs"] == pytest.approx(90e-6, rel=0.3)
    assert model["gap"]["graphs"] == pytest.approx(0.5e-6, rel=0.1)
    assert model["boundary"]["eager"] == 0.0


def test_the_fit_keeps_a_kind_apart_from_the_class_of_the_same_name():
    """"attention" names a class and its kind: the roofline seconds of the one and the kernels
    of the other are separate columns, so the class's factor is the rows' own."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import calibrate_device

    rng = np.random.default_rng(1)
    nodes = []
    for k in range(30):
        t = float(rng.uniform(20e-6, 900e-6))
        row = {"model": "m", "microbatch": 32, "node": f"n{k}"}
        for d, factor in (("fwd", 2.0), ("bwd", 1.5)):
            row[d] = {"features": {"attention": t}, "kernels": 1, "kinds": {"attention": 1}, "device": factor * t,
                      "host": 0.0}
        nodes.append(row)
    segs = [{"model": "m", "microbatch": 32, "nodes": [k], "graphs": 2 * nodes[k]["fwd"]["device"],
             "eager": 2 * nodes[k]["fwd"]["device"]} for k in range(30)]
    model = calibrate_device.fit(nodes, segs)
    assert model["factors"]["attention"] == pytest.approx((2.0, 1.5), rel=0.02)
    assert calibrate_device._gpu(nodes, model)[:, 0] == pytest.approx([r["fwd"]["device"] for r in nodes], rel=0.03)


def test_a_thin_convolution_keeps_a_factor_for_its_compute_side():
    """A patch embedding over 3 channels (compute-bound in the roofline) has its own factor, a
    memory-bound stem the class's; each kernel takes the larger of the two sides."""
    from autopipe.partition.calibration import FLOPS, kernel_features, split_by_bound

    base = DeviceProfile("p", 1e12, 1e11, 1e11, 1e9, 1e-5, 5e-6)
    patch = next(c for c in graph_costs(trace(nn.Conv2d(3, 256, 16, 16), (torch.randn(8, 3, 64, 64),)).gm).values()
                 if c.family == "conv")
    stem = next(c for c in graph_costs(trace(nn.Conv2d(3, 8, 3, padding=1), (torch.randn(8, 3, 64, 64),)).gm).values()
                if c.family == "conv")
    assert split_by_bound(class_of(patch)) and class_of(patch) == "conv/4"
    assert [name for name, _ in kernel_features(patch, base, backward=False)] == ["conv/4" + FLOPS]
    assert [name for name, _ in kernel_features(stem, base, backward=False)] == ["conv/4"]
    cal = Calibration("gpu", {"conv/4": (4.0, 4.0), "conv/4" + FLOPS: (20.0, 5.0)}, launch=(0.0, 0.0),
                      host=(0.0, 0.0))
    profile = dataclasses.replace(base, calibration=cal).with_mode("graphs")
    for cost in (patch, stem):
        compute, memory = cost.fwd_flops / 1e12, cost.fwd_bytes / 1e11
        assert profile.node_time(cost) == pytest.approx(max(20.0 * compute, 4.0 * memory))
    assert not split_by_bound("gemm/4") and not split_by_bound("conv/64")


def test_a_replayed_stage_pays_the_gap_after_each_kernel():
    cal = Calibration("gpu", {"gemm/>1024": (1.0, 1.0)}, launch=(0.0, 0.0), host=(0.0, 0.0), gap={"graphs": 2e-6})
    profile = DeviceProfile("p", 1e12, 1e11, 1e11, 1e9, 1e-5, 5e-6, calibration=cal)
    gemm = next(c for c in graph_costs(trace(nn.Linear(2048, 2048), (torch.randn(64, 2048),)).gm).values()
                if c.kind == "matmul")
    roofline = max(gemm.fwd_flops / 1e12, gemm.fwd_bytes / 1e11)
    assert profile.with_mode("graphs").node_time(gemm) == pytest.approx(roofline + 2e-6)
    assert profile.with_mode("compiled+graphs").node_time(gemm) == pytest.approx(roofline + 2e-6)
    assert profile.with_mode("eager").node_time(gemm) == pytest.approx(roofline)
    assert Calibration.from_dict(json.loads(cal.to_json())) == cal
    with pytest.raises(ConfigError, match="gaps between kernels"):
        Calibration.from_dict(dict(json.loads(cal.to_json()), gap={"graphs": -1.0}))


def test_a_calibration_prices_the_launch_of_each_kind_of_kernel():
    """Kinds the fit saw have their own launch time (a conv's set-up and format conversions),
    other kinds the table's fallback."""
    cal = Calibration("gpu", {"gemm/>1024": (2.0, 3.0)}, launch=(1e-6, 2e-6), host=(0.0, 0.0),
                      launches={"gemm": (7e-6, 9e-6)})
    profile = DeviceProfile("p", 1e12, 1e11, 1e11, 1e9, 1e-5, 5e-6, calibration=cal).with_mode("graphs")
    costs = graph_costs(trace(nn.Sequential(nn.Linear(2048, 2048), nn.GELU()), (torch.randn(64, 2048),)).gm)
    gemm = next(c for c in costs.values() if c.kind == "matmul")
    act = next(c for c in costs.values() if c.kind == "elementwise")
    assert profile.node_time(gemm) == pytest.approx(2.0 * max(gemm.fwd_flops / 1e12, gemm.fwd_bytes / 1e11) + 7e-6)
    assert profile.node_time(gemm, backward=True) - 3.0 * max(gemm.bwd_flops / 1e12, gemm.bwd_bytes / 1e11) \
        == pytest.approx(9e-6)
    assert cal.launch_time(class_of(act), False) == 1e-6
    assert Calibration.from_dict(json.loads(cal.to_json())) == cal
    with pytest.raises(ConfigError, match="negative or non-finite launch times"):
        Calibration.from_dict(dict(json.loads(cal.to_json()), launches={"gemm": [-1, 0]}))


# ------------------------------------------------------------------------------ parallelize
def _measured_rank(rank: int, world: int, cache_dir: str) -> dict:
    torch.manual_seed(0)
    model = timm_vit(depth=4)
    x = torch.randn(4, 3, 32, 32)
    pm = autopipe.parallelize(model, (x[:2],), pp=world, microbatches=2, loss_fn=F.cross_entropy, device="cpu",
                              costs="measured",
                              measure=MeasureOptions(segments=4, reps=2, rounds=1, cache_dir=cache_dir))
    loss = pm.train_step(x, torch.arange(4) % 10)
    plan = pm.report()
    return {"plan": plan.to_json(), "loss": float(loss), "measured": [s.measured_time for s in plan.stages],
            "source": plan.cost_source}


def test_every_rank_plans_alike_from_measured_costs_and_trains_as_one_process(tmp_path):
    results = run_distributed(_measured_rank, 2, str(tmp_path), timeout=240)
    assert results[0]["plan"] == results[1]["plan"]  # one plan, though each rank timed its share
    assert results[0]["source"]["source"] == "measured"
    assert all(t is not None and t > 0 for t in results[0]["measured"])
    torch.manual_seed(0)
    model = timm_vit(depth=4)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        reference = F.cross_entropy(model(x), torch.arange(4) % 10)
    assert results[0]["loss"] == pytest.approx(float(reference), rel=1e-5)
    assert os.listdir(tmp_path / "profiles")  # rank 0 cached the profile


def _failing_rank(rank: int, world: int) -> None:
    if rank == 1:
        profile_module.time_stages = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    traced = _vit_traced()
    profile_graph(traced, CPU, segments=4)


def test_a_rank_failing_to_time_fails_every_rank():
    results = run_distributed(_failing_rank, 2, timeout=120, return_exceptions=True)
    for r in results:
        assert "ProfileError" in r.exc_type and "rank 1: RuntimeError: device lost" in r.message


# ------------------------------------------------------------------------------ command line
def test_cli_profile_then_report_with_it(tmp_path, monkeypatch, capsys):
    from autopipe.cli import main

    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "p.json"
    spec = ["timm:vit_tiny_patch16_224", "--batch", "8", "--microbatches", "2", "--image-size", "32"]
    assert main(["profile", *spec, "--device", "cpu", "--dtype", "fp32", "--segments", "4", "--out", str(out)]) == 0
    assert main(["report", *spec, "--pp", "2", "--device", "cpu", "--costs", str(out),
                 "--json", str(tmp_path / "plan.json")]) == 0
    printed = capsys.readouterr().out
    assert "costs measured on cpu (eager, float32)" in printed
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["cost_source"]["source"] == "measured"
    assert main(["report", spec[0], "--batch", "16", "--microbatches", "2", "--image-size", "32", "--pp", "2",
                 "--costs", str(out)]) == 2
    assert "input_shapes" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", *spec, "--out", str(tmp_path / "q.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert main(["profile", *spec, "--out", str(tmp_path / "missing" / "q.json")]) == 2


# ------------------------------------------------------------------------------ timing passes
def _made_runs(monkeypatch) -> list:
    """Every StageRun made from now on, in the order made."""
    from autopipe.measure import timer

    made = []
    init = timer.StageRun.__init__

    def making(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(timer.StageRun, "__init__", making)
    return made


def test_each_stage_keeps_its_fastest_round(monkeypatch):
    """[Note: timing passes]: every stage is prepared before the first timing, the rounds go
    forwards and backwards in turn, and each stage keeps its fastest round (forward and backward
    of one round); node times are read once, from stages still on the device."""
    from autopipe.measure import timer

    traced = _vit_traced()
    plan = partition_at(traced, segment_starts(traced, 3, "cpu"), device="cpu")
    made, calls = _made_runs(monkeypatch), []
    script = {0: [(3.0, 3.0), (1.0, 2.0), (2.0, 2.0)], 1: [(1.0, 1.0), (2.0, 2.0), (0.5, 2.0)],
              2: [(5.0, 5.0), (4.0, 4.0), (6.0, 1.0)]}

    def timing(self, setup, *, warm_seconds):
        i = made.index(self)
        assert len(made) == 3  # all prepared before the first timing
        calls.append((i, warm_seconds))
        return timer.StageTiming(*script[i][sum(c[0] == i for c in calls) - 1])

    monkeypatch.setattr(timer.StageRun, "time", timing)
    out = timer._time_rounds(traced, plan, dataclasses.replace(CPU, passes=3), {0, 1, 2}, kernels=True)
    assert [c[0] for c in calls] == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert all((w > 0) == (k < 3) for k, (_, w) in enumerate(calls))  # warmed by the clock in round 0 only
    assert [(out[i].forward, out[i].backward) for i in range(3)] == [(1.0, 2.0), (1.0, 1.0), (6.0, 1.0)]
    assert all(out[i].nodes.device and set(out[i].nodes.device) <= set(plan.stages[i].nodes) for i in range(3))


def test_the_kept_sweeps_are_the_fastest_and_the_same_for_every_stage():
    """[Note: timing sweeps]: a spell that slows whole sweeps leaves the stages' times and their
    ratios as in the sweeps where the host kept up; a stage is not judged by sweeps of its own."""
    from autopipe.measure.timer import kept_sweeps

    fast = {0: (1.0, 2.0), 1: (2.0, 4.0), 2: (1.5, 1.5)}
    slow = {i: (1.6 * f, 1.6 * b) for i, (f, b) in fast.items()}
    # stage 1 alone read faster in one slow sweep: a stage's own fastest would pick it
    odd = {**slow, 1: (1.0, 2.0)}
    sweeps = [slow, fast, slow, odd, fast, slow, fast, slow, slow]
    out = kept_sweeps(sweeps)  # the fastest third: the three fast sweeps
    assert {i: (t.forward, t.backward) for i, t in out.items()} == fast
    assert kept_sweeps(sweeps, kept=1.0)[0].forward == 1.6  # the median of all nine
    with pytest.raises(ProfileError, match="no sweeps"):
        kept_sweeps([])


def _steady_host(monkeypatch, probes=None):
    """A host whose probes read ``probes`` in turn (default: always the same pace)."""
    from autopipe.measure import host_pace, timer

    pace = host_pace.HostPace()
    read = iter(probes) if probes is not None else None
    monkeypatch.setattr(pace, "probe", lambda device: 1.0 if read is None else next(read))
    monkeypatch.setattr(timer, "PACE", pace)
    monkeypatch.setattr(autopipe.measure, "PACE", pace)
    return pace


def test_stages_timed_in_sweeps(monkeypatch):
    """Every stage is prepared before the first sweep; the sweeps go forwards and backwards in
    turn, ``passes * reps`` of them after the warm-up; the stages' times come from the fastest
    sweeps, the same for each stage."""
    from autopipe.measure import timer

    traced = _vit_traced()
    plan = partition_at(traced, segment_starts(traced, 3, "cpu"), device="cpu")
    made, steps = _made_runs(monkeypatch), []

    def step(self):
        i = made.index(self)
        assert len(made) == 3  # all prepared before the first sweep
        steps.append(i)
        sweep = (len(steps) - 1) // 3
        scale = 2.0 if sweep % 3 else 1.0  # two of three sweeps in a slow spell
        return 0.0, scale * (i + 1), scale * (i + 1) * 3

    _steady_host(monkeypatch)
    monkeypatch.setattr(timer.StageRun, "step", step)
    setup = dataclasses.replace(CPU, passes=3, reps=2, warmup=1)
    out = timer.time_stages(traced, plan, setup)
    assert steps == [0, 1, 2, 2, 1, 0] * 3  # six sweeps, alternating
    assert [(out[i].forward, out[i].backward) for i in range(3)] == [(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]


def test_two_plans_timed_in_the_same_sweeps(monkeypatch):
    """[Note: paired timings]: a stage two plans share runs once and counts for both; the stages
    that differ run beside their counterparts, in the same sweeps, and every time comes from the
    same fastest sweeps."""
    from autopipe.measure import timer

    traced = _vit_traced()
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    starts = segment_starts(traced, 3, "cpu")
    plan = partition_at(traced, starts, device="cpu")
    allowed = cut_candidates(traced)
    moved = next(k for k in range(starts[2] - 1, starts[1], -1) if allowed[k - 1])
    other = partition_at(traced, [starts[0], starts[1], moved], device="cpu")
    assert other.stages[0].nodes == plan.stages[0].nodes and other.stages[2].nodes != plan.stages[2].nodes
    made, steps = _made_runs(monkeypatch), []

    def step(self):
        steps.append(made.index(self))
        sweep = (len(steps) - 1) // len(made)
        scale = 2.0 if sweep % 2 else 1.0  # every other sweep in a slow spell
        return 0.0, scale * len(self.stage.graph.nodes), scale * 3 * len(self.stage.graph.nodes)

    _steady_host(monkeypatch)
    monkeypatch.setattr(timer.StageRun, "step", step)
    a, b = timer.time_against(traced, plan, other, dataclasses.replace(CPU, passes=2, reps=2, warmup=1))
    assert len(made) == 5  # the shared first stage once; the other two of each plan
    first = steps[:5]
    assert steps == (first + first[::-1]) * 2  # four sweeps, alternating
    # made: the plan's three stages, then the other's stages 1 and 2; each runs beside its counterpart
    assert first == [0, 1, 3, 2, 4]
    nodes = [len(run.stage.graph.nodes) for run in made]
    # every time from the fast sweeps (scale 1), the shared stage's the same for both plans
    assert [(a[i].forward, a[i].backward) for i in range(3)] == [(n, 2 * n) for n in nodes[:3]]
    assert [b[i].forward for i in range(3)] == [nodes[0], nodes[3], nodes[4]]
    assert order.index(other.stages[2].nodes[0]) == moved


def test_a_timing_waits_out_a_slow_spell_of_the_host(monkeypatch):
    """[Note: host pace]: sweeps whose probe reads the host off its pace are not kept, and a timing
    with too few sweeps at pace sweeps again, up to MORE_SWEEPS times as many, before it takes the
    sweeps of the fastest probes."""
    from autopipe.measure import host_pace, timer

    traced = _vit_traced()
    plan = partition_at(traced, segment_starts(traced, 2, "cpu"), device="cpu")
    setup = dataclasses.replace(CPU, passes=3, reps=2, warmup=1)  # 6 sweeps, 2 kept
    state = {"slow": True}
    made = _made_runs(monkeypatch)

    def step(self):  # a slow spell slows the second stage (its host work) and not the first
        t = 1.0 if made.index(self) == 0 else (3.0 if state["slow"] else 2.0)
        return 0.0, t, 2 * t

    monkeypatch.setattr(timer.StageRun, "step", step)
    # the process has seen the host at its pace (probe 1.0); this timing starts in a spell (1.5)
    probes = iter([1.5] * 6 + [1.5] * 3 + [1.0] * 3 + [1.0] * 6)

    def probe(device):
        p = next(probes)
        state["slow"] = p > 1.2
        return p

    pace = _steady_host(monkeypatch)
    pace.seen = [1.0] * 50
    monkeypatch.setattr(pace, "probe", probe)
    out = timer.time_stages(traced, plan, setup)
    assert len([1 for _ in made]) == 2
    assert (out[0].forward, out[1].forward) == (1.0, 2.0)  # the stages as the host runs them at pace
    assert (pace.timings, pace.waited, pace.short) == (1, 1, 0)
    assert len(pace.seen) == 50 + 12  # two batches of six sweeps: the second reached the pace
    # a spell that outlasts every sweep: MORE_SWEEPS batches more, then the fastest probes
    made.clear()
    probes = iter([1.5] * 6 * (1 + host_pace.MORE_SWEEPS))
    out = timer.time_stages(traced, plan, setup)
    assert out[1].forward == 3.0 and (pace.timings, pace.waited, pace.short) == (2, 2, 1)
    with pytest.raises(StopIteration):
        next(probes)  # every batch was swept


def test_the_kept_sweeps_at_pace():
    from autopipe.measure.timer import kept_sweeps

    fast, slow = {0: (1.0, 1.0)}, {0: (0.5, 0.5)}  # a sweep that reads fast off pace is not kept
    out = kept_sweeps([slow, fast, fast, slow, fast, fast], at_pace=[False, True, True, False, True, True])
    assert out[0].forward == 1.0
    # too few sweeps at pace: the fastest of all
    assert kept_sweeps([slow, fast, slow, slow], at_pace=[False, False, False, True])[0].forward == 0.5


def test_the_plan_says_how_often_its_timings_waited_for_the_host(monkeypatch):
    """The loop's timings that waited for the host's pace are counted in the plan's cost source
    and named in its report ([Note: host pace])."""
    from autopipe.partition.report import format_table

    traced = _vit_traced()
    pace = _steady_host(monkeypatch)
    pace.seen = [1.0] * 100
    profile = profile_graph(traced, CPU, segments=4)
    probes = iter([1.5] * 4 + [1.0] * 10_000)  # the first timing's sweeps (2 x 2) in a spell
    monkeypatch.setattr(pace, "probe", lambda device: next(probes))
    # Cut between nodes only: two rounds cut into different MLP pieces would be judged in a
    # third timing, taken or not as the CPU's timings fall ([Note: closed loop]).
    plan = autopipe.measure.measured_plan(traced, CPU, dict(pp=2, device="cpu", split_mlps=False), measured=profile,
                                          options=MeasureOptions(reps=2, warmup=1, passes=2, target=1.0, rounds=1,
                                                                 moves=0))
    counts = plan.cost_source["host_pace"]
    assert counts["timings"] == pace.timings == 2  # the loop's two timings, in sweeps
    assert counts["waited"] == 1 and counts["short"] == 0
    assert f"1 of {counts['timings']} timings waited for the host's pace" in format_table(plan)
    plan.cost_source["host_pace"] = {"timings": 3, "waited": 0, "short": 0}
    assert "host's pace" not in format_table(plan)  # said only where a timing waited


def test_stages_that_do_not_fit_at_once_are_timed_one_at_a_time(monkeypatch):
    """Out of memory with every stage on the device: the plan is timed ``passes`` times over,
    one stage at a time, each stage keeping its fastest pass, node times from the first."""
    from autopipe.measure import timer
    from autopipe.measure.kernels import NodeTimes

    def too_big(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    nodes = NodeTimes(device={}, host={}, kernels={}, unattributed=(0.0, 0.0))
    passes = iter([{0: timer.StageTiming(3.0, 3.0, nodes), 1: timer.StageTiming(1.0, 1.0, nodes)},
                   {0: timer.StageTiming(1.0, 2.0), 1: timer.StageTiming(2.0, 2.0)},
                   {0: timer.StageTiming(2.0, 2.0), 1: timer.StageTiming(0.5, 2.0)}])
    seen = []

    def one_pass(traced, plan, setup, wanted, *, kernels):
        seen.append(kernels)
        return next(passes)

    monkeypatch.setattr(timer, "_time_sweeps", too_big)
    monkeypatch.setattr(timer, "_time_pass", one_pass)
    out = timer.time_stages(None, type("P", (), {"num_stages": 2})(), dataclasses.replace(CPU, passes=3),
                            kernels=True)
    assert seen == [True, False, False]
    assert (out[0].forward, out[0].backward) == (1.0, 2.0)
    assert (out[1].forward, out[1].backward) == (1.0, 1.0)
    assert out[0].nodes is nodes and out[1].nodes is nodes


def test_timing_passes_by_mode_and_their_check():
    assert CPU.timing_passes == 1  # CPU stages: timed once
    from autopipe.measure.timer import GRAPH_PASSES, PASSES, default_passes

    gpu = torch.device("cuda", 0)
    assert default_passes(gpu, "eager") == default_passes(gpu, "compiled") == PASSES == 5  # the host's pace
    assert default_passes(gpu, "graphs") == default_passes(gpu, "compiled+graphs") == GRAPH_PASSES == 3
    assert default_passes(torch.device("cpu"), "eager") == 1
    assert dataclasses.replace(CPU, passes=4).timing_passes == 4
    for bad in (0, -1, 1.5):
        with pytest.raises(ProfileError, match="passes must be a positive integer"):
            dataclasses.replace(CPU, passes=bad)


def test_measure_options_set_the_passes(monkeypatch):
    """``MeasureOptions.passes`` reaches the profile's and the closed loop's timings."""
    from autopipe.measure import timer

    traced = _vit_traced()
    seen = []
    sweeps = timer._time_sweeps

    def counting(traced, plan, setup, wanted, *, kernels):
        seen.append(setup.timing_passes)
        return sweeps(traced, plan, setup, wanted, kernels=kernels)

    monkeypatch.setattr(timer, "_time_sweeps", counting)
    autopipe.measure.measured_plan(traced, CPU, dict(pp=2), options=MeasureOptions(passes=2, segments=2, cache=False,
                                                                                 rounds=0, moves=0))
    assert seen and set(seen) == {2}  # the profile's and the loop's timings, in 2 * reps sweeps
    with pytest.raises(ProfileError, match="passes"):
        autopipe.measure.measured_plan(traced, CPU, dict(pp=2), options=MeasureOptions(passes=0, cache=False))


def test_indexing_with_a_tensor_is_a_gather_of_its_own_kind():
    """Its backward scatter-adds after sorting the indices: a fixed cost the table keeps apart
    from plain copies (Swin's relative position bias)."""
    from autopipe.partition.calibration import kernel_kind

    class Bias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(169, 4))
            self.register_buffer("index", torch.randint(0, 169, (49 * 49,)))

        def forward(self, x):
            return x + self.table[self.index].view(49, 49, 4).permute(2, 0, 1)

    costs = graph_costs(trace(Bias(), (torch.randn(2, 4, 49, 49),)).gm)
    gathers = [c for c in costs.values() if c.family == "gather"]
    assert len(gathers) == 1 and kernel_kind(class_of(gathers[0])) == "copy:gather"
    assert gathers[0].bwd_bytes > 0
