"""One emitted stage on the device, prepared and run as a pipeline rank runs it, and the clock
that times it; what timer.py times ([Note: stage timing] there)."""
from __future__ import annotations

import gc
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn as nn

from autopipe.measure.kernels import NodeTimes, node_times
from autopipe.memory_format import channels_last_dense
from autopipe.runtime.graphs import StageGraphs
from autopipe.runtime.p2p import TensorSpec

if TYPE_CHECKING:
    from autopipe.measure.timer import RunSetup

__all__ = ["StageTiming", "StageRun", "Clock"]


@dataclass(frozen=True)
class StageTiming:
    forward: float  # median seconds, one micro-batch
    backward: float
    nodes: NodeTimes | None = None  # per-node kernel times, when asked for

    @property
    def seconds(self) -> float:
        return self.forward + self.backward


class StageRun:
    """One prepared stage on its inputs, ready to be timed. The first forward and backward (which
    compile and capture) run on construction, on the process's cores; ``outputs`` (detached)
    feed the next stage (copies of a graph's static ones)."""

    def __init__(self, stage: nn.Module, inputs: Sequence[torch.Tensor], grads: Sequence[bool],
                 setup: RunSetup) -> None:
        self.stage, self.inputs, self.grads = stage, tuple(inputs), list(grads)
        self.xs = [x.detach().requires_grad_(g) for x, g in zip(inputs, grads)]
        self.graphs = None
        if setup.mode.endswith("graphs"):
            # As a pipeline of one host runs it ([Note: graph slots as boundaries]): the inputs
            # lie in the slot's static inputs, the gradients of the outputs in its static ones.
            specs = [_spec(x) for x in self.xs]
            self.graphs = StageGraphs(stage, specs, grads, 1, setup.device)
            self.graphs.prepare_grads()
            static = self.graphs.inputs_of(0, specs)
            with torch.no_grad():
                for x, into in zip(self.xs, static):
                    into.copy_(x)
            self.xs = static
        self.seeds: list[torch.Tensor] | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self.clock = Clock(setup.device)
        self.backward(*self.forward())

    @property
    def outputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(o.detach().clone() if self.graphs is not None else o.detach() for o in self._outputs)

    def forward(self) -> tuple[Any, list[torch.Tensor]]:
        outs = self.graphs.forward(0, *self.xs) if self.graphs is not None else self.stage(*self.xs)
        self._outputs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        return None, [o for o in self._outputs if isinstance(o, torch.Tensor) and o.requires_grad]

    def backward(self, slot: Any, outs: list[torch.Tensor]) -> None:
        if self.seeds is None:
            self.seeds = self._seeds(outs)
        for x in self.xs:  # each received micro-batch is a new leaf: nothing accumulates into it
            x.grad = None
        if outs:
            torch.autograd.backward(outs, self.seeds)
        if self.graphs is not None:
            self.graphs.leaving_input_grads(0, [i for i, g in enumerate(self.grads) if g], lend=True)

    def _seeds(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Random gradients for ``outs``; under CUDA graphs, in the slot's static ones."""
        static = None
        if self.graphs is not None:
            floating = [i for i, o in enumerate(self._outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
            static = self.graphs.grad_outputs_of(0, floating, [_spec(o) for o in outs])
        seeds = [torch.randn_like(o) for o in outs]
        if static is None:
            return seeds
        with torch.no_grad():
            for into, seed in zip(static, seeds):
                into.copy_(seed)
        return list(static)

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

    def step(self) -> tuple[Any, Any, Any]:
        """One forward and backward, on a drained device, between three clock marks; see
        [Note: timing sweeps]."""
        self.clock.sync()
        t0 = self.clock.mark()
        slot, outs = self.forward()
        t1 = self.clock.mark()
        self.backward(slot, outs)
        return t0, t1, self.clock.mark()

    def node_times(self, setup: RunSetup) -> NodeTimes:
        """Each node's own times ([Note: node times from kernels])."""
        return node_times(self.stage, self.inputs, self.grads, setup.device, setup.compute_dtype,
                          reps=max(2, setup.reps // 3), recompute=setup.recompute)

    def close(self) -> None:
        for p in self.stage.parameters():
            p.grad = None


def _spec(x: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(x.shape), x.dtype, channels_last_dense(x))


class Clock:
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
