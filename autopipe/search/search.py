"""Choose a layout: every way to run the model on N devices, priced, ranked, and the rest refused.

[Note: layout search]
The search weighs every layout that the devices, the batch, the heads and widths allow
(search/layouts.py): pp x tp x dp, micro-batches, chunks, schedule, sequence parallelism,
activation checkpointing and the execution mode (CUDA graphs and compiled stages where they
apply). It is meant to answer in seconds, so it prices in two passes:
- every candidate is estimated on cuts made once per graph and stage count: its stages' times
  at its own micro-batch size and mode, and the pipeline's step as the busiest rank's work plus
  the fill and drain of the slowest stage (no replay);
- the best ``exact`` by that estimate that fit in memory are priced in full ([Note: step
  prediction]): cut for their own costs, their schedules replayed.
The ranking is by predicted step time; a layout that does not fit the memory budget is kept
with its reason, as is every impossible one.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from torch.nn.modules.batchnorm import _BatchNorm

from autopipe.errors import ConfigError, ShardingError, positive_int
from autopipe.partition import balance as balancer
from autopipe.partition.cost import graph_costs
from autopipe.partition.measured import MeasuredCosts
from autopipe.runtime.schedule import max_in_flight_bound
from autopipe.shard import plan_sharding
from autopipe.tracer import TracedModel

from . import predict as pricing_module
from .costs import GraphCosts
from .layouts import Layout, layouts
from .predict import Prediction, Pricing, predict, stage_overhead
from .report import format_search

__all__ = ["SearchResult", "search_layouts", "Rejected", "min_microbatch"]


@dataclass(frozen=True)
class Rejected:
    layout: str
    reason: str


@dataclass
class SearchResult:
    """The ranked predictions (fastest first) and every refused layout with its reason."""

    ranked: list[Prediction]
    rejected: list[Rejected]
    devices: int
    batch: int
    device: str
    memory_budget: float | None
    links: str
    costs: str
    seconds: float = 0.0
    estimated: int = 0  # layouts priced by the first pass
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Prediction:
        return self.ranked[0]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": 1, "devices": self.devices, "batch": self.batch, "device": self.device,
                "memory_budget": self.memory_budget, "links": self.links, "costs": self.costs,
                "seconds": self.seconds, "estimated": self.estimated,
                "ranked": [p.to_dict() for p in self.ranked],
                "rejected": [{"layout": r.layout, "reason": r.reason} for r in self.rejected]}

    def __str__(self) -> str:
        return format_search(self)


def _graphs(traced: TracedModel, reference: int, tps: Sequence[int], measured: Mapping[int, MeasuredCosts] | Sequence[MeasuredCosts] | None,
            rejected: list[Rejected], sequence_parallel: bool) -> dict[tuple[int, bool], GraphCosts]:
    """The costs of every tensor-parallel degree the model's heads and widths allow."""
    base = graph_costs(traced.gm)
    graphs: dict[tuple[int, bool], GraphCosts] = {}
    for tp in tps:
        for sp in ((False, True) if tp > 1 and sequence_parallel else (False,)):
            if tp == 1:
                graphs[(1, False)] = GraphCosts(traced, reference, base_costs=base, measured=measured)
                continue
            # Sequence parallelism needs micro-batches that split over tp, which the layouts
            # check at their own size; the plan's choices do not depend on it.
            planned = dataclasses.replace(traced, input_shapes=[(tp * reference, *s[1:]) if s else s
                                                                for s in traced.input_shapes]) if sp else traced
            try:
                plan = plan_sharding(planned, tp, sequence_parallel=sp)
            except ShardingError as exc:
                lines = str(exc).splitlines()
                rejected.append(Rejected(f"tp{tp}{' sp' if sp else ''}", " ".join(l.strip(" -") for l in lines[:2])))
                continue
            graphs[(tp, sp)] = GraphCosts(traced, reference, shard_plan=plan, base_costs=base, measured=measured)
    return graphs


def _estimate(graph: GraphCosts, layout: Layout, pricing: Pricing, cuts: dict) -> tuple[float, float]:
    """(step seconds, memory bytes) of the first pass; see [Note: layout search]."""
    size = layout.microbatch_size(pricing.batch)
    fwd, bwd = pricing_module._node_seconds(graph, layout, size, pricing)
    stages = layout.pp * layout.chunks
    key = (id(graph), stages)
    if key not in cuts:
        ref_f, ref_b = graph.node_times(graph.reference_size, pricing.profile.with_mode("graphs"))
        cuts[key] = [0] if stages == 1 else balancer.solve_overlapped(
            ref_f + ref_b, stages, allowed_cuts=graph.allowed)
    starts = cuts[key]
    ends = starts[1:] + [len(fwd)]
    total = np.concatenate(([0.0], np.cumsum(fwd + bwd)))
    overhead = stage_overhead(pricing, layout, graph, size)
    stage = [float(total[j] - total[i]) + overhead + pricing.action_overhead * 2 for i, j in zip(starts, ends)]
    busy = max(sum(stage[s] for s in range(r, stages, layout.pp)) for r in range(layout.pp))
    fill = (layout.pp - 1) * max(stage)
    pipeline = layout.microbatches * busy + fill
    params = float(graph.param_count.sum()) / layout.pp
    grads = float(graph.param_bytes.sum()) / layout.pp
    step = pipeline + pricing.links.all_reduce(grads, layout.dp) + \
        params * pricing.optimizer_bytes / pricing.profile.mem_bandwidth
    # Memory: state of the fullest stage's rank, activations of the micro-batches it holds.
    state = np.concatenate(([0.0], np.cumsum(graph.state_bytes + graph.param_count * pricing.weight_cast_bytes)))
    saved = np.concatenate(([0.0], np.cumsum(graph.saved_ref * size / graph.reference_size
                                             * pricing.activation_bytes)))  # as predict._memory prices it
    held = max_in_flight_bound(layout.schedule, layout.pp, layout.microbatches, layout.chunks, 0)
    per_rank_state = max(sum(float(state[ends[s]] - state[starts[s]]) for s in range(r, stages, layout.pp))
                         for r in range(layout.pp))
    per_stage_saved = max(float(saved[j] - saved[i]) for i, j in zip(starts, ends))
    activations = per_stage_saved * (1 if layout.recompute else held) * layout.chunks
    return step, (per_rank_state + activations) * pricing_module.FRAGMENTATION


def min_microbatch(traced: TracedModel) -> tuple[int, str]:
    """The fewest samples a micro-batch may hold, and the BatchNorm that says so: in train()
    a batch norm needs more than one value per channel (torch raises otherwise), and one whose
    input is 1x1 per sample gets one value per sample. (1, "") when nothing limits it."""
    floor, name = 1, ""
    for node in traced.gm.graph.nodes:
        if node.op != "call_module" or not isinstance(traced.gm.get_submodule(node.target), _BatchNorm):
            continue
        value = node.meta.get("val")
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) < 2:
            continue
        per_sample = math.prod(shape[2:])
        if per_sample <= 1 and floor < 2:
            floor, name = 2, node.target
    return floor, name


def search_layouts(traced: TracedModel, *, devices: int, batch: int, pricing: Pricing, modes: tuple[str, ...],
                   memory: float | None = None, measured: Mapping[int, MeasuredCosts] | Sequence[MeasuredCosts] | None = None,
                   exact: int = 24, chunk_options: tuple[int, ...] = (1, 2, 4),
                   recompute_options: tuple[bool, ...] = (False, True), sequence_parallel: bool = True,
                   timeline: bool = True) -> SearchResult:
    """Rank every layout of ``traced`` (one micro-batch of it traced) on ``devices`` devices for
    a global ``batch``; see [Note: layout search]. ``memory`` is the budget per device (bytes)."""
    begin = time.perf_counter()
    for name, value in (("devices", devices), ("batch", batch)):
        positive_int(name, value)
    reference = traced.input_shapes[0][0] if traced.input_shapes and traced.input_shapes[0] else 1
    rejected: list[Rejected] = []
    candidates: list[Layout] = []
    for layout, what, why in layouts(devices, batch, modes=modes, chunk_options=chunk_options,
                                     recompute_options=recompute_options):
        if layout is None:
            rejected.append(Rejected(what, why))
        else:
            candidates.append(layout)
    floor, norm = min_microbatch(traced)
    small = [c for c in candidates if c.microbatch_size(batch) < floor]
    for layout in small:
        rejected.append(Rejected(str(layout), f"BatchNorm {norm} would normalise 1 value per channel in a micro-batch "
                                              f"of {layout.microbatch_size(batch)} sample(s); train() needs more: "
                                              f"micro-batches of at least {floor}"))
    candidates = [c for c in candidates if c.microbatch_size(batch) >= floor]
    tps = sorted({c.tp for c in candidates})
    graphs = _graphs(traced, reference, tps, measured, rejected, sequence_parallel)
    cuts: dict = {}
    estimates = []
    for layout in candidates:
        graph = graphs.get((layout.tp, layout.sequence_parallel))
        if graph is None:
            continue
        stages = layout.pp * layout.chunks
        if int(graph.allowed.sum()) + 1 < stages:
            rejected.append(Rejected(str(layout), f"the graph has {int(graph.allowed.sum()) + 1} places to cut "
                                                  f"at most, fewer than {stages} stages"))
            continue
        step, mem = _estimate(graph, layout, pricing, cuts)
        estimates.append((step, mem, layout))
    fitting = sorted((e for e in estimates if memory is None or e[1] <= memory), key=lambda e: e[0])
    ranked: list[Prediction] = []
    exact_cuts: dict[tuple, list[int]] = {}
    for _, _, layout in fitting[:exact]:
        p = predict(graphs[(layout.tp, layout.sequence_parallel)], layout, pricing, timeline=timeline, cuts=exact_cuts)
        if memory is not None and p.memory_bytes > memory:
            rejected.append(Rejected(str(layout), f"needs {p.memory_bytes / 2**30:.1f} GiB per device, over the "
                                                  f"{memory / 2**30:.1f} GiB budget"))
            continue
        ranked.append(p)
    for step, mem, layout in estimates:
        if memory is not None and mem > memory:
            rejected.append(Rejected(str(layout), f"needs about {mem / 2**30:.1f} GiB per device, over the "
                                                  f"{memory / 2**30:.1f} GiB budget"))
    ranked.sort(key=lambda p: p.step_seconds)
    source = "measured" if measured else ("calibrated " if pricing.profile.calibration else "") + \
        f"analytic ({pricing.profile.name})"
    result = SearchResult(ranked, rejected, devices, batch, pricing.profile.name, memory, pricing.links.source,
                          source, time.perf_counter() - begin, len(estimates))
    if not ranked:
        cuts = int(next(iter(graphs.values())).allowed.sum()) + 1 if graphs else 1
        shardable = {tp for tp, _ in graphs}

        def usable(d: int) -> bool:  # some pp x tp x dp = d with pp <= cuts, tp shardable, dp | batch
            return any(d % (tp * dp) == 0 and d // (tp * dp) <= cuts and batch % dp == 0
                       for tp in shardable | {1} for dp in range(1, d + 1) if d % dp == 0)

        raise _nothing_fits(result, estimates, memory, batch, devices, usable)
    return result


def _nothing_fits(result: SearchResult, estimates: list, memory: float | None, batch: int, devices: int,
                  usable: Any) -> ConfigError:
    """The typed error when no layout can run, naming what would."""
    if not estimates:
        # One line per kind of reason, sequence parallelism's own last (its degree fails anyway).
        reasons = sorted({r.reason for r in result.rejected}, key=lambda r: (r.startswith("sequence"), r))
        kinds: dict[str, str] = {}
        for r in reasons:
            kinds.setdefault(r.split(" ")[0] + r.split(" ")[1], r)
        reasons = list(kinds.values())[:5]
        counts = [d for d in range(1, 4 * devices + 1) if usable(d)]
        below = max((d for d in counts if d < devices), default=None)
        above = min((d for d in counts if d > devices), default=None)
        hint = " or ".join(str(d) for d in (below, above) if d is not None)
        return ConfigError(f"no layout runs a batch of {batch} on {devices} devices:\n"
                           + "\n".join(f"- {r}" for r in reasons)
                           + (f"\nThis model and batch run on {hint} devices" if hint else "")
                           + "; or use a batch that more data-parallel replicas divide")
    least = min(e[1] for e in estimates)
    best = min(estimates, key=lambda e: e[1])[2]
    return ConfigError(f"no layout of a batch of {batch} on {devices} devices fits {memory / 2**30:.1f} GiB per "
                       f"device; the least memory, about {least / 2**30:.1f} GiB, is {best}. Raise --memory, use more "
                       "devices or a smaller batch")
