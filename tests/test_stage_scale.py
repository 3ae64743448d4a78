"""Stages scaled by how much slower they run inside the pipeline than alone ([Note: stage scale]
in autopipe/measure/pipeline_scale.py): the scaled cut is the least largest scaled stage, the
closed loop and the plan use the scaled times, the factors are read back from a recorded step,
and bad factors are typed errors."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

import autopipe
import autopipe.measure as measure_module
from autopipe.errors import ConfigError, PartitionError
from autopipe.measure import MeasureOptions, RunSetup, measured_plan, profile_graph, stage_scale, stage_seconds
from autopipe.partition.balance import solve, solve_scaled
from autopipe.partition.partitioner import partition, partition_at
from autopipe.runtime.timeline import Event, gather
from autopipe.tracer import trace
from tests.distributed import run_distributed
from tests.models import timm_vit

CPU = RunSetup("cpu", reps=2, warmup=1)


def _largest(compute, scale, starts, cut_cost=None, overhead=0.0):
    n = len(compute)
    cut = cut_cost or [0.0] * (n - 1)
    ends = [*starts[1:], n]
    return max(f * (sum(compute[i:j]) + overhead) + (cut[i - 1] if i else 0.0) + (cut[j - 1] if j < n else 0.0)
               for f, i, j in zip(scale, starts, ends))


def test_the_scaled_cut_is_the_least_largest_scaled_stage():
    rng = random.Random(0)
    for _ in range(400):
        n, k = rng.randint(1, 11), rng.randint(1, 4)
        if k > n:
            continue
        compute = [rng.random() for _ in range(n)]
        scale = [rng.uniform(0.8, 1.5) for _ in range(k)]
        cut_cost = [rng.random() * 0.5 for _ in range(n - 1)] if rng.random() < 0.5 else None
        overhead = rng.choice([0.0, 0.3])
        allowed = [rng.random() < 0.8 for _ in range(n - 1)]
        cuts = [c + 1 for c in range(n - 1) if allowed[c]]
        if len(cuts) + 1 < k:
            with pytest.raises(PartitionError):
                solve_scaled(compute, scale, allowed_cuts=allowed)
            continue
        best = min(_largest(compute, scale, [0, *c], cut_cost, overhead) for c in itertools.combinations(cuts, k - 1))
        starts = solve_scaled(compute, scale, allowed_cuts=allowed, cut_cost=cut_cost, stage_overhead=overhead)
        assert starts[0] == 0 and all(allowed[s - 1] for s in starts[1:]) and starts == sorted(set(starts))
        assert _largest(compute, scale, starts, cut_cost, overhead) == pytest.approx(best, rel=1e-9)


def test_equal_factors_cut_as_the_additive_solver_does():
    rng = random.Random(1)
    for _ in range(100):
        n = rng.randint(2, 30)
        k = rng.randint(1, min(5, n))
        compute, cut_cost = [rng.random() for _ in range(n)], [rng.random() * 0.3 for _ in range(n - 1)]
        ours = solve_scaled(compute, [1.0] * k, cut_cost=cut_cost)
        assert _largest(compute, [1.0] * k, ours, cut_cost) == pytest.approx(
            _largest(compute, [1.0] * k, solve(compute, k, cut_cost=cut_cost), cut_cost), rel=1e-9)


def test_a_slower_place_gets_less_work():
    compute = [1.0] * 12
    assert solve_scaled(compute, [1.0, 1.0, 1.0]) == [0, 4, 8]
    slow_first = solve_scaled(compute, [2.0, 1.0, 1.0])
    assert _largest(compute, [2.0, 1.0, 1.0], slow_first) == 5.0 and slow_first[1] == 2  # 2 x 2 nodes, then 5 and 5
    with pytest.raises(PartitionError, match="positive"):
        solve_scaled(compute, [1.0, 0.0])


def test_partition_balances_and_reports_the_scaled_stage_times():
    torch.manual_seed(0)
    traced = trace(timm_vit(depth=4), (torch.randn(2, 3, 32, 32),))
    plain = partition(traced, 2, device="cpu")
    slow_first = partition(traced, 2, device="cpu", stage_scale=(1.6, 1.0))
    slow_last = partition(traced, 2, device="cpu", stage_scale=(1.0, 1.6))
    size = lambda plan: len(plan.stages[0].nodes)  # noqa: E731
    assert size(slow_first) < size(plain) < size(slow_last)
    assert slow_first.balance == "cost:stage_scale=1.6,1"
    # The plan's stage times are the scaled ones: balanced, where the unscaled ones are not.
    assert slow_first.imbalance < 1.1 and slow_first.stages[0].analytic_time < slow_first.stages[1].analytic_time
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    starts = [order.index(s.nodes[0]) for s in slow_first.stages]
    again = partition_at(traced, starts, device="cpu", stage_scale=(1.6, 1.0))
    assert [s.compute_time for s in again.stages] == pytest.approx([s.compute_time for s in slow_first.stages])
    assert again.balance == slow_first.balance  # a plan cut at given starts says it was scaled too
    unscaled = partition_at(traced, starts, device="cpu")
    assert again.stages[0].compute_time == pytest.approx(1.6 * unscaled.stages[0].compute_time)


def test_a_stage_read_as_very_slow_still_holds_parameters():
    """A stage scale read in a noisy stand-in pipeline can call the first stage 50x slow: the cut
    gives it the least work that still owns parameters, not the input's parameterless first
    nodes, on which the rank's optimizer would fail."""
    torch.manual_seed(0)
    traced = trace(timm_vit(depth=2), (torch.randn(2, 3, 32, 32),))
    for scale in ((50.0, 1.0), (1.0, 50.0)):
        plan = partition(traced, 2, device="cpu", stage_scale=scale)
        assert all(stage.params > 0 for stage in plan.stages), [s.nodes for s in plan.stages]
    # A model too small for that keeps every cut: the plan is then refused by name (check_parameters).
    lone = trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
    assert [len(s.nodes) for s in partition(lone, 2, device="cpu").stages] == [2, 1]


@pytest.mark.parametrize("scale, kwargs, match", [
    ((1.0,), {}, "one per stage"),
    ((1.0, -1.0), {}, "positive"),
    ((1.0, float("nan")), {}, "positive"),
    ("ab", {}, "numbers"),
    ((1.0, 1.0), {"balance": "uniform"}, "balance='cost'"),
    ((1.0, 1.0), {"mem_cap": 1e9}, "mem_cap"),
])
def test_bad_stage_scales_are_typed_errors(scale, kwargs, match):
    traced = trace(timm_vit(depth=2), (torch.randn(2, 3, 32, 32),))
    with pytest.raises(ConfigError, match=match):
        partition(traced, 2, device="cpu", stage_scale=scale, **kwargs)


def test_the_closed_loop_compares_scaled_times(monkeypatch):
    torch.manual_seed(0)
    traced = trace(timm_vit(depth=4), (torch.randn(2, 3, 32, 32),))
    profile = profile_graph(traced, CPU, segments=4)
    alone = {}  # what the fake device times each stage alone: its nodes' profiled seconds

    def fake_time_plan(traced_, plan, setup, group=None, stages=None):
        times = [sum(profile.node_seconds.get(n, 0.0) for n in s.nodes) for s in plan.stages]
        alone[id(plan)] = times
        return times if stages is None else [times[i] for i in stages]

    def fake_time_both(traced_, plan, other, setup, scale):  # boundary moves time two plans together
        return tuple([t * f for t, f in zip(fake_time_plan(traced_, p, setup), scale)] for p in (plan, other))

    monkeypatch.setattr(measure_module, "time_plan", fake_time_plan)
    monkeypatch.setattr(measure_module, "_time_both", fake_time_both)
    # cut between whole nodes: this device does not price MLP pieces
    plans = {scale: measured_plan(traced, CPU, dict(pp=2, device="cpu", split_mlps=False), measured=profile,
                                  options=MeasureOptions(reps=2, warmup=1, rounds=2, moves=4, stage_scale=scale))
             for scale in ((2.0, 1.0), (1.0, 2.0))}
    first, last = plans[(2.0, 1.0)], plans[(1.0, 2.0)]
    assert len(first.stages[0].nodes) < len(last.stages[0].nodes)
    for plan, scale in ((first, (2.0, 1.0)), (last, (1.0, 2.0))):
        times = [sum(profile.node_seconds.get(n, 0.0) for n in s.nodes) for s in plan.stages]
        # The loop kept the stages' times alone times their factors, and judged the balance by them.
        assert [s.measured_time for s in plan.stages] == pytest.approx([t * f for t, f in zip(times, scale)])
        assert plan.measured_imbalance < max(times) / (sum(times) / 2)
        # Its prices are the profile's, fitted on the times without their factors, times the factors.
        assert [s.compute_time for s in plan.stages] == pytest.approx([s.measured_time for s in plan.stages], rel=0.05)


def test_stage_scale_reads_each_stage_from_the_timeline():
    events = [Event(0, "F", 0, m, 0.0, 0.010 + 0.001 * m) for m in range(3)]
    events += [Event(0, "B", 0, m, 0.0, 0.020) for m in range(3)]
    events += [Event(1, "F", 1, m, 0.0, 0.015) for m in range(3)] + [Event(1, "B", 1, m, 0.0, 0.030) for m in range(3)]
    events += [Event(1, "RECV_ACT", 1, 0, 0.0, 5.0)]  # waits are not work
    assert stage_seconds(events) == pytest.approx({0: 0.031, 1: 0.045})
    torch.manual_seed(0)
    traced = trace(timm_vit(depth=2), (torch.randn(2, 3, 32, 32),))
    plan = partition(traced, 2, device="cpu")
    plan.stages[0].measured_time, plan.stages[1].measured_time = 0.031, 0.030
    assert stage_scale(events, plan) == pytest.approx((1.0, 1.5))
    assert stage_scale(events, plan, scale=(1.0, 1.5)) == pytest.approx((1.0, 2.25))
    with pytest.raises(ConfigError, match=r"stage\(s\) \[1\]"):
        stage_scale([e for e in events if e.stage == 0], plan)
    with pytest.raises(ConfigError, match="2 stages"):
        stage_scale(events, plan, scale=(1.0,))


def test_a_stage_scale_needs_measured_costs():
    with pytest.raises(ConfigError, match="costs='measured'"):
        autopipe.parallelize(timm_vit(depth=2), (torch.randn(2, 3, 32, 32),), pp=1, loss_fn=F.cross_entropy,
                             device="cpu", measure=MeasureOptions(stage_scale=(1.0,)))


def _reference_loss() -> float:
    """The ranks' first loss, in one process: the same model, batch and targets."""
    torch.manual_seed(0)
    model = timm_vit(depth=4)
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(4) % 10
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def _scaled_rank(rank: int, world: int, cache_dir: str) -> dict:
    out = {}
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(4) % 10
    scale = None
    for run in range(2):  # run once, read the factors from a recorded step, cut again with them
        torch.manual_seed(0)
        pm = autopipe.parallelize(timm_vit(depth=4), (x[:2],), pp=world, microbatches=2, loss_fn=F.cross_entropy,
                                  device="cpu", costs="measured", record_timeline=True,
                                  measure=MeasureOptions(segments=4, reps=2, rounds=0, moves=0, cache_dir=cache_dir,
                                                         stage_scale=scale))
        pm.timeline.clear()
        out[f"loss{run}"] = float(pm.train_step(x, y))
        events = gather(pm.timeline)
        found = [None if events is None else stage_scale(events, pm.plan, scale=scale)]
        torch.distributed.broadcast_object_list(found, src=0)
        out[f"plan{run}"] = pm.plan.to_json()
        scale = found[0]
        out[f"scale{run}"] = scale
        pm.close()
    return out


def test_factors_read_from_a_run_cut_the_next_one_alike_on_every_rank(tmp_path):
    results = run_distributed(_scaled_rank, 2, str(tmp_path), timeout=300)
    assert results[0]["plan1"] == results[1]["plan1"]
    assert results[0]["scale0"] == results[1]["scale0"] and all(f > 0 for f in results[0]["scale0"])
    assert '"balance": "cost:stage_scale=' in results[0]["plan1"]
    assert results[0]["loss1"] == pytest.approx(_reference_loss(), rel=1e-5)


def _in_pipeline_rank(rank: int, world: int, cache_dir: str) -> dict:
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(4) % 10
    torch.manual_seed(0)
    model = timm_vit(depth=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = autopipe.parallelize(model, (x[:2],), pp=world, microbatches=2, loss_fn=F.cross_entropy, device="cpu",
                              costs="measured", measure=MeasureOptions(segments=4, reps=2, rounds=0, moves=0,
                                                                       cache_dir=cache_dir, pipeline_steps=1))
    untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    no_grads = all(p.grad is None for p in model.parameters())
    loss = float(pm.train_step(x, y))
    plan = pm.plan.to_json()
    pm.close()
    return {"plan": plan, "loss": loss, "untouched": untouched, "no_grads": no_grads}


def test_parallelize_finds_the_stage_scale_in_a_stand_in_pipeline(tmp_path):
    results = run_distributed(_in_pipeline_rank, 2, str(tmp_path), timeout=300)
    assert results[0]["plan"] == results[1]["plan"] and '"balance": "cost:stage_scale=' in results[0]["plan"]
    assert all(r["untouched"] and r["no_grads"] for r in results)
    assert results[0]["loss"] == pytest.approx(_reference_loss(), rel=1e-5)


@pytest.mark.parametrize("steps, costs", [(-1, "measured"), (1, "analytic")])
def test_bad_pipeline_steps_are_typed_errors(steps, costs):
    with pytest.raises(ConfigError, match="pipeline_steps"):
        autopipe.parallelize(timm_vit(depth=2), (torch.randn(2, 3, 32, 32),), pp=1, loss_fn=F.cross_entropy,
                             device="cpu", costs=costs, measure=MeasureOptions(pipeline_steps=steps))
