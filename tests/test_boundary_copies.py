"""A measured profile's boundary copies (measure/boundary_copies.py): the rate fitted on the
segments' excess, the partitioner charging it beside every cut, and the closed loop counting it
as known. See [Note: a profile's boundary copies]."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from autopipe.measure import _groups, _planned, _planned_at
from autopipe.measure.boundary_copies import boundary_bytes, fit_boundary_rate
from autopipe.measure.closed_loop import UNPROFILED
from autopipe.measure.kernels import NodeTimes
from autopipe.measure.profile import _from_kernels
from autopipe.partition.cost import graph_costs
from autopipe.partition.cuts import cut_dag
from autopipe.partition.measured import MeasuredCosts, Segment, fingerprint
from autopipe.partition.partitioner import analytic_seconds, partition_at
from autopipe.stages import plan_stages
from autopipe.tracer import trace

RATE = 0.9e-12  # seconds per byte, about an H200's under CUDA graphs


class _Widening(nn.Module):
    """Eight equal layers whose middle activation is 64x wider than the rest."""

    def __init__(self) -> None:
        super().__init__()
        widths = [64, 64, 64, 64, 4096, 64, 64, 64, 64]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _profiled(traced, rate: float, seconds: float = 1e-4) -> MeasuredCosts:
    """A profile pricing every node that does work alike, with boundary copies at ``rate``."""
    base = {n: (seconds if t > 0 else 0.0) for n, t in analytic_seconds(traced, "h100").items() if n != "output"}
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    half = len(order) // 2
    segs = [Segment(0, half, sum(base[n] for n in order[:half]), 0.0),
            Segment(half, len(order), sum(base[n] for n in order[half:]), 0.0)]
    return MeasuredCosts(fingerprint(traced.gm), [list(s) for s in traced.input_shapes], "bfloat16", "graphs",
                         "cpu", torch.__version__, segs, base, boundary_rate=rate)


@pytest.fixture(scope="module")
def widening():
    torch.manual_seed(0)
    return trace(_Widening(), (torch.randn(512, 64),))


def test_the_rate_is_the_slope_of_the_excess_over_boundary_bytes():
    gen = torch.Generator().manual_seed(0)
    nbytes = [int(b) for b in torch.randint(1_000_000, 200_000_000, (16,), generator=gen)]
    beyond = [40e-6 + RATE * b + 2e-6 * float(torch.randn((), generator=gen)) for b in nbytes]
    beyond[3] += 300e-6  # one segment's gradient accumulation stands out
    assert fit_boundary_rate(beyond, nbytes) == pytest.approx(RATE, rel=0.05)


def test_no_rate_where_the_bytes_do_not_differ_and_never_a_negative_one():
    assert fit_boundary_rate([1e-5, 3e-5, 2e-5], [10**6] * 3) == 0.0
    assert fit_boundary_rate([5e-5, 3e-5, 1e-5], [10**6, 2 * 10**6, 3 * 10**6]) == 0.0
    assert fit_boundary_rate([], []) == 0.0


def test_boundary_bytes_are_the_cuts_beside_each_stage(widening):
    plan = partition_at(widening, [0, 5, 9, 13], device="h100")
    cut = cut_dag(widening, graph_costs(widening.gm), None).cut_bytes
    assert boundary_bytes(plan) == [cut[4], cut[4] + cut[8], cut[8] + cut[12], cut[12]]
    assert max(boundary_bytes(plan)) > 60 * min(boundary_bytes(plan))  # the wide activation is a cut


def test_the_partitioner_charges_the_rate_on_both_stages_beside_every_cut(widening):
    starts = [0, 5, 9, 13]
    free = partition_at(widening, starts, device="h100", measured=_profiled(widening, 0.0))
    charged = partition_at(widening, starts, device="h100", measured=_profiled(widening, RATE))
    extra = [b.compute_time - a.compute_time for a, b in zip(free.stages, charged.stages)]
    assert extra == pytest.approx([RATE * b for b in boundary_bytes(free)], rel=1e-6)


def test_a_cut_moves_off_the_wide_activation_when_its_copies_cost(widening):
    cut = cut_dag(widening, graph_costs(widening.gm), None).cut_bytes
    wide = {k for k in range(len(cut) - 1) if cut[k] > 10 * min(cut[:-1])}  # after layers_3 and its relu
    order = [n.name for n in widening.gm.graph.nodes if n.op != "output"]
    free = plan_stages(widening, 2, device="h100", measured=_profiled(widening, 0.0), split_mlps=False)
    assert order.index(free.stages[1].nodes[0]) - 1 in wide  # the even split is at the wide activation
    # 2 MB across it at 5e-11 s/B: 100 us a side, as much as a node
    charged = plan_stages(widening, 2, device="h100", measured=_profiled(widening, 5e-11), split_mlps=False)
    assert order.index(charged.stages[1].nodes[0]) - 1 not in wide
    repriced = partition_at(widening, [0, order.index(free.stages[1].nodes[0])], device="h100",
                            measured=_profiled(widening, 5e-11))
    assert max(s.cost for s in charged.stages) < max(s.cost for s in repriced.stages)


def test_the_closed_loop_counts_the_copies_as_known(widening):
    measured = _profiled(widening, RATE)
    group_of = _groups(widening, measured)
    plan = partition_at(widening, [0, 5, 9, 13], device="h100", measured=measured)
    with_copies = _planned(widening, plan, measured, group_of)
    without = _planned(widening, plan, dataclasses.replace(measured, boundary_rate=0.0), group_of)
    known = [a.get(UNPROFILED, 0.0) - b.get(UNPROFILED, 0.0) for a, b in zip(with_copies, without)]
    assert known == pytest.approx([RATE * b for b in boundary_bytes(plan)], rel=1e-9)
    # a plan rebuilt from its stage starts (the boundary moves' log) is priced alike
    rebuilt = _planned_at(widening, measured, group_of)([s.nodes[0] for s in plan.stages], {})
    assert [{k: pytest.approx(v) for k, v in by.items()} for by in with_copies] == rebuilt


def test_a_profile_under_cuda_graphs_keeps_the_copies_out_of_its_nodes():
    """Segments whose timings exceed their nodes' kernels by a fixed time plus the rate times
    their boundary bytes: the fit recovers both, and the nodes keep their own kernels plus
    what no node claimed, as before."""
    fixed, sizes = 30e-6, [0, 4_000_000, 50_000_000, 9_000_000, 120_000_000, 0]
    stages, timings = [], []
    for i in range(5):
        nodes = [f"n{i}a", f"n{i}b"]
        own = {nodes[0]: (10e-6, 20e-6), nodes[1]: (30e-6, 40e-6)}
        copies = RATE * (sizes[i] + sizes[i + 1])
        stages.append(SimpleNamespace(nodes=nodes, cut_bytes=sizes[i + 1]))
        times = NodeTimes(device=own, host={}, kernels={}, unattributed=(0.0, 5e-6))
        timings.append(SimpleNamespace(seconds=100e-6 + 5e-6 + fixed + copies, nodes=times))
    seconds, overhead, rate = _from_kernels(SimpleNamespace(stages=stages), timings, {})
    assert rate == pytest.approx(RATE, rel=1e-6)
    assert overhead == pytest.approx(fixed, rel=1e-6)
    assert seconds["n0a"] == pytest.approx(30e-6 + 5e-6 * 30 / 100)


def test_the_rate_is_saved_and_an_older_profile_reads_none(widening):
    measured = _profiled(widening, RATE)
    assert MeasuredCosts.from_dict(json.loads(measured.to_json())).boundary_rate == RATE
    older = json.loads(measured.to_json())
    del older["boundary_rate"]
    assert MeasuredCosts.from_dict(older).boundary_rate == 0.0


def test_the_loop_fits_the_nodes_alone_when_the_copies_are_known(widening):
    """A device whose stages cost their nodes' profiled seconds plus their boundaries' copies:
    with the copies counted as known, every timing of the loop fits the profile as it is
    (factors 1, no fixed time); a profile without the rate leaves the copies to the nodes."""
    from autopipe.measure.closed_loop import calibrate, refine

    rate = 5e-11
    cut = cut_dag(widening, graph_costs(widening.gm), None).cut_bytes
    order = [n.name for n in widening.gm.graph.nodes if n.op != "output"]

    def fitted(measured):
        group_of = _groups(widening, measured)
        seconds = measured.node_seconds

        def device(plan):
            bounds = [order.index(s.nodes[0]) for s in plan.stages] + [len(order)]
            copied = [(cut[a - 1] if a else 0) + (cut[b - 1] if b < len(order) else 0)
                      for a, b in zip(bounds, bounds[1:])]
            return [sum(seconds[n] for n in order[a:b]) + rate * c for a, b, c in zip(bounds, bounds[1:], copied)]

        def replan(factors):
            scaled = {n: s * factors[group_of[n]] for n, s in seconds.items()}
            return plan_stages(widening, 4, device="h100", split_mlps=False,
                               measured=dataclasses.replace(measured, node_seconds=scaled))

        first = plan_stages(widening, 4, device="h100", measured=measured, split_mlps=False)
        plan = refine(first, groups=len(measured.segments), target=1.0, rounds=2, measure=device, replan=replan,
                      planned=lambda p: _planned(widening, p, measured, group_of))
        at = _planned_at(widening, measured, group_of)
        return calibrate(plan.refinement, len(measured.segments), at)

    factors, fixed = fitted(_profiled(widening, rate))
    assert factors == pytest.approx([1.0, 1.0], abs=1e-6) and fixed == pytest.approx(0.0, abs=1e-9)
    factors, fixed = fitted(_profiled(widening, 0.0))
    assert fixed > 1e-5 and max(abs(f - 1.0) for f in factors) > 0.01  # the copies leak into both
