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
from .balance_problem import Band, stage_time
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
                 mem_cap: float | None = None) -> tuple[list[int], list[float]]:
    """The cut (``starts``, or with ``recut`` the one whose largest replayed stage is least) and
    each of its stages' replayed compute over its summed compute ([Note: cuts on stage replays]).
    ``launches``: the graph's passes of launches, a forward and a backward (``DeviceProfile.launches``);
    ``compute`` the node prices the balancers cut on (``starts`` among them), ``analytic`` their
    part the launches hold; a stage takes ``max(compute, comm) + latency`` with the transfers
    ``cut_time`` and ``cut_latency``, as ``balance.solve_overlapped`` counts it."""
    n = len(compute)
    extra = np.concatenate(([0.0], np.cumsum(np.subtract(compute, analytic))))
    if recut and len(starts) > 1:
        problem, cut_t, cut_l = overlap_problem(compute, len(starts), cut_time, cut_latency, mem, mem_cap, allowed)
        fences = np.array([*starts, n])
        given = _stage_seconds(launches, extra, fences[:-1], fences[1:], overhead)
        bound = float(np.max(np.maximum(given, cut_t[fences[:-1]] + cut_t[fences[1:]])
                             + cut_l[fences[:-1]] + cut_l[fences[1:]])) * (1 + 1e-9)  # rounding
        band = Band.build(problem, cut_t, cut_l, bound, overhead)  # every stage summing within the bound
        seconds = _stage_seconds(launches, extra, np.broadcast_to(band.heads[:, None], band.ends.shape), band.ends,
                                 overhead)
        _, comm, latency, _ = stage_time(problem.prefix, cut_t, cut_l, band.heads[:, None], band.ends, overhead)
        band = Band(n, band.heads, band.ends, np.where(np.isfinite(band.time), np.maximum(seconds, comm) + latency,
                                                       np.inf), band.weight)
        starts = band.pick(len(starts), band.least_max(len(starts)))
    ends = list(starts[1:]) + [n]
    replayed = [r + extra[j] - extra[i] + overhead for r, i, j in zip(stage_replays(launches, starts), starts, ends)]
    summed = [float(sum(compute[i:j])) + overhead for i, j in zip(starts, ends)]
    return list(starts), [r / s if s > 0 else 1.0 for r, s in zip(replayed, summed)]
