"""An eager plan's cut priced at the host's slow pace too ([Note: a cut at another pace])."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from autopipe.partition.device import PROFILES, SLOW_PACE
from autopipe.partition.partitioner import partition_at
from autopipe.partition.report import SLOW_PACE_NOTED, format_table
from autopipe.stages import plan_stages
from autopipe.tracer import trace

PROBE = 230e-6


def kernels_then_launches() -> nn.Module:
    """Convolutions over large maps (bound by their kernels on an H200), then a run of tiny
    linears (bound by their launches): stages of the two kinds move apart with the host's pace."""
    convs = [m for _ in range(4) for m in (nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())]
    tiny = [m for _ in range(31) for m in (nn.Linear(64, 64), nn.ReLU())]
    return nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), *tiny)


@pytest.fixture(scope="module")
def traced():
    with torch.device("meta"):
        model = kernels_then_launches()
    return trace(model, (torch.empty(64, 64, 112, 112, device="meta"),))


def _plan(traced, mode: str):
    profile = PROFILES["h200"].with_mode(mode).at_host_pace(PROBE)
    return plan_stages(traced, 2, microbatches=4, device=profile, split_mlps=False), profile


def test_an_eager_plan_carries_its_cut_priced_at_the_slow_pace(traced) -> None:
    plan, profile = _plan(traced, "eager")
    slow = plan.cost_source["slow_pace"]
    assert slow["host_probe_us"] == pytest.approx(PROBE * SLOW_PACE * 1e6)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    starts = [order.index(s.nodes[0]) for s in plan.stages]
    again = partition_at(traced, starts, device=profile.at_host_pace(PROBE * SLOW_PACE), microbatches=4)
    assert slow["imbalance"] == pytest.approx(again.imbalance, rel=1e-9)
    # The launch-bound stage grows with the pace, the kernel-bound one does not.
    assert slow["imbalance"] > plan.imbalance + SLOW_PACE_NOTED
    table = format_table(plan)
    assert f"this cut reads {slow['imbalance']:.3f} max/mean" in table
    assert "probe of 230 us" in table
    assert json.loads(plan.to_json())["cost_source"]["slow_pace"]["imbalance"] == pytest.approx(slow["imbalance"])


def test_a_plan_of_cuda_graphs_has_no_slow_pace(traced) -> None:
    plan, _ = _plan(traced, "graphs")
    assert "slow_pace" not in plan.cost_source
    assert "host pace:" not in format_table(plan)


def test_a_cut_that_holds_at_both_paces_is_not_reported(traced) -> None:
    plan, _ = _plan(traced, "eager")
    plan.cost_source = dict(plan.cost_source, slow_pace={"host_probe_us": 310.0, "imbalance": plan.imbalance + 0.01})
    assert "host pace:" not in format_table(plan)


def _hedged(traced, hedge: float, mode: str = "eager", pp: int = 2):
    profile = PROFILES["h200"].with_mode(mode).at_host_pace(PROBE)
    return plan_stages(traced, pp, microbatches=4, device=profile, split_mlps=False, pace_hedge=hedge)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_hedged_cut_gives_up_at_most_its_hedge_for_the_slow_pace(traced, pp) -> None:
    """[Note: a cut hedged over paces]: the cut's max/mean at the probed pace stays within the
    hedge of the unhedged cut's, and its slow-pace max/mean is lower."""
    base, hedged = _hedged(traced, 0.0, pp=pp), _hedged(traced, 0.1, pp=pp)
    assert "pace_hedge" not in base.cost_source and hedged.cost_source["pace_hedge"] == 0.1
    assert hedged.imbalance <= base.imbalance + 0.1 + 1e-9
    assert hedged.cost_source["slow_pace"]["imbalance"] < base.cost_source["slow_pace"]["imbalance"] - 0.01
    # Its figure is the worse of the two paces' least: no cut between these bounds does better.
    worst = max(hedged.imbalance, hedged.cost_source["slow_pace"]["imbalance"])
    assert worst < max(base.imbalance, base.cost_source["slow_pace"]["imbalance"])
    # A hedge of none cuts as the default does.
    assert [s.nodes[0] for s in _hedged(traced, 0).stages] == [s.nodes[0] for s in _plan(traced, "eager")[0].stages]


def test_a_small_hedge_stays_within_it(traced) -> None:
    base, hedged = _hedged(traced, 0.0, pp=4), _hedged(traced, 0.01, pp=4)
    assert hedged.imbalance <= base.imbalance + 0.01 + 1e-9
    assert hedged.cost_source["slow_pace"]["imbalance"] <= base.cost_source["slow_pace"]["imbalance"] + 1e-9


def test_cuda_graph_stages_are_not_hedged(traced) -> None:
    base, hedged = _hedged(traced, 0.0, mode="graphs"), _hedged(traced, 0.1, mode="graphs")
    assert [s.nodes[0] for s in hedged.stages] == [s.nodes[0] for s in base.stages]
    assert "pace_hedge" not in hedged.cost_source


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), True, "0.03"])
def test_a_pace_hedge_out_of_range_is_refused(traced, bad) -> None:
    from autopipe.errors import ConfigError

    with pytest.raises(ConfigError, match="pace_hedge"):
        _hedged(traced, bad)
