"""Analytic eager prices through the launch queue (partition/launch_queue.py, [Note: eager launch
queue] in measure/eager_host.py): a table fitted so prices a graph's nodes together."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

from autopipe.errors import ConfigError
from autopipe.partition.partitioner import analytic_seconds
from autopipe.partition.calibration import Calibration
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import PROFILES
from autopipe.partition.launch_queue import queue_steps
from autopipe.tracer import trace
from tests.models import timm_convnext, timm_resnet

US = 1e-6


def test_queue_steps_hide_the_host_under_long_kernels_and_add_up():
    # A long kernel first: the host launches the next two while it runs.
    assert queue_steps([(10 * US, 100 * US), (10 * US, US), (10 * US, US)]) == pytest.approx([110 * US, US, US])
    # Short kernels: the device waits for the host, and each step costs its launch.
    assert queue_steps([(10 * US, US)] * 3) == pytest.approx([11 * US, 10 * US, 10 * US])
    # A host-only step (a view) moves the host's clock alone; it costs only what the device does not hide.
    steps = [(5 * US, 50 * US), (20 * US, 0.0), (5 * US, 50 * US)]
    assert sum(queue_steps(steps)) == pytest.approx(105 * US)


def _queued(host: tuple[float, float], view_host: tuple[float, float] = (0.0, 0.0)):
    base = PROFILES["h200"].with_mode("eager")
    return dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, launch_queue=True,
                                                                     host=host, view_host=view_host))


def _kernels(profile, costs, backward: bool) -> list[float]:
    return [t for c in costs for t in (profile.kernel_time(p, backward=backward) for p in (c.parts or (c,))) if t > 0]


@pytest.fixture(scope="module")
def convnext_costs():
    traced = trace(timm_convnext(), (torch.randn(2, 3, 32, 32),))
    nodes = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    costs = graph_costs(traced.gm)
    return [costs[n] for n in nodes]


def test_analytic_eager_nodes_are_priced_by_their_kernels_or_by_the_host_whichever_binds(convnext_costs):
    costs = convnext_costs
    views = sum(c.kind == "view" for c in costs)
    assert views > 0
    # An idle host: a stage costs its kernels, each node its own.
    device_bound = _queued((0.0, 0.0)).node_times(costs)
    free = _queued((0.0, 0.0))
    for c, (f, b) in zip(costs, device_bound):
        assert f == pytest.approx(sum(free.kernel_time(p) for p in (c.parts or (c,))), abs=1e-15)
        assert b == pytest.approx(sum(free.kernel_time(p, backward=True) for p in (c.parts or (c,))), abs=1e-15)
    # A slow host: every kernel and view costs its launch, and the device's work hides under it.
    slow = _queued((1e-3, 2e-3), view_host=(5e-4, 0.0))
    times = slow.node_times(costs)
    n_fwd, n_bwd = len(_kernels(slow, costs, False)), len(_kernels(slow, costs, True))
    last_fwd = _kernels(slow, costs, False)[-1]
    assert sum(f for f, _ in times) == pytest.approx(n_fwd * 1e-3 + views * 5e-4 + last_fwd)
    assert sum(b for _, b in times) == pytest.approx(n_bwd * 2e-3, rel=1e-3)
    # In between, a node never costs more than its kernels plus its launches, and the whole
    # stage never less than either clock alone.
    mid = _queued((5 * US, 5 * US), view_host=(3 * US, 0.0))
    times = mid.node_times(costs)
    total = sum(f + b for f, b in times)
    kernels = sum(_kernels(mid, costs, False)) + sum(_kernels(mid, costs, True))
    assert total >= kernels - 1e-12 and total >= (n_fwd + n_bwd) * 5 * US + views * 3 * US - 1e-12
    node_by_node = dataclasses.replace(mid, calibration=dataclasses.replace(mid.calibration, launch_queue=False))
    assert total <= sum(f + b for f, b in node_by_node.node_times(costs)) + views * 3 * US + 1e-12


def test_the_h200_table_prices_eager_stages_through_the_queue_and_the_analytic_seconds_follow():
    h200, h100 = PROFILES["h200"].calibration, PROFILES["h100"].calibration
    assert h200.launch_queue and not h100.launch_queue  # h100's host terms were fitted node by node
    traced = trace(timm_resnet(), (torch.randn(2, 3, 32, 32),))
    costs = graph_costs(traced.gm)
    eager = PROFILES["h200"].with_mode("eager")
    seconds = analytic_seconds(traced, eager)
    queued = eager.node_times(list(costs.values()))
    assert list(seconds.values()) == pytest.approx([f + b for f, b in queued])
    # The host terms came from stages timed on an H200, committed beside the benchmarks.
    fit = h200.fit["eager_host"]
    for name in fit["results"]:
        assert (pathlib.Path(__file__).parent.parent / "benchmarks" / "results" / name).exists()
    assert fit["error_in_sample"]["mean"] < fit["error_before"]["mean"]


def test_a_table_without_the_queue_fields_loads_node_by_node_and_a_bad_view_host_is_refused():
    table = json.loads(PROFILES["h200"].calibration.to_json())
    del table["launch_queue"], table["view_host"]
    old = Calibration.from_dict(table)
    assert not old.launch_queue and old.view_host == (0.0, 0.0)
    with pytest.raises(ConfigError, match="view_host must be two non-negative seconds, got \\[-1"):
        Calibration.from_dict(dict(table, view_host=[-1.0, 0.0]))
