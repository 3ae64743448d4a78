"""Cuts priced by each stage's own replay through the launch queue, for eager stages.

[Note: cuts on stage replays]
Where eager stages replay their launches through the launch queue (a table fitted that way,
``Calibration.launch_queue``), a stage costs its own replay from an idle host and device, not the
sum of its nodes' prices from one replay of the whole graph ([Note: a stage starts idle] in
launch_queue.py). The balancers add node prices. So the partitioner cuts on them first, replays
each stage of that cut, and cuts again with each stage's replay over its sum as the stage's
factor (``balance.solve_scaled``, the solver of stage scales): up to ``RECUTS`` times, while the
largest replayed stage shrinks. A cut given (start positions, split points, a parameter count)
is kept, and only priced by the replays. The plan's stage times are the replays.
"""
from __future__ import annotations

from typing import Sequence

from . import balance as balancer
from .launch_queue import Launch, stage_replays

__all__ = ["RECUTS", "replayed_cut"]

RECUTS = 3  # cuts made again on stage replays, at most


def _stage_seconds(launches: Sequence[Sequence[Launch]], compute: Sequence[float], analytic: Sequence[float],
                   starts: Sequence[int], overhead: float) -> tuple[list[float], list[float]]:
    """Each stage's compute as it runs (its replay, what ``compute`` adds to the ``analytic`` node
    prices, such as tensor-parallel collectives, and ``overhead``), and as its nodes sum."""
    ends = list(starts[1:]) + [len(compute)]
    summed = [sum(compute[i:j]) + overhead for i, j in zip(starts, ends)]
    extra = [s - sum(analytic[i:j]) - overhead for s, i, j in zip(summed, starts, ends)]
    return [r + e + overhead for r, e in zip(stage_replays(launches, starts), extra)], summed


def replayed_cut(launches: Sequence[Sequence[Launch]], compute: Sequence[float], analytic: Sequence[float],
                 starts: list[int], *, recut: bool, cut_cost: Sequence[float], allowed: Sequence[bool],
                 overhead: float) -> tuple[list[int], list[float]]:
    """The cut (``starts``, or with ``recut`` one made again on stage replays) and each of its
    stages' replayed compute over its summed compute ([Note: cuts on stage replays]).
    ``launches``: the graph's forward and backward launches (``DeviceProfile.launches``);
    ``compute`` the node prices the balancers cut on, ``analytic`` their part the launches hold."""
    replayed, summed = _stage_seconds(launches, compute, analytic, starts, overhead)
    for _ in range(RECUTS if recut and len(starts) > 1 else 0):
        factors = tuple(r / s if s > 0 else 1.0 for r, s in zip(replayed, summed))
        again = balancer.solve_scaled(compute, factors, cut_cost=cut_cost, allowed_cuts=allowed,
                                      stage_overhead=overhead)
        replayed_again, summed_again = _stage_seconds(launches, compute, analytic, again, overhead)
        if max(replayed_again) >= max(replayed):
            break
        starts, replayed, summed = again, replayed_again, summed_again
    return starts, [r / s if s > 0 else 1.0 for r, s in zip(replayed, summed)]
