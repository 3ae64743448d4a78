"""Cuts priced by each stage's own replay through the launch queue, for eager stages.

[Note: cuts on stage replays]
Where eager stages replay their launches through the launch queue (a table fitted that way,
``Calibration.launch_queue``), a stage costs its own replay from an idle host and device, not the
sum of its nodes' prices from one replay of the whole graph ([Note: a stage starts idle] in
launch_queue.py). The balancers add node prices; a replay does not add up over nodes. But it has
a closed form ([Note: a replay's closed form] in launch_queue.py), so every stage's replay costs
O(1) after O(L log L) over the L launches, and the min-max dynamic program of
``balance.solve_overlapped`` (its ``Band`` of stages, by start and end) runs on the replays as
they are: the cut is the exact least largest replayed stage. The balancers' cut on node prices
bounds it: a stage replayed from idle costs at least its nodes' whole-graph prices, so a stage
whose nodes sum past that cut's largest replay is in no better cut, and the band leaves it out.
A cut given (start positions, split points, a parameter count) is kept, and only priced by the
replays. The plan's stage times are the replays.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .balance import overlap_problem
from .balance_problem import Band, Problem, stage_time
from .launch_queue import Launch, pass_replays, stage_replays

__all__ = ["replayed_cut"]


def _stage_seconds(launches: Sequence[Sequence[Launch]], extra: np.ndarray, heads: np.ndarray, ends: np.ndarray,
                   overhead: float) -> np.ndarray:
    """The compute of stages [heads, ends) as they run: forward and backward replayed, what
    ``extra`` adds beyond the launches (prefix sums over boundaries), and ``overhead``."""
    replay = sum(pass_replays(p, heads, ends) for p in launches)
    return replay + extra[ends] - extra[heads] + overhead


def replayed_cut(launches: Sequence[Sequence[Launch]], compute: Sequence[float], analytic: Sequence[float],
                 starts: list[int], *, recut: bool, cut_time: Sequence[float], cut_latency: Sequence[float],
                 allowed: Sequence[bool], overhead: float, mem: Sequence[float] | None = None,
                 mem_cap: float | None = None, slow: Sequence[Sequence[Launch]] | None = None,
                 hedge: float = 0.0) -> tuple[list[int], list[float]]:
    """The cut (``starts``, or with ``recut`` the one whose largest replayed stage is least) and
    each of its stages' replayed compute over its summed compute ([Note: cuts on stage replays]).
    ``launches``: the graph's passes of launches, a forward and a backward (``DeviceProfile.launches``);
    ``compute`` the node prices the balancers cut on (``starts`` among them), ``analytic`` their
    part the launches hold; a stage takes ``max(compute, comm) + latency`` with the transfers
    ``cut_time`` and ``cut_latency``, as ``balance.solve_overlapped`` counts it. With ``slow``
    (the same passes at the host's slow pace) and ``hedge`` > 0, the recut gives up to ``hedge``
    of max/mean at the first pace for the least worst of both ([Note: a cut hedged over paces])."""
    n = len(compute)
    extra = np.concatenate(([0.0], np.cumsum(np.subtract(compute, analytic))))
    if recut and len(starts) > 1:
        problem, cut_t, cut_l = overlap_problem(compute, len(starts), cut_time, cut_latency, mem, mem_cap, allowed)
        fences = np.array([*starts, n])
        given = _stage_seconds(launches, extra, fences[:-1], fences[1:], overhead)
        bound = float(np.max(np.maximum(given, cut_t[fences[:-1]] + cut_t[fences[1:]])
                             + cut_l[fences[:-1]] + cut_l[fences[1:]])) * (1 + 1e-9)  # rounding
        band = _replayed_band(launches, extra, problem, cut_t, cut_l, bound, overhead)
        least = band.least_max(len(starts))
        starts = band.pick(len(starts), least)
        if slow is not None and hedge > 0:
            starts = _hedged(launches, slow, extra, problem, cut_t, cut_l, starts, least, overhead, hedge)
    ends = list(starts[1:]) + [n]
    replayed = [r + extra[j] - extra[i] + overhead for r, i, j in zip(stage_replays(launches, starts), starts, ends)]
    summed = [float(sum(compute[i:j])) + overhead for i, j in zip(starts, ends)]
    return list(starts), [r / s if s > 0 else 1.0 for r, s in zip(replayed, summed)]


def _replayed_band(launches: Sequence[Sequence[Launch]], extra: np.ndarray, problem: Problem, cut_t: np.ndarray,
                   cut_l: np.ndarray, bound: float, overhead: float) -> Band:
    """Every stage whose summed compute fits ``bound``, timed by its replay of ``launches``."""
    band = Band.build(problem, cut_t, cut_l, bound, overhead)
    seconds = _stage_seconds(launches, extra, np.broadcast_to(band.heads[:, None], band.ends.shape), band.ends,
                             overhead)
    _, comm, latency, _ = stage_time(problem.prefix, cut_t, cut_l, band.heads[:, None], band.ends, overhead)
    return Band(band.n, band.heads, band.ends,
                np.where(np.isfinite(band.time), np.maximum(seconds, comm) + latency, np.inf), band.weight)


# [Note: a cut hedged over paces]
# A cut balanced at the pace a probe read is off at the host's slow pace where a model has
# stages bound by their kernels and stages bound by their launches ([Note: a cut at another
# pace] in device.py). The replays price every stage at both paces in closed form, so the least
# worst cut of the two is a min-max over the same band: each stage's time at each pace over
# that pace's mean stage (of the cut at the first pace), the larger of the two. Its price at the
# first pace is bounded: the stages may reach the first cut's largest plus ``hedge`` times the
# mean stage, and no further. By the h200 table (benchmarks/eager_pace_sensitivity.py, probes
# of 230 and 320 us), ResNet-50 at 128 images in 4 and 8 stages: the cut at 230 us reads 1.012
# and 1.027 there but 1.210 and 1.217 at 320; the least worst of both, 1.046 / 1.051 and
# 1.052 / 1.057. Off by default (``partition(pace_hedge=...)``): what it costs at the fast
# pace on the GPU is not timed yet.
def _hedged(launches: Sequence[Sequence[Launch]], slow: Sequence[Sequence[Launch]], extra: np.ndarray,
            problem: Problem, cut_t: np.ndarray, cut_l: np.ndarray, starts: list[int], least: float, overhead: float,
            hedge: float) -> list[int]:
    """The cut whose larger max/mean at the two paces of ``launches`` and ``slow`` is least,
    among cuts whose stages at the first pace stay within ``least`` plus ``hedge`` mean stages."""
    stages = len(starts)
    heads = np.asarray(starts)
    ends = np.append(heads[1:], problem.n)
    means = [float(np.mean(_stage_seconds(p, extra, heads, ends, overhead))) for p in (launches, slow)]
    limit = (least + hedge * means[0]) * (1 + 1e-9)  # rounding
    # The same band of stages (it is bounded by their summed compute), timed at each pace.
    fast, slowed = (_replayed_band(p, extra, problem, cut_t, cut_l, limit, overhead) for p in (launches, slow))
    worse = np.maximum(fast.time / means[0], slowed.time / means[1])
    both = Band(fast.n, fast.heads, fast.ends, np.where(fast.time <= limit, worse, np.inf), fast.weight)
    return both.pick(stages, both.least_max(stages))
