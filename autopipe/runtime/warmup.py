"""Stand-in inputs for a stage, and a warm-up pass on them that leaves no trace.

[Note: stage warm-up]
A compiled stage (``compile_stages=True``) compiles at its first call in each mode: training
with gradients, and evaluation without. Inside a pipeline schedule stage s + 1 is first called
when stage s's output arrives, so the compilations would run one after another along the
pipeline, every other rank idle and its receives running towards their deadline. The driver
therefore warms each local stage before the first step of a mode, on every rank at once: one
forward (and, when training, one backward) on random inputs of the stage's input specs. The
pass leaves no trace: buffers (BatchNorm's running statistics) are restored, the random
number generators are forked (dropout draws nothing the step would), and gradients are taken
with ``torch.autograd.grad``, so no ``.grad`` is written. CUDA graph capture (graphs.py) warms
up the same way on its own and needs no extra pass.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn

from autopipe.runtime.p2p import TensorSpec

if TYPE_CHECKING:
    from autopipe.runtime.batch_shapes import BatchShapes

__all__ = ["stand_in_inputs", "warm_up", "warm_up_once"]


def stand_in_inputs(specs: Sequence[TensorSpec], grad_inputs: Sequence[bool],
                    device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random floating tensors (zeros for integer ones) of ``specs``; those flagged in
    ``grad_inputs`` require grad, as received activations do."""
    return tuple(
        (torch.randn(s.shape, device=device).to(s.dtype) if s.dtype.is_floating_point
         else torch.zeros(s.shape, dtype=s.dtype, device=device)).contiguous(memory_format=s.memory_format)
        .requires_grad_(g)
        for s, g in zip(specs, grad_inputs)
    )


def warm_up(stage: nn.Module, specs: Sequence[TensorSpec], grad_inputs: Sequence[bool],
            device: torch.device, *, backward: bool) -> None:
    """Runs ``stage`` once on stand-in inputs (forward, and backward when ``backward``) in the
    mode it is in, without changing its buffers, ``.grad`` or the RNG states."""
    buffers = [b for b in stage.buffers()]
    saved = [b.clone() for b in buffers]
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(backward):
        inputs = stand_in_inputs(specs, [g and backward for g in grad_inputs], device)
        out = stage(*inputs)
        outs = [o for o in ((out,) if isinstance(out, torch.Tensor) else out)
                if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [x for x in inputs if x.requires_grad] + [p for p in stage.parameters() if p.requires_grad]
        if backward and outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
    with torch.no_grad():
        for b, s in zip(buffers, saved):
            b.copy_(s)


def warm_up_once(shapes: BatchShapes, sizes: set[int | None], device: torch.device, *, backward: bool,
                 done: set[tuple]) -> None:
    """Warms every stage of ``shapes`` at each micro-batch size in ``sizes`` (None: the planned
    one) that is not yet in ``done`` (keys (stage, size, training, backward), added here)."""
    # One order on every rank: compiled tp stages run collectives while warming up.
    for size in sorted(sizes, key=lambda k: k or 0):
        for s, stage in sorted(shapes.of(size)[0].items()):
            key = (s, size, stage.training, backward)
            if key not in done:
                warm_up(stage, *shapes.stage_inputs(s, size), device, backward=backward)
                done.add(key)
