"""Time a plan's stages on a device: each emitted stage alone, forward then backward, on the
real outputs of the stages before it, prepared as the runtime prepares it.

[Note: stage timing]
What a pipeline rank does per micro-batch is run its stage's forward, later its backward; so
that is what is timed, with nothing else around it:
- the stage is emitted from the plan (autopipe/stages/emit.py), copied to the device (a model
  planned on the meta device gets random weights: timing needs shapes, not values), and
  prepared as the runtime prepares it (runtime/preparation.py): weight casts and autocast in
  the compute dtype, activations cast at the boundary, activation checkpointing,
  ``torch.compile``, CUDA graphs (runtime/graphs.py, one slot);
- its inputs are the outputs of the stages before it, computed once in order (no grad), so a
  stage sees the values, dtypes and layouts it will see in training; received activations
  require grad, the model's own inputs do not;
- forward and backward are timed separately with CUDA events (perf_counter on CPU) around
  back-to-back repetitions after ``warmup`` untimed ones, and the median is kept. Between
  repetitions nothing synchronises, so a stage whose host work (Python, dispatch, launch)
  is slower than its kernels measures its host time, as it runs in a pipeline;
- the backward pass starts from random gradients of the stage's outputs (the last stage's
  outputs too: a classification loss adds a kernel or two, nothing that moves a cut);
- after a first pass (which compiles and captures), the host threads run on the rank's core,
  as the pipeline runs them ([Note: host thread placement], runtime/host_threads.py).
Stages are handled one at a time and dropped after use, so a model that does not fit the
device whole can still be timed stage by stage. ``indices`` times some stages only (the
others still run their forward to feed the next): ranks share the work this way.

[Note: timing passes]
A stage that runs at its host's pace (eager, or compiled without CUDA graphs) is timed at the
pace its host keeps at the time. On a shared virtual machine that pace changes for seconds at
a time: on the 16-core H200 host, five timings in a row of one plan of ResNet-50 in 8 stages at
128 images, eager, host threads pinned, gave its last stage 6.29, 8.48, 4.45, 4.97 and 4.66 ms,
while the first three stages (kernels over large maps, the GPU's pace) moved under 1%. A stage
timed in a slow spell looks heavier than it is, and the cut moves work away from it. So such
plans are timed ``PASSES`` times over, the whole plan each time (each pass seconds long), and
each stage keeps its fastest pass: its time when the host keeps up, which is what the stages
compare by. Stages at the GPU's pace (CUDA graphs) and CPU stages are timed once.
"""
from __future__ import annotations

import copy
import gc
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn

from autopipe.measure.kernels import NodeTimes, node_times
from autopipe.errors import ProfileError
from autopipe.memory_format import boundary_layout, channels_last_dense, channels_last_model
from autopipe.partition.device import EXECUTION_MODES, _materialise
from autopipe.partition.plan import PartitionPlan
from autopipe.runtime.graphs import StageGraphs
from autopipe.runtime.host_threads import pinned_host_threads
from autopipe.runtime.p2p import TensorSpec
from autopipe.runtime.preparation import prepare_stage
from autopipe.runtime.weight_casts import WeightCasts
from autopipe.stages.emit import emit_stages
from autopipe.stages.variants import boundary_values
from autopipe.tracer import TracedModel

__all__ = ["RunSetup", "StageTiming", "time_stages", "device_name", "WARM_SECONDS", "PASSES"]

WARM_SECONDS = 0.05  # warm-up passes run at least this long (and at least RunSetup.warmup of them)
PASSES = 3  # timings of a plan whose stages run on the host's pace; see [Note: timing passes]


@dataclass(frozen=True)
class RunSetup:
    """How stages run, hence how they are timed; see [Note: stage timing]."""

    device: torch.device
    mode: str = "eager"  # one of EXECUTION_MODES
    compute_dtype: torch.dtype | None = None  # autocast dtype; None: the traced dtype
    recompute: bool = False  # activation checkpointing
    warmup: int = 2
    reps: int = 10
    passes: int | None = None  # timings of the whole plan, each stage keeping its fastest; None: PASSES

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        if self.mode not in EXECUTION_MODES:
            raise ProfileError(f"execution mode {self.mode!r} is not one of {', '.join(EXECUTION_MODES)}")
        if "graphs" in self.mode and self.device.type != "cuda":
            raise ProfileError(f"mode {self.mode!r} captures CUDA graphs and needs a CUDA device, not "
                               f"{self.device}; use mode='eager'")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ProfileError(f"cannot time stages on {self.device}: this machine has no CUDA device "
                               "(torch.cuda.is_available() is False). Profile on the GPU machine "
                               "(`autopipe profile ... --out FILE`) and plan here with that file, or "
                               "plan with the analytic cost model")
        if self.reps < 1 or self.warmup < 0:
            raise ProfileError(f"reps must be >= 1 and warmup >= 0, got reps={self.reps}, warmup={self.warmup}")
        if self.passes is not None and (not isinstance(self.passes, int) or self.passes < 1):
            raise ProfileError(f"passes must be a positive integer (or None for the mode's default), "
                               f"got {self.passes!r}")

    @property
    def timing_passes(self) -> int:
        """How many times the plan is timed; see [Note: timing passes]."""
        if self.passes is not None:
            return self.passes
        host_bound = self.device.type == "cuda" and not self.mode.endswith("graphs")
        return PASSES if host_bound else 1


@dataclass(frozen=True)
class StageTiming:
    forward: float  # median seconds, one micro-batch
    backward: float
    nodes: NodeTimes | None = None  # per-node kernel times, when asked for

    @property
    def seconds(self) -> float:
        return self.forward + self.backward


def device_name(device: torch.device | str) -> str:
    """The name a device gives itself (the key a profile is made for)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def time_stages(traced: TracedModel, plan: PartitionPlan, setup: RunSetup,
                indices: Iterable[int] | None = None, *, kernels: bool = False) -> dict[int, StageTiming]:
    """Seconds of each stage in ``indices`` (default all), timed as [Note: stage timing] says;
    with ``kernels``, each node's own times too ([Note: node times from kernels]; not for
    compiled modes, whose fused kernels belong to no single node)."""
    if kernels and setup.mode.startswith("compiled"):
        raise ProfileError(f"per-node kernel times cannot be read in mode {setup.mode!r}: compiled "
                           "kernels fuse several nodes")
    wanted = set(range(plan.num_stages) if indices is None else indices)
    best: dict[int, StageTiming] = {}
    for n in range(setup.timing_passes):  # see [Note: timing passes]
        for i, t in _time_pass(traced, plan, setup, wanted, kernels=kernels and n == 0).items():
            if i not in best or t.seconds < best[i].seconds:
                best[i] = StageTiming(t.forward, t.backward, best[i].nodes if i in best else t.nodes)
    return best


def _time_pass(traced: TracedModel, plan: PartitionPlan, setup: RunSetup, wanted: set[int], *,
               kernels: bool) -> dict[int, StageTiming]:
    last_needed = max(wanted, default=-1)
    stages = emit_stages(traced, plan, range(last_needed + 1))
    layout = torch.channels_last if channels_last_model(traced.gm) else torch.contiguous_format
    inputs = _model_inputs(traced, setup.device, layout)
    out: dict[int, StageTiming] = {}
    for i in range(last_needed + 1):
        last = i == plan.num_stages - 1
        if i in wanted:
            stage = _prepare(stages.pop(i), setup, last=last)
            grads = [i > 0 and x.is_floating_point() for x in inputs]
            out[i], outputs = _time(stage, inputs, grads, setup)
            if kernels:
                nodes = node_times(stage, inputs, grads, setup.device, setup.compute_dtype,
                                   reps=max(2, setup.reps // 3), recompute=setup.recompute)
                out[i] = StageTiming(out[i].forward, out[i].backward, nodes)
        else:  # only feeds the next stage: eager, no gradients
            stage = _prepare(stages.pop(i), RunSetup(setup.device, "eager", setup.compute_dtype), last=last)
            with torch.no_grad():
                outputs = stage(*inputs)
        # What the next stage receives: a dense copy in the boundary's layout, as the pipeline's
        # receive buffers are (see [Note: boundary layout]).
        if i < plan.num_stages - 1:
            layouts = [boundary_layout(v) for v in boundary_values(traced, plan)[i]]
            inputs = tuple(_received(t.detach(), f) for t, f in zip(outputs, layouts, strict=True))
        del stage
    return out


def _received(t: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
    return t.contiguous(memory_format=layout if t.dim() == 4 else torch.contiguous_format)


def _model_inputs(traced: TracedModel, device: torch.device,
                  layout: torch.memory_format = torch.contiguous_format) -> tuple[torch.Tensor, ...]:
    return tuple(_received(torch.randn(s, device=device).to(d) if d.is_floating_point else
                           torch.zeros(s, dtype=d, device=device), layout)
                 for s, d in zip(traced.input_shapes, traced.input_dtypes))


def _prepare(stage: nn.Module, setup: RunSetup, *, last: bool) -> nn.Module:
    """A device copy of ``stage`` set up as the runtime sets up its stages."""
    stage = copy.deepcopy(stage)
    _materialise(stage, setup.device)
    stage.recompile()  # _materialise may retarget factory calls traced on the meta device
    stage.train()
    if setup.compute_dtype is not None:
        WeightCasts.install([stage], setup.compute_dtype)
    prepare_stage(stage, device_type=setup.device.type, compute_dtype=setup.compute_dtype,
                  compile=setup.mode.startswith("compiled"), recompute=setup.recompute, cast_outputs=not last)
    return stage


def _time(stage: nn.Module, inputs: Sequence[torch.Tensor], grads: Sequence[bool],
          setup: RunSetup) -> tuple[StageTiming, tuple[torch.Tensor, ...]]:
    """The stage's timing, and its outputs (of the last repetition) to feed the next stage."""
    xs = [x.detach().requires_grad_(g) for x, g in zip(inputs, grads)]
    graphs = None
    if setup.mode.endswith("graphs"):
        specs = [TensorSpec(tuple(x.shape), x.dtype, channels_last_dense(x)) for x in xs]
        graphs = StageGraphs(stage, specs, grads, 1, setup.device)
        graphs.prepare_grads()
    seeds: list[torch.Tensor] | None = None

    outputs: tuple[torch.Tensor, ...] = ()

    def forward() -> tuple[Any, list[torch.Tensor]]:
        nonlocal outputs
        if graphs is not None:
            slot, outs = graphs.forward(*xs)
        else:
            slot, outs = None, stage(*xs)
        outputs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        return slot, [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]

    def backward(slot: Any, outs: list[torch.Tensor]) -> None:
        nonlocal seeds
        if seeds is None:
            seeds = [torch.randn_like(o) for o in outs]
        if outs:
            torch.autograd.backward(outs, seeds)
        if graphs is not None:
            graphs.release(slot)

    clock = _Clock(setup.device)
    # The first pass compiles and captures, on the process's cores; the rest run as the
    # pipeline runs them, on the rank's core ([Note: host thread placement]).
    backward(*forward())
    fwd, bwd = [], []
    with pinned_host_threads(setup.device):
        # Warm for a while, not a count of passes: a GPU left idle (while the host emitted and
        # captured this stage) clocks down, and a stage of a millisecond needs many passes to
        # bring it back. No garbage collection inside the timed passes.
        warm_until = time.perf_counter() + WARM_SECONDS
        for passes in itertools.count(1):
            if passes >= setup.warmup:
                clock.sync()
                if time.perf_counter() >= warm_until:
                    break
            backward(*forward())
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(setup.reps):
                t0 = clock.mark()
                slot, outs = forward()
                t1 = clock.mark()
                backward(slot, outs)
                t2 = clock.mark()
                fwd.append((t0, t1))
                bwd.append((t1, t2))
            clock.sync()
        finally:
            if gc_was_enabled:
                gc.enable()
    timing = StageTiming(statistics.median(clock.seconds(a, b) for a, b in fwd),
                         statistics.median(clock.seconds(a, b) for a, b in bwd))
    for p in stage.parameters():
        p.grad = None
    return timing, tuple(o.detach() for o in outputs)


class _Clock:
    """Marks on the device's stream (CUDA events) or the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a
