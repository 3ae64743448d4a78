"""Make a measured cost profile of a traced graph: segments timed on the device, cached on disk.

See [Note: measured costs] (partition/measured.py) for what a profile is and how the
partitioner uses it, and [Note: stage timing] (timer.py) for how a segment is timed.

[Note: segments]
A profile runs the graph in segments cut where stages may be cut (``partition.cuts.cut_candidates``),
as evenly as the analytic model can tell (the min-max balancer cutting the graph into
``count`` parts). In the eager and CUDA-graph modes each segment is timed whole and, under the
profiler, node by node ([Note: node times from kernels] in kernels.py): the node times are what
the balancer cuts by, at node granularity, and the segments serve to share the work among
ranks, to bound the memory (one segment on the device at a time), and to measure what no
node owns: the fixed cost of running a stage at all (its first launch, autograd's start, the
cast of its outputs), the median over segments of what their timing exceeds their nodes by
(under CUDA graphs, beyond the copies of what crosses their boundaries: [Note: a profile's
boundary copies] in boundary_copies.py), and in eager mode the host's cost of launching a
kernel and of running a node, which price the nodes through the launch queue ([Note: eager
launch queue] in eager_host.py). 16 segments by default. On a CPU the ops run as they are
called, so each segment's wall time is exact: the profiler's op times (which it
inflates by a few us an op) only split it among the segment's nodes; the whole graph is also
timed as one stage, and what the segments add up to beyond it is K - 1 stages' fixed cost.
Compiled modes fuse nodes into kernels no single node owns: there each segment is timed whole
(24 by default: every one is compiled) and its time spread over its nodes by the analytic model.

[Note: segment pairs]
An eager segment's timing is its nodes' launch-queue replay plus a stage's fixed cost. Where
the segments hold about as many nodes each (ResNet-152's 16), a fixed cost and a launch cost
per node fit the segments' timings equally well in many proportions (on the H100 rows at 32
images, any fixed cost from 1.25 to 1.94 ms was within 0.5% of the best fit), and a stage of
four segments, which pays the fixed cost once where its segments paid it four times, is
priced by whichever proportion the fit picked: ResNet-152's stages came out 0.80x their
timings, every one alike. A pair of adjacent segments timed whole holds twice the nodes of
one and pays the fixed cost once, which tells the two apart. ``PAIRS_TIMED`` pairs spread
over the graph are timed so (without the profiler) and fitted with the segments, the few pairs
weighing as much as all the segments (``fit_launch_costs``); the profile keeps them
(``MeasuredCosts.pairs``). On an H100 at 32 images ResNet-152's pairs took 1.05-1.11x their two
segments: no fixed cost, a larger cost per node, and its stages priced within 8% of their
timings (0.20-0.53 off before). They add about a quarter of the segments' timing.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopipe.errors import ProfileError, positive_int
from autopipe.partition import balance as balancer
from autopipe.partition.device import DeviceProfile, get_profile, gpu_profile_name
from autopipe.partition.measured import MeasuredCosts, Segment, dtype_name, fingerprint, spread
from autopipe.partition.cuts import cut_candidates
from autopipe.partition.partitioner import analytic_seconds, partition_at
from autopipe.tracer import TracedModel

from .boundary_copies import boundary_bytes, fit_boundary_rate
from .cache import ProfileCache
from .eager_host import NodeWork, fit_launch_costs, queue_prices
from .timer import RunSetup, StageTiming, device_name, time_stages

__all__ = ["profile_graph", "segment_starts", "profile_key", "DEFAULT_SEGMENTS"]

DEFAULT_SEGMENTS = {"eager": 16, "graphs": 16, "compiled": 24, "compiled+graphs": 24}
PAIRS_TIMED = 4  # eager mode: pairs of adjacent segments timed whole; see [Note: segment pairs]


def segment_starts(traced: TracedModel, count: int, analytic: DeviceProfile | str = "h100") -> list[int]:
    """Start positions of at most ``count`` segments; see [Note: segments]."""
    positive_int("segments", count, ProfileError)
    seconds = analytic_seconds(traced, analytic)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    # A cut is a candidate only where work was done since the last one: a segment of views
    # alone launches nothing, and its outputs alias its inputs (no graph can capture that).
    allowed, work = cut_candidates(traced), 0.0
    for k, name in enumerate(order[:-1]):
        work += seconds[name]
        if allowed[k] and work > 0:
            work = 0.0
        else:
            allowed[k] = False
    count = min(count, sum(allowed) + 1)
    return balancer.solve([seconds[n] for n in order], count, allowed_cuts=allowed)


def profile_key(traced: TracedModel, setup: RunSetup) -> dict[str, Any]:
    """What a profile of ``traced`` run as ``setup`` must match; see MeasuredCosts.key."""
    return {"fingerprint": fingerprint(traced.gm), "input_shapes": [list(s) for s in traced.input_shapes],
            "dtype": dtype_name(setup.compute_dtype), "mode": setup.mode, "recompute": setup.recompute,
            "device": device_name(setup.device), "torch_version": torch.__version__}


def profile_graph(traced: TracedModel, setup: RunSetup, *, segments: int | None = None,
                  analytic: DeviceProfile | str | None = None, cache: ProfileCache | None = None,
                  group: Any = None) -> MeasuredCosts:
    """Time ``traced`` on ``setup.device`` segment by segment; a cached profile when one fits.

    Collective when torch.distributed is initialised (or ``group`` is given): every rank calls
    it with the same graph; ranks time a share of the segments each and gather the rest, and
    all of them return the same profile (rank 0's cache decides whether to time at all).
    """
    analytic = get_profile(analytic or ("cpu" if setup.device.type == "cpu" else gpu_profile_name(device_name(setup.device))))
    count = segments or DEFAULT_SEGMENTS[setup.mode]
    key = profile_key(traced, setup)
    rank, world = _rank_world(group)
    cached = on_rank0(lambda: cache.load(key, count) if cache is not None else None, group)
    if cached is not None:
        return cached

    begin, rate = time.perf_counter(), 0.0
    starts = segment_starts(traced, count, analytic)
    plan = partition_at(traced, starts, device=analytic, activation_dtype=setup.compute_dtype)
    mine = [i for i in range(plan.num_stages) if i % world == rank]
    by_kernels = not setup.mode.startswith("compiled")
    timings = _share(lambda: time_stages(traced, plan, setup, mine, kernels=by_kernels), group, world)
    order = [n for s in plan.stages for n in s.nodes]
    ends = starts[1:] + [len(order)]
    segs = [Segment(a, b, timings[i].forward, timings[i].backward) for i, (a, b) in enumerate(zip(starts, ends))]
    modelled = analytic_seconds(traced, analytic)
    detail: dict[str, list[float]] = {}
    pairs: list[Segment] = []
    stage_timings = [timings[i] for i in range(plan.num_stages)]
    for t in stage_timings if by_kernels else ():
        for n, (f, b) in t.nodes.device.items():
            detail[n] = [f, b, *t.nodes.host[n], *t.nodes.kernels[n]]
    if by_kernels and setup.device.type == "cpu":
        # On a CPU the ops run as they are called, so a segment's wall time is exact and the
        # profiler's own cost (a few us an op) is not: its op times only split the segment.
        # Every segment also pays a stage's fixed cost once; the whole graph timed as one stage
        # tells how much: ``overhead``, which a plan adds once per stage. Every rank times it
        # at once, as they time their segments and as they train: ranks on one machine share
        # its caches and memory bandwidth (ResNet-18 at 8 samples: 13% slower with the other
        # core busy), and one rank timing it alone made every stage that much too short.
        wholes = _share(lambda: {rank: time_stages(traced, partition_at(traced, [0], device=analytic,
                                                                         activation_dtype=setup.compute_dtype),
                                                   setup)[0]}, group, world)
        whole = statistics.fmean(t.seconds for t in wholes.values())
        total = sum(seg.seconds for seg in segs)
        overhead = min(max((total - whole) / max(len(segs) - 1, 1), 0.0), 0.5 * whole)
        scale = (whole - overhead) / total if total > 0 else 1.0
        segs = [Segment(seg.start, seg.end, seg.forward * scale, seg.backward * scale) for seg in segs]
        seconds = spread(segs, order, [sum(detail.get(n, (0.0, 0.0))[:2]) for n in order])
    elif setup.mode == "eager":
        timed = _timed_pairs(traced, starts, setup, analytic, stage_timings, group, rank, world)
        pairs = [Segment(order.index(nodes[0]), order.index(nodes[-1]) + 1, t.forward, t.backward)
                 for nodes, t, _ in timed]
        seconds, overhead = _eager_prices(plan, stage_timings, [(nodes, t.seconds, lost) for nodes, t, lost in timed])
    elif by_kernels:
        seconds, overhead, rate = _from_kernels(plan, stage_timings, modelled)
    else:
        seconds, overhead = spread(segs, order, [modelled[n] for n in order]), 0.0
    measured = MeasuredCosts(
        key["fingerprint"], key["input_shapes"], key["dtype"], key["mode"], key["device"], key["torch_version"],
        segs, seconds, time.perf_counter() - begin, recompute=setup.recompute, stage_overhead=overhead,
        node_detail=detail, pairs=pairs, boundary_rate=rate)
    if cache is not None and rank == 0:
        cache.save(measured, count)
    return measured


def _rank_world(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def on_rank0(work: Callable[[], Any], group: Any = None) -> Any:
    """``work()`` done on rank 0 and its result sent to every rank; if it raises, every rank
    raises (a ProfileError naming it), so that none waits for a value that never comes."""
    _, world = _rank_world(group)
    if world == 1:
        return work()
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box = [("ok", work())]
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank, typed
            box = [("error", exc if isinstance(exc, ProfileError) else ProfileError(f"{type(exc).__name__}: {exc}"))]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def _share(work: Callable[[], dict[int, StageTiming]], group: Any, world: int) -> dict[int, StageTiming]:
    """Every rank's share of the timings, on every rank. A rank that fails still takes part in
    the gather (with its error), so that every rank raises instead of one waiting forever."""
    try:
        result: dict[int, StageTiming] | str = work()
    except Exception as exc:  # noqa: BLE001 - re-raised below on every rank, typed
        if world == 1:
            raise
        result = f"{type(exc).__name__}: {exc}"
    if world == 1:
        return result  # type: ignore[return-value]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, result, group=group)
    failed = [f"rank {r}: {p}" for r, p in enumerate(parts) if isinstance(p, str)]
    if failed:
        raise ProfileError("timing the profile's segments failed on " + "; ".join(failed))
    merged: dict[int, StageTiming] = {}
    for part in parts:
        merged.update(part)
    return merged


def _timed_pairs(traced: TracedModel, starts: list[int], setup: RunSetup, analytic: DeviceProfile,
                 segments: list[StageTiming], group: Any, rank: int,
                 world: int) -> list[tuple[list[str], StageTiming, float]]:
    """A few pairs of adjacent segments, each timed whole as one stage: (nodes, timing, device
    seconds no node claims). See [Note: segment pairs]."""
    pairs = partition_at(traced, starts[::2], device=analytic, activation_dtype=setup.compute_dtype)
    whole = [p for p in range(pairs.num_stages) if 2 * p + 1 < len(starts)]
    if not whole:
        return []
    picked = sorted({whole[round(k * (len(whole) - 1) / max(PAIRS_TIMED - 1, 1))]
                     for k in range(min(PAIRS_TIMED, len(whole)))})
    mine = [p for k, p in enumerate(picked) if k % world == rank]
    timings = _share(lambda: time_stages(traced, pairs, setup, mine), group, world)
    return [(pairs.stages[p].nodes, timings[p],
             sum(segments[2 * p].nodes.unattributed) + sum(segments[2 * p + 1].nodes.unattributed))
            for p in picked]


def _from_kernels(plan: Any, timings: list[StageTiming],
                  modelled: dict[str, float]) -> tuple[dict[str, float], float, float]:
    """Per-node seconds from the segments' kernel times, the fixed cost of a stage, and the
    seconds per byte crossing a stage's boundaries (CUDA graphs); see [Note: segments] and
    [Note: a profile's boundary copies]."""
    seconds: dict[str, float] = {}
    excess = []
    for stage, timing in zip(plan.stages, timings):
        nodes = timing.nodes
        own = {n: sum(nodes.device.get(n, (0.0, 0.0))) for n in stage.nodes}
        # What no node claimed (gradient accumulation, ...) goes to the nodes by their share.
        lost = sum(nodes.unattributed)
        total = sum(own.values())
        weights = own if total > 0 else {n: modelled.get(n, 0.0) for n in stage.nodes}
        norm = sum(weights.values()) or 1.0
        for n in stage.nodes:
            seconds[n] = own.get(n, 0.0) + lost * weights.get(n, 0.0) / norm
        excess.append(timing.seconds - sum(seconds[n] for n in stage.nodes))
    # The copies into and out of the static buffers run outside the profiled nodes: they are
    # in the excess, by the bytes crossing each segment's boundaries.
    nbytes = boundary_bytes(plan)
    rate = fit_boundary_rate(excess, nbytes)
    fixed = [e - rate * b for e, b in zip(excess, nbytes)]
    return seconds, max(statistics.median(fixed), 0.0) if fixed else 0.0, rate


def _eager_prices(plan: Any, timings: list[StageTiming],
                  pairs: list[tuple[list[str], float, float]] = ()) -> tuple[dict[str, float], float]:
    """Eager node prices: each segment's nodes replayed through the launch queue, with the launch
    costs and a stage's fixed cost fitted on the segments' own timings and on ``pairs`` of them
    timed whole ([Note: eager launch queue], [Note: segment pairs]); what no node claims goes to
    the nodes by their price."""
    work: dict[str, NodeWork] = {}
    for timing in timings:
        nodes = timing.nodes
        for n, (f, b) in nodes.device.items():
            hf, hb = nodes.host.get(n, (0.0, 0.0))
            kf, kb = nodes.kernels.get(n, (0, 0))
            work[n] = (f, b, kf, kb, kf > 0 or hf > 0, kb > 0 or hb > 0)
    launch, fixed = fit_launch_costs(
        [(stage.nodes, timing.seconds, sum(timing.nodes.unattributed)) for stage, timing in zip(plan.stages, timings)],
        work, pairs)
    seconds: dict[str, float] = {}
    for stage, timing in zip(plan.stages, timings):
        own = queue_prices(stage.nodes, work, launch)
        total, lost = sum(own.values()), sum(timing.nodes.unattributed)
        for n in stage.nodes:
            seconds[n] = own[n] + (lost * own[n] / total if total > 0 else lost / len(stage.nodes))
    return seconds, fixed
