"""partition(): what it feeds the balancer, and plans priced by the balancer's own formula."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.partition import balance as balancer
from autopipe.partition.device import get_profile
from autopipe.partition.partitioner import partition
from autopipe.stages import plan_stages
from autopipe.partition.plan import PartitionPlan
from autopipe.tracer import trace

# A link slow enough that the wide layers' activations make a stage link-bound.
# The plain roofline: these tests are about links and cuts, not the GPU's fitted efficiencies.
ROOFLINE = dataclasses.replace(get_profile("h100"), calibration=None)
SLOW_LINK = dataclasses.replace(ROOFLINE, name="h100-slow-link", link_bandwidth=2e9)


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def tiny_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    # Wide then narrow: cuts in the wide half move 8x the bytes of cuts in the narrow half.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 256), *[Residual(256) for _ in range(3)], nn.Linear(256, 32),
                              *[Residual(32) for _ in range(3)], nn.Linear(32, 4))
    return model.to(dtype)


def traced_tiny(dtype: torch.dtype = torch.float32):
    return trace(tiny_model(dtype), (torch.empty(64, 16, device="meta", dtype=dtype),))


def link_times(plan: PartitionPlan, link) -> list[tuple[float, float]]:
    """(comm, latency) of each stage, from the bytes the plan says cross its cuts."""
    out = []
    for s, stage in enumerate(plan.stages):
        sides = [plan.stages[s - 1].cut_bytes] if s > 0 else []
        sides += [stage.cut_bytes] if s + 1 < plan.num_stages else []
        comm = sum((b / link.link_bandwidth for b in sides), 0.0)  # full duplex: each direction once
        out.append((comm, 2.0 * link.link_latency * sum(b > 0 for b in sides)))
    return out


@pytest.mark.parametrize("balance", ["cost", "params", "uniform"])
@pytest.mark.parametrize("device", ["h100", SLOW_LINK])
def test_stage_cost_is_the_balancers_formula(balance, device):
    plan = plan_stages(traced_tiny(), 3, balance=balance, device=device)
    link = get_profile(device)
    for stage, (comm, latency) in zip(plan.stages, link_times(plan, link)):
        assert stage.comm_time == pytest.approx(comm, rel=1e-12)
        assert stage.cost == max(stage.compute_time, stage.comm_time) + latency
    assert plan.imbalance == balancer.imbalance([s.cost for s in plan.stages])


def test_cost_balance_is_the_exact_optimum_of_what_partition_feeds_it(monkeypatch):
    seen = {}
    solve = balancer.solve_overlapped

    def spy(compute, n_stages, **kw):
        seen.update(compute=compute, n_stages=n_stages, **kw)
        return solve(compute, n_stages, **kw)

    monkeypatch.setattr(balancer, "solve_overlapped", spy)
    # One balancing pass (no MLP pieces, which balance a second graph after this one).
    plan = partition(traced_tiny(), 3, device=SLOW_LINK)
    compute, times = seen["compute"], (seen["cut_time"], seen["cut_latency"])
    starts = [0]
    for stage in plan.stages[:-1]:
        starts.append(starts[-1] + len(stage.nodes))
    overhead = seen.get("stage_overhead", 0.0)
    got = [t.cost for t in balancer.overlapped_stage_times(compute, starts, *times, overhead)]
    assert [s.cost for s in plan.stages] == got
    # Every split the allowed cuts permit is at least as slow (same formula, to the bit).
    n, allowed = len(compute), seen["allowed_cuts"]
    link_bound = False
    for chosen in itertools.combinations(range(1, n), 2):
        if all(allowed[b - 1] for b in chosen):
            other = balancer.overlapped_stage_times(compute, [0, *chosen], *times, overhead)
            assert max(got) <= max(t.cost for t in other)
            link_bound |= any(t.comm > t.compute for t in other)
    assert link_bound, "the slow link should make some split link-bound, or this test checks nothing"


def test_the_link_steers_cuts_away_from_wide_activations():
    traced = traced_tiny()
    free = dataclasses.replace(ROOFLINE, name="free", link_bandwidth=float("inf"), link_latency=0.0)
    # Compute alone cuts inside the wide half; on the slow link that stage would be link-bound.
    slow, fast = plan_stages(traced, 4, device=SLOW_LINK), plan_stages(traced, 4, device=free)
    assert max(s.cost for s in slow.stages) < max(
        max(s.compute_time, c) + lat for s, (c, lat) in zip(fast.stages, link_times(fast, SLOW_LINK)))
    assert slow.stages[0].cut_bytes < fast.stages[0].cut_bytes


def test_activation_dtype_prices_and_names_floating_cut_tensors():
    traced = traced_tiny()
    cuts = ["2", "6"]  # fixed split points, so both plans cut at the same places
    fp32 = plan_stages(traced, 3, balance=cuts, device=SLOW_LINK)
    bf16 = plan_stages(traced, 3, balance=cuts, device=SLOW_LINK, activation_dtype=torch.bfloat16)
    for a, b in zip(fp32.stages, bf16.stages):
        assert [t.shape for t in a.outputs] == [t.shape for t in b.outputs]
        for t in b.outputs + b.inputs:
            assert t.dtype == "bfloat16"
            assert t.nbytes == 2 * torch.Size(t.shape).numel()
        assert b.cut_bytes * 2 == a.cut_bytes
        assert b.comm_time == pytest.approx(a.comm_time / 2, rel=1e-12)
        assert b.compute_time == a.compute_time
    assert any(s.cut_bytes for s in bf16.stages)


@pytest.mark.parametrize("bad", [torch.int64, "bf16", torch.bool])
def test_activation_dtype_must_be_a_floating_dtype(bad):
    with pytest.raises(ConfigError, match="activation_dtype must be a floating torch.dtype"):
        plan_stages(traced_tiny(), 2, activation_dtype=bad)


@pytest.mark.parametrize("dtype, per_param", [(torch.float32, 16), (torch.bfloat16, 12)])
def test_training_state_follows_the_parameters_dtype(dtype, per_param):
    # adamw: parameter + gradient in the parameters' dtype, two fp32 moments.
    plan = plan_stages(traced_tiny(dtype), 2, microbatches=1)
    state = sum(s.memory_bytes - s.activation_bytes for s in plan.stages)  # one micro-batch in flight
    assert state == per_param * plan.total_params


def test_tp_collectives_are_priced_in_the_stage_cost():
    """A sharded graph's all-reduces cost time over the link: the same graph planned for tp=2
    costs more than the sum of its (already sharded) compute, by exactly the collectives."""
    from autopipe.partition.cost import graph_costs
    from autopipe.partition.device import get_profile
    from autopipe.partition.transfers import tp_collective_seconds
    from autopipe.shard import apply_sharding, plan_sharding
    from autopipe.tracer import trace
    from tests.models import MODELS

    traced = trace(MODELS["timm_vit"](), (torch.randn(2, 3, 32, 32),))
    sharded = apply_sharding(traced, plan_sharding(traced, 2), 0)
    with_comm = plan_stages(sharded, 1, tp=2, device="h100")
    without = plan_stages(sharded, 1, tp=1, device="h100")
    profile, costs = get_profile("h100"), graph_costs(sharded.gm)
    comm = [tp_collective_seconds(n, costs[n.name], 2, profile) for n in sharded.gm.graph.nodes]
    assert sum(c > 0 for c in comm) >= 8  # f and g around each attention and MLP of 2 blocks
    assert with_comm.stages[0].cost == pytest.approx(without.stages[0].cost + sum(comm), rel=1e-9)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tp_plan_prices_one_ranks_share_of_the_work(sequence_parallel):
    """plan_model (the CLI's path) plans the graph of one tp rank, as parallelize does: the
    matmuls of sharded layers (row-parallel ones included) at half their FLOPs for tp=2."""
    from autopipe.planning import plan_model
    from tests.models import MODELS

    x = torch.randn(4, 3, 32, 32)
    whole = plan_model(MODELS["timm_vit"](), pp=2, example_inputs=(x,))
    half = plan_model(MODELS["timm_vit"](), pp=2, tp=2, example_inputs=(x,), sequence_parallel=sequence_parallel)
    assert half.tp == 2 and half.total_params < 0.6 * whole.total_params
    flops = sum(s.flops for s in half.stages) / sum(s.flops for s in whole.stages)
    # ~0.5 of the FLOPs: norms, residuals and the replicated head keep a little more on each rank
    # (sequence parallelism splits the first two by sample as well).
    assert 0.45 < flops < 0.6, flops


def test_the_plan_records_the_floor_that_one_large_node_sets():
    """A node of 6 in 12 of work: at 4 stages (mean 3) no cut between nodes gets under 6 / 3."""
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(7)])
    traced = trace(model, (torch.randn(4, 16),))
    names = [n.name for n in traced.gm.graph.nodes if n.op == "call_module"]
    seconds = {n: 1.0 for n in names}
    seconds[names[3]] = 6.0
    cpu = dataclasses.replace(get_profile("cpu"), link_latency=0.0, link_bandwidth=1e18)
    plan = partition(traced, 4, device=cpu, node_seconds=seconds)
    assert plan.floor == pytest.approx(6.0 / (sum(seconds.values()) / 4), rel=1e-3)
    assert plan.imbalance == pytest.approx(plan.floor, rel=1e-3)  # the balancer reaches it
    assert "at the floor of cuts between nodes, 2.000" in str(plan)
    even = partition(traced, 7, device=cpu, node_seconds={n: 1.0 for n in names})  # a layer a stage
    assert even.floor == pytest.approx(1.0) and "floor" not in str(even).split("\n")[0]
    assert type(plan).from_dict(plan.to_dict()).floor == plan.floor
