"""The closed loop's steps after its rounds, on the graph a plan is cut in: boundary moves in
the graph whose poolings are cut finer ([Note: finer pieces]), and the re-cut from the whole
fit ([Note: re-cut from the whole fit]). ``measure/__init__.py`` runs them."""
from __future__ import annotations

import json
from typing import Any

from autopipe.errors import PartitionError
from autopipe.partition.cuts import cut_candidates
from autopipe.partition.measured import MeasuredCosts
from autopipe.partition.partitioner import partition_at
from autopipe.partition.plan import PartitionPlan
from autopipe.stages import finer_pieces, mlp_pieces
from autopipe.stages.piece_state import normalise
from autopipe.tracer import TracedModel

from .closed_loop import move_boundaries

__all__ = ["moved", "recut", "plan_cut", "RECUT_GAIN"]

RECUT_GAIN = 0.002  # how much faster a re-cut's slowest stage must be to replace the plan


def plan_cut(plan: PartitionPlan) -> tuple:
    """What tells two plans apart: their stage starts and their pieces."""
    return tuple(s.nodes[0] for s in plan.stages), json.dumps(plan.mlp_pieces or {}, sort_keys=True)


def moved(traced: TracedModel, plan: PartitionPlan, priced: MeasuredCosts, at_args: dict[str, Any],
          timed: Any, paired: Any, target: float, moves: int, pools: bool = True) -> PartitionPlan:
    """``plan`` with its boundaries moved ([Note: boundary moves]), each moved plan priced by
    ``priced``; in the graph cut into the plan's pieces, its poolings cut finer ([Note: finer
    pieces]), with ``pools`` those it left whole too, its MLPs' pieces as they are."""
    if moves <= 0:
        return plan
    graphs = _PieceGraphs(traced, priced)
    pieces = plan.mlp_pieces or {}
    fine = finer_pieces.finer({**(finer_pieces.whole_pools(traced.gm, pieces) if pools else {}), **pieces})
    graph = graphs.get(fine)
    starts = finer_pieces.translate([s.nodes[0] for s in plan.stages], graphs.get(pieces).gm, pieces, graph.gm, fine,
                                    graphs.original)
    if starts is None:  # a start with no counterpart there: moved in the plan's own graph
        fine, graph = normalise(pieces), graphs.get(pieces)
        starts = [s.nodes[0] for s in plan.stages]
    order = [n.name for n in graph.gm.graph.nodes if n.op != "output"]
    seconds = graphs.seconds(fine)

    def cut_at(new: list[int]) -> PartitionPlan:
        moved = partition_at(graph, new, measured=priced, node_seconds=seconds, **at_args)
        if fine == normalise(pieces):
            moved.mlp_pieces = plan.mlp_pieces
            return moved
        # Merged back to one piece per stage: the plan that runs.
        kept = {**{k: v for k, v in fine.items() if k not in finer_pieces.sample_pieces_only(fine)},
                **mlp_pieces.coarse_pieces(finer_pieces.sample_pieces_only(fine), moved.stage_of(), graph.gm)}
        coarse = graphs.get(kept)
        names = finer_pieces.translate([s.nodes[0] for s in moved.stages], graph.gm, fine, coarse.gm, kept,
                                       graphs.original)
        if names is None:
            raise PartitionError(f"stage starts {[s.nodes[0] for s in moved.stages]} have no counterpart in the "
                                 f"graph cut at {kept}")
        where = {n.name: k for k, n in enumerate(coarse.gm.graph.nodes)}
        merged = partition_at(coarse, [where[n] for n in names], measured=priced, node_seconds=graphs.seconds(kept),
                              **at_args)
        merged.mlp_pieces = kept
        return merged

    position = {n: k for k, n in enumerate(order)}
    allowed = cut_candidates(graph)
    if fine != normalise(pieces):  # only at nodes the merged plan has too (not a split's part)
        can = finer_pieces.startable(graph.gm, fine, graphs.original)
        allowed = [a and k + 1 < len(order) and order[k + 1] in can for k, a in enumerate(allowed)]
    return move_boundaries(plan, order=order, allowed=allowed,
                           seconds=[seconds.get(n, 0.0) for n in order], measure=timed, cut_at=cut_at,
                           target=target, moves=moves, paired=paired, starts=[position[n] for n in starts])


class _PieceGraphs:
    """``traced`` cut into pieces, by the pieces (each built once), and its nodes' seconds there
    as ``priced`` prices them (a piece at its share of its node; splits and joins left out, to
    be priced analytically)."""

    def __init__(self, traced: TracedModel, priced: MeasuredCosts) -> None:
        self.traced, self.priced = traced, priced
        self.original = {n.name for n in traced.gm.graph.nodes}
        self.graphs: dict[str, TracedModel] = {}

    def get(self, pieces: dict) -> TracedModel:
        key = json.dumps(normalise(pieces), sort_keys=True)
        if key not in self.graphs:
            self.graphs[key] = mlp_pieces.cut_mlps(self.traced, pieces) if pieces else self.traced
        return self.graphs[key]

    def seconds(self, pieces: dict) -> dict[str, float]:
        if not pieces:
            return dict(self.priced.node_seconds)
        known = self.priced.node_seconds
        return mlp_pieces.piece_seconds(self.get(pieces), lambda n: known.get(n, 0.0), known)


# [Note: re-cut from the whole fit]
# The rounds' re-cuts are fitted on the rounds' timings alone; the moves time many more plans.
# So where the moves stop above the target, the graph is cut once more (``plan_stages``,
# pieces and all) from the profile as every timing so far corrected it (``calibrate``); the
# candidate is timed beside the current plan (paired at the host's pace), kept if its slowest
# stage is faster, and moved in turn; until a re-cut is not kept, was timed before, or the
# moves' budget is spent. Re-cuts count in that budget and are logged as ``{"recut": k, ...}``.
# It is a try, not a sure step: the fit pulls each group's factor towards the profile, so
# groups few timings tell apart stay off by a few percent. On an H200 under CUDA graphs,
# ResNet-50 at 128 images in 8 stages, the re-cut after the moves timed 4.37 ms at its slowest
# stage against the moved plan's 4.24, and was not kept (benchmarks/results/2026-11-28-h200-
# measured-balance-recut-resnet50-graphs-128.json).
# A re-cut replaces the plan only where its slowest stage is faster by RECUT_GAIN: the plan
# holds the moves made so far, and a re-cut as fast within the timings' noise throws them
# away. On the H200 under CUDA graphs, ResNet-50 at 128 images in 4x2 stages, a re-cut without
# the pool's pieces replaced the moved plan at 3.7597 ms against 3.7608 (its front stages
# 2.76 and 3.67 ms against 3.36 and 3.39), and three of the six moves left went on cutting
# the pool again (benchmarks/results/2026-11-30-h200-measured-balance-pool-moves-graphs-128-
# resnet50.json).
# A plan in pieces has nodes no profile segment timed: the split before a pooling's pieces, the
# concatenation after them, the partial sums of an MLP's. The partitioner prices them
# analytically, so the fit takes them at that price, known (``UNPROFILED``), instead of
# spreading their time over the groups' factors. Before, the split's backward (a copy of the
# pool's whole input) went into the stem's factor. On the H200, ResNet-50 at 128 images under
# CUDA graphs: the kept plan's first stage was priced 3.98 ms against 3.71 timed, and the
# largest error of any stage was 7.2% (...-sample-pieces-priced-resnet50-graphs-128.json);
# with it, 3.5% (...-recut-resnet50-graphs-128.json).
def recut(plan: PartitionPlan, candidate: PartitionPlan, timed: Any, paired: Any) -> tuple[PartitionPlan, bool]:
    """``candidate`` (the graph cut again from the loop's whole fit) timed against ``plan``, and
    the candidate where its slowest stage is faster by ``RECUT_GAIN``, else ``plan``; whether
    that is the candidate. A candidate the loop has timed already is not timed again."""
    log = plan.refinement
    seen = {(tuple(e["stage_starts"]), json.dumps(e.get("mlp_pieces", {}), sort_keys=True))
            for e in log if "stage_starts" in e and ("round" in e or "move" in e or "recut" in e)}
    if plan_cut(candidate) in seen:
        return plan, False
    entry: dict[str, Any] = {"recut": 1 + sum("recut" in e for e in log),
                             **({"mlp_pieces": candidate.mlp_pieces} if candidate.mlp_pieces else {})}
    if paired is not None:  # both plans in one timing; the current plan's times from it
        now, times = ([float(t) for t in ts] for ts in paired(plan, candidate))
        for stage, t in zip(plan.stages, now):
            stage.measured_time = t
        entry.update(current=now, current_starts=[s.nodes[0] for s in plan.stages],
                     current_pieces=plan.mlp_pieces or {})
    else:
        times = [float(t) for t in timed(candidate)]
    kept = max(times) < max(s.measured_time or 0.0 for s in plan.stages) * (1.0 - RECUT_GAIN)
    log.append({**entry, "stages": list(range(candidate.num_stages)), "measured": times, "kept": kept,
                "stage_starts": [s.nodes[0] for s in candidate.stages]})
    if not kept:
        return plan, False
    for stage, t in zip(candidate.stages, times):
        stage.measured_time = t
    candidate.refinement = log
    return candidate, True
