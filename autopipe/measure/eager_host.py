"""What an eager stage's nodes cost when the host launches their kernels ahead of the device.

[Note: eager launch queue]
An eager stage is two clocks: the host walks the nodes (Python, dispatch, one launch per
kernel) and the device runs the kernels in the order they were launched, each as soon as it
is launched and the kernel before it has finished. Where the kernels are long (large maps)
the host runs ahead and its work hides under them; where they are short (small maps, the
last stages of a CNN, small micro-batches) the device waits for the host. So a node's price
is neither its kernels' time nor its host time, nor the larger of the two node by node: the
host work of a batch norm launched while a convolution runs costs nothing.

The host side is read from the kernels a node launches, ``per_kernel`` seconds each, plus
``per_node`` for any node that does work: the profiler's own host times are no use here (it
inflates every op it records by a factor that differs from op to op). On an H100 host, fitted
on each model's 16 profile segments (benchmarks/results/calibration/2026-11-2[67]-h100-nhwc-*
rows, 11 models at 32 and 128 images, 352 segments), segments priced this way were within 10%
of their eager timings in 80% of segments (median error 2.5%), against 63% (6.3%) for the
larger of kernel and scaled profiler host time, node by node. ResNet-50 at 32 images: 3.2%
median, against 14.5%; the old pricing put its first segments (stem, layer 1) at 1.5-2.5x
their timings and its last ones short.

The queue is replayed through a stage's nodes, forward in order then backward in reverse,
from an idle device; a node's price is how far it moves the later of the two clocks. The
prices of a segment add up to its replay exactly, so they are what the balancer cuts by; a
stage cut elsewhere starts from an idle device, which its nodes' prices miss only by the
backlog at its edges. The two host figures are fitted per profile on its own segment timings
(``fit_launch_costs``), so the host the profile ran on sets them. The analytic model replays
its own kernel prices the same way where its table was fitted so (partition/launch_queue.py,
``Calibration.launch_queue``): the same two figures, a host time per op and per kernel
launched (kernels counted by their kind), and one per view, fitted on timed stages by
benchmarks/fit_eager_host.py at a host pace the plan scales to its own ([Note: host pace]).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from autopipe.partition.launch_queue import queue_steps

__all__ = ["LaunchCosts", "NodeWork", "queue_prices", "fit_launch_costs", "PER_KERNEL_GRID", "PER_NODE_GRID"]

PER_KERNEL_GRID = tuple(x * 1e-6 for x in range(0, 101, 5))  # seconds of host time a kernel launch takes
PER_NODE_GRID = tuple(x * 1e-6 for x in range(0, 161, 10))  # seconds of host time a node that does work takes
GRID_SCALES = (1, 4, 16)  # the grids widened, in turn, while the best fit lies on their upper edge

# A node's times: (device forward, device backward, kernels forward, kernels backward, works
# forward, works backward); "works": it launched a kernel or spent host time at all.
NodeWork = tuple[float, float, int, int, bool, bool]


@dataclass(frozen=True)
class LaunchCosts:
    """The host's side of an eager stage ([Note: eager launch queue])."""

    per_kernel: float
    per_node: float

    def host(self, kernels: int, works: bool) -> float:
        return self.per_kernel * kernels + (self.per_node if works else 0.0)


def queue_prices(nodes: Sequence[str], work: Mapping[str, NodeWork], launch: LaunchCosts) -> dict[str, float]:
    """Each node's forward + backward seconds in a stage made of ``nodes`` (in graph order), replayed
    as [Note: eager launch queue] says; they add up to the stage's replayed time."""
    prices = dict.fromkeys(nodes, 0.0)
    for name, step in _replay(_passes(nodes, work), launch):
        prices[name] += step
    return prices


def fit_launch_costs(segments: Sequence[tuple[Sequence[str], float, float]],
                     work: Mapping[str, NodeWork],
                     pairs: Sequence[tuple[Sequence[str], float, float]] = ()) -> tuple[LaunchCosts, float]:
    """The launch costs that best predict the timings (least mean relative error), with the fixed
    cost of a stage (the median of what the timings exceed their replay by) added to every one.
    ``segments`` and ``pairs`` (segments timed two at a time, [Note: segment pairs] in profile.py):
    (nodes in graph order, timed seconds, device seconds no node claims). The pairs, though fewer,
    weigh as much as the segments in both the error and the median: they are what tells the
    fixed cost from a launch cost per node. The grids are widened while the best fit lies on
    their upper edge: a host shared with other jobs can launch several times slower than an idle
    one. Returns the launch costs and that fixed cost."""
    rows = list(segments) + list(pairs)
    weights = [1.0 / len(group) for group in (segments, pairs) for _ in group]
    passes = [_passes(nodes, work) for nodes, _, _ in rows]
    for scale in GRID_SCALES:  # a busy host launches slower than the grid reaches: widen it
        per_kernel_grid = [x * scale for x in PER_KERNEL_GRID]
        per_node_grid = [x * scale for x in PER_NODE_GRID]
        _, per_kernel, per_node, fixed = min(_fit(rows, weights, passes, LaunchCosts(k, n))
                                             for k in per_kernel_grid for n in per_node_grid)
        if per_kernel < per_kernel_grid[-1] and per_node < per_node_grid[-1]:
            break
    return LaunchCosts(per_kernel, per_node), fixed


def _fit(rows: Sequence[tuple[Sequence[str], float, float]], weights: Sequence[float],
         passes: Sequence[list], launch: LaunchCosts) -> tuple[float, float, float, float]:
    """(weighted mean relative error, per kernel, per node, fixed cost) of ``launch`` on ``rows``."""
    replayed = [sum(step for _, step in _replay(p, launch)) + lost for p, (_, _, lost) in zip(passes, rows)]
    fixed = max(_weighted_median([t - r for r, (_, t, _) in zip(replayed, rows)], weights), 0.0)
    err = sum(w * abs(r + fixed - t) / max(t, 1e-12) for w, r, (_, t, _) in zip(weights, replayed, rows))
    return err, launch.per_kernel, launch.per_node, fixed


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    ranked = sorted(zip(values, weights))
    total = sum(weights)
    if len(ranked) % 2 == 0 and len(set(weights)) == 1:  # equal weights: the plain median
        return statistics.median(values)
    acc = 0.0
    for value, weight in ranked:
        acc += weight
        if acc >= total / 2:
            return value
    return ranked[-1][0]


def _passes(nodes: Sequence[str], work: Mapping[str, NodeWork]) -> list[tuple[str, float, int, bool]]:
    """(node, device seconds, kernels, works) in the order a stage runs them: forward, then backward."""
    out = []
    for d, order in ((0, nodes), (1, list(reversed(nodes)))):
        for name in order:
            w = work.get(name)
            if w is not None:
                out.append((name, w[d], w[2 + d], w[4 + d]))
    return out


def _replay(passes: Sequence[tuple[str, float, int, bool]], launch: LaunchCosts) -> list[tuple[str, float]]:
    """How far each step of ``passes`` moves the later of the host's and the device's clock."""
    steps = queue_steps((launch.host(kernels, works), seconds) for _, seconds, kernels, works in passes)
    return [(p[0], step) for p, step in zip(passes, steps)]
