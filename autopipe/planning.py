"""The front door's plan: :func:`plan_pipeline` traces one micro-batch, shards it as tp rank 0
(collectives standing in) and cuts it into stages; ``parallelize`` and :func:`plan_model` (the
CLI's ``report``, no processes needed) both call it, so they make the same plan for the same
arguments. See docs/architecture.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .errors import ConfigError, positive_int
from .models import default_input, load_model
from .partition.device import DeviceProfile, get_profile, gpu_profile_name
from .partition.measured import MeasuredCosts
from .partition.plan import PartitionPlan
from .runtime.schedule import validate as validate_schedule
from .shard import ShardPlan, apply_sharding, plan_sharding
from .stages import plan_stages
from .tracer import TracedModel, trace

__all__ = ["plan_model", "plan_pipeline", "PlannedModel", "planning_graph", "planned_shard", "microbatch_size",
           "default_schedule", "default_profile"]


def microbatch_size(batch: int, microbatches: int) -> int:
    """``batch // microbatches``, or a :class:`ConfigError` naming both when it does not divide."""
    for name, value in (("batch", batch), ("microbatches", microbatches)):
        positive_int(name, value)
    if batch % microbatches:
        down, up = batch // microbatches * microbatches, -(-batch // microbatches) * microbatches
        near = sorted({b for b in (down, up) if b})
        raise ConfigError(
            f"batch {batch} does not split into {microbatches} equal micro-batches "
            f"({batch} % {microbatches} = {batch % microbatches}); use a batch divisible by "
            f"{microbatches} ({' or '.join(map(str, near))}) or microbatches dividing {batch}"
        )
    return batch // microbatches


def default_schedule(chunks: int) -> str:
    """1F1B for one chunk per rank, its interleaved form for several."""
    return "1f1b" if chunks == 1 else "interleaved_1f1b"


def default_profile(profile: str | DeviceProfile | None, device: str | torch.device = "cuda") -> DeviceProfile:
    """The cost model's device profile: ``profile`` when given, else the CPU's for a CPU run, the
    profile of the GPU itself for a run on a GPU this process can see (h200 on an H200), and the
    H100's otherwise (a plan made without a device is for the GPU)."""
    if profile:
        return get_profile(profile)
    device = torch.device(device)
    if device.type == "cpu":
        return get_profile("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return get_profile(gpu_profile_name(torch.cuda.get_device_name(device)))
    return get_profile("h100")


@dataclass(frozen=True)
class PlannedModel:
    """What the front door makes: the traced graph, its shard plan (tp > 1), the graph the plan
    was made on (tp rank 0's, collectives standing in) and the plan."""

    traced: TracedModel
    shard_plan: ShardPlan | None
    graph: TracedModel
    plan: PartitionPlan


Cut = Callable[[TracedModel, dict[str, Any]], PartitionPlan]


def plan_pipeline(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    pp: int,
    chunks: int = 1,
    tp: int = 1,
    microbatches: int = 1,
    schedule: str | None = None,
    balance: str | Sequence[str] = "cost",
    profile: str | DeviceProfile | None = None,
    mode: str | None = None,
    shard_rules: Sequence[Any] | None = None,
    sequence_parallel: bool = False,
    leaf_modules: Iterable[type | str] = (),
    exec_sequence: Sequence[Any] | None = None,
    route: str = "auto",
    split_mlps: bool | str = True,
    activation_dtype: torch.dtype | None = None,
    mem_cap: float | None = None,
    model_name: str | None = None,
    measured: MeasuredCosts | None = None,
    cut: Cut | None = None,
    stage_scale: Sequence[float] | None = None,
) -> PlannedModel:
    """The front door, shared by :func:`plan_model` (and so ``autopipe report``) and
    ``parallelize``: trace ``model`` on one micro-batch, shard it for tp rank 0 (``tp > 1``; its
    collectives stand in, so the plan is the same on every rank and in a report) and cut it into
    ``pp * chunks`` stages. ``profile`` defaults by :func:`default_profile`; ``mode`` (default:
    ``measured``'s, else "eager") is how the stages will run; ``activation_dtype`` (default:
    ``measured``'s compute dtype) the dtype activations cross stages in. ``cut(graph, args)``
    replaces ``plan_stages(graph, **args)`` (``parallelize`` measures there). ``stage_scale``:
    how much slower each stage runs inside the pipeline ([Note: stage scale])."""
    schedule = schedule or default_schedule(chunks)
    # Refuse a schedule that cannot run before the (slower) trace, with the schedule's own reason.
    validate_schedule(schedule, pp, microbatches, chunks)
    if mem_cap is not None and not mem_cap > 0:
        raise ConfigError(f"mem_cap must be a positive number of bytes, got {mem_cap!r}")
    traced = trace(model, tuple(example_inputs), route=route, leaf_modules=leaf_modules, exec_sequence=exec_sequence)
    shard_plan, graph = planned_shard(traced, tp, shard_rules, sequence_parallel)
    if measured is not None:
        mode = mode or measured.mode
        if activation_dtype is None and measured.dtype != "float32":
            activation_dtype = getattr(torch, measured.dtype)
    args = dict(pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, balance=balance, schedule=schedule,
                device=default_profile(profile).with_mode(mode or "eager"), mem_cap=mem_cap,
                model_name=model_name or type(model).__name__, split_mlps=split_mlps,
                activation_dtype=activation_dtype)
    if measured is not None:
        args["measured"] = measured
    if stage_scale is not None:
        args["stage_scale"] = stage_scale
    plan = cut(graph, args) if cut is not None else plan_stages(graph, **args)
    return PlannedModel(traced, shard_plan, graph, plan)


def example_batch(model: nn.Module, *, batch: int | None, microbatches: int, image_size: int | None,
                  example_inputs: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    """One micro-batch: ``example_inputs``, or an image batch of ``batch // microbatches``."""
    if example_inputs is None:
        if batch is None:
            raise ConfigError("planning needs example_inputs (one micro-batch) or batch (the global batch)")
        return (default_input(model, microbatch_size(batch, microbatches), image_size=image_size),)
    if batch is not None:
        raise ConfigError("give example_inputs or batch, not both")
    return tuple(example_inputs)


def planning_graph(
    model: nn.Module | str,
    *,
    tp: int = 1,
    microbatches: int = 1,
    batch: int | None = None,
    example_inputs: Sequence[torch.Tensor] | None = None,
    image_size: int | None = None,
    route: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    sequence_parallel: bool = False,
    model_name: str | None = None,
) -> tuple[TracedModel, str]:
    """The graph a plan is made on, and the model's name: ``model`` (a module, best built on the
    meta device, or a spec for :func:`autopipe.models.load_model`) traced on one micro-batch
    (``example_inputs``, or an image batch of ``batch // microbatches``) and, with ``tp > 1``,
    sharded as tp rank 0 with its collectives standing in."""
    model, name = _loaded(model, model_name, image_size)
    inputs = example_batch(model, batch=batch, microbatches=microbatches, image_size=image_size,
                           example_inputs=example_inputs)
    traced = trace(model, inputs, route=route, leaf_modules=leaf_modules)
    return planned_shard(traced, tp, None, sequence_parallel)[1], name


def planned_shard(traced: TracedModel, tp: int, shard_rules: Sequence[Any] | None,
                  sequence_parallel: bool) -> tuple[ShardPlan | None, TracedModel]:
    """The shard plan (None for tp=1) and the graph plans are made on: tp rank 0's, its
    collectives standing in (no group), so that the plan is the same on every rank."""
    if not tp > 1:
        return None, traced
    shard_plan = plan_sharding(traced, tp, rules=shard_rules, sequence_parallel=sequence_parallel)
    return shard_plan, apply_sharding(traced, shard_plan, 0)


def _loaded(model: nn.Module | str, model_name: str | None, image_size: int | None) -> tuple[nn.Module, str]:
    if isinstance(model, str):
        return load_model(model, image_size=image_size), model_name or model
    return model, model_name or type(model).__name__


def plan_model(
    model: nn.Module | str,
    *,
    pp: int,
    chunks: int = 1,
    tp: int = 1,
    microbatches: int = 1,
    batch: int | None = None,
    example_inputs: Sequence[torch.Tensor] | None = None,
    image_size: int | None = None,
    balance: str | Sequence[str] = "cost",
    device: str | DeviceProfile | None = None,
    schedule: str | None = None,
    mem_cap: float | None = None,
    model_name: str | None = None,
    route: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    exec_sequence: Sequence[Any] | None = None,
    shard_rules: Sequence[Any] | None = None,
    sequence_parallel: bool = False,
    split_mlps: bool | str = True,
    mode: str | None = None,
    activation_dtype: torch.dtype | None = None,
    measured: MeasuredCosts | None = None,
    stage_scale: Sequence[float] | None = None,
) -> PartitionPlan:
    """Plan ``model`` for ``pp`` x ``chunks`` stages of ``tp``-way tensor parallelism, as
    ``parallelize`` plans it for the same arguments (both call :func:`plan_pipeline`).

    ``model`` is an ``nn.Module`` (best built on the meta device) or a spec for
    :func:`autopipe.models.load_model`. Give ``example_inputs`` for one micro-batch, or the
    global ``batch`` (split into ``microbatches``) and an image batch is made for it.
    ``device`` is the cost model's profile (default: :func:`default_profile`'s, the H100's).
    ``mem_cap`` is in bytes per stage; ``schedule`` defaults to :func:`default_schedule`.
    With ``tp > 1`` the graph of one tp rank is planned, as ``parallelize`` plans it: sharded
    layers at 1/tp of their work, the tensor-parallel collectives priced on the link.
    ``measured`` prices the nodes by a profile made on the GPU (``autopipe profile``); ``mode``
    (default: the profile's, else "eager") is how the stages will run, ``activation_dtype``
    (default: the profile's compute dtype) the dtype activations cross stages in.
    ``stage_scale`` balances each stage's time times its factor, one per stage: how much slower
    it ran inside a pipeline than alone ([Note: stage scale] in autopipe/measure/pipeline_scale.py).
    """
    # Refuse a schedule that cannot run before the (slower) model load and trace.
    validate_schedule(schedule or default_schedule(chunks), pp, microbatches, chunks)
    model, name = _loaded(model, model_name, image_size)
    inputs = example_batch(model, batch=batch, microbatches=microbatches, image_size=image_size,
                           example_inputs=example_inputs)
    return plan_pipeline(
        model, inputs, pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, schedule=schedule, balance=balance,
        profile=device, mode=mode, shard_rules=shard_rules, sequence_parallel=sequence_parallel,
        leaf_modules=leaf_modules, exec_sequence=exec_sequence, route=route, split_mlps=split_mlps,
        activation_dtype=activation_dtype, mem_cap=mem_cap, model_name=name, measured=measured,
        stage_scale=stage_scale,
    ).plan
