"""A layout's step time and memory per device, predicted from stage times, the schedule and links.

[Note: step prediction]
For one layout (search/layouts.py) on one graph (search/costs.py):
1. nodes are priced at the layout's micro-batch size in its execution mode; activation
   checkpointing adds each node's forward to its backward (the recomputation), or takes the
   backward of a profile timed with checkpointing where one is given; the tensor-parallel
   collectives of a node add their time on the link model (half each way, and the forward's
   half again when the recomputation runs them);
2. the graph is cut into pp x chunks stages by the partitioner's own balancer (cut bytes in
   the activation dtype, the stage's fixed time counted), so the search sees the plan
   ``parallelize`` would make from the same costs;
3. the schedule's action lists are replayed with the stages' forward and backward times and
   the transfers between them (search/replay.py), each tensor sent or received costing its
   rank ``transfer_overhead`` of host time: the pipeline's makespan and bubble. Where NCCL
   collectives run beside a stage (tp > 1) its compute is scaled by ``neighbour_scale``, and
   where only a pipeline's transfers do (pp > 1) by ``pipeline_scale``: their kernels hold SMs
   while they wait for the peer;
4. the step adds the data-parallel all-reduce of the gradients (after the last backward, as
   the runtime does it, in flat buckets the gradients are copied into and back from), the
   global gradient norm (a pass and a scalar all-reduce), the optimizer's pass over its state
   (memory-bound, AdamW's, plus a host cost per parameter tensor: torch's AdamW steps CPU
   tensors one at a time, about ten kernels each) and, with mixed precision, the weights' cast;
5. memory per device: parameters, gradients and optimizer state of its stages (plus bf16
   weight copies under mixed precision) and the saved activations of the micro-batches it
   holds at once (the schedule's in-flight bound; with checkpointing only each stage's input,
   plus one micro-batch recomputed at a time), with 10% for the allocator's fragmentation;
   captured stages hold their graphs' pools instead ([Note: graph pools]).

[Note: graph pools]
A stage run as CUDA graphs has one graph per micro-batch it may hold (``stage_slots``, [Note:
graph slots] in runtime/graphs.py), each with a private memory pool that no other graph and no
eager allocation reuses. A slot's pool keeps its forward's saved activations, its forward's
transients beside them, and its backward's parameter gradients before they are added into
``.grad`` (fp32, the stage's parameter bytes); besides, a slot holds about three tensors of each
of its boundaries (static inputs and outputs, their gradients, the output copies that travel
and wait for backward). So a rank holds the sum over its stages of slots x (pool + boundary
tensors), where eager memory holds the most micro-batches in flight at once x saved: an
interleaved rank's stages peak at different times (pp=2, 4 chunks, 4 micro-batches: 12 slots
against 9 held), and checkpointing saves nothing (a slot's backward recomputes its activations
into the same pool; this follows from the pools, no checkpointed graph layout was measured).

Fitted on two H200s (benchmarks/results/2026-11-28-h200x2-layout-choice-memory.json): what the
allocator held after training (``torch.cuda.memory_reserved``: graphs' pools included, which
``max_memory_allocated`` misses, as their replays allocate nothing) for ViT-L/16 and ViT-H/14,
dp=2 with 1, 2 and 4 micro-batches and pp=2 interleaved with 4 chunks, put the pool at
``GRAPH_POOL_SCALE`` x the saved activations' eager bytes (eight layouts: -2% to +17%). Held
out (-heldout.json): ResNet-50 from -1% (pp=2 interleaved) to +50% (dp=2, one micro-batch),
ViT-B/16 dp=2 from -10% to +14%, but ViT-B/16 pp=2 interleaved with 2 chunks and 8
micro-batches 28% short, not understood.

On 4 H200s (benchmarks/results/2026-11-28-h200x4-layout-choice-vit-{l,h}.json) pp=4 interleaved
with 4 chunks and 8 micro-batches (24 slots on its fullest ranks) was 11% (ViT-L/16) and 18%
(ViT-H/14) short, and the shortfall per slot went with the stage's parameters: about 5 bytes per
parameter for both. Under autocast a slot also keeps the bf16 copy of each weight that its
forward saved, and its backward writes the weight's bf16 gradient beside the fp32 one: 4 bytes
per parameter (``GRAPH_POOL_WEIGHT_BYTES``; none where the stages compute in fp32). Refitted with that term over the 29 graph layouts of
the five 2026-11-28 runs on 2 and 4 H200s (ViT-L/16, ViT-H/14, ViT-B/16, ResNet-50; the scale
1.27 -> 1.2), 28 lie within the benchmark's bounds (-15% to +50%; 25 before): the pp=4 layouts -4%
and -5%, ResNet-50's dp=2 at one micro-batch +45% (from +52%); ViT-B/16's pp=2 with 2 chunks and 8
micro-batches is still 27% short.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopipe.partition import balance as balancer
from autopipe.partition.device import DeviceProfile
from autopipe.partition.transfers import boundary_copy_seconds
from autopipe.partition.launch_queue import pass_replays
from autopipe.partition.replayed_cuts import replayed_cut
from autopipe.runtime.host_links import ring_slots
from autopipe.runtime.schedule import max_in_flight_bound, stage_slots

from .costs import GraphCosts
from .layouts import Layout
from .links import LinkModel
from .replay import replay

__all__ = ["Prediction", "predict", "Pricing", "stage_overhead", "boundary_copy_rate"]

FRAGMENTATION = 1.10
GRAPH_POOL_SCALE = 1.2  # a graph slot's pool over its saved activations; see [Note: graph pools]
GRAPH_POOL_WEIGHT_BYTES = 4.0  # per stage parameter, a slot's pool beside its fp32 gradients; the same Note
NORM_OPS_PER_TENSOR = 10  # a tensor's norm is one kernel; its AdamW update about ten (single-tensor path)
ADAMW_BYTES_PER_PARAM = 32.0  # fused: read param, grad, 2 moments; write param, 2 moments (fp32), + grad zeroing
# torch's default AdamW on CUDA (multi-tensor "foreach"): eight passes, some over temporaries
# (the moments' square root, divided, plus eps), 93 B per parameter as an H200 timed it
# (benchmarks/optimizer_step_gpu.py).
ADAMW_FOREACH_BYTES_PER_PARAM = 93.0


@dataclass(frozen=True)
class Pricing:
    """What prices every layout of a search alike."""

    profile: DeviceProfile  # the device's compute and memory rates (any mode; set per layout)
    links: LinkModel
    batch: int  # global batch
    activation_bytes: float = 1.0  # bytes of a crossing floating value over its traced bytes (0.5: bf16 of fp32)
    weight_cast_bytes: float = 0.0  # bytes per parameter of the low-precision weight copies (2 under bf16)
    action_overhead: float = 0.0  # host seconds per compute the driver adds
    tensor_overhead: float = 0.0  # host seconds per parameter tensor of the optimizer's step and the norm
    optimizer_bytes: float = ADAMW_BYTES_PER_PARAM  # bytes the optimizer's step moves per parameter
    transfer_overhead: float = 0.0  # host seconds per tensor sent or received between pipeline stages
    # The same under an interleaved schedule (None: ``transfer_overhead``): on a CPU a post costs
    # the host differently there, where more transfers are in flight and complete while the rank
    # computes (docs/benchmarks.md, "where an interleaved step's time goes").
    interleaved_transfer_overhead: float | None = None
    # Host seconds per parameter tensor of the global gradient norm (None: a tenth of
    # ``tensor_overhead``, one kernel against the optimizer's ten on CPU).
    norm_tensor_overhead: float | None = None
    # Stage compute runs this much slower on a rank whose NCCL collectives (tp > 1) run beside
    # it, and ``pipeline_scale`` (None: the same) where only its transfers do (pp > 1, tp = 1);
    # see plan.StepDefaults.
    neighbour_scale: float = 1.0
    pipeline_scale: float | None = None


@dataclass
class Prediction:
    """A priced layout; see [Note: step prediction]."""

    layout: Layout
    step_seconds: float
    samples_per_second: float
    memory_bytes: float  # the fullest device's
    bubble: float
    parts: dict[str, float] = field(default_factory=dict)  # pipeline, dp all-reduce, optimizer ...
    stage_seconds: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "name": str(self.layout), "step_seconds": self.step_seconds,
                "samples_per_second": self.samples_per_second, "memory_bytes": self.memory_bytes,
                "bubble": self.bubble, "parts": self.parts, "stage_seconds": self.stage_seconds,
                "starts": self.starts}


def _node_seconds(graph: GraphCosts, layout: Layout, size: int, pricing: Pricing) -> tuple[np.ndarray, np.ndarray]:
    profile = pricing.profile.with_mode(layout.mode)
    fwd, bwd = graph.node_times(size, profile, recompute=layout.recompute)
    if layout.tp > 1:
        moved = graph.moved_ref * (size / graph.reference_size) * pricing.activation_bytes
        comm = pricing.links.collectives(moved, graph.calls, graph.follow_calls)
        # The recomputation runs the forward's collectives again.
        fwd, bwd = fwd + comm / 2, bwd + comm / 2 * (2 if layout.recompute else 1)
    return fwd, bwd


def stage_overhead(pricing: Pricing, layout: Layout, graph: GraphCosts, size: int) -> float:
    measured = graph.measured_for(size)
    if measured is not None:
        return measured.stage_overhead
    cal = pricing.profile.calibration
    return cal.stage.get(layout.mode.replace("compiled+", "").replace("compiled", "graphs"), 0.0) if cal else 0.0


def boundary_copy_rate(pricing: Pricing, layout: Layout, graph: GraphCosts, size: int) -> float:
    """Seconds per byte crossing a cut that each stage beside it spends copying it ([Note:
    boundary copies] in partition/calibration.py); a measured profile's own rate where one
    prices the layout ([Note: a profile's boundary copies] in measure/boundary_copies.py)."""
    measured = graph.measured_for(size)
    if measured is not None:
        return measured.boundary_rate
    return boundary_copy_seconds(1.0, pricing.profile.with_mode(layout.mode))


def predict(graph: GraphCosts, layout: Layout, pricing: Pricing, *, timeline: bool = False,
            cuts: dict[tuple, list[int]] | None = None) -> Prediction:
    """Price ``layout`` on ``graph`` (its tp-sharded graph); see [Note: step prediction].
    ``cuts`` keeps the balancer's answers between calls (one per graph, stage count, size, mode)."""
    size = layout.microbatch_size(pricing.batch)
    fwd, bwd = _node_seconds(graph, layout, size, pricing)
    ratio = size / graph.reference_size
    cut_bytes = graph.cut_bytes_ref * ratio * pricing.activation_bytes
    stages = layout.pp * layout.chunks
    overhead = stage_overhead(pricing, layout, graph, size)
    copies = cut_bytes * boundary_copy_rate(pricing, layout, graph, size)
    compute = fwd + bwd
    link = pricing.links
    # Eager stages through the launch queue: each replayed alone ([Note: cuts on stage replays]).
    passes = graph.launches(size, pricing.profile.with_mode(layout.mode), recompute=layout.recompute)
    key = (id(graph), stages, size, layout.mode, layout.recompute)
    cuts = {} if cuts is None else cuts
    if key not in cuts:
        cuts[key] = _cut(graph, layout, size, pricing, (fwd, bwd), cut_bytes, copies, overhead, passes)
    starts = cuts[key]
    ends = starts[1:] + [len(compute)]
    copied = [(float(copies[i - 1]) if i > 0 else 0.0) + (float(copies[j - 1]) if j < len(compute) else 0.0)
              for i, j in zip(starts, ends)]  # half in the forward, half in the backward
    scale = _stage_scale(layout, pricing)
    run_f, run_b = _stage_passes(graph, layout, size, pricing, (fwd, bwd), passes, starts, ends)
    stage_f = [float(t) * scale + (overhead + c) / 2 for t, c in zip(run_f, copied)]
    stage_b = [float(t) * scale + (overhead + c) / 2 for t, c in zip(run_b, copied)]
    sends = [link.p2p(float(cut_bytes[j - 1])) if j < len(compute) else 0.0 for j in ends]
    grads = [link.p2p(float(cut_bytes[i - 1])) if i > 0 else 0.0 for i in starts]
    per_transfer = pricing.transfer_overhead if layout.chunks == 1 or pricing.interleaved_transfer_overhead is None \
        else pricing.interleaved_transfer_overhead
    host_act = [per_transfer * float(graph.cut_tensors[j - 1]) if j < len(compute) else 0.0 for j in ends]
    host_grad = [per_transfer * float(graph.cut_tensors[i - 1]) if i > 0 else 0.0 for i in starts]
    run = replay(layout.schedule, layout.pp, layout.microbatches, layout.chunks, stage_f, stage_b,
                 send_act=sends, send_grad=grads, action_overhead=pricing.action_overhead,
                 host_act=host_act, host_grad=host_grad, keep_spans=timeline)

    # Per pipeline rank: its stages' parameters (already 1/tp where sharded).
    params = [0.0] * layout.pp
    tensors = [0.0] * layout.pp
    state = [0.0] * layout.pp
    t_prefix = np.concatenate(([0.0], np.cumsum(graph.param_tensors)))
    p_prefix = np.concatenate(([0.0], np.cumsum(graph.param_bytes)))
    n_prefix = np.concatenate(([0.0], np.cumsum(graph.param_count)))
    s_prefix = np.concatenate(([0.0], np.cumsum(graph.state_bytes)))
    for s, (i, j) in enumerate(zip(starts, ends)):
        params[s % layout.pp] += float(n_prefix[j] - n_prefix[i])
        tensors[s % layout.pp] += float(t_prefix[j] - t_prefix[i])
        state[s % layout.pp] += float(s_prefix[j] - s_prefix[i])
    grad_bytes = max(float(p_prefix[j] - p_prefix[i]) for i, j in zip(starts, ends)) if layout.chunks == 1 else \
        max(sum(float(p_prefix[e] - p_prefix[b]) for k, (b, e) in enumerate(zip(starts, ends)) if k % layout.pp == r)
            for r in range(layout.pp))
    most = max(params)
    bandwidth = pricing.profile.mem_bandwidth
    # The runtime all-reduces the gradients where they lie, views of one buffer ([Note:
    # gradients as views of one buffer] in runtime/grad_buffers.py), and divides them there:
    # two passes over them.
    all_reduce = link.all_reduce(grad_bytes, layout.dp) + (2 * grad_bytes / bandwidth if layout.dp > 1 else 0.0)
    per_tensor = max(tensors) * pricing.tensor_overhead
    optimizer = most * pricing.optimizer_bytes / bandwidth + per_tensor
    casts = most * (4 + pricing.weight_cast_bytes) / bandwidth if pricing.weight_cast_bytes else 0.0
    # The global gradient norm step() takes (non-finite steps are skipped): a pass over the
    # gradients and a scalar all-reduce over the mesh.
    norm_tensor = pricing.tensor_overhead / NORM_OPS_PER_TENSOR if pricing.norm_tensor_overhead is None \
        else pricing.norm_tensor_overhead
    norm = most * 4 / bandwidth + max(tensors) * norm_tensor \
        + (link.collective_latency if layout.pp * layout.tp * layout.dp > 1 else 0.0)
    step = run.makespan + all_reduce + optimizer + casts + norm
    memory = _memory(graph, layout, starts, ends, state, params, size, pricing)
    return Prediction(layout, step, pricing.batch / step, memory, run.bubble,
                      {"pipeline": run.makespan, "dp_all_reduce": all_reduce, "optimizer": optimizer,
                       "weight_casts": casts, "grad_norm": norm},
                      [f + b for f, b in zip(stage_f, stage_b)], list(starts), run.spans)


def _cut(graph: GraphCosts, layout: Layout, size: int, pricing: Pricing, seconds: tuple[np.ndarray, ...],
         cut_bytes: np.ndarray, copies: np.ndarray, overhead: float, passes: list | None) -> list[int]:
    """The stages' starts whose largest time is least: the nodes' ``seconds`` summed, or where
    eager stages replay through the launch queue (``passes``), each stage replayed."""
    stages, compute = layout.pp * layout.chunks, seconds[0] + seconds[1]
    if stages == 1:
        return [0]
    cut_time = cut_bytes / pricing.links.p2p_bandwidth
    cut_latency = np.where(cut_bytes > 0, 2 * pricing.links.p2p_latency, 0.0) + copies
    starts = balancer.solve_overlapped(compute, stages, cut_time=cut_time, cut_latency=cut_latency,
                                       allowed_cuts=graph.allowed, stage_overhead=overhead)
    if passes is None:
        return starts
    queued = np.add(*graph.node_times(size, pricing.profile.with_mode(layout.mode), recompute=layout.recompute))
    return replayed_cut(passes, compute, queued, starts, recut=True, cut_time=cut_time, cut_latency=cut_latency,
                        allowed=graph.allowed, overhead=overhead)[0]


def _stage_passes(graph: GraphCosts, layout: Layout, size: int, pricing: Pricing, seconds: tuple[np.ndarray, ...],
                  passes: list | None, starts: list[int], ends: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each stage's forward and backward compute: the sums of its nodes' ``seconds``, or where
    eager stages replay through the launch queue (``passes``), its own passes replayed from idle
    and what ``seconds`` adds beyond them (tensor-parallel collectives)."""
    heads, tails = np.asarray(starts), np.asarray(ends)
    summed = [np.concatenate(([0.0], np.cumsum(t))) for t in seconds]
    summed = [p[tails] - p[heads] for p in summed]
    if passes is None:
        return summed[0], summed[1]
    queued = graph.node_times(size, pricing.profile.with_mode(layout.mode), recompute=layout.recompute)
    queued = [np.concatenate(([0.0], np.cumsum(t))) for t in queued]
    extra = [s - (q[tails] - q[heads]) for s, q in zip(summed, queued)]
    return pass_replays(passes[0], heads, tails) + extra[0], \
        sum(pass_replays(p, heads, tails) for p in passes[1:]) + extra[1]


def _stage_scale(layout: Layout, pricing: Pricing) -> float:
    """How much slower a stage computes beside its rank's NCCL kernels: tensor-parallel
    collectives, else a pipeline's transfers alone, else none."""
    if layout.tp > 1:
        return pricing.neighbour_scale
    if layout.pp > 1:
        return pricing.neighbour_scale if pricing.pipeline_scale is None else pricing.pipeline_scale
    return 1.0


def _memory(graph: GraphCosts, layout: Layout, starts: list[int], ends: list[int], state: list[float],
            params: list[float], size: int, pricing: Pricing) -> float:
    ratio = size / graph.reference_size
    # Under autocast the tensors kept for backward are mostly the compute dtype's (a GEMM keeps
    # its cast inputs): priced like crossing values. On 2 x H100 (bf16, ViT-L/16 and ViT-H/14,
    # results/2026-11-25-h100x2-layout-choice.json) the traced fp32 bytes gave 1.4-2.6x the
    # measured peak; see benchmarks/layout_prediction.py.
    saved = graph.saved_ref * ratio * pricing.activation_bytes
    s_prefix = np.concatenate(([0.0], np.cumsum(saved)))
    rings = _ring_bytes(graph, layout, starts, ratio * pricing.activation_bytes, pricing)
    worst = 0.0
    for r in range(layout.pp):
        held = max_in_flight_bound(layout.schedule, layout.pp, layout.microbatches, layout.chunks, r)
        mine = [(i, j) for k, (i, j) in enumerate(zip(starts, ends)) if k % layout.pp == r]
        per_mb = sum(float(s_prefix[j] - s_prefix[i]) for i, j in mine) / max(len(mine), 1)
        if layout.mode.endswith("graphs"):
            activations = _graph_pools(graph, layout, starts, ends, s_prefix, ratio * pricing.activation_bytes, r,
                                       autocast=pricing.activation_bytes < 1.0)
        elif layout.recompute:
            inputs = sum(float(graph.cut_bytes_ref[i - 1]) * ratio * pricing.activation_bytes
                         for i, _ in mine if i > 0) / max(len(mine), 1)
            activations = held * inputs + max(float(s_prefix[j] - s_prefix[i]) for i, j in mine)
        else:
            activations = held * per_mb
        total = (state[r] + params[r] * pricing.weight_cast_bytes + activations) * FRAGMENTATION
        worst = max(worst, total + rings.get(r, 0.0))
    return worst


HOST_GPUS = 8  # the most GPUs of one host: a layout on no more shares one host, and its links shared memory


def _ring_bytes(graph: GraphCosts, layout: Layout, starts: list[int], cut_scale: float,
                pricing: Pricing) -> dict[int, float]:
    """Per pipeline rank, the bytes of the shared-memory rings of the links into it, on GPUs of
    one host ([Note: shared-memory links] in runtime/host_links.py): slots x the largest
    boundary of the layout's cut. ``cut_scale``: a cut's traced bytes to its bytes at this
    micro-batch size."""
    devices = layout.pp * layout.tp * layout.dp
    if layout.pp == 1 or pricing.profile.name == "cpu" or devices > HOST_GPUS:
        return {}
    n = len(graph.cut_bytes_ref) + 1
    largest = max((float(graph.cut_bytes_ref[i - 1]) for i in starts if 0 < i < n), default=0.0) * cut_scale
    rings: dict[int, float] = {}
    for (_, b), slots in ring_slots(layout.schedule, layout.pp, layout.microbatches, layout.chunks,
                                    fewer=False).items():
        rings[b] = rings.get(b, 0.0) + slots * largest
    return rings


def _graph_pools(graph: GraphCosts, layout: Layout, starts: list[int], ends: list[int], saved: np.ndarray,
                 cut_scale: float, rank: int, *, autocast: bool) -> float:
    """Bytes rank ``rank``'s captured stages hold: per stage, its slots x (its graph pool and
    static boundary tensors); see [Note: graph pools]. ``saved``: the prefix sums of the saved
    bytes; ``cut_scale``: a cut's traced bytes to its bytes at this micro-batch; ``autocast``: the
    stages compute in a lower precision than their fp32 weights (a slot keeps their copies)."""
    weights = 1.0 + (GRAPH_POOL_WEIGHT_BYTES / 4.0 if autocast else 0.0)  # per fp32 parameter byte
    slots = stage_slots(layout.schedule, layout.pp, layout.microbatches, layout.chunks, rank)
    params = np.concatenate(([0.0], np.cumsum(graph.param_bytes)))
    n = len(graph.cut_bytes_ref) + 1
    total = 0.0
    for k, (i, j) in enumerate(zip(starts, ends)):
        if k % layout.pp != rank:
            continue
        boundary = sum(float(graph.cut_bytes_ref[c - 1]) * cut_scale for c in (i, j) if 0 < c < n)
        pool = GRAPH_POOL_SCALE * float(saved[j] - saved[i]) + float(params[j] - params[i]) * weights
        total += slots.get(k, 1) * (pool + 3 * boundary)
    return total
