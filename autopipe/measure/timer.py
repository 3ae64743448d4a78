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
pace its host keeps at the time. On a shared virtual machine that pace changes, for seconds at
a time and within a second: on the 16-core H200 host, five timings in a row of one plan of
ResNet-50 in 8 stages at 128 images, eager, host threads pinned, gave its last stage 6.29, 8.48,
4.45, 4.97 and 4.66 ms, while the first three stages (kernels over large maps, the GPU's pace)
moved under 1%. On an H100 host, one 8-stage plan of ConvNeXt-B at 32 images timed stage after
stage (each stage emitted, copied to the device and warmed before its timing) read 5.2-6.4 ms
for every stage in one pass and 9.1-10.0 ms for four of them in the pass before; in many passes
the stages read slower the later they came. A stage timed in a slow spell looks heavier than it
is, and the cut moves work away from it.
So such plans are timed in ``PASSES`` rounds: every stage is prepared first and kept on the
device, then each round times each stage in turn (``reps`` back to back after ``warmup``),
odd rounds from the last stage back, and each stage keeps its fastest round: its time when the
host keeps up, which is what the stages compare by. A round is a fraction of a second with no
preparation between its stages, so a spell falls on neighbouring stages of one round and the
other rounds time them again. Stages that do not fit the device at once (an out-of-memory
error) are timed one at a time, the whole plan ``PASSES`` times over. CPU stages are timed
once, one at a time.

Stages at the GPU's pace (CUDA graphs) move far less, but not never: on an H100, in seven
timings of three 8-stage plans (ViT-B/16 and ConvNeXt-B at 32 images; 56 stage timings), three
stages read 1.13-1.86x their time in another timing of the same plan, every other stage within
2% (ViT-B/16's first stage 3.66 ms against 1.97; benchmarks/results/
2026-11-27-h100-graph-timing-spikes.txt). One such stage made plans of 1.04-1.12 read 1.15-1.79.
So they are timed in ``GRAPH_PASSES`` rounds too, each stage keeping its fastest.
"""
from __future__ import annotations

import copy
import gc
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

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

__all__ = ["RunSetup", "StageTiming", "time_stages", "device_name", "default_passes", "WARM_SECONDS", "PASSES",
           "GRAPH_PASSES"]

WARM_SECONDS = 0.05  # warm-up passes run at least this long (and at least RunSetup.warmup of them)
PASSES = 5  # rounds of timings of a plan whose stages run at the host's pace; see [Note: timing passes]
GRAPH_PASSES = 3  # rounds of timings of a plan replayed as CUDA graphs (the GPU's pace)


@dataclass(frozen=True)
class RunSetup:
    """How stages run, hence how they are timed; see [Note: stage timing]."""

    device: torch.device
    mode: str = "eager"  # one of EXECUTION_MODES
    compute_dtype: torch.dtype | None = None  # autocast dtype; None: the traced dtype
    recompute: bool = False  # activation checkpointing
    warmup: int = 2
    reps: int = 10
    passes: int | None = None  # rounds of timings, each stage keeping its fastest; None: PASSES

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
        return default_passes(self.device, self.mode)


def default_passes(device: torch.device, mode: str) -> int:
    """Rounds of timings of a plan on ``device`` in execution ``mode``; see [Note: timing passes]."""
    if device.type != "cuda":
        return 1
    return GRAPH_PASSES if mode.endswith("graphs") else PASSES


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
    if setup.timing_passes == 1:
        return _time_pass(traced, plan, setup, wanted, kernels=kernels)
    try:
        return _time_rounds(traced, plan, setup, wanted, kernels=kernels)
    except torch.cuda.OutOfMemoryError:  # the stages do not fit the device at once: one at a time
        gc.collect()
        torch.cuda.empty_cache()
    best: dict[int, StageTiming] = {}
    for n in range(setup.timing_passes):
        for i, t in _time_pass(traced, plan, setup, wanted, kernels=kernels and n == 0).items():
            if i not in best or t.seconds < best[i].seconds:
                best[i] = StageTiming(t.forward, t.backward, best[i].nodes if i in best else t.nodes)
    return best


def _time_pass(traced: TracedModel, plan: PartitionPlan, setup: RunSetup, wanted: set[int], *,
               kernels: bool) -> dict[int, StageTiming]:
    """Each wanted stage timed once, one stage on the device at a time."""
    out: dict[int, StageTiming] = {}
    for i, run in _stage_runs(traced, plan, setup, wanted):
        with pinned_host_threads(setup.device):
            out[i] = run.time(setup, warm_seconds=WARM_SECONDS)
        if kernels:
            out[i] = StageTiming(out[i].forward, out[i].backward, run.node_times(setup))
        run.close()
        del run  # before the next stage is made: one stage on the device at a time
    return out


def _time_rounds(traced: TracedModel, plan: PartitionPlan, setup: RunSetup, wanted: set[int], *,
                 kernels: bool) -> dict[int, StageTiming]:
    """Every wanted stage prepared at once and timed in rounds, each keeping its fastest round;
    see [Note: timing passes]."""
    runs = dict(_stage_runs(traced, plan, setup, wanted))
    best: dict[int, StageTiming] = {}
    try:
        with pinned_host_threads(setup.device):
            for r in range(setup.timing_passes):
                for i in sorted(runs, reverse=r % 2 == 1):  # odd rounds backwards: no stage always last
                    t = runs[i].time(setup, warm_seconds=WARM_SECONDS if r == 0 else 0.0)
                    if i not in best or t.seconds < best[i].seconds:
                        best[i] = t
        if kernels:
            best = {i: StageTiming(t.forward, t.backward, runs[i].node_times(setup)) for i, t in best.items()}
    finally:
        for run in runs.values():
            run.close()
    return best


def _stage_runs(traced: TracedModel, plan: PartitionPlan, setup: RunSetup,
                wanted: set[int]) -> Iterator[tuple[int, "_StageRun"]]:
    """Each wanted stage, in order, prepared on the real outputs of the stages before it."""
    last_needed = max(wanted, default=-1)
    stages = emit_stages(traced, plan, range(last_needed + 1))
    layout = torch.channels_last if channels_last_model(traced.gm) else torch.contiguous_format
    inputs = _model_inputs(traced, setup.device, layout)
    for i in range(last_needed + 1):
        last = i == plan.num_stages - 1
        if i in wanted:
            run = _StageRun(_prepare(stages.pop(i), setup, last=last), inputs,
                            [i > 0 and x.is_floating_point() for x in inputs], setup)
            outputs = run.outputs
            yield i, run
            del run
        else:  # only feeds the next stage: eager, no gradients
            stage = _prepare(stages.pop(i), RunSetup(setup.device, "eager", setup.compute_dtype), last=last)
            with torch.no_grad():
                outputs = stage(*inputs)
            outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
            del stage
        # What the next stage receives: a dense copy in the boundary's layout, as the pipeline's
        # receive buffers are (see [Note: boundary layout]).
        if i < plan.num_stages - 1:
            layouts = [boundary_layout(v) for v in boundary_values(traced, plan)[i]]
            inputs = tuple(_received(t.detach(), f) for t, f in zip(outputs, layouts, strict=True))


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


class _StageRun:
    """One prepared stage on its inputs, ready to be timed. The first forward and backward (which
    compile and capture) run on construction, on the process's cores; ``outputs`` (detached)
    feed the next stage."""

    def __init__(self, stage: nn.Module, inputs: Sequence[torch.Tensor], grads: Sequence[bool],
                 setup: RunSetup) -> None:
        self.stage, self.inputs, self.grads = stage, tuple(inputs), list(grads)
        self.xs = [x.detach().requires_grad_(g) for x, g in zip(inputs, grads)]
        self.graphs = None
        if setup.mode.endswith("graphs"):
            specs = [TensorSpec(tuple(x.shape), x.dtype, channels_last_dense(x)) for x in self.xs]
            self.graphs = StageGraphs(stage, specs, grads, 1, setup.device)
            self.graphs.prepare_grads()
        self.seeds: list[torch.Tensor] | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self.clock = _Clock(setup.device)
        self.backward(*self.forward())

    @property
    def outputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(o.detach() for o in self._outputs)

    def forward(self) -> tuple[Any, list[torch.Tensor]]:
        if self.graphs is not None:
            slot, outs = self.graphs.forward(*self.xs)
        else:
            slot, outs = None, self.stage(*self.xs)
        self._outputs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        return slot, [o for o in self._outputs if isinstance(o, torch.Tensor) and o.requires_grad]

    def backward(self, slot: Any, outs: list[torch.Tensor]) -> None:
        if self.seeds is None:
            self.seeds = [torch.randn_like(o) for o in outs]
        if outs:
            torch.autograd.backward(outs, self.seeds)
        if self.graphs is not None:
            self.graphs.release(slot)

    def time(self, setup: RunSetup, *, warm_seconds: float) -> StageTiming:
        """Median forward and backward seconds of ``setup.reps`` back-to-back repetitions, after
        ``setup.warmup`` untimed ones and at least ``warm_seconds`` of them: a GPU left idle (while
        the host emitted and captured a stage) clocks down, and a stage of a millisecond needs many
        passes to bring it back. No garbage collection inside the timed repetitions."""
        clock, fwd, bwd = self.clock, [], []
        warm_until = time.perf_counter() + warm_seconds
        for passes in itertools.count(1):
            if passes > setup.warmup:
                clock.sync()
                if time.perf_counter() >= warm_until:
                    break
            self.backward(*self.forward())
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(setup.reps):
                t0 = clock.mark()
                slot, outs = self.forward()
                t1 = clock.mark()
                self.backward(slot, outs)
                t2 = clock.mark()
                fwd.append((t0, t1))
                bwd.append((t1, t2))
            clock.sync()
        finally:
            if gc_was_enabled:
                gc.enable()
        return StageTiming(statistics.median(clock.seconds(a, b) for a, b in fwd),
                           statistics.median(clock.seconds(a, b) for a, b in bwd))

    def node_times(self, setup: RunSetup) -> NodeTimes:
        """Each node's own times ([Note: node times from kernels])."""
        return node_times(self.stage, self.inputs, self.grads, setup.device, setup.compute_dtype,
                          reps=max(2, setup.reps // 3), recompute=setup.recompute)

    def close(self) -> None:
        for p in self.stage.parameters():
            p.grad = None


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
