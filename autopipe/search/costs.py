"""A traced graph's costs at any micro-batch size, as arrays: what the layout search prices with.

[Note: costs at another batch]
Tracing a large model takes seconds, and a search weighs many micro-batch sizes, so the graph
is traced once, at a reference size, and every node's cost is scaled to the others: FLOPs,
activation bytes, saved and output bytes grow with the batch, a node's parameter bytes do
not (``scaled``). The kernel classes of a calibration never depend on the batch (see
[Note: calibrated roofline]), except through bytes, which are scaled first. A measured
profile prices the nodes at its own size, and other sizes by the analytic ratio of the two.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import numpy as np

from autopipe.graph import owning_module
from autopipe.partition.calibration import BYTE_BOUNDS, BYTE_LABELS, BYTE_LIMITS, Calibration
from autopipe.partition.cost import NodeCost, graph_costs, training_state_bytes
from autopipe.partition.device import COMPILED_FUSION, DeviceProfile
from autopipe.partition.launch_queue import Launch, queue_by_node
from autopipe.partition.measured import MeasuredCosts
from autopipe.partition.cuts import cut_candidates, cut_dag
from autopipe.search.kernel_table import KernelTable
from autopipe.shard.collectives import COLLECTIVES, RING_UNITS
from autopipe.shard.plan import ShardPlan
from autopipe.tracer import TracedModel

# What a sequence-parallel region's edges communicate: each such collective waits after compute one
# way and follows another collective closely the other way ([Note: collectives in a step]).
SEQUENCE_PARALLEL = ("reduce-scatter", "all-gather")

__all__ = ["GraphCosts", "scaled"]


def scaled(cost: NodeCost, ratio: float) -> NodeCost:
    """``cost`` at ``ratio`` times its batch; see [Note: costs at another batch]. Its kernel no
    longer has the shape it was traced with, so no calibration prices it by that shape's
    measured time ([Note: kernels off their class])."""
    if ratio == 1.0:
        return cost
    if cost.parts:
        parts = tuple(scaled(p, ratio) for p in cost.parts)
        return dataclasses.replace(
            cost, parts=parts, shape="", fwd_flops=sum(p.fwd_flops for p in parts),
            bwd_flops=sum(p.bwd_flops for p in parts), fwd_bytes=sum(p.fwd_bytes for p in parts),
            bwd_bytes=sum(p.bwd_bytes for p in parts),
            saved_bytes=int(cost.saved_bytes * ratio), out_bytes=int(cost.out_bytes * ratio))
    weights = min(float(cost.param_bytes), cost.fwd_bytes)
    grads = min(2.0 * cost.param_bytes, cost.bwd_bytes)  # weights read, their gradients written
    return dataclasses.replace(
        cost, shape="", fwd_flops=cost.fwd_flops * ratio, bwd_flops=cost.bwd_flops * ratio,
        fwd_bytes=weights + (cost.fwd_bytes - weights) * ratio, bwd_bytes=grads + (cost.bwd_bytes - grads) * ratio,
        saved_bytes=int(cost.saved_bytes * ratio), out_bytes=int(cost.out_bytes * ratio))


class GraphCosts:
    """One traced graph, as one tensor-parallel rank runs it, priced per node at any micro-batch
    size. Arrays follow the graph's node order (placeholders first, the output node left out).

    With a shard plan the graph is the unsharded one and the plan says what each tp rank does
    of it (see [Note: sharded costs from the plan]); without, the graph is run whole.
    """

    def __init__(self, traced: TracedModel, reference_size: int, *, shard_plan: ShardPlan | None = None,
                 base_costs: Mapping[str, NodeCost] | None = None,
                 measured: Mapping[object, MeasuredCosts] | Iterable[MeasuredCosts] | None = None) -> None:
        self.traced, self.reference_size = traced, reference_size
        self.tp = shard_plan.tp if shard_plan is not None else 1
        nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
        self.order = [n.name for n in nodes]
        unsharded = dict(base_costs) if base_costs is not None else graph_costs(traced.gm)
        all_costs = _sharded(unsharded, shard_plan) if shard_plan is not None else unsharded
        self.costs = [all_costs[n] for n in self.order]
        self.unsharded = [unsharded[n] for n in self.order]  # what a measured profile timed
        self.allowed = np.array(cut_candidates(traced), dtype=bool)
        dag = cut_dag(traced, all_costs, None)
        self.cut_bytes_ref = np.asarray(dag.cut_bytes[: len(self.order) - 1], dtype=float)  # traced dtype
        self.cut_tensors = _cut_tensors(dag, len(self.order))  # each one its own send
        self.param_bytes = np.array([c.param_bytes for c in self.costs], dtype=float)
        self.param_count = np.array([c.param_count for c in self.costs], dtype=float)
        self.param_tensors = np.array([_parameter_tensors(traced, n) for n in nodes], dtype=float)
        self.saved_ref = np.array([c.saved_bytes for c in self.costs], dtype=float)
        self.state_bytes = np.array([training_state_bytes(c.param_bytes) if c.param_count else 0
                                     for c in self.costs], dtype=float)
        # Per node: bytes its tensor-parallel collectives move per rank, how many calls wait for
        # the other ranks after compute, and how many follow another collective closely (see
        # [Note: collectives in a step] in search/links.py).
        self.moved_ref, self.calls, self.follow_calls = _collective_counts(
            shard_plan.collectives if shard_plan is not None else (), nodes, self.tp)
        # Profiles by micro-batch size: those timed as stages run plain, and those timed with
        # activation checkpointing (the recomputation included in their backward).
        profiles = list(measured.values()) if isinstance(measured, Mapping) else list(measured or ())
        self.measured = {_size_of(m, reference_size): m for m in profiles if not m.recompute}
        self.recomputed = {_size_of(m, reference_size): m for m in profiles if m.recompute}
        weights = {n: float(c.param_bytes) for n, c in zip(self.order, self.unsharded)}
        self.fixed = {False: _fixed_seconds(self.measured, weights), True: _fixed_seconds(self.recomputed, weights)}
        self.modules = [owning_module(n) for n in nodes]
        self._kernels = KernelTable.of(self.costs)
        self._times: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._passes: dict[tuple, list[list[Launch]] | None] = {}  # by node_times' key, without recompute
        self._kernel_terms: dict[int, tuple[tuple[np.ndarray, ...], ...]] = {}
        self._factors: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        # The caches are keyed by a table's id: every table seen is kept alive, so that no other
        # can take its id while these prices are kept.
        self._tables: dict[int, Calibration | None] = {}

    def node_times(self, size: int, profile: DeviceProfile, *,
                   recompute: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of every node at ``size`` samples per micro-batch; with
        ``recompute`` (activation checkpointing) the backward runs the forward again: as a
        profile timed with checkpointing measured it where there is one, else as the sum."""
        self._tables.setdefault(id(profile.calibration), profile.calibration)
        key = (*self._priced_by(size, profile), recompute)
        if key not in self._times:
            if not recompute:
                fwd, bwd, self._passes[key[:-1]] = self._node_times(size, profile, self.measured_for(size))
                self._times[key] = (fwd, bwd)
            elif self.recomputed:
                fwd, bwd, _ = self._node_times(size, profile, self.measured_for(size, recompute=True), recompute=True)
                self._times[key] = (fwd, bwd)
            else:
                fwd, bwd = self.node_times(size, profile)
                self._times[key] = (fwd, bwd + fwd)
        return self._times[key]

    def launches(self, size: int, profile: DeviceProfile, *, recompute: bool = False) -> list[list[Launch]] | None:
        """The passes of launches (node, host seconds, device seconds) in launch order whose
        replays through the launch queue price eager stages at ``size`` (partition/replayed_cuts.py,
        [Note: cuts on stage replays]): the forward, then the backward, which with ``recompute``
        runs the forward again first. None where nodes are priced otherwise: another mode, a
        measured profile, a table not fitted through the queue."""
        self.node_times(size, profile)
        passes = self._passes[self._priced_by(size, profile)]
        if passes is None or not recompute:
            return passes
        return None if self.recomputed else [passes[0], passes[0], passes[1]]

    @staticmethod
    def _priced_by(size: int, profile: DeviceProfile) -> tuple:
        """What the prices at ``size`` under ``profile`` depend on: the caches' key."""
        return size, profile.name, profile.mode, id(profile.calibration), profile.matmul_flops, profile.mem_bandwidth

    def _node_times(self, size: int, profile: DeviceProfile, measured: MeasuredCosts | None, *,
                    recompute: bool = False) -> tuple[np.ndarray, np.ndarray, list[list[Launch]] | None]:
        ratio = size / self.reference_size
        k = self._kernels
        # Measured prices hold the queue already; the model only scales them, node by node.
        queued = measured is None and profile.mode == "eager" and getattr(profile.calibration, "launch_queue", False)
        out = []
        for d in (0, 1):
            flops = k.flops[d] * ratio
            nbytes = k.fixed_bytes[d] + k.act_bytes[d] * ratio
            peak = np.where(k.matmul, profile.matmul_flops, profile.vector_flops)
            cal = profile.calibration
            if cal is None:
                seconds = np.maximum(flops / peak, nbytes / profile.mem_bandwidth) + profile.op_overhead
            else:
                launch, vector, kept = self._per_kernel(cal, d, ratio)
                seconds = self._gpu_seconds(cal, flops / peak, nbytes, profile.mem_bandwidth, d) + launch \
                    + vector * flops / profile.vector_flops
                seconds = np.where(kept > 0, kept, seconds)
                host = np.full(len(seconds), cal.host[d])
                if profile.mode.startswith("compiled"):
                    fused = np.where(k.matmul, 1.0, COMPILED_FUSION)
                    seconds, host = seconds * fused, host * fused
                if profile.mode == "compiled" or (profile.mode == "eager" and not queued):
                    seconds = np.maximum(seconds, host)
                elif profile.mode != "eager":
                    seconds = seconds + cal.gap_time(profile.mode)
            seconds = np.where((flops > 0) | (nbytes > 0), seconds, 0.0)
            out.append(seconds)
        passes = None
        if queued:  # the kernels' device times through the launch queue, as DeviceProfile.node_times
            passes = self._launch_passes(out[0], out[1], profile.calibration)
            fwd, bwd = (queue_by_node(p, len(self.costs)) for p in passes)
        else:
            fwd, bwd = (np.bincount(k.node, weights=seconds, minlength=len(self.costs)) for seconds in out)
        if measured is not None:
            fwd, bwd = self._from_measured(measured, size, profile, fwd, bwd, self.fixed[recompute])
        return fwd, bwd, passes

    def _launch_passes(self, fwd: np.ndarray, bwd: np.ndarray, cal: Calibration) -> list[list[Launch]]:
        """The forward and the backward launches of the kernels (device seconds ``fwd``, ``bwd``)
        and views, as ``DeviceProfile.launches`` makes them over the kernel table."""
        k = self._kernels
        # kernels and views in launch order: (node, kernel row or -1 for a view)
        launches = sorted([(int(n), j) for j, n in enumerate(k.node)]
                          + [(i, -1) for i, c in enumerate(self.costs) if c.kind == "view"])
        out = []
        for d, seconds in ((0, fwd), (1, bwd)):
            host = [cal.launch_host(fixed or prefix, bool(d)) for fixed, prefix in zip(k.fixed_class, k.prefix)]
            out.append([(n, cal.view_host[d], 0.0) if j < 0 else (n, host[j], float(seconds[j]))
                        for n, j in (launches if d == 0 else launches[::-1])
                        if (seconds[j] > 0 if j >= 0 else cal.view_host[d] > 0)])
        return out

    def _per_kernel(self, cal: Calibration, direction: int, ratio: float) -> tuple[np.ndarray, ...]:
        """Each kernel's launch time, vector-arithmetic factor ([Note: depthwise arithmetic]) and
        measured seconds where ``cal`` keeps its shape (0 elsewhere, and at any other size than
        the traced one: [Note: kernels off their class]) under ``cal``, made once per table."""
        key = id(cal)
        if key not in self._kernel_terms:
            k = self._kernels
            self._kernel_terms[key] = tuple(
                (np.array([cal.launch_time(fixed or prefix, backward)
                           for fixed, prefix in zip(k.fixed_class, k.prefix)]),
                 np.array([cal.vector_factor(term, backward) if term else 0.0 for term in k.term]),
                 np.array([cal.kernel_seconds(shape, backward) for shape in k.shape])) for backward in (False, True))
        launch, vector, kept = self._kernel_terms[key][direction]
        return launch, vector, kept if ratio == 1.0 else np.zeros_like(kept)

    def _gpu_seconds(self, cal: Calibration, compute: np.ndarray, nbytes: np.ndarray, bandwidth: float,
                     direction: int) -> np.ndarray:
        """Calibration.gpu_time less the launch, for every kernel at once: a class by shape
        scales the roofline by its factor; a class by bytes takes the most over its bucket and
        the ones below (see [Note: monotone in bytes])."""
        key = (id(cal), direction)
        if key not in self._factors:  # per kernel: (flops factor, factor) by shape, or one per bucket by bytes
            k, backward = self._kernels, bool(direction)
            self._factors[key] = (
                np.array([bool(f) for f in k.fixed_class]),
                np.array([[cal.flops_factor(f, backward), cal.factor(f, backward)] if f else [0.0, 0.0]
                          for f in k.fixed_class]).reshape(-1, 2),
                np.array([[cal.factor(f"{p}/{label}", backward) for label in BYTE_LABELS] if not f
                          else [0.0] * len(BYTE_LABELS) for f, p in zip(k.fixed_class, k.prefix)]).reshape(
                    -1, len(BYTE_LABELS)))
        fixed, shaped, by_bytes = self._factors[key]
        bucket = np.searchsorted(np.asarray(BYTE_BOUNDS, dtype=float), nbytes, side="left")
        limits = np.minimum(nbytes[:, None], np.asarray(BYTE_LIMITS)[None, :]) / bandwidth
        bucketed = by_bytes * np.maximum(compute[:, None], limits)
        bucketed[np.arange(len(BYTE_LABELS))[None, :] > bucket[:, None]] = 0.0
        return np.where(fixed, np.maximum(compute * shaped[:, 0], nbytes / bandwidth * shaped[:, 1]),
                        bucketed.max(axis=1, initial=0.0))

    def measured_for(self, size: int, *, recompute: bool = False) -> MeasuredCosts | None:
        """The profile of ``size`` samples, else the one of the nearest size (None without any);
        with ``recompute``, among those timed with activation checkpointing."""
        profiles = self.recomputed if recompute else self.measured
        if size in profiles:
            return profiles[size]
        return profiles[min(profiles, key=lambda s: abs(s - size))] if profiles else None

    def _from_measured(self, measured: MeasuredCosts, size: int, profile: DeviceProfile,
                       fwd: np.ndarray, bwd: np.ndarray, fixed: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """Measured node times (profiled unsharded, at the profile's size), split into forward and
        backward as measured, scaled by what the model says this rank does at ``size`` over what
        the profile timed; a sharded node keeps its fixed time whole (see [Note: fixed time of a
        sharded node])."""
        own = measured.input_shapes[0][0] if measured.input_shapes and measured.input_shapes[0] else size
        ratio_batch = own / self.reference_size
        out_f, out_b = fwd.copy(), bwd.copy()
        for i, name in enumerate(self.order):
            seconds = measured.node_seconds.get(name)
            if seconds is None:
                continue
            timed = scaled(self.unsharded[i], ratio_batch)
            base = profile.node_time(timed) + profile.node_time(timed, backward=True)
            detail = measured.node_detail.get(name)
            share = detail[0] / (detail[0] + detail[1]) if detail and detail[0] + detail[1] > 0 else \
                fwd[i] / (fwd[i] + bwd[i]) if fwd[i] + bwd[i] > 0 else 0.5
            ratio = (fwd[i] + bwd[i]) / base if base > 0 else size / own / self.tp
            total = seconds * ratio
            if self.tp > 1 and name in fixed and self.costs[i] is not self.unsharded[i]:
                whole = scaled(self.unsharded[i], size / self.reference_size)
                at_size = profile.node_time(whole) + profile.node_time(whole, backward=True)
                if base > 0 and at_size > 0:
                    unsharded = seconds * at_size / base  # the whole node at ``size``
                    work = (fwd[i] + bwd[i]) / at_size  # this rank's share of its work
                else:  # no work the model can price (a view of a sharded value)
                    unsharded, work = seconds * size / own, 1.0 / self.tp
                kept = min(fixed[name], unsharded)
                total = kept + (unsharded - kept) * work
            out_f[i], out_b[i] = total * share, total * (1 - share)
        return out_f, out_b


# [Note: sharded costs from the plan]
# Rewriting the graph for every tensor-parallel degree (apply_sharding, with its shape
# propagation) takes seconds a model; the shard plan alone says what each rank runs: a node
# that is split (column, row, heads, channels, or an op on a split tensor, a sequence-parallel
# region's included) does 1/tp of the node's work, holds 1/tp of its parameters and sends
# 1/tp of its output; a row-parallel layer's output is whole (the partial sums the all-reduce
# adds). The plan's collectives move their payload (a ring all-reduce 2 (tp-1)/tp of it, a
# gather or scatter (tp-1)/tp) after the node they follow. parallelize() plans the rewritten
# graph itself; the search only needs to rank.


# [Note: fixed time of a sharded node]
# A node's measured time is a fixed part (dispatch, autograd's bookkeeping, the kernel's
# launch: paid whatever the batch) and a part that grows with the batch. Tensor parallelism
# divides the work, not the dispatch. Where profiles were timed at two sizes or more, each
# node's fixed part is the intercept of the line through its times against the micro-batch
# size (``_fixed_seconds``), and a sharded node costs that plus its share of the rest. On 2 CPU
# processes ViT (width 128, one sample a micro-batch) ran its sharded graph in as long as the
# unsharded one, 155 against 153 ms a step, where halving every node's time said 80. The
# intercept also holds what a node does to its weights once a micro-batch, which sharding does
# divide: ResNet-18's convolutions on this CPU have intercepts of 0.2 ms plus 0.39 ms per MB of
# weights (oneDNN reorders the weights into its blocked layout every call, and the backward
# writes their gradient): 3.6 ms for a 9.4 MB 3x3 kernel of layer4, 17.6 of the graph's 25.6 ms
# of fixed time. Kept whole, this priced ResNet-18's tp=2 layouts 8-22% long, growing with the
# micro-batches. So the part that grows with a node's parameter bytes, the slope of the least
# squares line through the intercepts of the nodes with parameters against their parameter
# bytes (clipped at 0), is work that the shards divide; the rest of the intercept is kept
# whole. ViT (width 128) has intercepts near 0 for its linear layers and a slope of 0: its
# prices do not move. (Subtracting the weights' bytes at the copy bandwidth instead, 3 passes
# at 26 GB/s, would take 1.1 ms of the 3.6.)


def _fixed_seconds(profiles: Mapping[int, MeasuredCosts], weights: Mapping[str, float]) -> dict[str, float]:
    """Each node's fixed seconds, which sharding does not divide: the intercept (clipped to
    [0, its least time]) of the least squares line through its times against the profiles'
    micro-batch sizes, less the part that grows with its parameter bytes (``weights``; see
    [Note: fixed time of a sharded node]); {} with fewer than two sizes."""
    if len(profiles) < 2:
        return {}
    sizes = sorted(profiles)
    x = np.asarray(sizes, dtype=float)
    names = sorted(set.intersection(*(set(profiles[s].node_seconds) for s in sizes)))
    out = {}
    for name in names:
        y = np.asarray([profiles[s].node_seconds[name] for s in sizes], dtype=float)
        slope, intercept = np.polyfit(x, y, 1)
        out[name] = float(min(max(intercept, 0.0), y.min()))
    per_byte = _seconds_per_weight_byte({n: out[n] for n in names if weights.get(n, 0.0) > 0}, weights)
    return {n: max(f - per_byte * weights.get(n, 0.0), 0.0) for n, f in out.items()}


def _seconds_per_weight_byte(intercepts: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """The slope (clipped at 0) of the least squares line through the nodes' ``intercepts``
    against their parameter bytes; 0 with fewer than three nodes or one size of weights."""
    w = np.asarray([weights[n] for n in intercepts], dtype=float)
    if len(w) < 3 or np.ptp(w) == 0:
        return 0.0
    slope, _ = np.polyfit(w, np.asarray(list(intercepts.values()), dtype=float), 1)
    return max(float(slope), 0.0)


def _collective_counts(collectives, nodes: list, tp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node (of ``nodes``): bytes the tensor-parallel ``collectives`` after it move per rank,
    their calls reached after compute, and their calls that follow another collective closely
    (see [Note: collectives in a step] in search/links.py and [Note: collective table] in
    shard/collectives.py).
    - A collective on another one's output (an f after a g between two MLPs, a gather after a
      reduce-scatter around an empty sequence-parallel region) is counted at the node the first
      follows; its forward call follows that collective's closely. Such a pair is no region's
      edge: the first's backward call is reached after compute too.
    - A collective on a graph input calls nothing backward: no gradient flows into the inputs."""
    moved, calls, follows = np.zeros(len(nodes)), np.zeros(len(nodes)), np.zeros(len(nodes))
    position = {n.name: i for i, n in enumerate(nodes)}
    by_name = {c.name: c for c in collectives}
    chained_into = {c.src for c in collectives if c.src in by_name}
    for c in collectives:
        src = c.src
        while src in by_name:
            src = by_name[src].src
        i = position.get(src)
        if i is None:
            continue
        kind = COLLECTIVES[c.kind]
        forward, backward = c.fwd_bytes > 0, c.bwd_bytes > 0 and nodes[i].op != "placeholder"
        units = RING_UNITS[kind.forward] * forward + RING_UNITS[kind.backward] * backward
        moved[i] += units * (tp - 1) / tp * max(c.fwd_bytes, c.bwd_bytes)
        follow = (c.src in by_name and forward) or (kind.forward in SEQUENCE_PARALLEL and forward and backward
                                                    and c.name not in chained_into)
        calls[i] += forward + backward - follow
        follows[i] += follow
    return moved, calls, follows


def _size_of(profile: MeasuredCosts, default: int) -> int:
    """The micro-batch size a profile timed: its first input's leading dimension."""
    shapes = profile.input_shapes
    return shapes[0][0] if shapes and shapes[0] else default


def _cut_tensors(dag, n: int) -> np.ndarray:
    """``counts[k]``: how many tensors cross a cut after position k of the first ``n`` nodes
    (those made at or before k and read after it)."""
    delta = np.zeros(len(dag.order) + 1)
    for i in np.flatnonzero(np.asarray(dag.out_bytes) > 0):
        if dag.last_use[i] > i:
            delta[i] += 1
            delta[dag.last_use[i]] -= 1
    return np.cumsum(delta)[: max(n - 1, 0)]


def _parameter_tensors(traced: TracedModel, node) -> int:
    """How many parameter tensors ``node`` owns (an optimizer steps each on its own)."""
    if node.op == "call_module":
        return sum(1 for _ in traced.gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        owner, _, name = node.target.rpartition(".")
        return int(name in dict(traced.gm.get_submodule(owner).named_parameters(recurse=False)))
    return 0


def _sharded(costs: Mapping[str, NodeCost], plan: ShardPlan) -> dict[str, NodeCost]:
    out = dict(costs)
    tp = plan.tp
    for name, shard in plan.nodes.items():
        if name not in out or shard.sharding in ("replicated",) or shard.sharding.startswith("collective"):
            continue
        c = scaled(out[name], 1.0 / tp)
        params = out[name].param_bytes
        # A column-parallel layer (qkv and MultiheadAttention included) keeps its input for
        # backward, and that input is every rank's whole activation.
        whole_input = shard.sharding.startswith(("column", "heads:", "mha", "qkv"))
        c = dataclasses.replace(c, param_bytes=params // tp, param_count=out[name].param_count // tp,
                                fwd_bytes=max(c.fwd_bytes - params * (1 - 1 / tp), 0.0),
                                out_bytes=out[name].out_bytes if shard.sharding == "row" else c.out_bytes,
                                saved_bytes=out[name].saved_bytes if whole_input else c.saved_bytes)
        out[name] = c
    return out
