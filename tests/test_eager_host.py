"""Eager node prices through the launch queue ([Note: eager launch queue], measure/eager_host.py)."""
from __future__ import annotations

import json
import random
import statistics
from types import SimpleNamespace

import pytest
import torch

from autopipe.errors import ProfileError
from autopipe.measure import cache as cache_module
from autopipe.measure.cache import ProfileCache
from autopipe.measure.eager_host import PER_KERNEL_GRID, PER_NODE_GRID, LaunchCosts, fit_launch_costs, queue_prices
from autopipe.measure.kernels import NodeTimes
from autopipe.measure import RunSetup, profile_graph, segment_starts
from autopipe.measure import profile as profile_module
from autopipe.measure.profile import PAIRS_TIMED, _eager_prices, _timed_pairs
from autopipe.partition.device import get_profile
from autopipe.measure.stage_run import StageTiming
from autopipe.partition.measured import MeasuredCosts
from autopipe.tracer import trace
from tests.models import timm_vit

US = 1e-6


def _forward_only(devices: dict[str, float]) -> dict[str, tuple]:
    return {n: (d, 0.0, 1, 0, True, False) for n, d in devices.items()}


def test_host_work_hides_under_long_kernels():
    launch = LaunchCosts(per_kernel=10 * US, per_node=0.0)
    # A long kernel first: the host launches the next two while it runs, and they cost only
    # their own kernels (the larger of kernel and host time, node by node, would say 120 us).
    prices = queue_prices(["conv", "bn", "relu"], _forward_only({"conv": 100 * US, "bn": US, "relu": US}), launch)
    assert prices == pytest.approx({"conv": 110 * US, "bn": US, "relu": US})
    # Short kernels: the device waits for the host, and every node costs its launch.
    prices = queue_prices(["a", "b", "c"], _forward_only({"a": US, "b": US, "c": US}), launch)
    assert prices == pytest.approx({"a": 11 * US, "b": 10 * US, "c": 10 * US})


def test_the_backward_runs_after_the_forward_in_reverse():
    launch = LaunchCosts(per_kernel=0.0, per_node=5 * US)
    work = {"a": (10 * US, 20 * US, 1, 1, True, True), "b": (0.0, 0.0, 0, 0, False, False),
            "c": (10 * US, 30 * US, 1, 2, True, True)}
    prices = queue_prices(["a", "b", "c"], work, launch)
    # forward: a 5..15, c 15..25 (b is a view: no host time, no kernel); backward: c 25..55, a 55..75
    assert prices == pytest.approx({"a": 15 * US + 20 * US, "b": 0.0, "c": 10 * US + 30 * US})
    assert sum(prices.values()) == pytest.approx(75 * US)


def _model(seed: int = 0, nodes: int = 64) -> dict[str, tuple]:
    rng = random.Random(seed)
    work = {}
    for i in range(nodes):
        long_kernels = i < nodes // 2  # large maps first, as in a CNN
        f = rng.uniform(50, 400) * US if long_kernels else rng.uniform(2, 20) * US
        kf, kb = rng.randint(1, 3), rng.randint(1, 4)
        work[f"n{i}"] = (f, 2 * f, kf, kb, True, True)
    return work


def test_the_fit_finds_the_launch_costs_that_made_the_timings():
    work, truth, fixed = _model(), LaunchCosts(per_kernel=20 * US, per_node=30 * US), 200 * US
    names = list(work)
    segments = [names[i:i + 8] for i in range(0, len(names), 8)]
    timed = [(s, sum(queue_prices(s, work, truth).values()) + fixed, 0.0) for s in segments]
    launch, found_fixed = fit_launch_costs(timed, work)
    assert launch == LaunchCosts(pytest.approx(20 * US), pytest.approx(30 * US))
    assert found_fixed == pytest.approx(fixed)


def test_the_fit_follows_a_busy_host_beyond_its_first_grid():
    # A host shared with other jobs: launches three times slower than the first grid reaches.
    work, truth = _model(1), LaunchCosts(per_kernel=300 * US, per_node=320 * US)
    assert truth.per_kernel > PER_KERNEL_GRID[-1] and truth.per_node > PER_NODE_GRID[-1]
    names = list(work)
    timed = [(s, sum(queue_prices(s, work, truth).values()), 0.0) for s in (names[i:i + 8] for i in range(0, 64, 8))]
    launch, fixed = fit_launch_costs(timed, work)
    assert launch == LaunchCosts(pytest.approx(300 * US), pytest.approx(320 * US)) and fixed == pytest.approx(0.0)


def test_an_eager_profile_prices_each_segment_at_its_timing():
    work, truth, fixed = _model(1), LaunchCosts(per_kernel=15 * US, per_node=40 * US), 150 * US
    names = list(work)
    stages = [SimpleNamespace(nodes=names[i:i + 16]) for i in range(0, len(names), 16)]
    timings = []
    for k, stage in enumerate(stages):
        lost = (5 * US * k, 10 * US)
        seconds = sum(queue_prices(stage.nodes, work, truth).values()) + fixed + sum(lost)
        # The profiler's host times are off by a factor that differs node to node: not used.
        nodes = NodeTimes({n: work[n][:2] for n in stage.nodes},
                          {n: (random.uniform(1, 9) * 1e-3, 0.0) for n in stage.nodes},
                          {n: work[n][2:4] for n in stage.nodes}, lost)
        timings.append(StageTiming(seconds / 3, seconds * 2 / 3, nodes))
    prices, found_fixed = _eager_prices(SimpleNamespace(stages=stages), timings)
    assert found_fixed == pytest.approx(fixed)
    for stage, timing in zip(stages, timings):
        assert sum(prices[n] for n in stage.nodes) + found_fixed == pytest.approx(timing.seconds)
    assert all(p >= 0 for p in prices.values())


def _host_bound(nodes: int = 64) -> dict[str, tuple]:
    """Nodes whose kernels are all shorter than their launch: every segment is the host's pace."""
    return {f"n{i}": (1 * US, 2 * US, 1, 1, True, True) for i in range(nodes)}


def test_pairs_of_segments_timed_whole_tell_the_fixed_cost_from_the_launch_costs():
    # Segments of eight nodes each: a fixed cost and a per-node cost fit their timings in many
    # proportions ([Note: segment pairs]); the fit alone cannot say which.
    work, truth, fixed = _host_bound(), LaunchCosts(per_kernel=10 * US, per_node=40 * US), 1000 * US
    names = list(work)
    segments = [names[i:i + 8] for i in range(0, len(names), 8)]
    timed = [(s, sum(queue_prices(s, work, truth).values()) + fixed, 0.0) for s in segments]
    launch, found = fit_launch_costs(timed, work)
    stage = names[:32]  # four segments as one stage pays the fixed cost once
    true_stage = sum(queue_prices(stage, work, truth).values()) + fixed
    assert found != pytest.approx(fixed, rel=0.05)
    assert sum(queue_prices(stage, work, launch).values()) + found != pytest.approx(true_stage, rel=0.05)
    pairs = [(names[i:i + 16], sum(queue_prices(names[i:i + 16], work, truth).values()) + fixed, 0.0)
             for i in (0, 32)]
    launch, found = fit_launch_costs(timed, work, pairs)
    assert found == pytest.approx(fixed, rel=0.05)
    assert sum(queue_prices(stage, work, launch).values()) + found == pytest.approx(true_stage, rel=0.02)


def test_a_profile_of_another_schema_is_profiled_again(tmp_path, monkeypatch):
    cache = ProfileCache(tmp_path)
    key = {"fingerprint": "f", "mode": "eager"}
    before = cache.path(key, 16)
    monkeypatch.setattr(cache_module, "SCHEMA_VERSION", cache_module.SCHEMA_VERSION + 1)
    assert cache.path(key, 16) != before


def test_a_profile_file_of_another_schema_is_a_typed_error(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"schema": 1, "segments": [], "node_seconds": {}}')
    with pytest.raises(ProfileError, match="schema 1, expected 3: a profile written by another version.*profile again"):
        MeasuredCosts.load(path)


def _vit_traced():
    torch.manual_seed(0)
    return trace(timm_vit(), (torch.randn(4, 3, 32, 32),))


def test_the_timed_pairs_are_adjacent_segments_spread_over_the_graph():
    traced = _vit_traced()
    starts = segment_starts(traced, 16, "cpu")
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    ends = starts[1:] + [len(order)]
    segments = [StageTiming(0.0, 0.0, NodeTimes({}, {}, {}, (1e-6 * k, 0.0))) for k in range(len(starts))]
    pairs = _timed_pairs(traced, starts, RunSetup("cpu", reps=1, warmup=0), get_profile("cpu"), segments, None, 0, 1)
    assert len(pairs) == min(PAIRS_TIMED, len(starts) // 2) >= 2
    firsts = []
    for nodes, timing, lost in pairs:
        k = starts.index(order.index(nodes[0]))  # a pair starts where an even segment starts ...
        assert k % 2 == 0 and nodes == order[starts[k]:ends[k + 1]]  # ... and ends where the next one ends
        assert timing.seconds > 0 and lost == pytest.approx(1e-6 * (2 * k + 1))
        firsts.append(k)
    assert firsts[0] == 0 and firsts[-1] >= len(starts) - 3  # from the first segments to the last


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="eager kernel times need a GPU")
def test_an_eager_gpu_profile_fits_its_segments_and_pairs(monkeypatch):
    rows = []
    fit = profile_module.fit_launch_costs

    def spy(segments, work, pairs):
        rows.extend(segments)
        rows.extend(pairs)
        return fit(segments, work, pairs)

    monkeypatch.setattr(profile_module, "fit_launch_costs", spy)
    traced = _vit_traced()
    measured = profile_graph(traced, RunSetup("cuda", "eager", reps=2, warmup=1), segments=8)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    assert set(measured.node_seconds) == set(order) and measured.stage_overhead >= 0
    assert len(rows) == len(measured.segments) + min(PAIRS_TIMED, len(measured.segments) // 2) == \
        len(measured.segments) + len(measured.pairs)
    for pair in measured.pairs:  # each pair spans two segments, and is kept with the profile
        assert any(s.start == pair.start for s in measured.segments) and any(s.end == pair.end for s in measured.segments)
    assert MeasuredCosts.from_dict(json.loads(measured.to_json())) == measured
    # A segment's nodes' prices and the fixed cost add up to about its timing, for most segments:
    # the fit is robust to a segment whose timing a busy host spoiled (on a 4-GPU machine with
    # another job beside it, one of 8 segments read 3.2 ms where its prices summed to 0.55).
    ratios = sorted((sum(measured.node_seconds[n] for n in order[seg.start:seg.end]) + measured.stage_overhead)
                    / seg.seconds for seg in measured.segments)
    assert 0.5 <= statistics.median(ratios) <= 1.5, ratios


def test_a_few_pairs_weigh_as_much_as_all_the_segments_in_the_fixed_cost():
    from autopipe.measure.eager_host import _weighted_median
    assert _weighted_median([3.0, 1.0, 2.0, 4.0], [0.25] * 4) == 2.5  # equal weights: the plain median
    # 12 of 16 segments say 1, the other 4 and both pairs say 5: by count 1 (12 of 18), by weight 5
    values = [1.0] * 12 + [5.0] * 4 + [5.0, 5.0]
    assert _weighted_median(values, [1 / 18] * 18) == 1.0
    assert _weighted_median(values, [1 / 16] * 16 + [0.5, 0.5]) == 5.0
