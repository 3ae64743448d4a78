"""Where to cut a linear order of nodes into contiguous pipeline stages.

Pure functions over plain sequences of numbers (no torch, no graph): the caller lays its
graph out in one order (``dag.linearize``) and passes per-node numbers. Every solver returns
stage start positions: ``starts[0] == 0``, strictly increasing, one per stage.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from autopipe.errors import PartitionError

from .balance_problem import (Band, Problem, boundary_vector, bullets, check_stage_count, length_message,
                              stage_time, vector)

__all__ = [
    "solve",
    "solve_overlapped",
    "solve_scaled",
    "overlap_problem",
    "overlapped_stage_times",
    "StageTime",
    "solve_uniform",
    "solve_params",
    "solve_split_points",
    "stage_costs",
    "imbalance",
    "least_imbalance",
    "check_starts",
]

# n: number of nodes;  S: number of stages.
# Position p: index of a node in the order. Boundary b in 0..n: the gap before position b,
# so 0 and n are the two ends and a stage is a half-open range of positions [i, j).
# A "cut after position k" is boundary k + 1; cut_cost[k] and allowed_cuts[k] belong to it
# (and cut_time[k], cut_latency[k]).


def solve(
    cost: Sequence[float],
    n_stages: int,
    *,
    cut_cost: Sequence[float] | None = None,
    mem: Sequence[float] | None = None,
    mem_cap: float | None = None,
    allowed_cuts: Sequence[bool] | None = None,
) -> list[int]:
    """Start positions of the ``n_stages`` contiguous stages whose largest cost is least.

    The cost of stage [i, j) is ``sum(cost[i:j])`` plus ``cut_cost[i-1]`` for receiving
    (i > 0) plus ``cut_cost[j-1]`` for sending (j < n). With ``mem_cap``, a stage whose
    summed ``mem`` exceeds the cap is not allowed; ``allowed_cuts[k]`` False forbids a cut
    after position k. Among splits of equal largest cost the one with the smaller sum of
    ``cut_cost`` wins, then the one whose start list is lexicographically smallest.

    Exact: the least largest cost is found by bisection over candidate stage costs, each
    test a reachability sweep of O(S n) (O(S n log n) under ``mem_cap``); ties are then
    settled by a dynamic program over the stages that fit.
    """
    problem = Problem.build(cost, n_stages, cut_cost, mem, mem_cap, allowed_cuts)
    if not problem.feasible(n_stages, float("inf")):
        # Only the memory cap can rule out every split once the stage count fits.
        raise problem.cap_error(n_stages)
    return problem.pick(n_stages, problem.least_max(n_stages))


def solve_overlapped(
    compute: Sequence[float],
    n_stages: int,
    *,
    cut_time: Sequence[float] | None = None,
    cut_latency: Sequence[float] | None = None,
    mem: Sequence[float] | None = None,
    mem_cap: float | None = None,
    allowed_cuts: Sequence[bool] | None = None,
    stage_overhead: float = 0.0,
) -> list[int]:
    """Start positions of the stages whose largest time is least, transfers overlapping compute.

    Stage [i, j) takes ``max(compute, comm) + latency`` as ``overlapped_stage_times`` counts
    it: compute is ``sum(compute[i:j])``, comm is ``cut_time[i-1]`` (i > 0) plus
    ``cut_time[j-1]`` (j < n), latency the same sum over ``cut_latency``. ``mem``,
    ``mem_cap`` and ``allowed_cuts`` act as in ``solve``; every stage's compute also counts
    ``stage_overhead`` (what running a stage costs beyond its nodes). Among splits of equal largest time
    the one with the least summed ``cut_time + cut_latency`` over its cuts wins, then the
    earliest starts.

    Exact: a min-max dynamic program over (stages left, start). A split already found (the
    additive objective's, solved as in ``solve`` with cut cost ``cut_time + cut_latency``,
    which overestimates every stage) bounds the answer by U, so only stages whose compute
    alone fits U are tabulated: n x w of them, w <= n the most nodes such a stage spans.
    S passes over that table find the least largest time, S more settle ties: O(S n w) time,
    O(n w) memory (fx graphs of ~1,000 nodes cut into 8 stages: some 30 ms).
    """
    problem, cut_t, cut_l = overlap_problem(compute, n_stages, cut_time, cut_latency, mem, mem_cap, allowed_cuts)
    if not problem.feasible(n_stages, float("inf")):
        raise problem.cap_error(n_stages)
    if n_stages == 1:
        return [0]
    rough = problem.pick(n_stages, problem.least_max(n_stages))
    fences = np.array([*rough, problem.n])
    upper = float(stage_time(problem.prefix, cut_t, cut_l, fences[:-1], fences[1:], stage_overhead)[3].max())
    band = Band.build(problem, cut_t, cut_l, upper, stage_overhead)
    return band.pick(n_stages, band.least_max(n_stages))


def solve_scaled(
    compute: Sequence[float],
    scale: Sequence[float],
    *,
    cut_cost: Sequence[float] | None = None,
    allowed_cuts: Sequence[bool] | None = None,
    stage_overhead: float = 0.0,
) -> list[int]:
    """Start positions of ``len(scale)`` stages whose largest time is least, stage [a, b) taking
    ``scale[i] x (sum(compute[a:b]) + stage_overhead) + cut_cost[a-1] (a > 0) + cut_cost[b-1]
    (b < n)``: stage i runs ``scale[i]`` times slower than its parts, whatever it holds (see
    [Note: stage scale] in autopipe/measure/pipeline_scale.py), and its transfers are added, as
    ``solve`` adds them.

    Exact up to float rounding: bisection over the largest time, each test a reachability
    sweep of O(S n). Stage i can start at boundary b when some start a < b of stage i - 1 has
    ``scale x prefix[a] - cut_cost(a) >= scale x (prefix[b] + overhead) + cut_cost(b) - limit``:
    a running maximum of the left side over the reachable a.
    """
    values = vector("compute", compute)
    n, n_stages = len(values), len(scale)
    check_stage_count(n_stages)
    factors = np.asarray([float(f) for f in scale])
    if not (np.all(np.isfinite(factors)) and np.all(factors > 0)):
        raise PartitionError(f"stage scale {list(scale)} must be positive finite numbers, one per stage")
    allowed = np.ones(max(n - 1, 0), dtype=bool) if allowed_cuts is None else np.asarray(allowed_cuts, dtype=bool)
    if len(allowed) != max(n - 1, 0):
        raise PartitionError(length_message("allowed_cuts", len(allowed), n))
    if int(allowed.sum()) + 1 < n_stages:
        raise PartitionError(f"cannot cut {n} nodes into {n_stages} stages: {int(allowed.sum())} cuts are allowed")
    edge = boundary_vector("cut_cost", cut_cost, n)  # a transfer's seconds at boundary b in 0..n (none at the ends)
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    may_start = np.concatenate(([False], allowed, [False]))  # boundary b in 0..n; stage 0 starts at 0
    index = np.arange(n + 1)
    slack = 1e-12 * float(factors.max() * (prefix[n] + stage_overhead) + edge.sum() + 1e-30)

    def time_from(i: int, ends: np.ndarray | int, starts: np.ndarray) -> np.ndarray:
        return factors[i] * (prefix[ends] - prefix[starts] + stage_overhead) + edge[starts] + edge[ends]

    def reach(limit: float) -> list[np.ndarray] | None:
        """Per stage, the boundaries it can start at with every stage before it within ``limit``."""
        sets = [index == 0]
        for i in range(n_stages - 1):
            left = np.where(sets[-1], factors[i] * prefix - edge, -np.inf)
            best = np.concatenate(([-np.inf], np.maximum.accumulate(left)[:-1]))  # over a < b
            need = factors[i] * (prefix + stage_overhead) + edge - limit - slack
            nxt = may_start & (best >= need)
            if not nxt.any():
                return None
            sets.append(nxt)
        if not (sets[-1] & (index < n) & (time_from(n_stages - 1, n, index) <= limit + slack)).any():
            return None
        return sets

    def pick(sets: list[np.ndarray], limit: float) -> list[int]:
        starts, end = [], n
        for i in range(n_stages - 1, -1, -1):
            fits = sets[i] & (index < end) & (time_from(i, end, index) <= limit + slack)
            end = int(np.flatnonzero(fits)[-1])
            starts.append(end)
        return starts[::-1]

    high = float(factors.max() * (prefix[n] + stage_overhead) + 2 * edge.max())
    if reach(high) is None:
        raise PartitionError(f"cannot cut {n} nodes into {n_stages} non-empty stages at the allowed cuts")
    low = 0.0
    for _ in range(200):
        if high - low <= 1e-12 * high:
            break
        middle = (low + high) / 2
        if reach(middle) is None:
            low = middle
        else:
            high = middle
    return pick(reach(high), high)


class StageTime(NamedTuple):
    """One stage's modelled seconds: ``cost = max(compute, comm) + latency``."""

    compute: float
    comm: float
    latency: float
    cost: float


def overlapped_stage_times(
    compute: Sequence[float],
    starts: Sequence[int],
    cut_time: Sequence[float] | None = None,
    cut_latency: Sequence[float] | None = None,
    stage_overhead: float = 0.0,
) -> list[StageTime]:
    """Each stage of ``starts`` timed as ``solve_overlapped`` times it, to the last bit."""
    values = vector("compute", compute)
    n = len(values)
    check_starts(starts, n)
    cut_t = boundary_vector("cut_time", cut_time, n)
    cut_l = boundary_vector("cut_latency", cut_latency, n)
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    fences = np.array([*(int(s) for s in starts), n])
    parts = stage_time(prefix, cut_t, cut_l, fences[:-1], fences[1:], stage_overhead)
    return [StageTime(*map(float, row)) for row in zip(*parts)]


def solve_uniform(group_of: Sequence[int], n_stages: int) -> list[int]:
    """Equal numbers of top-level layers per stage, cutting only between layers.

    ``group_of[i]`` is the layer that node i belongs to (non-decreasing). Stage k starts at
    layer ``round(k * L / S)`` (halves round up), the "uniform" split of Colossal-AI and
    PyTorch pipelining, blind to cost.
    """
    check_stage_count(n_stages)
    groups = [int(g) for g in group_of]
    backward = [i for i in range(1, len(groups)) if groups[i] < groups[i - 1]]
    if backward:
        i = backward[0]
        raise PartitionError(
            f"group_of must be non-decreasing: position {i} is in layer {groups[i]} "
            f"after layer {groups[i - 1]} at position {i - 1} ({len(backward)} such places)"
        )
    firsts = [i for i in range(len(groups)) if i == 0 or groups[i] != groups[i - 1]]
    n_layers = len(firsts)
    if n_stages > n_layers:
        raise PartitionError(
            f"cannot cut {n_layers} layers into {n_stages} stages: at most {n_layers} "
            f"stages; lower pp or chunks"
        )
    # floor(k*L/S + 1/2) in integers, so that no float rounding moves a cut.
    return [firsts[(2 * k * n_layers + n_stages) // (2 * n_stages)] for k in range(n_stages)]


def solve_params(
    params: Sequence[int], n_stages: int, allowed_cuts: Sequence[bool] | None = None
) -> list[int]:
    """Least largest parameter count per stage (DeepSpeed's default "parameters" split)."""
    return solve(np.asarray(params, dtype=np.float64), n_stages, allowed_cuts=allowed_cuts)


def solve_split_points(
    order_positions: Sequence[int], n_stages: int, *, n_nodes: int | None = None
) -> list[int]:
    """Stage starts from explicit cuts: position k means "cut after position k".

    ``order_positions`` holds the ``n_stages - 1`` cuts, increasing, so the result is
    ``[0, k0 + 1, k1 + 1, ...]``. ``n_nodes``, when given, bounds them to 0..n_nodes-2.
    """
    check_stage_count(n_stages)
    cuts = [int(k) for k in order_positions]
    problems = []
    if len(cuts) != n_stages - 1:
        problems.append(f"{n_stages} stages need {n_stages - 1} cut positions, got {len(cuts)}")
    for a, (k, m) in enumerate(zip(cuts, cuts[1:])):
        if m <= k:
            problems.append(f"cut #{a + 1} (after {m}) does not come after cut #{a} (after {k})")
    span = "0 or more" if n_nodes is None else f"0..{n_nodes - 2} for {n_nodes} nodes"
    for a, k in enumerate(cuts):
        if k < 0 or (n_nodes is not None and k > n_nodes - 2):
            problems.append(f"cut #{a} (after {k}) is out of range: cuts lie at {span}")
    if problems:
        raise PartitionError(bullets(f"invalid split points {cuts}", problems))
    return [0, *(k + 1 for k in cuts)]


def stage_costs(
    cost: Sequence[float], starts: Sequence[int], cut_cost: Sequence[float] | None = None
) -> list[float]:
    """Cost of each stage of ``starts``, counted as ``solve`` counts it."""
    values = np.asarray(cost, dtype=np.float64)
    n = len(values)
    check_starts(starts, n)
    cuts = np.zeros(max(n - 1, 0)) if cut_cost is None else np.asarray(cut_cost, np.float64)
    if len(cuts) != max(n - 1, 0):
        raise PartitionError(length_message("cut_cost", len(cuts), n))
    bounds = [*starts, n]
    return [
        float(np.sum(values[i:j]))
        + (float(cuts[i - 1]) if i > 0 else 0.0)
        + (float(cuts[j - 1]) if j < n else 0.0)
        for i, j in zip(bounds, bounds[1:])
    ]


def imbalance(stage_costs: Sequence[float]) -> float:
    """Largest stage cost over the mean: 1.0 is perfect balance, S the worst."""
    if len(stage_costs) == 0:
        raise PartitionError("imbalance of no stages is undefined")
    mean = sum(stage_costs) / len(stage_costs)
    return 1.0 if mean == 0 else max(stage_costs) / mean


def least_imbalance(cost: Sequence[float], n_stages: int, *, stage_overhead: float = 0.0,
                    allowed_cuts: Sequence[bool] | None = None, cut_cost: Sequence[float] | None = None) -> float:
    """The smallest max/mean that any split of ``cost`` into ``n_stages`` contiguous stages
    reaches, each stage also paying ``stage_overhead``: the floor of every plan that cuts only
    between these positions, however well it knows their costs. A stage can be no shorter than
    its largest position, so one large node (a stem's batch norm over 112x112 maps) can hold
    the floor above a balance target whatever the cost model says. ``allowed_cuts`` as for
    :func:`solve`; ``cut_cost[k]``, where given, is paid by both stages beside a cut after
    position k (a boundary's copies), and the split is the one whose largest stage is least."""
    if cut_cost is None:
        costs = stage_costs(cost, solve(cost, n_stages, allowed_cuts=allowed_cuts))
        return imbalance([c + stage_overhead for c in costs])
    starts = solve_scaled(cost, [1.0] * n_stages, cut_cost=cut_cost, allowed_cuts=allowed_cuts,
                          stage_overhead=stage_overhead)
    ends = list(starts[1:]) + [len(cost)]
    edge = boundary_vector("cut_cost", cut_cost, len(cost))
    return imbalance([sum(cost[a:b]) + stage_overhead + edge[a] + edge[b] for a, b in zip(starts, ends)])


def check_starts(starts: Sequence[int], n: int) -> None:
    """Raise unless ``starts`` are valid stage starts over ``n`` nodes."""
    starts = [int(s) for s in starts]
    problems = []
    if not starts:
        problems.append("there must be at least one stage")
    elif starts[0] != 0:
        problems.append(f"the first stage must start at 0, not {starts[0]}")
    for s, (a, b) in enumerate(zip(starts, starts[1:])):
        if b <= a:
            problems.append(f"stage {s + 1} starts at {b}, not after stage {s} ({a}): empty stage")
    if starts and starts[-1] >= n:
        last = len(starts) - 1
        problems.append(f"stage {last} starts at {starts[-1]}, past the last node {n - 1}")
    if problems:
        raise PartitionError(bullets(f"invalid stage starts {starts} for {n} nodes", problems))


def overlap_problem(
    compute: Sequence[float],
    n_stages: int,
    cut_time: Sequence[float] | None,
    cut_latency: Sequence[float] | None,
    mem: Sequence[float] | None,
    mem_cap: float | None,
    allowed_cuts: Sequence[bool] | None,
) -> tuple[Problem, np.ndarray, np.ndarray]:
    """The additive relaxation (validating everything as ``solve`` does) and both cut arrays."""
    check_stage_count(n_stages)
    n = len(vector("compute", compute))
    cut_t = boundary_vector("cut_time", cut_time, n)
    cut_l = boundary_vector("cut_latency", cut_latency, n)
    # max(a, b) + c <= a + b + c: each stage costs at least as much as in the real objective.
    relaxed = (cut_t + cut_l)[1:n]
    problem = Problem.build(compute, n_stages, relaxed, mem, mem_cap, allowed_cuts)
    return problem, cut_t, cut_l


