"""``plan_layout``: the layout search from a model (or a model spec), as the CLI and
``parallelize(pp="auto")`` ask for it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.partition.device import DeviceProfile, get_profile
from autopipe.partition.measured import MeasuredCosts
from autopipe.planning import planning_graph

from .links import LinkModel
from .predict import ADAMW_BYTES_PER_PARAM, ADAMW_FOREACH_BYTES_PER_PARAM, Pricing
from .search import SearchResult, search_layouts

__all__ = ["plan_layout", "DEFAULT_MODES", "STEP_DEFAULTS", "StepDefaults"]

# Execution modes weighed by default: on GPUs every one; on CPU stages run eagerly.
DEFAULT_MODES = {"cuda": ("eager", "graphs", "compiled", "compiled+graphs"), "cpu": ("eager",)}


@dataclass(frozen=True)
class StepDefaults:
    """What a step costs beside its stages, by kind of device, where the caller measured none.

    - ``action``: host seconds the driver adds per compute;
    - ``tensor``: host seconds per parameter tensor of the optimizer's step;
    - ``norm_tensor``: host seconds per parameter tensor of the global gradient norm (None: a
      tenth of ``tensor``, one kernel against the optimizer's ten);
    - ``transfer``: host seconds per tensor a pipeline stage sends or receives;
    - ``optimizer_bytes``: bytes the optimizer's step moves per parameter;
    - ``neighbour_scale``: how much slower a stage computes while its rank's NCCL transfers or
      tensor-parallel collectives run beside it (their kernels hold SMs while they wait);
    - ``pipeline_scale``: the same for a pipeline's transfers alone (pp > 1, tp = 1).

    CUDA: torch's default AdamW (multi-tensor "foreach"), as ``benchmarks/optimizer_step_gpu.py``
    timed it on an H200 (5.4 us per tensor and 93 B per parameter at the profile's 4.3 TB/s;
    the norm 3.9 us per tensor; benchmarks/results/2026-11-27-h200-optimizer-step.json). The neighbour
    scale is the median of the pipeline part of the pp > 1 and tp > 1 layouts measured on 4
    H200s against their prediction (1.11-1.24; benchmarks/results/2026-11-27-h200x4-layout-choice-
    before-step-pricing.json); a second run there and a 2 x H100 run priced with it came within
    15% in 38 of 38 layouts (docs/benchmarks.md, "Several GPUs: the layout search measured").
    Those runs posted every receive one compute ahead. Between GPUs of one host receives are now
    posted just in time ([Note: receive lead] in autopipe/runtime/streams.py), and each pipeline
    rank's busy time fell by a factor of 1.057 (median of five runs of ViT-L/16 at pp=2 on two
    H200s and two H100s, benchmarks/results/2026-11-28-h*x2-pipeline-links-*.json). Sends are now
    posted as late as the schedule allows ([Note: send timing] in the same file), and the busy
    time fell again, by 1.030 (ViT-L/16, pp=2, CUDA graphs, two H200s, A-B-A in one run;
    benchmarks/results/2026-11-28-h200x2-pipeline-links-send-delays-graphs.json): the pipeline
    scale was 1.17 / 1.057 / 1.030 = 1.075, checked on 4 H200s (-2026-11-28-h200x4-layout-choice-
    vit-{l,h}.json): the pipeline part of the four pp layouts within -2% to +5%. Between GPUs of
    one host a pipeline's messages now go through shared memory, copied by the copy engines
    ([Note: shared-memory links] in autopipe/runtime/host_links.py), and the busy time fell by
    1.046 (ViT-L/16, pp=2, interleaved with 4 chunks and 4 micro-batches, compiled stages in CUDA
    graphs, two H200s, A-B-A in one run: 116.1 ms off, 110.3 and 111.7 on;
    benchmarks/results/2026-11-28-h200x2-shared-links.json): the scale is 1.075 / 1.046 = 1.028.
    A transfer's posting overlaps the GPU's work. CPU: torch's AdamW takes its single-tensor
    path, about ten small kernels per tensor (~35 us measured on a 2-core x86 box, one thread),
    and each gloo transfer is posted, waited on by a thread and handed back while the compute
    shares the same cores (~150 us on that box, see benchmarks/layout_choice_cpu.py).
    """

    action: float
    tensor: float
    norm_tensor: float | None
    transfer: float
    optimizer_bytes: float
    neighbour_scale: float = 1.0
    pipeline_scale: float = 1.0


STEP_DEFAULTS = {"cuda": StepDefaults(10e-6, 5.4e-6, 3.9e-6, 0.0, ADAMW_FOREACH_BYTES_PER_PARAM, 1.17, 1.028),
                 "cpu": StepDefaults(200e-6, 35e-6, None, 150e-6, ADAMW_BYTES_PER_PARAM)}


def plan_layout(model: nn.Module | str, *, devices: int, batch: int, device: str | DeviceProfile = "h100",
                memory: float | None = None, links: LinkModel | None = None,
                measured: Mapping[int, MeasuredCosts] | Sequence[MeasuredCosts] | MeasuredCosts | None = None,
                example_inputs: Sequence[torch.Tensor] | None = None, image_size: int | None = None,
                mixed_precision: str | None = "bf16", modes: tuple[str, ...] | None = None,
                action_overhead: float | None = None, tensor_overhead: float | None = None,
                transfer_overhead: float | None = None, interleaved_transfer_overhead: float | None = None,
                optimizer_bytes: float | None = None, **options) -> SearchResult:
    """Rank the layouts of ``model`` on ``devices`` devices of kind ``device`` for a global
    ``batch``. The model is traced once, at the micro-batch of ``example_inputs`` or at
    ``min(8, batch)`` images; ``measured`` (profiles, by micro-batch size or in a list, or one
    profile) prices the nodes where given; profiles timed with activation checkpointing price
    the layouts that checkpoint. ``memory`` is the budget per device in bytes. ``options`` go to
    :func:`search_layouts`. ``action_overhead``, ``tensor_overhead`` and ``transfer_overhead``
    are the host seconds the driver adds per compute, the optimizer per parameter tensor and a
    pipeline rank per tensor it sends or receives (defaults by device: see STEP_DEFAULTS), and
    ``interleaved_transfer_overhead`` the last under an interleaved schedule (default: the same);
    ``optimizer_bytes`` what the optimizer's step moves per parameter (by default torch's
    AdamW on CUDA, about 93 B; ``ADAMW_BYTES_PER_PARAM`` prices ``AdamW(fused=True)``)."""

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
    defaults = STEP_DEFAULTS[kind]
    floating = next((d for d in traced.input_dtypes if d.is_floating_point), torch.float32)
    pricing = Pricing(profile, links or LinkModel.from_profile(profile), batch,
                      activation_bytes=2 / floating.itemsize if low else 1.0, weight_cast_bytes=2.0 if low else 0.0,
                      action_overhead=defaults.action if action_overhead is None else action_overhead,
                      tensor_overhead=defaults.tensor if tensor_overhead is None else tensor_overhead,
                      norm_tensor_overhead=defaults.norm_tensor,
                      transfer_overhead=defaults.transfer if transfer_overhead is None else transfer_overhead,
                      interleaved_transfer_overhead=interleaved_transfer_overhead,
                      optimizer_bytes=defaults.optimizer_bytes if optimizer_bytes is None else optimizer_bytes,
                      neighbour_scale=defaults.neighbour_scale, pipeline_scale=defaults.pipeline_scale)
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
