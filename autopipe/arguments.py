"""The checks ``parallelize`` makes of its arguments on one rank, before any collective, so
that every rank raises the same typed error instead of leaving a peer waiting. See
docs/architecture.md.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from .errors import ConfigError, PartitionError
from .measure import MeasureOptions
from .partition.measured import MeasuredCosts
from .partition.plan import PartitionPlan
from .runtime.batchnorm import check_batchnorm
from .runtime.microbatch import SPLITS
from .runtime.schedule import SCHEDULES, validate
from .training.mesh import ParallelDims, default_device

__all__ = ["PRECISIONS", "check_on_this_rank", "check_deadline", "check_parameters", "costs_label", "resolve_device"]

PRECISIONS = {None: None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check(loss_fn: Any, schedule: str, pp: int, chunks: int, microbatches: int, mixed_precision: Any,
           batch_split: str) -> None:
    if not callable(loss_fn):
        raise ConfigError("loss_fn must be a callable loss_fn(model_output, target) -> scalar tensor")
    if schedule not in SCHEDULES or schedule == "forward_only":
        raise ConfigError(
            f"schedule={schedule!r}; training schedules are 'gpipe', '1f1b', 'interleaved_1f1b'"
        )
    if mixed_precision not in PRECISIONS:
        raise ConfigError(f"mixed_precision={mixed_precision!r}; use None, 'bf16' or 'fp16'")
    if batch_split not in SPLITS:
        raise ConfigError(f"batch_split={batch_split!r}; use one of {', '.join(map(repr, SPLITS))}")
    validate(schedule, pp, microbatches, chunks)


def _check_costs(costs: Any, measure: Any) -> None:
    if not (isinstance(costs, (MeasuredCosts, os.PathLike)) or isinstance(costs, str)):
        raise ConfigError(f"costs={costs!r}; use 'analytic', 'measured', a profile file's path or a MeasuredCosts")
    if measure is not None and not isinstance(measure, MeasureOptions):
        raise ConfigError(f"measure={measure!r}; pass autopipe.measure.MeasureOptions(...) or None")
    if measure is not None and measure.stage_scale is not None and isinstance(costs, str) and costs == "analytic":
        raise ConfigError("measure=MeasureOptions(stage_scale=...) scales the measured stage times; pass "
                          "costs='measured' (or a profile) with it")


def check_deadline(deadline: Any) -> None:
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline < math.inf:
        raise ConfigError(f"deadline={deadline!r}; pass a positive number of seconds (how long a rank waits "
                          "for its peers before deciding that one has failed)")


def costs_label(costs: Any) -> str:
    """What ``costs`` is, comparable between ranks: its name, a path, or a profile's fingerprint."""
    if isinstance(costs, str):
        return costs
    if isinstance(costs, os.PathLike):
        return os.fspath(costs)
    return getattr(costs, "fingerprint", type(costs).__name__)


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"device={str(device)!r}, but there is no CUDA on this machine ({why}: "
                          "torch.cuda.is_available() is False); pass device='cpu', or run on a machine with a GPU")
    return device


def check_parameters(plan: PartitionPlan) -> None:
    """Every pipeline rank must hold parameters: an optimizer over none raises (on that rank
    alone). Checked on the plan, so every rank refuses alike before the first collective."""
    for r in range(plan.pp):
        stages = [s for s in plan.stages if s.pp_rank == r]
        if not any(s.params for s in stages):
            held = "; ".join(f"stage {s.index}: module '{s.modules[0]}'" if s.modules[0] == s.modules[1] else
                             f"stage {s.index}: modules '{s.modules[0]}' to '{s.modules[1]}'" for s in stages)
            raise PartitionError(
                f"pipeline rank {r} would hold no parameters ({held}), and an optimizer over no parameters "
                f"fails on that rank (torch.optim raises on an empty list). Use fewer stages (pp={plan.pp} x "
                f"chunks={plan.chunks}; {sum(1 for s in plan.stages if s.params)} of these stages hold "
                "parameters), or balance= cut points that give every pipeline rank a layer with parameters")


def check_on_this_rank(loss_fn: Any, schedule: str, *, pp: int, tp: int, chunks: int, microbatches: int,
                        mixed_precision: Any, batch_split: str, costs: Any, measure: Any, batchnorm: str,
                        cuda_graphs: bool, compile_stages: bool, sequence_parallel: bool,
                        device: torch.device | str | None) -> tuple[ParallelDims, torch.device, int]:
    """Every local check, before any collective: the mesh's dimensions, the device, the rank."""
    if cuda_graphs and tp > 1:
        raise ConfigError(f"cuda_graphs=True with tp={tp}: stages holding tensor-parallel collectives are "
                          "not captured; use cuda_graphs=False, or tp=1")
    if compile_stages and sequence_parallel and tp > 1 and TorchVersion(torch.__version__) < "2.14":
        # Measured: torch 2.11 trains compiled sequence-parallel stages to wrong parameters (over
        # gloo on CPU; 2.14 matches one process), while compiled tp without it is right.
        raise ConfigError(f"compile_stages=True with sequence_parallel=True needs torch >= 2.14; torch "
                          f"{torch.__version__} compiles the sequence-parallel collectives' gradients wrong. "
                          "Upgrade torch, or pass sequence_parallel=False (compiled tensor parallelism "
                          "without it is right) or compile_stages=False")
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims(pp, tp, world)
    _check(loss_fn, schedule, pp, chunks, microbatches, mixed_precision, batch_split)
    _check_costs(costs, measure)
    check_batchnorm(None, batchnorm, cuda_graphs=cuda_graphs)
    device = resolve_device(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims.coords(rank)
    if world > 1 and not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised; launch with torchrun and call "
                          "torch.distributed.init_process_group() first")
    gloo_on_cuda = device.type == "cuda" and dist.is_initialized() and dist.get_backend() == "gloo"
    if pp > 1 and gloo_on_cuda:
        raise ConfigError(f"pp={pp} on CUDA needs the NCCL backend: gloo sends and receives CPU tensors "
                          "only; init_process_group('nccl'), or device='cpu'")
    if compile_stages and tp > 1 and gloo_on_cuda:
        # Measured on torch 2.11: gradients through gloo's all-reduce of CUDA tensors came out as
        # zeros in compiled backward passes. Gloo compiles right on CPU tensors (tests).
        raise ConfigError(f"compile_stages=True with tp={tp} on CUDA needs the NCCL backend, not gloo "
                          "(gloo's CUDA collectives gave zero gradients in compiled backward passes); "
                          "init_process_group('nccl'), or compile_stages=False")
    return dims, device, rank
