"""Eager stages priced by their own replay through the launch queue ([Note: a stage starts idle]
in partition/launch_queue.py, [Note: cuts on stage replays] in partition/replayed_cuts.py)."""
from __future__ import annotations

import pytest
import torch

from autopipe.partition import balance as balancer
from autopipe.partition import replayed_cuts
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import PROFILES
from autopipe.partition.launch_queue import queue_by_node, queue_steps, stage_replays
from autopipe.partition.partitioner import partition, partition_at
from autopipe.partition.replayed_cuts import replayed_cut
from autopipe.tracer import trace
from tests.models import timm_resnet

US = 1e-6
# One kernel a node each way: twenty GPU-bound nodes (200 us on the device, 10 on the host), then
# six host-bound ones (300 us on the host, 10 on the device).
HEAVY, LIGHT = (10 * US, 200 * US), (300 * US, 10 * US)
NODES = [HEAVY] * 20 + [LIGHT] * 6
LAUNCHES = ([(i, h, d) for i, (h, d) in enumerate(NODES)],
            [(i, h, d) for i, (h, d) in reversed(list(enumerate(NODES)))])


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
    free, every = [0.0] * 25, [True] * 25
    kept, factors = replayed_cut(LAUNCHES, compute, compute, list(first), recut=False, cut_cost=free, allowed=every,
                                 overhead=0.0)
    assert kept == list(first) and max(factors) > 1.04  # priced by the replays, cut as given
    again, factors = replayed_cut(LAUNCHES, compute, compute, list(first), recut=True, cut_cost=free, allowed=every,
                                  overhead=0.0)
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


def test_without_recuts_the_cut_is_the_one_made_on_node_prices(monkeypatch):
    traced = trace(timm_resnet(), (torch.randn(8, 3, 32, 32),))
    eager = PROFILES["h200"].with_mode("eager")
    monkeypatch.setattr(replayed_cuts, "RECUTS", 0)
    plain = partition(traced, 4, device=eager)
    monkeypatch.setattr(replayed_cuts, "RECUTS", 3)
    recut = partition(traced, 4, device=eager)
    assert max(s.compute_time for s in recut.stages) <= max(s.compute_time for s in plain.stages) * (1 + 1e-9)
