"""Where to cut a linear order of nodes into contiguous pipeline stages.

Pure functions over plain sequences of numbers (no torch, no graph): the caller lays its
graph out in one order (``dag.linearize``) and passes per-node numbers. Every solver returns
stage start positions: ``starts[0] == 0``, strictly increasing, one per stage.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from autopipe.errors import PartitionError

__all__ = [
    "solve",
    "solve_overlapped",
    "overlapped_stage_times",
    "StageTime",
    "solve_uniform",
    "solve_params",
    "solve_split_points",
    "stage_costs",
    "imbalance",
    "check_starts",
]

# n: number of nodes;  S: number of stages.
# Position p: index of a node in the order. Boundary b in 0..n: the gap before position b,
# so 0 and n are the two ends and a stage is a half-open range of positions [i, j).
# A "cut after position k" is boundary k + 1; cut_cost[k] and allowed_cuts[k] belong to it
# (and cut_time[k], cut_latency[k]).

_INF_BITS = struct.unpack("<q", struct.pack("<d", float("inf")))[0]


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
    problem = _Problem.build(cost, n_stages, cut_cost, mem, mem_cap, allowed_cuts)
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
    problem, cut_t, cut_l = _overlap_problem(compute, n_stages, cut_time, cut_latency, mem, mem_cap, allowed_cuts)
    if not problem.feasible(n_stages, float("inf")):
        raise problem.cap_error(n_stages)
    if n_stages == 1:
        return [0]
    rough = problem.pick(n_stages, problem.least_max(n_stages))
    fences = np.array([*rough, problem.n])
    upper = float(_stage_time(problem.prefix, cut_t, cut_l, fences[:-1], fences[1:], stage_overhead)[3].max())
    band = _Band.build(problem, cut_t, cut_l, upper, stage_overhead)
    return band.pick(n_stages, band.least_max(n_stages))


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
    values = _vector("compute", compute)
    n = len(values)
    check_starts(starts, n)
    cut_t = _boundary_vector("cut_time", cut_time, n)
    cut_l = _boundary_vector("cut_latency", cut_latency, n)
    prefix = np.concatenate(([0.0], np.cumsum(values)))
    fences = np.array([*(int(s) for s in starts), n])
    parts = _stage_time(prefix, cut_t, cut_l, fences[:-1], fences[1:], stage_overhead)
    return [StageTime(*map(float, row)) for row in zip(*parts)]


def solve_uniform(group_of: Sequence[int], n_stages: int) -> list[int]:
    """Equal numbers of top-level layers per stage, cutting only between layers.

    ``group_of[i]`` is the layer that node i belongs to (non-decreasing). Stage k starts at
    layer ``round(k * L / S)`` (halves round up), the "uniform" split of Colossal-AI and
    PyTorch pipelining, blind to cost.
    """
    _check_stage_count(n_stages)
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
    _check_stage_count(n_stages)
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
        raise PartitionError(_bullets(f"invalid split points {cuts}", problems))
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
        raise PartitionError(_length_message("cut_cost", len(cuts), n))
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
        raise PartitionError(_bullets(f"invalid stage starts {starts} for {n} nodes", problems))


@dataclass(frozen=True, eq=False)
class _Problem:
    """Validated arrays over boundaries 0..n; see the letters at the top of the module.

    Stage [i, j) fits under a bound t iff ``end[j] - begin[i] <= t`` in floating point and
    its memory fits the same way. Every test against a bound is that one expression (as
    ``end[j] <= room``, see ``_room``), so the least bound is exactly the cost of some stage
    and splits that tie on it tie to the last bit.
    """

    n: int
    prefix: np.ndarray  # prefix[b] = sum(cost[:b])
    cut: np.ndarray  # cut[b] = cut_cost[b-1] inside, 0.0 at both ends
    ok: np.ndarray  # ok[b]: a stage may start or end at b
    end: np.ndarray  # prefix + cut: stage [i, j) costs end[j] - begin[i]
    begin: np.ndarray  # prefix - cut
    ladder: np.ndarray  # sorted(end) + [inf], see _room
    lowest: np.ndarray | None  # lowest[j]: first i whose stage [i, j) fits the mem cap
    mem: np.ndarray | None
    mem_cap: float | None

    @staticmethod
    def build(
        cost: Sequence[float],
        n_stages: int,
        cut_cost: Sequence[float] | None,
        mem: Sequence[float] | None,
        mem_cap: float | None,
        allowed_cuts: Sequence[bool] | None,
    ) -> _Problem:
        _check_stage_count(n_stages)
        costs = _vector("cost", cost)
        n = len(costs)
        cut = np.zeros(n + 1)
        if cut_cost is not None:
            cuts = _vector("cut_cost", cut_cost)
            if len(cuts) != max(n - 1, 0):
                raise PartitionError(_length_message("cut_cost", len(cuts), n))
            cut[1:n] = cuts
        ok = np.ones(n + 1, dtype=bool)
        if allowed_cuts is not None:
            flags = np.asarray(allowed_cuts, dtype=bool)
            if flags.shape != (max(n - 1, 0),):
                raise PartitionError(_length_message("allowed_cuts", len(flags), n))
            ok[1:n] = flags
        max_stages = int(ok[1:n].sum()) + 1 if n else 0
        if n_stages > max_stages:
            why = "" if max_stages == n else f" ({max_stages - 1} allowed cut positions)"
            raise PartitionError(
                f"cannot cut {n} nodes into {n_stages} stages: at most {max_stages} "
                f"stages{why}; lower pp or chunks"
            )
        prefix = np.concatenate(([0.0], np.cumsum(costs)))
        mems, lowest = None, None
        if mem_cap is not None:
            if mem is None:
                raise PartitionError("mem_cap needs mem, the memory of each node")
            if not mem_cap >= 0:
                raise PartitionError(f"mem_cap must be non-negative, got {mem_cap!r}")
            mems = _vector("mem", mem, n)
            held = np.concatenate(([0.0], np.cumsum(mems)))
            # The cost test again, so the least cap that cap_error reports is one that fits.
            j = np.arange(n + 1)
            lowest = _search(lambda i: held[j] - held[i] <= mem_cap, np.zeros_like(j), j)
        end = prefix + cut
        ladder = np.append(np.sort(end), np.inf)
        return _Problem(n, prefix, cut, ok, end, prefix - cut, ladder, lowest, mems, mem_cap)

    @cached_property
    def _capped(self) -> _Windows:
        assert self.lowest is not None
        return _Windows(self.lowest[1:], np.arange(self.n), self.n + 1)

    def feasible(self, n_stages: int, bound: float) -> bool:
        """Whether some split into ``n_stages`` keeps every stage within ``bound``."""
        room = _room(self.ladder, self.begin, bound)
        reach = np.zeros(self.n + 1, dtype=bool)
        reach[0] = True
        for _ in range(n_stages):
            offer = np.where(reach, room, -np.inf)
            if self.lowest is None:
                best = np.maximum.accumulate(offer)[:-1]
            else:
                best = self._capped.reduce(offer, np.maximum, -np.inf)
            # best[j-1]: the most room any reachable start leaves for a stage ending at j.
            reach = np.zeros(self.n + 1, dtype=bool)
            reach[1:] = (self.end[1:] <= best) & self.ok[1:]
            if not reach.any():
                return False
        return bool(reach[self.n])

    def least_max(self, n_stages: int) -> float:
        """The least feasible bound: exactly the cost of some stage [i, j).

        Bisection over the bit patterns of doubles (non-negative doubles sort like their
        int64 bits) narrows (lo, hi] until few stage costs ``end[j] - begin[i]`` lie inside,
        then a binary search over those costs finishes: some 20 to 30 tests, not 63.
        """
        lo, hi = -1, _INF_BITS  # bits; everything below lo fails, hi fits
        few = 4 * (self.n + 1)
        below = np.zeros(self.n + 1, dtype=np.int64)
        above = _rungs(self.ladder, self.begin, np.inf)
        while hi - lo > 1 and int((above - below).sum()) > few:
            mid = (lo + hi) // 2
            rungs = _rungs(self.ladder, self.begin, _from_bits(mid))
            if self.feasible(n_stages, _from_bits(mid)):
                hi, above = mid, rungs
            else:
                lo, below = mid, rungs
        # Every (start i, ladder rung k) pair whose cost lies in (lo, hi]; j <= i pairs too,
        # which cannot fit anything and only cost a test or two.
        count = above - below
        rows = np.repeat(np.arange(self.n + 1), count)
        rungs = np.repeat(below + count - np.cumsum(count), count) + np.arange(len(rows))
        costs = np.unique(self.ladder[rungs] - self.begin[rows])
        a, b = 0, len(costs)  # the answer is costs[a] once a == b; the bound hi fits
        while a < b:
            m = (a + b) // 2
            if self.feasible(n_stages, float(costs[m])):
                b = m
            else:
                a = m + 1
        return float(costs[a]) if a < len(costs) else _from_bits(hi)

    def pick(self, n_stages: int, bound: float) -> list[int]:
        """Among splits within ``bound``: least summed cut cost, then the earliest starts.

        A stage from i may end at j in (i, last[i]] where ``end[j] <= room[i]``. Up to
        ``safe[i]`` that holds for every j (end <= prefix + the largest cut), so a range
        minimum covers those ends and only the few past ``safe`` are tested one by one.
        """
        n = self.n
        heads = np.flatnonzero(self.ok[:n])
        room = _room(self.ladder, self.begin[heads], bound)
        last = np.searchsorted(self.prefix, room, side="right") - 1
        safe = np.searchsorted(self.prefix + self.cut.max(), room, side="right") - 1
        if self.lowest is not None:
            roof = np.searchsorted(self.lowest[1:], heads, side="right")
            last, safe = np.minimum(last, roof), np.minimum(safe, roof)
        last = np.maximum(last, heads)
        safe = np.clip(safe, heads, last)
        near = _Windows(heads + 1, safe, n + 1)
        count = last - safe
        src = np.repeat(np.arange(len(heads)), count)
        dst = np.repeat(safe + 1 + count - np.cumsum(count), count) + np.arange(len(src))
        keep = (self.end[dst] <= room[src]) & self.ok[dst]
        src, dst = src[keep], dst[keep]
        rows, first = np.unique(src, return_index=True)
        # togo[r][b]: least summed cut cost from boundary b to n in exactly r stages.
        togo = [np.full(n + 1, np.inf)]
        togo[0][n] = 0.0
        for _ in range(n_stages):
            value = np.where(self.ok, self.cut + togo[-1], np.inf)
            best = near.reduce(value, np.minimum, np.inf)
            if len(dst):
                best[rows] = np.minimum(best[rows], np.minimum.reduceat(value[dst], first))
            togo.append(np.full(n + 1, np.inf))
            togo[-1][heads] = best
        row = np.full(n + 1, -1)
        row[heads] = np.arange(len(heads))
        starts, b = [0], 0
        for left in range(n_stages, 1, -1):
            ends = np.arange(b + 1, last[row[b]] + 1)
            fits = (self.end[ends] <= room[row[b]]) & self.ok[ends]
            fits &= self.cut[ends] + togo[left - 1][ends] == togo[left][b]
            b = int(ends[np.argmax(fits)])
            starts.append(b)
        return starts

    def cap_error(self, n_stages: int) -> PartitionError:
        """The error for a cap that no split fits, with the least cap that would."""
        assert self.mem is not None and self.mem_cap is not None
        by_mem = _Problem.build(self.mem, n_stages, None, None, None, self.ok[1 : self.n])
        need = by_mem.least_max(n_stages)
        heavy = int(np.argmax(self.mem))
        return PartitionError(
            f"no split of {self.n} nodes into {n_stages} stages keeps each stage's mem "
            f"within mem_cap={float(self.mem_cap)!r}: the smallest cap that fits is "
            f"{float(need)!r} (largest single node: {float(self.mem[heavy])!r} at position "
            f"{heavy}); raise mem_cap or use more stages"
        )


def _stage_time(
    prefix: np.ndarray, cut_t: np.ndarray, cut_l: np.ndarray, i: np.ndarray, j: np.ndarray,
    stage_overhead: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(compute, comm, latency, cost) of stages [i, j): the one formula, for solver and plan."""
    compute = prefix[j] - prefix[i] + stage_overhead
    comm = cut_t[i] + cut_t[j]
    latency = cut_l[i] + cut_l[j]
    return compute, comm, latency, np.maximum(compute, comm) + latency


def _overlap_problem(
    compute: Sequence[float],
    n_stages: int,
    cut_time: Sequence[float] | None,
    cut_latency: Sequence[float] | None,
    mem: Sequence[float] | None,
    mem_cap: float | None,
    allowed_cuts: Sequence[bool] | None,
) -> tuple[_Problem, np.ndarray, np.ndarray]:
    """The additive relaxation (validating everything as ``solve`` does) and both cut arrays."""
    _check_stage_count(n_stages)
    n = len(_vector("compute", compute))
    cut_t = _boundary_vector("cut_time", cut_time, n)
    cut_l = _boundary_vector("cut_latency", cut_latency, n)
    # max(a, b) + c <= a + b + c: each stage costs at least as much as in the real objective.
    relaxed = (cut_t + cut_l)[1:n]
    problem = _Problem.build(compute, n_stages, relaxed, mem, mem_cap, allowed_cuts)
    return problem, cut_t, cut_l


@dataclass(frozen=True, eq=False)
class _Band:
    """Every allowed stage whose compute alone fits a bound, as a matrix of rows by start.

    Row r holds the stages from ``heads[r]``: column d is the stage [heads[r], heads[r]+1+d),
    ending at ``ends[r, d]``; ``time`` is its cost, inf where the stage is not allowed (a cut
    forbidden there, the memory cap, past the bound). A stage's cost is at least its compute
    (rounding is monotone), so no split within the bound needs a stage outside the band.
    """

    n: int
    heads: np.ndarray  # int[rows]: allowed starts
    ends: np.ndarray  # int[rows, w]: stage ends, clipped to n
    time: np.ndarray  # float[rows, w]
    weight: np.ndarray  # float[n + 1]: cut_time + cut_latency at each boundary, 0 at both ends

    @staticmethod
    def build(problem: _Problem, cut_t: np.ndarray, cut_l: np.ndarray, bound: float,
              stage_overhead: float = 0.0) -> _Band:
        n, prefix, ok = problem.n, problem.prefix, problem.ok
        heads = np.flatnonzero(ok[:n])
        # The first end whose compute alone exceeds the bound; compute grows with the end.
        padded = np.append(prefix, np.inf)
        stop = _search(lambda j: padded[j] - prefix[heads] > bound, heads + 1, np.full_like(heads, n + 1))
        last = stop - 1
        if problem.lowest is not None:
            last = np.minimum(last, np.searchsorted(problem.lowest[1:], heads, side="right"))
        width = max(int((last - heads).max(initial=0)), 1)
        ends = heads[:, None] + 1 + np.arange(width)
        allowed = ends <= last[:, None]
        ends = np.minimum(ends, n)
        allowed &= ok[ends]
        time = _stage_time(prefix, cut_t, cut_l, heads[:, None], ends, stage_overhead)[3]
        time[~allowed] = np.inf
        return _Band(n, heads, ends, time, cut_t + cut_l)

    def least_max(self, n_stages: int) -> float:
        """The least largest stage time over splits into ``n_stages``: exactly some stage's time."""
        best = np.full(self.n + 1, np.inf)  # best[b]: least largest time from b to n
        best[self.n] = 0.0
        for _ in range(n_stages):
            reached = np.full(self.n + 1, np.inf)
            worst = best[self.ends]
            reached[self.heads] = np.maximum(self.time, worst, out=worst).min(axis=1)
            best = reached
        return float(best[0])

    def pick(self, n_stages: int, bound: float) -> list[int]:
        """Among splits within ``bound``: least summed cut weight, then the earliest starts."""
        fits = self.time <= bound
        step = self.weight[self.ends]
        # togo[r][b]: least summed weight of the cuts from boundary b to n in exactly r stages.
        togo = [np.full(self.n + 1, np.inf)]
        togo[0][self.n] = 0.0
        for _ in range(n_stages):
            value = np.where(fits, step + togo[-1][self.ends], np.inf)
            togo.append(np.full(self.n + 1, np.inf))
            togo[-1][self.heads] = value.min(axis=1)
        row = np.full(self.n + 1, -1)
        row[self.heads] = np.arange(len(self.heads))
        starts, b = [0], 0
        for left in range(n_stages, 1, -1):
            r = row[b]
            good = fits[r] & (step[r] + togo[left - 1][self.ends[r]] == togo[left][b])
            b = int(self.ends[r, np.argmax(good)])
            starts.append(b)
        return starts


class _Windows:
    """Fixed ranges [lo[q], hi[q]] of arrays of one size, each reduced in O(1) (a sparse table).

    Empty ranges (hi < lo) give ``fill``. Building the table costs O(size log w) per array,
    w the longest range.
    """

    def __init__(self, lo: np.ndarray, hi: np.ndarray, size: int) -> None:
        length = hi - lo + 1
        self.empty = np.flatnonzero(length <= 0)
        level = np.zeros(len(lo), dtype=np.int64)
        full = length > 0
        level[full] = np.log2(length[full]).astype(np.int64)
        self.size = size
        self.depth = int(level.max(initial=0)) + 1
        # Flat indices into the (depth, size) table: the two halves that cover each range.
        self.near = level * size + np.where(full, lo, 0)
        self.far = level * size + np.where(full, hi + 1 - (1 << level), 0)

    def reduce(self, values: np.ndarray, op: np.ufunc, fill: float) -> np.ndarray:
        table = np.empty((self.depth, self.size))
        table[0] = values
        for k in range(1, self.depth):
            half = 1 << (k - 1)
            op(table[k - 1, :-half], table[k - 1, half:], out=table[k, :-half])
            table[k, -half:] = fill
        flat = table.ravel()
        out = op(flat.take(self.near), flat.take(self.far))
        out[self.empty] = fill
        return out


def _room(ladder: np.ndarray, base: np.ndarray, bound: float) -> np.ndarray:
    """Per base b: the largest end e with ``e - b <= bound`` in floating point, or -inf.

    Turns the stage test ``end[j] - begin[i] <= bound`` into ``end[j] <= room[i]``, which a
    running maximum answers for many starts at once.
    """
    over = _rungs(ladder, base, bound)
    return np.where(over > 0, ladder[over - 1], -np.inf)


def _rungs(ladder: np.ndarray, base: np.ndarray, bound: float) -> np.ndarray:
    """Per base b: how many rungs e of ``ladder`` (sorted ends, then +inf) have e - b <= bound.

    ``bound + b`` nearly always finds the answer, but not always: when |b| is far above the
    ends, many floats x give the same rounded x - b, so a binary search settles the rest.
    """
    top = len(ladder) - 1  # the +inf rung never fits
    if bound == np.inf:
        return np.full(len(base), top)
    over = np.minimum(np.searchsorted(ladder, bound + base, side="right"), top)
    below = np.maximum(over - 1, 0)
    wrong = ~(ladder[over] - base > bound) | ((over > 0) & (ladder[below] - base > bound))
    if wrong.any():
        rows = np.flatnonzero(wrong)
        first = np.zeros(len(rows), dtype=np.int64)
        over[rows] = _search(lambda k: ladder[k] - base[rows] > bound, first, first + top)
    return over


def _search(pred: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Least k in [lo, hi] with ``pred(k)``, row by row: a vectorised binary search.

    ``pred`` must be false then true along each row and is taken as true at ``hi``
    (though ``hi`` must still be a valid index, as settled rows keep asking for it).
    """
    lo, hi = lo.copy(), hi.copy()
    while (active := lo < hi).any():
        mid = (lo + hi) // 2
        yes = pred(mid)
        hi = np.where(active & yes, mid, hi)
        lo = np.where(active & ~yes, mid + 1, lo)
    return lo


def _from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _vector(name: str, values: Sequence[float], n: int | None = None) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise PartitionError(f"{name} must be a flat sequence, got shape {array.shape}")
    if n is not None and len(array) != n:
        raise PartitionError(f"{name} has {len(array)} entries, expected {n}")
    bad = np.flatnonzero(~(np.isfinite(array) & (array >= 0)))
    if len(bad):
        p = int(bad[0])
        raise PartitionError(
            f"{name}[{p}] is {float(array[p])!r}: values must be finite and non-negative "
            f"({len(bad)} such entries)"
        )
    return array


def _boundary_vector(name: str, values: Sequence[float] | None, n: int) -> np.ndarray:
    """Per-cut values laid over boundaries 0..n, 0.0 at both ends."""
    out = np.zeros(n + 1)
    if values is not None:
        array = _vector(name, values)
        if len(array) != max(n - 1, 0):
            raise PartitionError(_length_message(name, len(array), n))
        out[1:n] = array
    return out


def _check_stage_count(n_stages: int) -> None:
    if n_stages < 1:
        raise PartitionError(f"n_stages must be at least 1, got {n_stages}")


def _length_message(name: str, got: int, n: int) -> str:
    return (
        f"{name} has {got} entries but {n} nodes have {max(n - 1, 0)} cut positions "
        f"(one after each position but the last)"
    )


def _bullets(head: str, problems: list[str]) -> str:
    return head + ":\n" + "\n".join(f"  - {p}" for p in problems)
