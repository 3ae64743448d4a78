"""CUDA graphs for pipeline stages: a stage's forward and backward replayed, not relaunched.

A ViT-L stage run on 16-32 samples launches some thousand kernels per micro-batch, each a
few microseconds of GPU work: the GPU waits on Python. Shapes are static (the plan fixes
every boundary tensor), so each stage's forward and backward are captured once with
``torch.cuda.make_graphed_callables`` and replayed per micro-batch.

[Note: graph slots]
A captured graph keeps the activations its backward needs in its own memory, overwritten by
its next forward replay. 1F1B keeps several micro-batches of one stage between forward and
backward, so a stage gets one graph per micro-batch it may hold at once ("slots", counted
from the schedule: pp - rank for 1F1B, m for GPipe); a forward takes a free slot, its
backward frees it. What leaves a graph is copied out (outputs, the input gradients sent to
the previous stage), and parameter gradients are added into ``.grad`` tensors that exist
before the first backward, so nothing outside a graph aliases its memory.

Capture runs each slot's forward and backward a few times on stand-in inputs first; the stage's
buffers (BatchNorm's running statistics, the sums of deferred statistics) are restored after
capture, so those passes leave no trace. A captured forward replays every in-place update it
made: BatchNorm's own (``batchnorm="microbatch"``) or the collection of deferred statistics into
buffers that the end of the step reads and zeroes in place (see [Note: deferred batch norm]).

Limits: stages with collectives inside (tp > 1, ``batchnorm="sync"``) are not captured; dropout
draws through the graph-safe generator.
"""
from __future__ import annotations

import gc
from typing import Sequence

import torch
import torch.nn as nn

from autopipe.runtime.p2p import TensorSpec
from autopipe.runtime.warmup import stand_in_inputs

__all__ = ["StageGraphs", "slots_per_stage"]


def slots_per_stage(actions_by_stage: dict[int, Sequence[tuple[str, int]]]) -> dict[int, int]:
    """The most micro-batches each stage holds between forward and backward, from its
    ordered ("F"|"B", micro-batch) actions."""
    out = {}
    for s, actions in actions_by_stage.items():
        held, most = 0, 0
        for kind, _ in actions:
            held += 1 if kind == "F" else -1
            most = max(most, held)
        out[s] = max(most, 1)
    return out


class _Slot(nn.Module):
    """One capture of ``stage`` (its parameters, shared)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.stage(*inputs)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)


class StageGraphs:
    """The captured slots of one stage; see [Note: graph slots].

    ``input_specs`` are the stage's inputs for one micro-batch; ``grad_inputs`` says which of
    them carry a gradient (received activations do, the model's images do not).
    """

    def __init__(self, stage: nn.Module, input_specs: Sequence[TensorSpec], grad_inputs: Sequence[bool],
                 slots: int, device: torch.device) -> None:
        self.stage = stage
        self.training = stage.training
        self._free = list(range(slots))[::-1]
        self._slots = []
        buffers = list(stage.buffers())
        saved = [b.clone() for b in buffers]
        # Graphs no longer used still hold their memory pools until the collector runs:
        # make_graphed_callables's autograd Functions sit in reference cycles, and torch no
        # longer collects before a capture. Where many stages are captured in turn (the stage
        # timer tries one plan after another), that memory piles up until an allocation inside
        # a capture fails and invalidates it ("operation failed due to a previous error
        # during capture"). Collect once here, before this stage's captures.
        gc.collect()
        for _ in range(slots):
            sample = stand_in_inputs(input_specs, grad_inputs, device)
            slot = _Slot(stage)
            self._slots.append(torch.cuda.make_graphed_callables(slot, sample, allow_unused_input=True))
        with torch.no_grad():  # in place: the graphs read and write these very tensors
            for b, s in zip(buffers, saved):
                b.copy_(s)
        self._grads_ready = False

    def usable(self) -> bool:
        """Replays are valid only in the train/eval mode the graphs were captured in."""
        return self.stage.training == self.training and torch.is_grad_enabled()

    def prepare_grads(self) -> None:
        """Gives every parameter a ``.grad`` so that backward adds into it (see the Note)."""
        for p in self.stage.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def forward(self, *inputs: torch.Tensor) -> tuple[int, tuple[torch.Tensor, ...]]:
        """Replays a free slot's forward; returns the slot (for :meth:`release`) and copies of
        the outputs, attached to the graph's backward."""
        slot = self._free.pop()
        outputs = self._slots[slot](*inputs)
        return slot, tuple(o.clone() for o in outputs)

    def release(self, slot: int) -> None:
        self._free.append(slot)
