"""Measured costs: profile a graph on its device, plan from the profile, check the plan by timing it.

The layer above partition/, emit and runtime/: it runs stages on the device. ``measured_plan``
is what ``parallelize(costs="measured")`` and ``autopipe profile`` call; see
[Note: measured costs] (partition/measured.py), [Note: stage timing] (timer.py),
[Note: segments] (profile.py) and [Note: closed loop] (closed_loop.py).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from autopipe.errors import ConfigError
from autopipe.partition.cost import graph_costs
from autopipe.partition.cuts import cut_dag
from autopipe.partition.measured import MeasuredCosts
from autopipe.partition.partitioner import analytic_seconds, partition_at
from autopipe.partition.plan import PartitionPlan
from autopipe.stages import mlp_pieces, plan_stages
from autopipe.tracer import TracedModel

from .boundary_copies import boundary_bytes
from .cache import ProfileCache, default_cache_dir
from .closed_loop import TARGET, UNPROFILED, Planned, calibrate, move_boundaries, refine, timings
from .pipeline_scale import stage_scale, stage_seconds
from .profile import DEFAULT_SEGMENTS, _rank_world, _share, on_rank0, profile_graph, profile_key, segment_starts
from .host_pace import PACE
from .loop_moves import moved, plan_cut, recut
from .timer import RunSetup, StageTiming, device_name, time_against, time_stages

__all__ = ["MeasureOptions", "measured_plan", "profile_graph", "time_stages", "time_plan", "RunSetup", "stage_scale",
           "stage_seconds",
           "StageTiming", "ProfileCache", "refine", "move_boundaries", "segment_starts", "profile_key", "device_name",
           "default_cache_dir", "DEFAULT_SEGMENTS"]


@dataclass(frozen=True)
class MeasureOptions:
    """How to measure: segments of the profile (None: DEFAULT_SEGMENTS for the mode), repetitions
    per timing, the closed loop's max/mean target (see [Note: closed loop]), re-cuts and
    boundary moves (each a timing; see [Note: boundary moves]), the cache directory (None:
    ``default_cache_dir()``; ``cache=False`` times again every time), and ``stage_scale``: how much slower each stage ran
    inside a pipeline than alone, from :func:`stage_scale` of an earlier run (one factor per
    stage; the cut and the closed loop balance the scaled times, see [Note: stage scale]).
    ``pipeline_steps=n`` has ``parallelize`` find those factors itself first: it builds a
    stand-in pipeline of a copy of the model, records n steps of it, and cuts again.
    ``passes`` times the plan's stages in ``passes * reps`` sweeps (rounds under CUDA graphs; None:
    the mode's default, see [Note: timing passes])."""

    segments: int | None = None
    reps: int = 10
    warmup: int = 2
    passes: int | None = None
    target: float = TARGET
    rounds: int = 3
    moves: int = 16
    cache: bool = True
    cache_dir: str | None = None
    stage_scale: tuple[float, ...] | None = None
    pipeline_steps: int = 0


def time_plan(traced: TracedModel, plan: PartitionPlan, setup: RunSetup, group: Any = None,
              stages: list[int] | None = None) -> list[float]:
    """The measured forward+backward seconds of ``stages`` (default: every stage), ranks sharing
    the work (collective when torch.distributed is initialised)."""
    rank, world = _rank_world(group)
    wanted = list(range(plan.num_stages)) if stages is None else list(stages)
    mine = [i for k, i in enumerate(wanted) if k % world == rank]
    timings = _share(lambda: time_stages(traced, plan, setup, mine), group, world)
    return [timings[i].seconds for i in wanted]


def measured_plan(traced: TracedModel, setup: RunSetup, partition_args: dict[str, Any], *,
                  options: MeasureOptions = MeasureOptions(),
                  measured: MeasuredCosts | str | os.PathLike[str] | None = None,
                  closed_loop: bool = True, group: Any = None) -> PartitionPlan:
    """Profile ``traced`` as ``setup`` runs it (or take ``measured``: a profile, or a profile
    file's path, read on rank 0 and sent to the others), cut it with
    ``plan_stages(traced, **partition_args)`` on the measured costs, then time the stages and cut
    again while they are unbalanced ([Note: closed loop]). Collective when torch.distributed is
    initialised: every rank ends with the same plan, or every rank raises."""
    if measured is None:
        cache = ProfileCache(options.cache_dir) if options.cache else None
        timing = dataclasses.replace(setup, reps=options.reps, warmup=options.warmup, passes=options.passes)
        measured = profile_graph(traced, timing, segments=options.segments, cache=cache, group=group)
    else:
        given = measured
        measured = on_rank0(lambda: given if isinstance(given, MeasuredCosts) else MeasuredCosts.load(given),
                            group)
        key = profile_key(traced, setup)
        key.pop("torch_version")  # a profile given by hand may come from another torch
        measured.check(key, source="the given profile")
    scale = options.stage_scale
    if scale is not None:  # see [Note: stage scale]
        partition_args = dict(partition_args, stage_scale=scale)
    plan = plan_stages(traced, measured=measured, **partition_args)
    if not closed_loop:
        return plan
    before = PACE.summary()
    plan = _close_the_loop(traced, plan, setup, measured, partition_args, options, group)
    # How often the loop's timings waited for the host's pace ([Note: host pace]), as rank 0 saw it.
    plan.cost_source = dict(plan.cost_source, host_pace=on_rank0(
        lambda: {k: PACE.summary()[k] - before[k] for k in ("timings", "waited", "short")}, group))
    return plan


def _close_the_loop(traced: TracedModel, plan: PartitionPlan, setup: RunSetup, measured: MeasuredCosts,
                    partition_args: dict[str, Any], options: MeasureOptions, group: Any) -> PartitionPlan:
    """``plan`` re-cut and its boundaries moved while its timed stages are unbalanced; see
    [Note: closed loop] and [Note: boundary moves]."""
    scale = options.stage_scale
    timing = dataclasses.replace(setup, reps=options.reps, warmup=options.warmup, passes=options.passes)
    group_of = _groups(traced, measured)

    def timed(p: PartitionPlan, stages: list[int] | None = None) -> list[float]:
        """The stages' times alone, scaled as they run in the pipeline where a scale is given."""
        times = time_plan(traced, p, timing, group, stages)
        if scale is None:
            return times
        return [t * float(scale[i]) for t, i in zip(times, range(p.num_stages) if stages is None else stages)]

    def timed_against(p: PartitionPlan, other: PartitionPlan) -> tuple[list[float], list[float]]:
        """Both plans' stages in one timing ([Note: paired timings]), on rank 0, sent to all."""
        return on_rank0(lambda: _time_both(traced, p, other, timing, scale), group)

    def corrected(factors: list[float], fixed: float | None = None) -> MeasuredCosts:
        """The profile with each group's seconds scaled by its factor (and a stage's fixed
        seconds, where given)."""
        seconds = {n: s * factors[group_of[n]] for n, s in measured.node_seconds.items()}
        return dataclasses.replace(measured, node_seconds=seconds,
                                   stage_overhead=measured.stage_overhead if fixed is None else fixed)

    def replan(factors: list[float]) -> PartitionPlan:
        return plan_stages(traced, measured=corrected(factors), **partition_args)

    def faster(a: PartitionPlan, b: PartitionPlan) -> PartitionPlan:
        """Of two plans cut into different pieces, the one whose slowest stage is faster, timed
        together ([Note: paired timings]; one after the other under CUDA graphs)."""
        ta, tb = (timed(a), timed(b)) if setup.mode.endswith("graphs") else timed_against(a, b)
        won, times = (a, ta) if max(ta) <= max(tb) else (b, tb)
        for stage, t in zip(won.stages, times):
            stage.measured_time = t
        return won

    if not isinstance(options.moves, int) or isinstance(options.moves, bool) or options.moves < 0:
        raise ConfigError(f"closed-loop boundary moves must be a non-negative integer, got {options.moves!r}")
    device = partition_args.get("device", "h100")
    plan = refine(plan, groups=len(measured.segments), target=options.target, rounds=options.rounds,
                  planned=lambda p: _planned(traced, p, measured, group_of, device),
                  measure=timed, replan=replan, scale=scale, judge=faster)
    if options.moves == 0 or partition_args.get("balance", "cost") != "cost" \
            or partition_args.get("mem_cap") is not None:
        return plan  # boundaries the user placed, or a memory cap the moves would not check, stay
    at_args = {k: v for k, v in partition_args.items() if k not in ("split_mlps", "measured", "node_seconds")}
    groups = len(measured.segments)
    planned = _planned_at(traced, measured, group_of, device, partition_args.get("activation_dtype"))
    paired = None if setup.mode.endswith("graphs") else timed_against

    def fitted() -> MeasuredCosts:
        """The profile as every timing of the loop so far corrected it ([Note: closed loop])."""
        return corrected(*(calibrate(plan.refinement, groups, planned, scale) or ([1.0] * groups,)))

    pools = bool(partition_args.get("split_mlps", True)) and partition_args.get("tp", 1) == 1  # pieces allowed
    rounds_plan = plan
    while True:
        plan = moved(traced, plan, fitted(), at_args, timed, paired, options.target, _timings_left(plan, options),
                     pools)
        if _timings_left(plan, options) <= 0 or (plan.measured_imbalance or 1.0) <= options.target:
            break
        # See [Note: re-cut from the whole fit].
        plan, kept = recut(plan, plan_stages(traced, measured=fitted(), **partition_args), timed, paired)
        if not kept:
            break
    if paired is not None and plan_cut(plan) != plan_cut(rounds_plan):  # see [Note: the moves' last judge]
        log = plan.refinement
        plan = faster(rounds_plan, plan)
        plan.refinement = log + [{"judged_moves": plan is not rounds_plan, "times": [s.measured_time for s in plan.stages],
                                  "stage_starts": [s.nodes[0] for s in plan.stages]}]
    return _priced_by_fit(traced, plan, calibrate(plan.refinement, groups, planned, scale), planned, corrected,
                          at_args)


# [Note: the moves' last judge]
# At the host's pace each move is judged in one timing beside the plan it moves, but the pace
# is not alike for every stage from one timing to the next, and moves made in a slow spell of
# some stages stay when it passes. On an H200, eager, ResNet-50 at 128 images in 8 stages,
# the rounds' last plan timed 1.063 and sixteen moves, each kept by its pair, ended at a plan
# that three fresh timings read at 1.126: the moves had given the first stages work while the
# later ones ran 1.5x slow (benchmarks/results/2026-11-28-h200-measured-balance-recut-
# resnet50-eager-128.json). So at the host's pace the plan the moves end at is timed once more
# beside the plan they started from, and the one whose slowest stage is faster is kept.
def _timings_left(plan: PartitionPlan, options: MeasureOptions) -> int:
    """What is left of the loop's budget of moves (each a timing) after ``plan``'s log."""
    return options.moves - sum("move" in e or "recut" in e for e in plan.refinement)


def _priced_by_fit(traced: TracedModel, plan: PartitionPlan, fit: tuple[list[float], float] | None,
                   planned: Planned, corrected: Any, at_args: dict[str, Any]) -> PartitionPlan:
    """``plan`` priced by the profile as every timing of the loop corrected it (``fit``), its
    measured times kept; as it is where nothing was fitted or its stages cannot be rebuilt."""
    starts = [s.nodes[0] for s in plan.stages]
    if fit is None or planned(starts, plan.mlp_pieces) is None:
        return plan
    final, graph, seconds = corrected(*fit), traced, None
    if plan.mlp_pieces:  # priced in the graph cut into its pieces, each at its share of its node
        graph = mlp_pieces.cut_mlps(traced, plan.mlp_pieces)
        seconds = mlp_pieces.piece_seconds(graph, lambda n: final.node_seconds.get(n, 0.0), final.node_seconds)
    order = [n.name for n in graph.gm.graph.nodes if n.op != "output"]
    kept = partition_at(graph, [order.index(n) for n in starts], measured=final, node_seconds=seconds, **at_args)
    kept.mlp_pieces = plan.mlp_pieces
    for stage, old in zip(kept.stages, plan.stages):
        stage.measured_time = old.measured_time
    kept.refinement = plan.refinement + [{"calibrated": [round(f, 4) for f in fit[0]], "fixed": fit[1],
                                          "timings": len(timings(plan.refinement))}]
    return kept


def _planned_at(traced: TracedModel, measured: MeasuredCosts, group_of: dict[str, int],
                device: Any = "h100", activation_dtype: torch.dtype | None = None) -> Planned:
    """``planned(stage_starts, pieces)``: each stage's profiled seconds by segment group, for
    the plan of ``traced`` cut into ``pieces`` whose stages start at those nodes (a piece counts
    its share of its node, a split or join its analytic seconds on ``device``, the copies of its
    boundaries their seconds at the profile's rate); None where a start is not a node of that graph."""
    seconds, rate = measured.node_seconds, measured.boundary_rate
    graphs: dict[str, tuple[list[str], dict[str, tuple[str, float]], dict[str, float], list[float]]] = {}

    def planned(starts: list[str], pieces: dict) -> list[dict[int, float]] | None:
        key = json.dumps(pieces, sort_keys=True)
        if key not in graphs:  # the graph cut into those pieces: its order, each piece's node and share
            split = mlp_pieces.cut_mlps(traced, pieces)
            nodes = split.gm.graph.nodes
            cut = cut_dag(split, graph_costs(split.gm), activation_dtype).cut_bytes if rate > 0 else []
            graphs[key] = ([n.name for n in nodes if n.op != "output"],
                           {n.name: n.meta[mlp_pieces.PIECE_OF] for n in nodes if mlp_pieces.PIECE_OF in n.meta},
                           _unprofiled(split, seconds, device) if pieces else {}, [float(b) * rate for b in cut])
        order, piece_of, analytic, copies = graphs[key]
        position = {n: k for k, n in enumerate(order)}
        if any(n not in position for n in starts):
            return None
        bounds = [position[n] for n in starts] + [len(order)]
        stages = [_by_group(order[a:b], seconds, group_of, piece_of, analytic) for a, b in zip(bounds, bounds[1:])]
        if copies:  # see [Note: a profile's boundary copies]
            for stage, a, b in zip(stages, bounds, bounds[1:]):
                known = (copies[a - 1] if a > 0 else 0.0) + (copies[b - 1] if b < len(order) else 0.0)
                stage[UNPROFILED] = stage.get(UNPROFILED, 0.0) + known
        return stages
    return planned


def _time_both(traced: TracedModel, plan: PartitionPlan, other: PartitionPlan, setup: RunSetup,
               scale: tuple[float, ...] | None) -> tuple[list[float], list[float]]:
    """Every stage of both plans, timed together; one after the other where they do not fit the
    device at once. Scaled as the stages run in the pipeline where a scale is given."""
    try:
        a, b = time_against(traced, plan, other, setup)
    except torch.cuda.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        a, b = time_stages(traced, plan, setup), time_stages(traced, other, setup)
    factors = [1.0] * max(plan.num_stages, other.num_stages) if scale is None else [float(f) for f in scale]
    return ([a[i].seconds * factors[i] for i in range(plan.num_stages)],
            [b[i].seconds * factors[i] for i in range(other.num_stages)])


def _groups(traced: TracedModel, measured: MeasuredCosts) -> dict[str, int]:
    """Node name -> the profile segment it was timed in."""
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    return {order[i]: k for k, seg in enumerate(measured.segments) for i in range(seg.start, seg.end)}


def _planned(traced: TracedModel, plan: PartitionPlan, measured: MeasuredCosts,
             group_of: dict[str, int], device: Any = "h100") -> list[dict[int, float]]:
    """Each stage's profiled seconds by segment group; an MLP piece counts its share of its node,
    a node the profile did not time its analytic seconds on ``device`` (see ``_by_group``), and
    the copies of the stage's boundaries their seconds at the profile's rate, as known."""
    piece_of, analytic, seconds = {}, {}, measured.node_seconds
    if plan.mlp_pieces:
        split = mlp_pieces.cut_mlps(traced, plan.mlp_pieces)
        piece_of = {n.name: n.meta[mlp_pieces.PIECE_OF] for n in split.gm.graph.nodes
                    if mlp_pieces.PIECE_OF in n.meta}
        analytic = _unprofiled(split, seconds, device)
    stages = [_by_group(stage.nodes, seconds, group_of, piece_of, analytic) for stage in plan.stages]
    if measured.boundary_rate > 0:  # see [Note: a profile's boundary copies]
        for stage, nbytes in zip(stages, boundary_bytes(plan)):
            stage[UNPROFILED] = stage.get(UNPROFILED, 0.0) + nbytes * measured.boundary_rate
    return stages


def _unprofiled(graph: TracedModel, seconds: dict[str, float], device: Any) -> dict[str, float]:
    """The analytic seconds on ``device`` of the nodes of ``graph`` (cut into pieces) that no
    profiled node is, nor a piece of one: its splits and joins."""
    pieces = {n.name for n in graph.gm.graph.nodes if mlp_pieces.PIECE_OF in n.meta}
    return {n: t for n, t in analytic_seconds(graph, device).items() if n not in seconds and n not in pieces}


def _by_group(nodes: list[str], seconds: dict[str, float], group_of: dict[str, int],
              piece_of: dict[str, tuple[str, float]], analytic: dict[str, float]) -> dict[int, float]:
    """The profiled seconds of ``nodes`` by segment group; an MLP piece (``piece_of``: its node
    and share) counts its share of its node, and a node the profile did not time (a split, a
    join) its ``analytic`` seconds under ``UNPROFILED``, as the partitioner prices it."""
    by_group: dict[int, float] = {}
    for n in nodes:
        whole, share = piece_of.get(n, (n, 1.0))
        k = group_of[whole] if whole in seconds else UNPROFILED
        by_group[k] = by_group.get(k, 0.0) + (share * seconds[whole] if whole in seconds else analytic.get(n, 0.0))
    return by_group
