"""``plan_stages()``: cut a graph into stages at node granularity, or inside MLPs where that
balances better (the graph then cut into MLP pieces: see [Note: MLP pieces] in mlp_pieces.py).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch.nn as nn

from ..errors import ConfigError, PartitionError
from ..partition.measured import MeasuredCosts
from ..partition.partitioner import analytic_seconds, partition
from ..partition.plan import PartitionPlan
from ..tracer import TracedModel
from . import mlp_pieces as pieces
from . import sample_pieces

__all__ = ["plan_stages", "SPLIT_ABOVE", "GRANULE", "SPLIT_GAIN"]

# [Note: when MLP pieces are tried]
# Only for a plan whose imbalance exceeds SPLIT_ABOVE (a balanced plan gains nothing, and
# planning stays one pass), by one refinement: every MLP slower than two granules (GRANULE of
# the mean stage's compute) is cut into pieces of about a granule, the graph is balanced
# again, and the MLPs a boundary fell inside are kept, merged to one piece per stage; the
# graph with only those is balanced a last time (the cuts it took are still there). The pieces
# are kept when the largest stage gets faster by at least SPLIT_GAIN; otherwise the node-level
# plan stands. Convolutions are cut only when asked (split_mlps="convolutions"): priced at their
# share of the whole, channel pieces on an H200 ran well over it (ResNet-50's stem in three
# pieces, 128 images: 5.6 ms against 4.0), and plans cut in them were slower at their slowest
# stage than plans cut between nodes (docs/benchmarks.md, "One GPU: convolutions cut by channel").
# A pooling slower than two granules is cut by sample the same way ([Note: sample pieces] in
# sample_pieces.py), with MLPs of linears (split_mlps=True); a pooling inside a convolution's
# run is cut with the run instead.
SPLIT_ABOVE = 0.01
SPLIT_MLPS = (True, False, "convolutions")  # what split_mlps may be
GRANULE = 0.01
SPLIT_GAIN = 0.002


def plan_stages(traced: TracedModel, pp: int, chunks: int = 1, *, split_mlps: bool | str = True,
                **partition_args: Any) -> PartitionPlan:
    """Cut ``traced`` into ``pp * chunks`` stages: :func:`~autopipe.partition.partitioner.partition`
    (``partition_args`` as for it), then, with ``split_mlps`` (balance="cost", tp=1), a boundary
    inside a large MLP of linears or pooling (by sample) where that balances better, and with
    ``split_mlps="convolutions"``
    inside convolutions too; the plan then names the graph with those cut into pieces
    (``plan.mlp_pieces``), which ``emit_stages`` builds. See [Note: when MLP pieces are tried]."""
    if split_mlps not in SPLIT_MLPS:
        raise ConfigError(f"split_mlps={split_mlps!r}: use True (MLPs of linears), \"convolutions\" (also "
                          "convolutions, by channel) or False")
    if traced.gm.meta.get(pieces.PIECES_META):
        raise ConfigError("partition() takes the traced model before any MLP pieces were cut; "
                          "pass the traced model itself (the plan names the pieces it needs)")
    args = dict(partition_args, pp=pp, chunks=chunks)
    plan = partition(traced, **args)
    if not (split_mlps and args.get("balance", "cost") == "cost" and args.get("tp", 1) == 1
            and plan.imbalance > 1.0 + SPLIT_ABOVE):
        return plan
    node_seconds: Mapping[str, float] | None = args.get("node_seconds")
    measured: MeasuredCosts | None = args.get("measured")
    if node_seconds is None and measured is not None:
        node_seconds = dict(measured.node_seconds)
    return _with_mlp_pieces(traced, plan, args, node_seconds, convolutions=split_mlps == "convolutions")


def _with_mlp_pieces(traced: TracedModel, plan: PartitionPlan, args: dict[str, Any],
                     node_seconds: Mapping[str, float] | None, convolutions: bool) -> PartitionPlan:
    modelled = analytic_seconds(traced, args.get("device", "h100"))
    granule = GRANULE * sum(s.compute_time for s in plan.stages) / plan.num_stages

    def seconds(name: str) -> float:
        if node_seconds is not None and name in node_seconds:
            return node_seconds[name]
        return modelled[name]

    fine = {}
    units: list[pieces.Mlp | sample_pieces.Pool] = [
        m for m in pieces.find_mlps(traced.gm)
        if convolutions or isinstance(traced.gm.get_submodule(m.fc1.target), nn.Linear)]
    inside = {n for m in units for n in m.nodes}  # a pooling in a run of a convolution is cut with it
    units += [p for p in sample_pieces.find_pools(traced.gm) if p.node not in inside]
    for unit in units:
        hidden = unit.hidden(traced.gm)
        k = pieces.pieces_for(sum(seconds(n.name) for n in unit.nodes), hidden, granule, unit.align)
        if k > 1:
            fine[unit.key] = unit.spec(pieces.fine_hidden(hidden, k, unit.align))
    if not fine:
        return plan
    # Where the boundaries would go if cutting were free: each piece takes its share of the
    # unsplit nodes' time, the partial sums none. The plan made from real costs follows.
    fine_traced = pieces.cut_mlps(traced, fine)
    args = {k: v for k, v in args.items() if k != "node_seconds"}  # priced here, piece by piece
    ideal = {}
    for node in fine_traced.gm.graph.nodes:
        if node.meta.get(pieces.JOIN):
            ideal[node.name] = 0.0
        elif pieces.PIECE_OF in node.meta:
            whole, share = node.meta[pieces.PIECE_OF]
            ideal[node.name] = share * seconds(whole)
        elif node_seconds is not None and node.name in node_seconds:
            ideal[node.name] = node_seconds[node.name]
    try:
        fine_plan = partition(fine_traced, **args, node_seconds=ideal)
    except PartitionError:  # the pieces leave fewer places to cut than the stages need
        return plan
    kept = pieces.coarse_pieces(fine, fine_plan.stage_of(), fine_traced.gm)
    if not kept:
        return plan
    split_traced = pieces.cut_mlps(traced, kept)
    split_seconds = None
    if node_seconds is not None:  # a piece takes its share of the measured node; the rest as measured
        split_seconds = pieces.piece_seconds(split_traced, seconds, node_seconds)
    try:
        split = partition(split_traced, **args, node_seconds=split_seconds)
    except PartitionError:
        return plan
    split.mlp_pieces = kept
    largest = max(s.cost for s in plan.stages)
    return split if max(s.cost for s in split.stages) < largest * (1.0 - SPLIT_GAIN) else plan
