"""``plan_model()``: from a model (or a model spec) to a :class:`PartitionPlan`, without processes.

The one path the CLI and the python API share: validate the degrees, trace one micro-batch on
the meta device, price the nodes (sharded when tp > 1), cut into stages.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn as nn

from .errors import ConfigError
from .models import default_input, load_model
from .partition.device import DeviceProfile, get_profile
from .partition.measured import MeasuredCosts
from .partition.plan import PartitionPlan
from .runtime.schedule import validate as validate_schedule
from .stages import plan_stages
from .tracer import TracedModel, trace

__all__ = ["plan_model", "planning_graph", "microbatch_size", "default_schedule"]


def microbatch_size(batch: int, microbatches: int) -> int:
    """``batch // microbatches``, or a :class:`ConfigError` naming both when it does not divide."""
    for name, value in (("batch", batch), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
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
    if isinstance(model, str):
        name = model_name or model
        model = load_model(model, image_size=image_size)
    else:
        name = model_name or type(model).__name__
    if example_inputs is None:
        if batch is None:
            raise ConfigError("planning needs example_inputs (one micro-batch) or batch (the global batch)")
        example_inputs = (default_input(model, microbatch_size(batch, microbatches), image_size=image_size),)
    elif batch is not None:
        raise ConfigError("give example_inputs or batch, not both")
    traced = trace(model, tuple(example_inputs), route=route, leaf_modules=leaf_modules)
    if tp > 1:
        from .shard import apply_sharding, plan_sharding

        shard_plan = plan_sharding(traced, tp, sequence_parallel=sequence_parallel)
        traced = apply_sharding(traced, shard_plan, 0)  # rank 0's graph; collectives stand in (no group)
    return traced, name


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
    device: str | DeviceProfile = "h100",
    schedule: str | None = None,
    mem_cap: float | None = None,
    model_name: str | None = None,
    route: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    sequence_parallel: bool = False,
    split_mlps: bool = True,
    mode: str | None = None,
    activation_dtype: torch.dtype | None = None,
    measured: MeasuredCosts | None = None,
) -> PartitionPlan:
    """Plan ``model`` for ``pp`` x ``chunks`` stages of ``tp``-way tensor parallelism.

    ``model`` is an ``nn.Module`` (best built on the meta device) or a spec for
    :func:`autopipe.models.load_model`. Give ``example_inputs`` for one micro-batch, or the
    global ``batch`` (split into ``microbatches``) and an image batch is made for it.
    ``mem_cap`` is in bytes per stage; ``schedule`` defaults to :func:`default_schedule`.
    With ``tp > 1`` the graph of one tp rank is planned, as ``parallelize`` plans it: sharded
    layers at 1/tp of their work, the tensor-parallel collectives priced on the link.
    ``measured`` prices the nodes by a profile made on the GPU (``autopipe profile``); ``mode``
    (default: the profile's, else "eager") is how the stages will run, ``activation_dtype``
    (default: the profile's compute dtype) the dtype activations cross stages in.
    """
    schedule = schedule or default_schedule(chunks)
    # Refuse a schedule that cannot run before the (slower) trace, with the schedule's own reason.
    validate_schedule(schedule, pp, microbatches, chunks)
    if mem_cap is not None and not mem_cap > 0:
        raise ConfigError(f"mem_cap must be a positive number of bytes, got {mem_cap!r}")
    traced, name = planning_graph(model, tp=tp, microbatches=microbatches, batch=batch,
                                  example_inputs=example_inputs, image_size=image_size, route=route,
                                  leaf_modules=leaf_modules, sequence_parallel=sequence_parallel,
                                  model_name=model_name)
    if measured is not None:
        mode = mode or measured.mode
        if activation_dtype is None and measured.dtype != "float32":
            activation_dtype = getattr(torch, measured.dtype)
    return plan_stages(
        traced,
        pp,
        chunks,
        tp=tp,
        microbatches=microbatches,
        balance=balance,
        device=get_profile(device).with_mode(mode or "eager"),
        schedule=schedule,
        mem_cap=mem_cap,
        model_name=name,
        split_mlps=split_mlps,
        activation_dtype=activation_dtype,
        measured=measured,
    )
