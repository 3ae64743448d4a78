"""This rank's stages at run time: :func:`build_runtime` prepares them (autocast, weight casts,
compilation, checkpointing wrappers) and starts the pipeline driver that runs them.
See docs/architecture.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from ..failure.monitor import FailureMonitor
from ..partition.plan import PartitionPlan
from ..runtime.batchnorm import BatchNormStats
from ..runtime.driver import PipelineDriver, StageSet
from ..runtime.grad_buffers import GradientViews
from ..memory_format import boundary_layout, channels_last_model
from ..runtime.p2p import TensorSpec
from ..runtime.preparation import prepare_stage
from ..runtime.timeline import Timeline
from ..runtime.weight_casts import WeightCasts
from ..stages.mlp_pieces import cut_mlps
from ..stages.variants import boundary_values, emit_variant, repropagate
from ..tracer import TracedModel
from .mesh import Mesh
from .training_state import TrainingState

__all__ = ["ModeStages", "StageRuntime", "build_runtime"]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass
class ModeStages:
    """This rank's stages of the model's eval-mode graph, where its forward branches on
    ``self.training``; they share the train stages' state (see [Note: one graph per mode] in
    autopipe/stages/mode_plan.py)."""

    plan: PartitionPlan
    traced: TracedModel
    stages: dict[int, nn.Module]


@dataclass
class StageRuntime:
    """This rank's stages with the plan and mesh they came from, and the driver running them.
    Made by :func:`build_runtime`, which prepares the stages and starts the driver."""

    plan: PartitionPlan
    traced: TracedModel
    stages: dict[int, nn.Module]
    mesh: Mesh
    schedule: str
    loss_fn: Callable[[Any, Any], torch.Tensor]
    compute_dtype: torch.dtype | None = None
    activation_checkpointing: bool = False
    deadline: float = 300.0
    record_timeline: bool = False
    cuda_graphs: bool = False
    compile_stages: bool = False
    batchnorm: BatchNormStats | None = None  # deferred running statistics (runtime/batchnorm.py)
    # Another micro-batch size's graph, for routes that bake the size in (see [Note: stage variants]).
    retrace: Callable[[int], tuple[TracedModel, PartitionPlan]] | None = None
    batch_split: str = "equal"  # see [Note: batch splits] in runtime/microbatch.py
    monitor: FailureMonitor | None = None  # shared by the whole mesh; see [Note: failure propagation]
    eval_stages: ModeStages | None = None
    training: bool = True  # which mode's stages run first
    state: TrainingState = field(default_factory=TrainingState)  # the loss scale is read from it
    # Made by build_runtime:
    weight_casts: WeightCasts | None = field(default=None, init=False)
    timeline: Timeline | None = field(default=None, init=False)
    driver: PipelineDriver = field(init=False)
    grad_scale: float = field(default=1.0, init=False)  # the current train_step's grad_scale
    _channels_last: bool = field(default=False, init=False)  # the model's inputs travel in channels-last
    _gradient_views: GradientViews | None = field(default=None, init=False)

    def prepare_gradients(self) -> None:
        """Before a step's backward: where the gradients are all-reduced over dp replicas and no
        CUDA graph holds them already, they are made views of one buffer again, which the
        all-reduce takes where they lie ([Note: gradients as views of one buffer])."""
        if self.mesh.dims.dp == 1 or self.cuda_graphs:
            return
        if self._gradient_views is None:
            self._gradient_views = GradientViews([p for i in sorted(self.stages) for p in self.stages[i].parameters()])
        self._gradient_views.prepare()

    def _spec(self, shape: Any, dtype: torch.dtype, traced: Any = None) -> TensorSpec:
        """A boundary tensor's spec, in the layout its ``traced`` value was made in
        ([Note: boundary layout])."""
        if self.compute_dtype is not None and dtype.is_floating_point:
            dtype = self.compute_dtype
        return TensorSpec(tuple(shape), dtype, boundary_layout(traced) == torch.channels_last)

    def _wrap(self, i: int, stage: nn.Module) -> None:
        prepare_stage(stage, device_type=self.mesh.device.type, compute_dtype=self.compute_dtype,
                      compile=self.compile_stages, recompute=self.activation_checkpointing,
                      cast_outputs=i != self.plan.num_stages - 1, norms=self.batchnorm)

    def _variants(self, traced: TracedModel, plan: PartitionPlan, stages: dict[int, nn.Module],
                  retrace: Callable[[int], tuple[TracedModel, PartitionPlan]] | None) -> Callable[[int], Any]:
        """This rank's stages and boundary specs of one mode's graph at another micro-batch size;
        see [Note: stage variants] in stages/variants.py."""

        def build(size: int) -> tuple[dict[int, nn.Module], list[list[TensorSpec]]]:
            sized, sized_plan = retrace(size) if retrace is not None else (repropagate(traced, size), plan)
            built = emit_variant(sized, sized_plan, stages)
            for i, stage in built.items():
                if stage is not stages[i]:
                    self._wrap(i, stage)
            return built, [[self._spec(v.shape, v.dtype, v) for v in b] for b in boundary_values(sized, sized_plan)]

        return build

    def _start(self) -> None:
        plan, last = self.plan, self.plan.num_stages - 1
        self._channels_last = channels_last_model(self.traced.gm)  # see [Note: boundary layout]

        def boundary(traced: TracedModel, p: PartitionPlan) -> list[list[TensorSpec]]:
            values = {n.name: n.meta.get("val") for n in cut_mlps(traced, p.mlp_pieces).gm.graph.nodes}
            return [[self._spec(c.shape, _dtype(c.dtype), values.get(c.name)) for c in p.stages[k].outputs]
                    for k in range(last)]

        modes = [self.stages] + ([self.eval_stages.stages] if self.eval_stages is not None else [])
        # Linear layers read copies cast once per step; see [Note: weight casts].
        self.weight_casts = WeightCasts.install([st for m in modes for st in m.values()], self.compute_dtype) \
            if self.compute_dtype is not None else None
        for i, stage in ((i, st) for m in modes for i, st in m.items()):
            self._wrap(i, stage)
        self.timeline = Timeline(self.mesh.rank, cuda_events=self.mesh.device.type == "cuda") \
            if self.record_timeline else None
        input_specs = [TensorSpec(s, d, self._channels_last)
                       for s, d in zip(self.traced.input_shapes, self.traced.input_dtypes)]
        mode = self.eval_stages
        eval_set = None if mode is None else StageSet(
            mode.stages, boundary(mode.traced, mode.plan), mode.traced.unflatten_output,
            self._variants(mode.traced, mode.plan, mode.stages, None))
        self.driver = PipelineDriver(
            self.stages, boundary(self.traced, plan), pp=plan.pp, chunks=plan.chunks, pp_rank=self.mesh.pp_rank,
            pp_group=self.mesh.pp_group, schedule=self.schedule, microbatches=plan.microbatches,
            loss_fn=self._scaled_loss, postprocess=self.traced.unflatten_output, device=self.mesh.device,
            timeline=self.timeline, input_specs=input_specs, deadline=self.deadline, cuda_graphs=self.cuda_graphs,
            warm_up_stages=self.compile_stages, links=self.mesh.links,
            variants=self._variants(self.traced, plan, self.stages, self.retrace), split=self.batch_split,
            monitor=self.monitor, eval_set=eval_set, training=self.training,
        )

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        if self.compute_dtype is None:
            loss = self.loss_fn(output, target)
        else:
            # As in the autocast recipe, the loss runs under autocast (which computes losses in
            # fp32) and is scaled in fp32: an fp16 loss times a 2**16 loss scale overflows.
            with torch.autocast(self.mesh.device.type, dtype=self.compute_dtype):
                loss = self.loss_fn(output, target)
            if isinstance(loss, torch.Tensor) and loss.is_floating_point():
                loss = loss.float()
        scale = self.state.loss_scale * self.grad_scale
        return loss * scale if scale != 1.0 and isinstance(loss, torch.Tensor) else loss


def build_runtime(**settings: Any) -> StageRuntime:
    """A :class:`StageRuntime` of ``settings`` (its fields), started: every stage wrapped to run
    as configured (compiled where asked: compilation happens at the first step or the warm-up),
    linear layers' weight casts installed, and the pipeline driver made."""
    runtime = StageRuntime(**settings)
    runtime._start()
    return runtime
