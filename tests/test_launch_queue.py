"""Analytic eager prices through the launch queue (partition/launch_queue.py, [Note: eager launch
queue] in measure/eager_host.py): a table fitted so prices a graph's nodes together."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import pytest
import torch

from autopipe.errors import ConfigError
from autopipe.partition.partitioner import analytic_seconds
from autopipe.partition.calibration import Calibration, class_of, kernel_kind
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import PROFILES
from autopipe.partition.launch_queue import queue_by_node, queue_steps
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
    return dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, launch_queue=True, host=host,
                                                                     view_host=view_host, node_host=(0.0, 0.0),
                                                                     host_kernels={}))


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


def test_a_slow_host_pays_each_ops_call_and_each_kernel_its_kind_launches(convnext_costs):
    costs = convnext_costs
    base = _queued((1e-3, 2e-3), view_host=(5e-4, 0.0))
    counts = {"conv": (2.0, 4.0), "norm:row": (3.0, 1.0)}  # a channels-last conv counts as "conv"
    slow = dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, host_kernels=counts,
                                                                     node_host=(7e-3, 9e-3)))
    cal = slow.calibration
    assert cal.launch_host("conv-nhwc/64", True) == pytest.approx(9e-3 + 8e-3)
    assert cal.launch_host("norm:row/1MiB", False) == pytest.approx(7e-3 + 3e-3)
    assert cal.launch_host("elementwise/1MiB", True) == pytest.approx(9e-3 + 2e-3)  # not counted: one kernel
    kinds = {kernel_kind(class_of(p)) for c in costs for p in (c.parts or (c,))}
    assert "norm:row" in kinds and kinds & {"conv", "conv-nhwc"}
    times = slow.node_times(costs)
    for d in (0, 1):
        launched = [p for c in costs for p in (c.parts or (c,)) if slow.kernel_time(p, backward=bool(d)) > 0]
        host = sum(cal.launch_host(class_of(p, backward=bool(d)), bool(d)) for p in launched)
        views = sum(c.kind == "view" for c in costs) * (5e-4, 0.0)[d]
        total = sum(t[d] for t in times)
        # the host binds: every op's call and launches, the views, and the kernel it ends on
        assert host + views - 1e-12 <= total <= host + views + max(slow.kernel_time(p, backward=bool(d))
                                                                   for p in launched) + 1e-12
    # A composite module costs what its parts cost as nodes of their own: each part is an op.
    a, b = [c for c in costs if not c.parts and slow.kernel_time(c) > 0][:2]
    apart = sum(f + w for f, w in slow.node_times([a, b]))
    assert sum(slow.node_times([dataclasses.replace(a, parts=(a, b))])[0]) == pytest.approx(apart)
    # Steps through the queue, by node: a view (no device seconds) only moves the host.
    steps = [(0, 40 * US, 1 * US), (0, 10 * US, 1 * US), (1, 4 * US, 0.0), (2, 40 * US, 50 * US)]
    assert queue_by_node(steps, 3).tolist() == pytest.approx([51 * US, 3 * US, 90 * US])


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
    results = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
    for name in fit["results"]:
        assert (results / name).exists()
    for name in fit["launch_counts"]:  # the calibration rows the kernels per op were counted in
        assert (results / "calibration" / name).exists()
    assert fit["launch_counts"] and h200.host_kernels
    assert fit["error_in_sample"]["mean"] < fit["error_before"]["mean"]


def test_a_table_without_the_queue_fields_loads_node_by_node_and_a_bad_view_host_is_refused():
    table = json.loads(PROFILES["h200"].calibration.to_json())
    del table["launch_queue"], table["view_host"]
    old = Calibration.from_dict(table)
    assert not old.launch_queue and old.view_host == (0.0, 0.0)
    with pytest.raises(ConfigError, match="view_host must be two non-negative numbers, got \\(-1"):
        Calibration.from_dict(dict(table, view_host=[-1.0, 0.0]))
    with pytest.raises(ConfigError, match="conv must be two non-negative numbers, got \\(1.0,\\)"):
        Calibration.from_dict(dict(table, host_kernels={"conv": [1.0]}))
    with pytest.raises(ConfigError, match="node_host must be two non-negative numbers, got \\(nan"):
        Calibration.from_dict(dict(table, node_host=[float("nan"), 0.0]))


def test_a_profile_at_another_hosts_pace_scales_its_host_terms_and_nothing_else(convnext_costs):
    base = _queued((20 * US, 30 * US), view_host=(10 * US, 0.0))
    cal = dataclasses.replace(base.calibration, node_host=(40 * US, 2 * US), host_probe=250 * US)
    profile = dataclasses.replace(base, calibration=cal)
    slow = profile.at_host_pace(500 * US)
    s = slow.calibration
    assert [*s.host, *s.node_host, *s.view_host, s.host_probe] == pytest.approx(
        [40 * US, 60 * US, 80 * US, 4 * US, 20 * US, 0.0, 500 * US])
    assert s.factors == cal.factors and s.stage == cal.stage
    c = next(c for c in convnext_costs if profile.kernel_time(c) > 0)
    assert slow.kernel_time(c) == profile.kernel_time(c)  # the device is the same
    fast_total = sum(f + b for f, b in profile.node_times(convnext_costs))
    assert sum(f + b for f, b in slow.node_times(convnext_costs)) > fast_total
    # Half the pace's probe twice over is the same host: the scaling composes.
    assert slow.at_host_pace(250 * US).calibration.host == pytest.approx(cal.host)
    # No probe, or a table that never recorded its host's, leaves the profile as it is.
    assert profile.at_host_pace(0.0) is profile
    unknown = dataclasses.replace(profile, calibration=dataclasses.replace(cal, host_probe=0.0))
    assert unknown.at_host_pace(500 * US) is unknown


def test_the_h200_table_knows_its_hosts_pace_and_an_analytic_eager_plan_says_which_it_priced_at():
    from autopipe.stages import plan_stages

    cal = PROFILES["h200"].calibration
    assert 50 * US < cal.host_probe < 2000 * US and cal.node_host[0] > 0 and cal.host_kernels
    with pytest.raises(ConfigError, match="host_probe must be non-negative seconds, got -1.0"):
        Calibration.from_dict(dict(json.loads(cal.to_json()), host_probe=-1.0))
    traced = trace(timm_resnet(), (torch.randn(2, 3, 32, 32),))
    eager = PROFILES["h200"].with_mode("eager")
    plan = plan_stages(traced, pp=2, device=eager.at_host_pace(2 * cal.host_probe))
    assert plan.cost_source["host_probe_us"] == pytest.approx(2e6 * cal.host_probe)
    assert "host_probe_us" not in plan_stages(traced, pp=2, device=PROFILES["h200"].with_mode("graphs")).cost_source


def test_the_host_probe_reads_this_hosts_pace():
    from autopipe.measure.host_pace import probe_seconds

    begin = time.perf_counter()
    seconds = probe_seconds(torch.device("cpu"), window=0.2, pause=0.01)
    assert 0 < seconds < 0.1
    assert time.perf_counter() - begin >= 0.2  # spread over the window, not one burst



def test_the_host_probe_reads_the_fast_pace_through_a_slow_spell_and_lone_fast_readings(monkeypatch):
    from autopipe.measure import host_pace

    begin = time.perf_counter()
    calls = iter(range(10**9))

    def probe(device):  # slow for the first 60% of the window, then fast; 1 in 7 slow readings is fast
        if time.perf_counter() - begin < 0.12:
            return 100 * US if next(calls) % 7 == 0 else 260 * US
        return 200 * US

    monkeypatch.setattr(host_pace.PACE, "probe", probe)
    assert host_pace.probe_seconds(torch.device("cpu"), window=0.2, pause=0.01) == pytest.approx(200 * US)


def test_the_host_probe_waits_out_a_slow_spell_longer_than_its_window_where_it_saw_the_fast_pace(monkeypatch):
    from autopipe.measure import host_pace

    def slow_host(spell_from: float):
        """Slow, but for a glimpse of the fast pace (two bursts of ten, after a warm-up of ten) and
        a fast spell from ``spell_from`` seconds on."""
        begin, calls = time.perf_counter(), iter(range(10**9))

        def probe(device):
            fast = 30 <= next(calls) < 50 or time.perf_counter() - begin >= spell_from
            return 200 * US if fast else 300 * US
        return probe

    cpu = torch.device("cpu")
    monkeypatch.setattr(host_pace.PACE, "probe", slow_host(0.3))
    begin = time.perf_counter()
    assert host_pace.probe_seconds(cpu, window=0.2, pause=0.005, longest=5.0) == pytest.approx(200 * US)
    assert time.perf_counter() - begin >= 0.3
    # Nor does it go past its longest, whatever it saw.
    monkeypatch.setattr(host_pace.PACE, "probe", slow_host(0.3))
    assert host_pace.probe_seconds(cpu, window=0.1, pause=0.005, longest=0.15) == pytest.approx(300 * US)
    # A host that keeps its slow pace all along gives no sign of another: the probe stops at its window.
    monkeypatch.setattr(host_pace.PACE, "probe", lambda device: 300 * US)
    begin = time.perf_counter()
    assert host_pace.probe_seconds(cpu, window=0.2, pause=0.005, longest=5.0) == pytest.approx(300 * US)
    assert time.perf_counter() - begin < 2.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host's pace is probed on a GPU")
def test_an_eager_plan_made_on_a_gpu_is_priced_at_this_hosts_pace():
    import torch.nn.functional as F

    import autopipe

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 16 * 16, 10))
    pm = autopipe.parallelize(model, (torch.randn(2, 3, 16, 16),), microbatches=2, chunks=2, schedule="gpipe",
                              loss_fn=F.cross_entropy, device="cuda")
    source = pm.plan.cost_source
    assert source["source"] == "analytic" and source["mode"] == "eager"
    # The table's host terms moved to the pace probed here, not the pace they were fitted at; a
    # table that never recorded its host's pace (h100's) prices at its own.
    table = PROFILES[source["profile"]].calibration
    if table.host_probe > 0:
        assert source["host_probe_us"] > 0 and source["host_probe_us"] != pytest.approx(table.host_probe * 1e6, abs=1e-9)
    else:
        assert "host_probe_us" not in source


def test_parallelize_plans_eager_stages_on_a_gpu_at_the_pace_probed_there_and_nothing_else(monkeypatch):
    import autopipe.api as api

    monkeypatch.setattr(api, "recent_probe_seconds", lambda device: 123 * US)
    monkeypatch.setattr(api, "default_profile", lambda profile, device: PROFILES[profile or "h200"])
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    assert api._planning_profile(None, cuda, "eager").calibration.host_probe == pytest.approx(123 * US)
    # CUDA graphs replay without the host; a profile the user gave is theirs; a CPU has no GPU host.
    for profile, device, mode in ((None, cuda, "graphs"), ("h200", cuda, "eager"), (None, torch.device("cpu"), "eager")):
        assert api._planning_profile(profile, device, mode) is PROFILES[profile or "h200"]


def test_the_layout_search_prices_eager_layouts_on_a_gpu_at_the_pace_probed_there(monkeypatch):
    import types

    import autopipe.api as api

    seen = {}

    def plan_layout(model, *, device, **kwargs):
        seen["profile"] = device
        layout = types.SimpleNamespace(microbatch_size=lambda batch: 2)
        return types.SimpleNamespace(best=types.SimpleNamespace(layout=layout))

    monkeypatch.setattr(api, "recent_probe_seconds", lambda device: 123 * US)
    monkeypatch.setattr(api, "default_profile", lambda profile, device: PROFILES[profile or "h200"])
    monkeypatch.setattr(api, "resolve_device", torch.device)
    monkeypatch.setattr(api, "plan_layout", plan_layout)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=2**30))
    api._choose_layout(torch.nn.Linear(4, 4), (torch.randn(4, 4),), batch=8, device="cuda", profile=None,
                       costs="analytic", mixed_precision=None, deadline=60)
    assert seen["profile"].calibration.host_probe == pytest.approx(123 * US)
    api._choose_layout(torch.nn.Linear(4, 4), (torch.randn(4, 4),), batch=8, device="cuda", profile="h200",
                       costs="analytic", mixed_precision=None, deadline=60)
    assert seen["profile"] is PROFILES["h200"]  # a profile the user gave is theirs


def test_a_recent_probe_is_read_again_only_once_it_is_old(monkeypatch):
    from autopipe.measure import host_pace

    readings = iter([1.0, 2.0])
    monkeypatch.setattr(host_pace, "probe_seconds", lambda device: next(readings))
    monkeypatch.setattr(host_pace, "_RECENT", {})
    cpu = torch.device("cpu")
    assert host_pace.recent_probe_seconds(cpu) == 1.0
    assert host_pace.recent_probe_seconds(cpu) == 1.0  # one pace for a search and its plan
    assert host_pace.recent_probe_seconds(cpu, max_age=0.0) == 2.0
