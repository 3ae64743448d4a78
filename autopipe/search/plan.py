"""``plan_layout``: the layout search from a model (or a model spec), as the CLI and
``parallelize(pp="auto")`` ask for it."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.partition.device import DeviceProfile, get_profile
from autopipe.partition.measured import MeasuredCosts
from autopipe.planning import planning_graph

from .links import LinkModel
from .predict import ADAMW_BYTES_PER_PARAM, Pricing
from .search import SearchResult, search_layouts

__all__ = ["plan_layout", "DEFAULT_MODES", "HOST_COSTS"]

# Execution modes weighed by default: on GPUs every one; on CPU stages run eagerly.
DEFAULT_MODES = {"cuda": ("eager", "graphs", "compiled", "compiled+graphs"), "cpu": ("eager",)}
# Host seconds (per compute the driver runs, per parameter tensor the optimizer steps, per
# tensor a pipeline stage sends or receives) when not measured: on CUDA the optimizer's
# multi-tensor kernels make the second small, and a transfer's posting overlaps the GPU's work;
# on CPU torch's AdamW takes its single-tensor path, about ten small kernels per tensor (~35 us
# measured on a 2-core x86 box, one thread), and each gloo transfer is posted, waited on by a
# thread and handed back while the compute shares the same cores (~150 us on that box, see
# benchmarks/layout_choice_cpu.py).
HOST_COSTS = {"cuda": (10e-6, 2e-6, 0.0), "cpu": (200e-6, 35e-6, 150e-6)}


def plan_layout(model: nn.Module | str, *, devices: int, batch: int, device: str | DeviceProfile = "h100",
                memory: float | None = None, links: LinkModel | None = None,
                measured: Mapping[int, MeasuredCosts] | Sequence[MeasuredCosts] | MeasuredCosts | None = None,
                example_inputs: Sequence[torch.Tensor] | None = None, image_size: int | None = None,
                mixed_precision: str | None = "bf16", modes: tuple[str, ...] | None = None,
                action_overhead: float | None = None, tensor_overhead: float | None = None,
                transfer_overhead: float | None = None, interleaved_transfer_overhead: float | None = None,
                optimizer_bytes: float = ADAMW_BYTES_PER_PARAM, **options) -> SearchResult:
    """Rank the layouts of ``model`` on ``devices`` devices of kind ``device`` for a global
    ``batch``. The model is traced once, at the micro-batch of ``example_inputs`` or at
    ``min(8, batch)`` images; ``measured`` (profiles, by micro-batch size or in a list, or one
    profile) prices the nodes where given; profiles timed with activation checkpointing price
    the layouts that checkpoint. ``memory`` is the budget per device in bytes. ``options`` go to
    :func:`search_layouts`. ``action_overhead``, ``tensor_overhead`` and ``transfer_overhead``
    are the host seconds the driver adds per compute, the optimizer per parameter tensor and a
    pipeline rank per tensor it sends or receives (defaults by device: see HOST_COSTS), and
    ``interleaved_transfer_overhead`` the last under an interleaved schedule (default: the same);
    ``optimizer_bytes`` what the optimizer's step moves per parameter (AdamW's fused step by
    default; torch's single-tensor step on CPU moves several times more)."""

    profile = get_profile(device)
    if isinstance(measured, MeasuredCosts):
        measured = [measured]
    elif isinstance(measured, Mapping):
        measured = list(measured.values())
    measured = list(measured or ())
    reference = None if example_inputs is not None else \
        min(m.input_shapes[0][0] for m in measured) if measured else min(8, batch)
    if example_inputs is not None and options.get("sequence_parallel", True):
        example_inputs = _splittable(example_inputs, devices)
    traced, _ = planning_graph(model, example_inputs=example_inputs, batch=reference, image_size=image_size)
    if mixed_precision not in (None, "fp32", "bf16", "fp16"):
        raise ConfigError(f"mixed_precision={mixed_precision!r}; use None, 'bf16' or 'fp16'")
    low = mixed_precision in ("bf16", "fp16")
    kind = "cpu" if profile.name == "cpu" else "cuda"
    floating = next((d for d in traced.input_dtypes if d.is_floating_point), torch.float32)
    pricing = Pricing(profile, links or LinkModel.from_profile(profile), batch,
                      activation_bytes=2 / floating.itemsize if low else 1.0, weight_cast_bytes=2.0 if low else 0.0,
                      action_overhead=HOST_COSTS[kind][0] if action_overhead is None else action_overhead,
                      tensor_overhead=HOST_COSTS[kind][1] if tensor_overhead is None else tensor_overhead,
                      transfer_overhead=HOST_COSTS[kind][2] if transfer_overhead is None else transfer_overhead,
                      interleaved_transfer_overhead=interleaved_transfer_overhead,
                      optimizer_bytes=optimizer_bytes)
    return search_layouts(traced, devices=devices, batch=batch, pricing=pricing, modes=modes or DEFAULT_MODES[kind],
                          memory=memory, measured=measured, **options)


def _splittable(example_inputs: Sequence[torch.Tensor], devices: int) -> Sequence[torch.Tensor]:
    """The inputs repeated along the batch so that the tp degrees (up to 8) split a micro-batch
    of them: sequence parallelism divides each micro-batch's samples over the tp ranks, and a
    plan made on a graph of fewer samples than ranks has no sequence-parallel region to price
    (every "sp" layout was priced as its plain twin). Inputs without a common batch dimension
    stay as they are."""
    sizes = {x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim()}
    if len(sizes) != 1:
        return example_inputs
    (size,) = sizes
    tp = max(d for d in range(1, min(devices, 8) + 1) if devices % d == 0)
    repeat = math.lcm(size, tp) // size
    if repeat == 1:
        return example_inputs
    return tuple(x.repeat(repeat, *[1] * (x.dim() - 1)) if isinstance(x, torch.Tensor) and x.dim() else x
                 for x in example_inputs)
