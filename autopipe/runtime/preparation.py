"""How a stage runs: compiled, under autocast with its outputs cast for the wire, its
activations checkpointed. The runtime prepares its stages this way and the profiler times
them prepared alike (measure/timer.py), so what is timed is what runs.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .batchnorm import BatchNormStats

__all__ = ["prepare_stage"]


def prepare_stage(stage: nn.Module, *, device_type: str, compute_dtype: torch.dtype | None, compile: bool,
                  recompute: bool, cast_outputs: bool, norms: BatchNormStats | None = None) -> None:
    """Make ``stage`` run as it will in the pipeline: compiled (see [Note: compiled stages]),
    under autocast in ``compute_dtype`` with floating outputs cast to it (``cast_outputs``: all
    but the last stage send them), and with its activations checkpointed (``recompute``).
    Weight casts ([Note: weight casts] in weight_casts.py) are installed by the caller, once
    for every stage sharing the layers."""
    if compile:  # see [Note: compiled stages]
        stage.forward = torch.compile(stage.forward, dynamic=False)
    if compute_dtype is not None or recompute:
        _wrap_forward(stage, device_type=device_type, compute_dtype=compute_dtype, cast_outputs=cast_outputs,
                      recompute=recompute, norms=norms)


def _wrap_forward(stage: nn.Module, *, device_type: str, compute_dtype: torch.dtype | None,
                  cast_outputs: bool, recompute: bool, norms: BatchNormStats | None = None) -> None:
    """Run the stage under autocast and/or activation checkpointing; send activations in the
    compute dtype. The instance attribute shadows the generated ``forward``, so parameter names
    and the module tree stay those of the plan."""
    inner = stage.forward

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if compute_dtype is None:
            return inner(*inputs)
        # No cast cache: CUDA graph capture refuses it, and each weight is cast once per call anyway.
        with torch.autocast(device_type, dtype=compute_dtype, cache_enabled=False):
            outputs = inner(*inputs)
        if cast_outputs:
            outputs = tuple(o.to(compute_dtype) if o.is_floating_point() else o for o in outputs)
        return outputs

    if recompute:
        def contexts() -> tuple[Any, Any]:
            return contextlib.nullcontext(), _recomputation(stage, norms)

        stage.forward = functools.wraps(inner)(
            lambda *xs: checkpoint(run, *xs, use_reentrant=False, context_fn=contexts))
    else:
        stage.forward = run


@contextlib.contextmanager
def _recomputation(stage: nn.Module, norms: BatchNormStats | None) -> Iterator[None]:
    """A checkpointed forward run again in backward: BatchNorm statistics must not count twice."""
    with _running_stats_kept(stage), norms.paused() if norms is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _running_stats_kept(stage: nn.Module) -> Iterator[None]:
    """The recomputation of a checkpointed forward runs in train mode again: keep BatchNorm's
    running statistics as the first forward left them (one update per micro-batch)."""
    norms = [m for m in stage.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
             and m.track_running_stats]
    saved = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
             for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, kept in zip(norms, saved):
                for b, k in zip([b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None],
                                kept):
                    b.copy_(k)


# [Note: compiled stages]
# ``compile_stages=True`` hands each stage's generated ``forward`` to ``torch.compile`` (inductor,
# static shapes: the plan fixes them). Inductor fuses what runs between the GEMMs, forward and
# backward: norms, activations, bias and residual adds, dtype casts; on one H100, ViT-L in 4
# micro-batches of 64 went from 831 to 1036 samples/s (benchmarks/microbatch_efficiency.py).
# The weight-cast linears (autograd Functions) are compiled with the rest; autocast is entered
# outside, around the compiled call, and dynamo guards on it. Tensor-parallel collectives are
# traced too (see [Note: traceable collectives] in shard/collectives.py): a stage is one graph.
# With ``cuda_graphs`` the compiled code is what is captured: compilation happens in the
# capture's warm-up passes. The first train step pays the compilation, and the first eval step
# another (no_grad is a different graph), every rank compiling its stages at once before the
# schedule starts (see [Note: stage warm-up] in runtime/warmup.py); every stage has its own
# generated code, so stages do not share dynamo's recompilation limit.
