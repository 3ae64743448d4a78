import itertools
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import PartitionError
from autopipe.partition.balance import (
    StageTime,
    check_starts,
    imbalance,
    least_imbalance,
    overlapped_stage_times,
    solve,
    solve_overlapped,
    solve_params,
    solve_split_points,
    solve_uniform,
    stage_costs,
)

SMALL = settings(max_examples=150, deadline=None)


def brute_force(cost, n_stages, cut_cost=None, mem=None, mem_cap=None, allowed_cuts=None):
    """Every split, ranked as solve ranks them: (largest cost, summed cut cost, starts)."""
    n = len(cost)
    cuts = [0.0] * (n - 1) if cut_cost is None else list(cut_cost)
    best = None
    for chosen in itertools.combinations(range(1, n), n_stages - 1):
        if allowed_cuts is not None and not all(allowed_cuts[b - 1] for b in chosen):
            continue
        starts = [0, *chosen]
        fences = [*starts, n]
        if mem_cap is not None and any(sum(mem[i:j]) > mem_cap for i, j in zip(fences, fences[1:])):
            continue
        key = (max(stage_costs(cost, starts, cut_cost)), sum(cuts[b - 1] for b in chosen), starts)
        best = key if best is None or key < best else best
    return best


@st.composite
def problems(draw, values=st.integers(0, 6).map(float)):
    n = draw(st.integers(1, 9))
    n_stages = draw(st.integers(1, min(4, n)))
    cost = draw(st.lists(values, min_size=n, max_size=n))
    cut_cost = draw(st.none() | st.lists(values, min_size=n - 1, max_size=n - 1))
    mem = draw(st.lists(st.integers(0, 5).map(float), min_size=n, max_size=n))
    mem_cap = draw(st.none() | st.integers(0, 20).map(float))
    allowed = draw(st.none() | st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
    return cost, n_stages, dict(cut_cost=cut_cost, mem=mem, mem_cap=mem_cap, allowed_cuts=allowed)


@SMALL
@given(problems())
def test_solve_is_optimal_with_ties_broken_as_documented(problem):
    # Integer-valued costs add up exactly, so the ranking must match the brute force exactly.
    cost, n_stages, kw = problem
    best = brute_force(cost, n_stages, **kw)
    allowed = kw["allowed_cuts"]
    if allowed is not None and sum(allowed) + 1 < n_stages:
        with pytest.raises(PartitionError, match="cannot cut"):
            solve(cost, n_stages, **kw)
    elif best is None:
        with pytest.raises(PartitionError, match="smallest cap that fits"):
            solve(cost, n_stages, **kw)
    else:
        assert solve(cost, n_stages, **kw) == best[2]


@SMALL
@given(
    problems(
        values=st.floats(0, 1e3, allow_subnormal=False)
        | st.floats(0, 1e-6, allow_subnormal=False)
        | st.sampled_from([0.1, 0.2, 0.3, 1e9])
    )
)
def test_solve_is_optimal_for_any_floats(problem):
    cost, n_stages, kw = problem
    kw.update(mem=None, mem_cap=None)
    allowed = kw["allowed_cuts"]
    if allowed is not None and sum(allowed) + 1 < n_stages:
        return
    starts = solve(cost, n_stages, **kw)
    check_starts(starts, len(cost))
    assert len(starts) == n_stages
    if allowed is not None:
        assert all(allowed[b - 1] for b in starts[1:])
    got = max(stage_costs(cost, starts, kw["cut_cost"]))
    want = brute_force(cost, n_stages, **kw)[0]
    assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


@SMALL
@given(problems())
def test_mem_cap_is_respected_and_the_error_names_the_least_cap(problem):
    cost, n_stages, kw = problem
    mem, allowed = kw["mem"], kw["allowed_cuts"]
    if allowed is not None and sum(allowed) + 1 < n_stages:
        return
    least = brute_force(mem, n_stages, allowed_cuts=allowed)[0]
    cap = kw["mem_cap"] if kw["mem_cap"] is not None else least
    if cap >= least:
        starts = solve(cost, n_stages, **{**kw, "mem_cap": cap})
        fences = [*starts, len(cost)]
        assert all(sum(mem[i:j]) <= cap for i, j in zip(fences, fences[1:]))
        return
    with pytest.raises(PartitionError) as caught:
        solve(cost, n_stages, **kw)
    message = str(caught.value)
    assert float(re.search(r"smallest cap that fits is ([\d.e+-]+)", message)[1]) == least
    assert f"largest single node: {max(mem)!r} at position {mem.index(max(mem))}" in message
    assert solve(cost, n_stages, **{**kw, "mem_cap": least})


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_never_worse_than_uniform_or_params_splits(data):
    n_layers = data.draw(st.integers(1, 12))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=n_layers, max_size=n_layers))
    group_of = [g for g, size in enumerate(sizes) for _ in range(size)]
    n = len(group_of)
    cost = data.draw(st.lists(st.floats(0, 100), min_size=n, max_size=n))
    cut_cost = data.draw(st.lists(st.floats(0, 10), min_size=n - 1, max_size=n - 1))
    params = data.draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n))
    n_stages = data.draw(st.integers(1, n_layers))
    at_layers = [group_of[k] != group_of[k + 1] for k in range(n - 1)]

    def worst(starts):
        return max(stage_costs(cost, starts, cut_cost))

    uniform = worst(solve_uniform(group_of, n_stages))
    by_params = worst(solve_params(params, n_stages))
    free = worst(solve(cost, n_stages, cut_cost=cut_cost))
    layered = worst(solve(cost, n_stages, cut_cost=cut_cost, allowed_cuts=at_layers))
    slack = 1e-9 * (sum(cost) + sum(cut_cost)) + 1e-12
    assert layered <= uniform + slack
    assert free <= min(by_params, layered) + slack


@SMALL
@given(st.lists(st.integers(1, 9).map(float), min_size=2, max_size=8), st.integers(1, 4), st.sampled_from([0.0, 2.0]))
def test_least_imbalance_is_the_best_of_every_split(cost, n_stages, overhead):
    n_stages = min(n_stages, len(cost))
    best = min(imbalance([c + overhead for c in stage_costs(cost, [0, *chosen])])
               for chosen in itertools.combinations(range(1, len(cost)), n_stages - 1))
    assert least_imbalance(cost, n_stages, stage_overhead=overhead) == pytest.approx(best)


@SMALL
@given(st.lists(st.integers(1, 9).map(float), min_size=2, max_size=8), st.integers(1, 4),
       st.lists(st.integers(0, 4).map(float), min_size=7, max_size=7))
def test_least_imbalance_with_cut_costs_is_the_split_of_least_largest_stage(cost, n_stages, edges):
    """Each cut's cost paid by both stages beside it: the ratio of a split whose largest stage
    is least (the mean moves with the cuts, so that is what a floor for a pipeline's pace is)."""
    n_stages = min(n_stages, len(cost))
    cut_cost = edges[: len(cost) - 1]
    edge = [0.0, *cut_cost, 0.0]

    def stages(starts):
        ends = [*starts[1:], len(cost)]
        return [sum(cost[a:b]) + 1.0 + edge[a] + edge[b] for a, b in zip(starts, ends)]

    splits = [stages([0, *chosen]) for chosen in itertools.combinations(range(1, len(cost)), n_stages - 1)]
    least = min(max(s) for s in splits)
    ratios = [imbalance(s) for s in splits if max(s) <= least + 1e-9]
    got = least_imbalance(cost, n_stages, stage_overhead=1.0, cut_cost=cut_cost)
    assert any(got == pytest.approx(r) for r in ratios)
    if not any(cut_cost):
        assert got == pytest.approx(least_imbalance(cost, n_stages, stage_overhead=1.0))


def test_one_large_node_holds_the_floor_above_a_target():
    cost = [6.0] + [1.0] * 18  # the large node alone is 6 of a 24/4 = 6 mean: fine at 4 stages
    assert least_imbalance(cost, 4) == pytest.approx(1.0)
    assert least_imbalance(cost, 8) == pytest.approx(6.0 / 3.0)  # at 8 stages it is twice the mean
    assert least_imbalance(cost, 8, stage_overhead=3.0) == pytest.approx(9.0 / 6.0)


def test_tie_broken_by_cut_cost_not_float_noise():
    # 15.999999999999998 + 5 rounds to 21: a bound tested as "end <= bound + begin" would
    # split [3,3 | 2,5,1,2,5] (cut cost 1) where [3,3,2,5,1,2 | 5] (cut cost 0) ties on 16.
    cost = [3.0, 3, 2, 5, 1, 2, 5]
    cut_cost = [1.0, 1, 3, 1, 3, 0]
    allowed = [True, True, True, False, False, True]
    assert solve(cost, 2, cut_cost=cut_cost, allowed_cuts=allowed) == [0, 6]


def test_ties_go_to_the_earliest_split():
    assert solve([1.0] * 4, 2) == [0, 2]
    assert solve([1.0, 0, 0, 1], 2) == [0, 1]
    assert solve([0.0] * 5, 3) == [0, 1, 2]


def test_cut_cost_counts_on_both_sides():
    # Cutting after position 0 costs 10 on both stages; after position 2 costs 0.
    cost = [1.0, 1, 1, 1]
    assert solve(cost, 2, cut_cost=[10.0, 5, 0]) == [0, 3]
    assert stage_costs(cost, [0, 3], [10.0, 5, 0]) == [3.0, 1.0]
    assert stage_costs(cost, [0, 1], [10.0, 5, 0]) == [11.0, 13.0]


def test_allowed_cuts_are_respected():
    cost = [1.0] * 8
    allowed = [False, False, True, False, False, False, True]
    assert solve(cost, 3, allowed_cuts=allowed) == [0, 3, 7]
    assert solve(cost, 2, allowed_cuts=allowed) == [0, 3]


def test_too_many_stages():
    message = "cannot cut 40 nodes into 64 stages: at most 40 stages; lower pp or chunks"
    with pytest.raises(PartitionError, match=f"^{message}$"):
        solve([1.0] * 40, 64)
    with pytest.raises(PartitionError, match=r"at most 3 stages \(2 allowed cut positions\)"):
        solve([1.0] * 5, 4, allowed_cuts=[True, False, True, False])
    with pytest.raises(PartitionError, match="cannot cut 0 nodes into 1 stages"):
        solve([], 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cost=[1.0, -1.0]), r"cost\[1\] is -1.0"),
        (dict(cost=[1.0, float("nan")]), r"cost\[1\] is nan"),
        (dict(cost=[[1.0, 2.0]]), "flat sequence"),
        (dict(cost=[1.0, 2.0], n_stages=0), "n_stages must be at least 1, got 0"),
        (dict(cost=[1.0, 2.0], cut_cost=[1.0, 2.0]), "cut_cost has 2 entries but 2 nodes have 1"),
        (dict(cost=[1.0, 2.0], allowed_cuts=[True] * 3), "allowed_cuts has 3 entries"),
        (dict(cost=[1.0, 2.0], mem_cap=4.0), "mem_cap needs mem"),
        (dict(cost=[1.0, 2.0], mem=[1.0], mem_cap=4.0), "mem has 1 entries, expected 2"),
        (dict(cost=[1.0, 2.0], mem=[1.0, 1.0], mem_cap=-1.0), "mem_cap must be non-negative"),
    ],
)
def test_bad_input(kwargs, match):
    kwargs.setdefault("n_stages", 1)
    with pytest.raises(PartitionError, match=match):
        solve(**kwargs)


def test_mem_cap_error_message():
    with pytest.raises(PartitionError) as caught:
        solve([1.0] * 4, 2, mem=[3.0, 1.0, 1.0, 7.0], mem_cap=6.0)
    assert str(caught.value) == (
        "no split of 4 nodes into 2 stages keeps each stage's mem within mem_cap=6.0: "
        "the smallest cap that fits is 7.0 (largest single node: 7.0 at position 3); "
        "raise mem_cap or use more stages"
    )


def test_solve_params_is_solve_on_params():
    params = [10, 10**9, 3, 5 * 10**8, 7, 7, 2 * 10**8]
    for n_stages in (1, 2, 3, 5):
        assert solve_params(params, n_stages) == solve([float(p) for p in params], n_stages)
    allowed = [True, False, True, True, False, True]
    as_float = [float(p) for p in params]
    assert solve_params(params, 3, allowed) == solve(as_float, 3, allowed_cuts=allowed)


def test_solve_uniform():
    group_of = [g for g in range(10) for _ in range(2)]  # 10 layers of 2 nodes
    # Layers 0, round(2.5) = 3, 5, round(7.5) = 8: halves round up.
    assert solve_uniform(group_of, 4) == [0, 6, 10, 16]
    assert solve_uniform(group_of, 1) == [0]
    assert solve_uniform([0, 0, 4, 7, 7, 7], 3) == [0, 2, 3]  # layer ids need not be dense
    with pytest.raises(PartitionError, match="cannot cut 3 layers into 4 stages: at most 3"):
        solve_uniform([0, 1, 2], 4)
    with pytest.raises(PartitionError, match="non-decreasing: position 2 is in layer 0"):
        solve_uniform([0, 1, 0], 2)


def test_solve_split_points():
    assert solve_split_points([2, 5], 3) == [0, 3, 6]
    assert solve_split_points([], 1) == [0]
    assert solve_split_points([0, 5], 3, n_nodes=7) == [0, 1, 6]
    with pytest.raises(PartitionError, match="3 stages need 2 cut positions, got 1"):
        solve_split_points([2], 3)
    with pytest.raises(PartitionError, match=r"cut #1 \(after 2\) does not come after cut #0"):
        solve_split_points([4, 2], 3)
    with pytest.raises(PartitionError, match=r"\(after 6\) is out of range: cuts lie at 0..5 "):
        solve_split_points([2, 6], 3, n_nodes=7)
    with pytest.raises(PartitionError, match=r"cut #0 \(after -1\) is out of range"):
        solve_split_points([-1], 2)


def test_stage_costs_and_imbalance():
    assert stage_costs([1.0, 2.0, 3.0, 4.0], [0, 2, 3]) == [3.0, 3.0, 4.0]
    assert imbalance([3.0, 3.0, 4.0]) == pytest.approx(1.2)
    assert imbalance([0.0, 0.0]) == 1.0
    with pytest.raises(PartitionError):
        imbalance([])


@pytest.mark.parametrize(
    "starts, match",
    [
        ([], "at least one stage"),
        ([1, 3], "must start at 0, not 1"),
        ([0, 3, 3], "stage 2 starts at 3, not after stage 1"),
        ([0, 5], "starts at 5, past the last node 4"),
    ],
)
def test_check_starts(starts, match):
    with pytest.raises(PartitionError, match=match):
        check_starts(starts, 5)


def test_large_graph_smoke():
    # n = 3000, S = 16 with every option on; timing is measured elsewhere, not asserted.
    rng = np.random.default_rng(0)
    n = 3000
    cost = rng.random(n)
    cost[100] = 30.0  # one dominant node, as an LM head can be
    cut_cost = rng.random(n - 1) * 0.1
    mem = rng.random(n)
    allowed = rng.random(n - 1) < 0.8
    cap = mem.sum() / 12
    starts = solve(cost, 16, cut_cost=cut_cost, mem=mem, mem_cap=cap, allowed_cuts=allowed)
    assert len(starts) == 16
    check_starts(starts, n)
    assert imbalance(stage_costs(cost, solve(cost, 16), None)) < 1.5


# solve_overlapped: stage [i, j) takes max(compute, comm) + latency.


def overlapped_time(compute, i, j, cut_time, cut_latency):
    """One stage's time, written out from the definition (no prefix sums)."""
    n = len(compute)
    t = [0.0] * (n - 1) if cut_time is None else cut_time
    lat = [0.0] * (n - 1) if cut_latency is None else cut_latency
    comm = (t[i - 1] if i > 0 else 0.0) + (t[j - 1] if j < n else 0.0)
    latency = (lat[i - 1] if i > 0 else 0.0) + (lat[j - 1] if j < n else 0.0)
    return max(sum(compute[i:j]), comm) + latency


def splits(n, n_stages, mem=None, mem_cap=None, allowed_cuts=None):
    for chosen in itertools.combinations(range(1, n), n_stages - 1):
        if allowed_cuts is not None and not all(allowed_cuts[b - 1] for b in chosen):
            continue
        fences = [0, *chosen, n]
        if mem_cap is not None and any(sum(mem[i:j]) > mem_cap for i, j in zip(fences, fences[1:])):
            continue
        yield [0, *chosen]


def brute_force_overlapped(compute, n_stages, cut_time=None, cut_latency=None, mem=None, mem_cap=None,
                           allowed_cuts=None):
    """Every split ranked as solve_overlapped ranks them: (largest time, summed cut weight, starts)."""
    n = len(compute)
    t = [0.0] * (n - 1) if cut_time is None else cut_time
    lat = [0.0] * (n - 1) if cut_latency is None else cut_latency
    best = None
    for starts in splits(n, n_stages, mem, mem_cap, allowed_cuts):
        fences = [*starts, n]
        largest = max(overlapped_time(compute, i, j, cut_time, cut_latency) for i, j in zip(fences, fences[1:]))
        key = (largest, sum(t[b - 1] + lat[b - 1] for b in starts[1:]), starts)
        best = key if best is None or key < best else best
    return best


@st.composite
def overlap_problems(draw, values=st.integers(0, 6).map(float)):
    cost, n_stages, kw = draw(problems(values))
    n = len(cost)
    kw["cut_time"] = kw.pop("cut_cost")
    kw["cut_latency"] = draw(st.none() | st.lists(values, min_size=n - 1, max_size=n - 1))
    return cost, n_stages, kw


@SMALL
@given(overlap_problems(values=st.integers(0, 9).map(float)))
def test_solve_overlapped_is_optimal_with_ties_broken_as_documented(problem):
    cost, n_stages, kw = problem
    best = brute_force_overlapped(cost, n_stages, **kw)
    allowed = kw["allowed_cuts"]
    if allowed is not None and sum(allowed) + 1 < n_stages:
        with pytest.raises(PartitionError, match="cannot cut"):
            solve_overlapped(cost, n_stages, **kw)
    elif best is None:
        with pytest.raises(PartitionError, match="smallest cap that fits"):
            solve_overlapped(cost, n_stages, **kw)
    else:
        assert solve_overlapped(cost, n_stages, **kw) == best[2]


@SMALL
@given(
    overlap_problems(
        values=st.floats(0, 1e3, allow_subnormal=False)
        | st.floats(0, 1e-6, allow_subnormal=False)
        | st.sampled_from([0.1, 0.2, 0.3, 1e9])
    )
)
def test_solve_overlapped_is_exact_for_any_floats(problem):
    # Timed by overlapped_stage_times (the solver's own formula), no split may beat the answer
    # even in the last bit; against the formula written out it agrees to rounding.
    cost, n_stages, kw = problem
    kw.update(mem=None, mem_cap=None)
    allowed = kw["allowed_cuts"]
    if allowed is not None and sum(allowed) + 1 < n_stages:
        return
    starts = solve_overlapped(cost, n_stages, **kw)
    check_starts(starts, len(cost))
    assert len(starts) == n_stages
    if allowed is not None:
        assert all(allowed[b - 1] for b in starts[1:])
    times = (kw["cut_time"], kw["cut_latency"])
    got = max(t.cost for t in overlapped_stage_times(cost, starts, *times))
    for other in splits(len(cost), n_stages, allowed_cuts=allowed):
        assert got <= max(t.cost for t in overlapped_stage_times(cost, other, *times))
    want = brute_force_overlapped(cost, n_stages, *times, allowed_cuts=allowed)[0]
    assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


@SMALL
@given(overlap_problems())
def test_solve_overlapped_caps_memory_and_errs_as_solve_does(problem):
    cost, n_stages, kw = problem
    mem, allowed = kw["mem"], kw["allowed_cuts"]
    solve_kw = dict(mem=mem, mem_cap=kw["mem_cap"], allowed_cuts=allowed)
    try:
        solve(cost, n_stages, **solve_kw)
    except PartitionError as expected:
        with pytest.raises(PartitionError) as caught:
            solve_overlapped(cost, n_stages, **kw)
        assert str(caught.value) == str(expected)
        return
    starts = solve_overlapped(cost, n_stages, **kw)
    if kw["mem_cap"] is not None:
        fences = [*starts, len(cost)]
        assert all(sum(mem[i:j]) <= kw["mem_cap"] for i, j in zip(fences, fences[1:]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=40), st.data())
def test_solve_overlapped_with_a_free_link_is_solve(cost, data):
    n_stages = data.draw(st.integers(1, len(cost)))
    assert solve_overlapped(cost, n_stages) == solve(cost, n_stages)


def test_transfers_hide_behind_compute():
    # Each cut moves 1.5 s of data: the additive model would charge 2 + 1.5 + 1.5 to a middle
    # stage, but overlapped it only takes max(2, 3) = 3.
    compute = [1.0, 1.0, 1.0, 1.0]
    assert solve_overlapped(compute, 2, cut_time=[1.5, 1.5, 1.5]) == [0, 2]
    assert overlapped_stage_times(compute, [0, 2], [1.5, 1.5, 1.5]) == [
        StageTime(2.0, 1.5, 0.0, 2.0), StageTime(2.0, 1.5, 0.0, 2.0)]
    # A huge activation after position 1 makes a stage link-bound: avoided, ties to the earliest.
    assert solve_overlapped(compute, 2, cut_time=[0.5, 10.0, 0.5]) == [0, 1]
    # Latency is never hidden: 2 + 0.25 + 0.25 on both sides of the middle cut.
    times = overlapped_stage_times(compute, [0, 2], [1.5, 1.5, 1.5], [0.25, 0.25, 0.25])
    assert [t.cost for t in times] == [2.25, 2.25]
    assert [t.latency for t in times] == [0.25, 0.25]


def test_overlapped_ties_go_to_the_lighter_cuts():
    # Cuts after position 0 and 2 both give a largest time of 3; the one moving less wins.
    compute = [1.0, 1.0, 1.0, 1.0]
    assert solve_overlapped(compute, 2, cut_time=[0.5, 9.0, 0.25]) == [0, 3]
    # Both give 3.5 again; the weight of a cut is its cut_time + cut_latency (0.25 vs 1, then 1.25 vs 1).
    compute = [1.0, 1.0, 1.0, 1.5]
    assert solve_overlapped(compute, 2, cut_time=[0.25, 9.0, 0.5], cut_latency=[0.0, 0.0, 0.5]) == [0, 1]
    assert solve_overlapped(compute, 2, cut_time=[1.25, 9.0, 0.5], cut_latency=[0.0, 0.0, 0.5]) == [0, 3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(compute=[1.0, -1.0]), r"compute\[1\] is -1.0"),
        (dict(compute=[1.0, 2.0], n_stages=0), "n_stages must be at least 1, got 0"),
        (dict(compute=[1.0, 2.0], cut_time=[1.0, 2.0]), "cut_time has 2 entries but 2 nodes have 1"),
        (dict(compute=[1.0, 2.0], cut_latency=[float("inf")]), r"cut_latency\[0\] is inf"),
        (dict(compute=[1.0, 2.0], allowed_cuts=[True] * 3), "allowed_cuts has 3 entries"),
        (dict(compute=[1.0, 2.0], mem_cap=4.0), "mem_cap needs mem"),
        (dict(compute=[1.0] * 3, n_stages=4), "cannot cut 3 nodes into 4 stages: at most 3 stages"),
    ],
)
def test_solve_overlapped_bad_input(kwargs, match):
    kwargs.setdefault("n_stages", 1)
    with pytest.raises(PartitionError, match=match):
        solve_overlapped(**kwargs)


def test_overlapped_stage_times():
    compute = [1.0, 2.0, 3.0, 4.0]
    times = overlapped_stage_times(compute, [0, 2, 3], [9.0, 0.5, 4.0], [0.1, 0.2, 0.3])
    assert [(t.compute, t.comm, t.latency) for t in times] == [(3.0, 0.5, 0.2), (3.0, 4.5, 0.5), (4.0, 4.0, 0.3)]
    assert [t.cost for t in times] == [3.2, 5.0, 4.3]
    assert overlapped_stage_times(compute, [0]) == [StageTime(10.0, 0.0, 0.0, 10.0)]
    with pytest.raises(PartitionError, match="cut_time has 2 entries"):
        overlapped_stage_times(compute, [0, 2], [1.0, 2.0])
    with pytest.raises(PartitionError, match="empty stage"):
        overlapped_stage_times(compute, [0, 2, 2])


def test_overlapped_large_graph_smoke():
    rng = np.random.default_rng(0)
    n = 3000
    compute = rng.random(n)
    compute[rng.random(n) < 0.4] = 0.0  # views and getitems cost nothing
    compute[100] = 30.0
    cut_time = rng.random(n - 1)
    cut_latency = np.full(n - 1, 0.01)
    mem = rng.random(n)
    allowed = rng.random(n - 1) < 0.8
    starts = solve_overlapped(compute, 16, cut_time=cut_time, cut_latency=cut_latency, mem=mem,
                              mem_cap=mem.sum() / 12, allowed_cuts=allowed)
    assert len(starts) == 16
    check_starts(starts, n)
    additive = solve(compute, 16, cut_cost=cut_time + cut_latency, allowed_cuts=allowed)
    free = solve_overlapped(compute, 16, cut_time=cut_time, cut_latency=cut_latency, allowed_cuts=allowed)

    def largest(split):
        return max(t.cost for t in overlapped_stage_times(compute, split, cut_time, cut_latency))

    assert largest(free) <= largest(additive)


@SMALL
@given(overlap_problems(), st.floats(0, 1e3, allow_subnormal=False))
def test_solve_overlapped_counts_a_stage_overhead_exactly(problem, overhead):
    # A fixed time per stage moves no compute-bound cut, but it does move where a stage turns
    # link-bound; no split timed with the same overhead may beat the answer.
    cost, n_stages, kw = problem
    kw.update(mem=None, mem_cap=None)
    allowed = kw["allowed_cuts"]
    if allowed is not None and sum(allowed) + 1 < n_stages:
        return
    starts = solve_overlapped(cost, n_stages, **kw, stage_overhead=overhead)
    times = (kw["cut_time"], kw["cut_latency"])
    got = overlapped_stage_times(cost, starts, *times, overhead)
    assert all(t.compute >= overhead for t in got)
    for other in splits(len(cost), n_stages, allowed_cuts=allowed):
        assert max(t.cost for t in got) <= max(t.cost for t in overlapped_stage_times(cost, other, *times, overhead))
