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
A round of every stage in turn does not outlast it either: on an H100 host, a 4-stage
plan of ResNet-50 at 32 images read 5.45, 5.55, 5.62 and 5.07 ms in one timing and 8.08, 8.40,
8.27 and 5.18 a minute later, each stage keeping its fastest of five rounds; in four of twelve
eager plans of the two ResNets, two such timings parted by more than 0.05 in max/mean.
So such plans are timed in sweeps ([Note: timing sweeps]).

[Note: timing sweeps]
Every stage is prepared first and kept on the device. A sweep runs each stage once, forward then
backward, in turn (odd sweeps from the last stage back), with the device drained before each
stage so that no stage runs on work the host queued for the one before. Sweeps are a few
milliseconds to a few tens of milliseconds long, far shorter than the host's spells, so the
stages of one sweep are timed at one pace: a spell slows every stage of the sweeps it falls on,
and the stages compare within a sweep as they compare in a pipeline. The plan is timed in
``passes * reps`` sweeps after untimed ones (``warmup`` and ``WARM_SECONDS``); the fastest
``SWEEPS_KEPT`` of them by their total time, when the host kept up, are kept, and each stage's
forward and backward are their medians over the kept sweeps: the same sweeps for every stage.
Spells that outlast a timing are waited out where they can be ([Note: host pace]): the kept
sweeps are the fastest of those at the host's pace.
Stages that do not fit the device at once (an out-of-memory error) are timed one at a time, the
whole plan ``passes`` times over, each stage keeping its fastest pass. CPU stages are timed once,
one at a time.

Stages at the GPU's pace (CUDA graphs) move far less, but not never: on an H100, in seven
timings of three 8-stage plans (ViT-B/16 and ConvNeXt-B at 32 images; 56 stage timings), three
stages read 1.13-1.86x their time in another timing of the same plan, every other stage within
2% (ViT-B/16's first stage 3.66 ms against 1.97; benchmarks/results/
2026-11-27-h100-graph-timing-spikes.txt). One such stage made plans of 1.04-1.12 read 1.15-1.79.
So they are timed in ``GRAPH_PASSES`` rounds: every stage on the device at once, each round
timing each stage in turn (``reps`` back to back after ``warmup``, odd rounds from the last stage
back), each stage keeping its fastest round.

[Note: paired timings]
Two timings run at two paces, and at the host's pace a slow spell does not slow every stage
alike: it slows the stages whose host work outlasts their kernels (small maps: the last stages
of a CNN) and leaves those over large maps as they were. On an H100 host, ResNet-50 at 128
images in 8 stages, eager, two timings a boundary move apart (the first boundary moved; the
third and the seventh stage the same in both) read the seventh stage 0.86x the third in one and
1.40x in the other (results/2026-11-27-h100-measured-plans-eager-resnets-sweeps-pace.json);
no scaling of one timing to the other's total makes them agree. So two plans that are to be
compared are timed in the same sweeps (``time_against``): the stages they share run once and
count for both, the others run beside their counterparts, and the comparison rests on one
timing.
"""
from __future__ import annotations

import copy
import gc
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from autopipe.errors import ProfileError
from autopipe.measure.host_pace import MORE_SWEEPS, PACE
from autopipe.measure.stage_run import StageRun, StageTiming
from autopipe.memory_format import boundary_layout, channels_last_model
from autopipe.partition.device import EXECUTION_MODES, _materialise
from autopipe.partition.plan import PartitionPlan
from autopipe.runtime.host_threads import pinned_host_threads
from autopipe.runtime.preparation import prepare_stage
from autopipe.runtime.weight_casts import WeightCasts
from autopipe.stages.emit import emit_stages
from autopipe.stages.variants import boundary_values
from autopipe.tracer import TracedModel

__all__ = ["RunSetup", "StageTiming", "time_stages", "time_against", "device_name", "default_passes",
           "WARM_SECONDS", "PASSES", "GRAPH_PASSES", "SWEEPS_KEPT"]

WARM_SECONDS = 0.05  # warm-up passes run at least this long (and at least RunSetup.warmup of them)
PASSES = 5  # a plan whose stages run at the host's pace: PASSES * reps sweeps; see [Note: timing sweeps]
GRAPH_PASSES = 3  # rounds of timings of a plan replayed as CUDA graphs (the GPU's pace)
SWEEPS_KEPT = 1 / 3  # the fraction of sweeps, the fastest by their total, that the stages' times come from


@dataclass(frozen=True)
class RunSetup:
    """How stages run, hence how they are timed; see [Note: stage timing]."""

    device: torch.device
    mode: str = "eager"  # one of EXECUTION_MODES
    compute_dtype: torch.dtype | None = None  # autocast dtype; None: the traced dtype
    recompute: bool = False  # activation checkpointing
    warmup: int = 2
    reps: int = 10
    passes: int | None = None  # rounds (or passes * reps sweeps) of timings; None: the mode's default

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
    timed_together = _time_rounds if setup.mode.endswith("graphs") else _time_sweeps
    try:
        return timed_together(traced, plan, setup, wanted, kernels=kernels)
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


def _time_sweeps(traced: TracedModel, plan: PartitionPlan, setup: RunSetup, wanted: set[int], *,
                 kernels: bool) -> dict[int, StageTiming]:
    """Every wanted stage prepared at once and timed in sweeps, each stage's times the medians
    over the fastest sweeps; see [Note: timing sweeps]."""
    runs = dict(_stage_runs(traced, plan, setup, wanted))
    try:
        best = _swept(runs, setup)
        if kernels:
            best = {i: StageTiming(t.forward, t.backward, runs[i].node_times(setup)) for i, t in best.items()}
        return best
    finally:
        for run in runs.values():
            run.close()


def time_against(traced: TracedModel, plan: PartitionPlan, other: PartitionPlan,
                 setup: RunSetup) -> tuple[dict[int, StageTiming], dict[int, StageTiming]]:
    """Every stage of ``plan`` and of ``other``, timed in the same sweeps; a stage the two share
    (the same nodes, receiving and sending the same values) runs once and counts for both. See
    [Note: paired timings]."""
    shared = {i for i in range(min(plan.num_stages, other.num_stages))
              if _stage_key(plan, i) == _stage_key(other, i)}
    runs: dict[tuple[int, int], StageRun] = {}
    try:
        runs.update(((i, 0), run) for i, run in _stage_runs(traced, plan, setup, set(range(plan.num_stages))))
        own = set(range(other.num_stages)) - shared
        runs.update(((i, 1), run) for i, run in _stage_runs(traced, other, setup, own))
        best = _swept(runs, setup)
    finally:
        for run in runs.values():
            run.close()
    return ({i: best[i, 0] for i in range(plan.num_stages)},
            {i: best[i, 0 if i in shared else 1] for i in range(other.num_stages)})


def _stage_key(plan: PartitionPlan, i: int) -> tuple[object, ...]:
    stage = plan.stages[i]
    return (tuple(stage.nodes), tuple(c.name for c in stage.inputs), tuple(c.name for c in stage.outputs),
            i == plan.num_stages - 1)


def _swept(runs: dict[Any, StageRun], setup: RunSetup) -> dict[Any, StageTiming]:
    """``runs`` warmed, then timed in ``passes * reps`` sweeps in the order of their keys
    (alternating), more while the host is off its pace ([Note: host pace]), each keeping the
    medians over the fastest sweeps at pace ([Note: timing sweeps])."""
    order = sorted(runs)
    count = setup.timing_passes * setup.reps
    with pinned_host_threads(setup.device):
        warm_until = time.perf_counter() + WARM_SECONDS
        for n in itertools.count():
            if n >= setup.warmup and time.perf_counter() >= warm_until:
                break
            for i in order:
                runs[i].backward(*runs[i].forward())
            runs[order[0]].clock.sync()
        sweeps, probes = _sweeps(runs, order, count, setup.device)
        for _ in range(MORE_SWEEPS):
            if sum(PACE.at_pace(probes)) >= _kept_count(count):
                break
            more, more_probes = _sweeps(runs, order, count, setup.device)
            sweeps, probes = sweeps + more, probes + more_probes
    at_pace = PACE.at_pace(probes)
    PACE.record(probes, waited=len(sweeps) > count, short=sum(at_pace) < _kept_count(count))
    return kept_sweeps(sweeps, at_pace=at_pace, count=count)


def _sweeps(runs: dict[Any, StageRun], order: list[Any], count: int,
            device: torch.device) -> tuple[list[dict[Any, tuple[float, float]]], list[float]]:
    """``count`` sweeps over ``runs``: per sweep, each stage's (forward, backward) seconds; and
    each sweep's probe of the host's pace ([Note: host pace])."""
    marks: list[dict[Any, tuple[Any, Any, Any]]] = []
    probes: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for s in range(count):
            probes.append(PACE.probe(device))
            marks.append({i: runs[i].step() for i in (reversed(order) if s % 2 else order)})
        runs[order[0]].clock.sync()
    finally:
        if gc_was_enabled:
            gc.enable()
    return [{i: (runs[i].clock.seconds(a, b), runs[i].clock.seconds(b, c)) for i, (a, b, c) in sweep.items()}
            for sweep in marks], probes


def _kept_count(count: int, kept: float = SWEEPS_KEPT) -> int:
    return max(1, math.ceil(kept * count))


def kept_sweeps(sweeps: Sequence[dict[Any, tuple[float, float]]], kept: float = SWEEPS_KEPT, *,
                at_pace: Sequence[bool] | None = None, count: int | None = None) -> dict[Any, StageTiming]:
    """Each stage's forward and backward: their medians over the fastest ``kept`` of ``count``
    sweeps (default: all of them) by total time, the same sweeps for every stage ([Note: timing
    sweeps]); with ``at_pace``, taken from the sweeps at the host's pace where there are enough
    of them ([Note: host pace])."""
    if not sweeps:
        raise ProfileError("no sweeps to keep: time at least one sweep (passes * reps >= 1)")
    wanted = _kept_count(len(sweeps) if count is None else count, kept)
    pool = list(sweeps)
    if at_pace is not None and sum(at_pace) >= wanted:
        pool = [s for s, ok in zip(sweeps, at_pace) if ok]
    fastest = sorted(pool, key=lambda sweep: sum(f + b for f, b in sweep.values()))[:wanted]
    return {i: StageTiming(statistics.median(s[i][0] for s in fastest), statistics.median(s[i][1] for s in fastest))
            for i in fastest[0]}


def _stage_runs(traced: TracedModel, plan: PartitionPlan, setup: RunSetup,
                wanted: set[int]) -> Iterator[tuple[int, "StageRun"]]:
    """Each wanted stage, in order, prepared on the real outputs of the stages before it."""
    last_needed = max(wanted, default=-1)
    stages = emit_stages(traced, plan, range(last_needed + 1))
    layout = torch.channels_last if channels_last_model(traced.gm) else torch.contiguous_format
    inputs = _model_inputs(traced, setup.device, layout)
    for i in range(last_needed + 1):
        last = i == plan.num_stages - 1
        if i in wanted:
            run = StageRun(_prepare(stages.pop(i), setup, last=last), inputs,
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
