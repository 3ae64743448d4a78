"""Eager stages priced by their own replay through the launch queue ([Note: a stage starts idle]
in partition/launch_queue.py, [Note: cuts on stage replays] in partition/replayed_cuts.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from autopipe.partition import balance as balancer
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import PROFILES
from autopipe.partition.launch_queue import pass_replays, queue_by_node, queue_steps, stage_replays
from autopipe.partition.partitioner import partition, partition_at
from autopipe.partition.replayed_cuts import replayed_cut
from autopipe.tracer import trace
from autopipe.search import Layout, LinkModel, Pricing
from autopipe.search.costs import GraphCosts
from autopipe.search.predict import _stage_scale, predict, stage_overhead
from tests.models import timm_resnet

US = 1e-6
# One kernel a node each way: twenty GPU-bound nodes (200 us on the device, 10 on the host), then
# six host-bound ones (300 us on the host, 10 on the device).
HEAVY, LIGHT = (10 * US, 200 * US), (300 * US, 10 * US)
NODES = [HEAVY] * 20 + [LIGHT] * 6
LAUNCHES = ([(i, h, d) for i, (h, d) in enumerate(NODES)],
            [(i, h, d) for i, (h, d) in reversed(list(enumerate(NODES)))])


FREE = dict(cut_time=[0.0] * 25, cut_latency=[0.0] * 25, allowed=[True] * 25, overhead=0.0)


def _node_prices() -> list[float]:
    fwd, bwd = (queue_by_node(passed, len(NODES)) for passed in LAUNCHES)
    return [float(f + b) for f, b in zip(fwd, bwd)]


def test_a_stage_replays_from_idle_and_the_whole_graph_replay_hides_its_host_under_the_backlog():
    replays = stage_replays(LAUNCHES, [0, 20])
    alone = [sum(queue_steps([(h, d) for h, d in NODES[i:j]])) + sum(queue_steps([(h, d) for h, d in NODES[i:j][::-1]]))
             for i, j in ((0, 20), (20, 26))]
    assert replays == pytest.approx(alone)
    prices = _node_prices()
    # The forward's host-bound nodes come after 3.8 ms of backlog: their 1.8 ms of launches hide.
    assert sum(prices[20:]) < replays[1] - 1500 * US
    assert stage_replays(LAUNCHES, [0]) == pytest.approx([sum(prices)])  # one stage: the whole replay


def test_a_cut_made_again_on_stage_replays_shrinks_its_largest_stage():
    compute = _node_prices()
    first = balancer.solve(compute, 2)
    before = max(stage_replays(LAUNCHES, first))
    kept, factors = replayed_cut(LAUNCHES, compute, compute, list(first), recut=False, **FREE)
    assert kept == list(first) and max(factors) > 1.04  # priced by the replays, cut as given
    again, factors = replayed_cut(LAUNCHES, compute, compute, list(first), recut=True, **FREE)
    after = stage_replays(LAUNCHES, again)
    # The node prices put 12 GPU-bound nodes before the host-bound tail; its stage runs 5.30 ms.
    assert again[1] > first[1] and max(after) < before - 50 * US, (first, again)
    ends = again[1:] + [len(compute)]
    assert factors == pytest.approx([r / sum(compute[i:j]) for r, i, j in zip(after, again, ends)])


def test_an_eager_plan_reports_each_stage_as_it_replays():
    traced = trace(timm_resnet(), (torch.randn(8, 3, 32, 32),))
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    costs = graph_costs(traced.gm)
    eager = PROFILES["h200"].with_mode("eager")
    plan = partition(traced, 3, device=eager)
    starts = [order.index(s.nodes[0]) for s in plan.stages]
    fixed = eager.calibration.stage["eager"]
    replays = stage_replays(eager.launches([costs[n] for n in order]), starts)
    assert [s.compute_time for s in plan.stages] == pytest.approx([r + fixed for r in replays])
    again = partition_at(traced, starts, device=eager)  # given starts: kept, and priced alike
    assert [s.compute_time for s in again.stages] == pytest.approx([s.compute_time for s in plan.stages])
    assert PROFILES["h200"].with_mode("graphs").launches([costs[n] for n in order]) is None  # no host to replay


def _random_launches(rng: np.random.Generator, n: int) -> tuple[list, list]:
    """Forward and backward launches of ``n`` nodes: each node none to three kernels, some views,
    host and device times spread over two orders of magnitude either way."""
    passes = []
    for order in (range(n), range(n - 1, -1, -1)):
        launches = []
        for i in order:
            for _ in range(int(rng.integers(0, 4))):
                device = 0.0 if rng.random() < 0.2 else float(rng.lognormal(-9, 1.5))
                launches.append((i, float(rng.lognormal(-9, 1.0)), device))
        passes.append(launches)
    return passes[0], passes[1]


def test_the_closed_form_replays_every_range_as_the_queue_steps_it():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 30):
        launches = _random_launches(rng, n)
        heads, ends = np.triu_indices(n + 1, k=1)
        for passed in launches:
            closed = pass_replays(passed, heads, ends)
            stepped = [sum(queue_steps([(h, dev) for node, h, dev in passed if a <= node < b])) for a, b in zip(heads, ends)]
            assert closed == pytest.approx(stepped, rel=1e-12, abs=1e-18)


def test_the_cut_on_stage_replays_is_the_least_largest_replay_of_every_cut():
    rng = np.random.default_rng(1)
    for trial in range(6):
        n, stages = 9, 2 + trial % 3
        launches = _random_launches(rng, n)
        fwd, bwd = (queue_by_node(p, n) for p in launches)
        compute = [float(f + b) for f, b in zip(fwd, bwd)]
        cut_time = list(rng.uniform(0, 2e-4, n - 1))
        latency = list(rng.uniform(0, 1e-5, n - 1))
        allowed = [bool(a) for a in rng.random(n - 1) < 0.8]
        if sum(allowed) + 1 < stages:
            continue
        first = balancer.solve_overlapped(compute, stages, cut_time=cut_time, cut_latency=latency, allowed_cuts=allowed)
        best, _ = replayed_cut(launches, compute, compute, list(first), recut=True, cut_time=cut_time,
                               cut_latency=latency, allowed=allowed, overhead=1e-5)

        def largest(starts: list[int]) -> float:
            ends = starts[1:] + [n]
            comm = [(cut_time[i - 1] if i else 0.0) + (cut_time[j - 1] if j < n else 0.0) for i, j in zip(starts, ends)]
            lat = [(latency[i - 1] if i else 0.0) + (latency[j - 1] if j < n else 0.0) for i, j in zip(starts, ends)]
            return max(max(r + 1e-5, c) + lt for r, c, lt in zip(stage_replays(launches, starts), comm, lat))

        every = [[0, *c] for c in itertools.combinations([k + 1 for k in range(n - 1) if allowed[k]], stages - 1)]
        assert largest(best) == pytest.approx(min(largest(c) for c in every), rel=1e-9), (trial, best)


def test_a_cut_on_stage_replays_keeps_the_memory_cap():
    compute = _node_prices()
    mem = [2.0] * 13 + [1.0] * 13  # the least largest replay, [0, 13) and [13, 26), holds 26 and 13
    free, _ = replayed_cut(LAUNCHES, compute, compute, [0, 20], recut=True, **FREE)
    capped, _ = replayed_cut(LAUNCHES, compute, compute, [0, 20], recut=True, mem=mem, mem_cap=24.0, **FREE)
    assert free == [0, 13] and capped == [0, 12]


def test_without_recuts_the_cut_is_the_one_made_on_node_prices():
    traced = trace(timm_resnet(), (torch.randn(8, 3, 32, 32),))
    eager = PROFILES["h200"].with_mode("eager")
    recut = partition(traced, 4, device=eager)
    plain = partition(traced, 4, device=eager, balance=["layer2", "layer3", "layer4"])
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    for starts in ([order.index(s.nodes[0]) for s in plain.stages], [0, 3, 9, 14]):
        given = partition_at(traced, starts, device=eager)
        assert max(s.compute_time for s in recut.stages) <= max(s.compute_time for s in given.stages) * (1 + 1e-9)


def test_the_layout_search_replays_eager_stages_as_the_partitioner_does():
    traced = trace(timm_resnet(), (torch.randn(8, 3, 32, 32),))
    graph = GraphCosts(traced, 8)
    eager = PROFILES["h200"].with_mode("eager")
    passes = graph.launches(8, eager)
    for searched, planned in zip(passes, eager.launches(graph.costs)):
        assert [n for n, _, _ in searched] == [n for n, _, _ in planned]
        assert [t for _, h, d in searched for t in (h, d)] == pytest.approx([t for _, h, d in planned for t in (h, d)])
    assert graph.launches(8, eager.with_mode("graphs")) is None  # no host to replay
    pricing = Pricing(PROFILES["h200"], LinkModel.from_profile(PROFILES["h200"]), 32)
    for recompute in (False, True):
        layout = Layout(4, 1, 1, 4, 1, "1f1b", False, recompute, "eager")
        priced = predict(graph, layout, pricing)
        again = [passes[0], passes[0], passes[1]] if recompute else passes  # the forward runs again
        scale, overhead = _stage_scale(layout, pricing), stage_overhead(pricing, layout, graph, 8)
        assert priced.stage_seconds == pytest.approx([r * scale + overhead for r in stage_replays(again, priced.starts)])
