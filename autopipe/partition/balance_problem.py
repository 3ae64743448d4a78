"""The balancer's problem: validated per-node arrays over the boundaries of a linear order,
and the search for the least bound every stage fits under. balance.py's solvers build and
query it; the letters (n, S, positions, boundaries) are those at the top of balance.py.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from autopipe.errors import PartitionError

__all__ = ["Problem", "Band", "Windows", "INF_BITS", "from_bits", "vector", "boundary_vector", "check_stage_count",
           "length_message", "bullets", "stage_time"]

INF_BITS = struct.unpack("<q", struct.pack("<d", float("inf")))[0]


@dataclass(frozen=True, eq=False)
class Problem:
    """Validated arrays over boundaries 0..n; see the letters at the top of the module.

    Stage [i, j) fits under a bound t iff ``end[j] - begin[i] <= t`` in floating point and
    its memory fits the same way. Every test against a bound is that one expression (as
    ``end[j] <= room``, see ``room``), so the least bound is exactly the cost of some stage
    and splits that tie on it tie to the last bit.
    """

    n: int
    prefix: np.ndarray  # prefix[b] = sum(cost[:b])
    cut: np.ndarray  # cut[b] = cut_cost[b-1] inside, 0.0 at both ends
    ok: np.ndarray  # ok[b]: a stage may start or end at b
    end: np.ndarray  # prefix + cut: stage [i, j) costs end[j] - begin[i]
    begin: np.ndarray  # prefix - cut
    ladder: np.ndarray  # sorted(end) + [inf], see room
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
    ) -> Problem:
        check_stage_count(n_stages)
        costs = vector("cost", cost)
        n = len(costs)
        cut = np.zeros(n + 1)
        if cut_cost is not None:
            cuts = vector("cut_cost", cut_cost)
            if len(cuts) != max(n - 1, 0):
                raise PartitionError(length_message("cut_cost", len(cuts), n))
            cut[1:n] = cuts
        ok = np.ones(n + 1, dtype=bool)
        if allowed_cuts is not None:
            flags = np.asarray(allowed_cuts, dtype=bool)
            if flags.shape != (max(n - 1, 0),):
                raise PartitionError(length_message("allowed_cuts", len(flags), n))
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
            mems = vector("mem", mem, n)
            held = np.concatenate(([0.0], np.cumsum(mems)))
            # The cost test again, so the least cap that cap_error reports is one that fits.
            j = np.arange(n + 1)
            lowest = _search(lambda i: held[j] - held[i] <= mem_cap, np.zeros_like(j), j)
        end = prefix + cut
        ladder = np.append(np.sort(end), np.inf)
        return Problem(n, prefix, cut, ok, end, prefix - cut, ladder, lowest, mems, mem_cap)

    @cached_property
    def _capped(self) -> Windows:
        assert self.lowest is not None
        return Windows(self.lowest[1:], np.arange(self.n), self.n + 1)

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
        lo, hi = -1, INF_BITS  # bits; everything below lo fails, hi fits
        few = 4 * (self.n + 1)
        below = np.zeros(self.n + 1, dtype=np.int64)
        above = _rungs(self.ladder, self.begin, np.inf)
        while hi - lo > 1 and int((above - below).sum()) > few:
            mid = (lo + hi) // 2
            rungs = _rungs(self.ladder, self.begin, from_bits(mid))
            if self.feasible(n_stages, from_bits(mid)):
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
        return float(costs[a]) if a < len(costs) else from_bits(hi)

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
        near = Windows(heads + 1, safe, n + 1)
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
        by_mem = Problem.build(self.mem, n_stages, None, None, None, self.ok[1 : self.n])
        need = by_mem.least_max(n_stages)
        heavy = int(np.argmax(self.mem))
        return PartitionError(
            f"no split of {self.n} nodes into {n_stages} stages keeps each stage's mem "
            f"within mem_cap={float(self.mem_cap)!r}: the smallest cap that fits is "
            f"{float(need)!r} (largest single node: {float(self.mem[heavy])!r} at position "
            f"{heavy}); raise mem_cap or use more stages"
        )


@dataclass(frozen=True, eq=False)
class Band:
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
    def build(problem: Problem, cut_t: np.ndarray, cut_l: np.ndarray, bound: float,
              stage_overhead: float = 0.0) -> Band:
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
        time = stage_time(prefix, cut_t, cut_l, heads[:, None], ends, stage_overhead)[3]
        time[~allowed] = np.inf
        return Band(n, heads, ends, time, cut_t + cut_l)

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


class Windows:
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


def from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def vector(name: str, values: Sequence[float], n: int | None = None) -> np.ndarray:
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


def boundary_vector(name: str, values: Sequence[float] | None, n: int) -> np.ndarray:
    """Per-cut values laid over boundaries 0..n, 0.0 at both ends."""
    out = np.zeros(n + 1)
    if values is not None:
        array = vector(name, values)
        if len(array) != max(n - 1, 0):
            raise PartitionError(length_message(name, len(array), n))
        out[1:n] = array
    return out


def check_stage_count(n_stages: int) -> None:
    if n_stages < 1:
        raise PartitionError(f"n_stages must be at least 1, got {n_stages}")


def length_message(name: str, got: int, n: int) -> str:
    return (
        f"{name} has {got} entries but {n} nodes have {max(n - 1, 0)} cut positions "
        f"(one after each position but the last)"
    )


def bullets(head: str, problems: list[str]) -> str:
    return head + ":\n" + "\n".join(f"  - {p}" for p in problems)


def stage_time(
    prefix: np.ndarray, cut_t: np.ndarray, cut_l: np.ndarray, i: np.ndarray, j: np.ndarray,
    stage_overhead: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(compute, comm, latency, cost) of stages [i, j): the one formula, for solver and plan."""
    compute = prefix[j] - prefix[i] + stage_overhead
    comm = cut_t[i] + cut_t[j]
    latency = cut_l[i] + cut_l[j]
    return compute, comm, latency, np.maximum(compute, comm) + latency
