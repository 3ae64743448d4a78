"""``parallelize()``: pipeline x tensor x data parallelism for an unmodified model, in one call.

The steps run in this order, each a function of the last (see docs/architecture.md):
1. agree on the arguments with every other rank (over the store, with the deadline: see
   [Note: argument agreement]), then check them on this rank (no collective yet, so a mistake
   cannot hang a peer); from here on a failure on any rank reaches every rank;
2-4. trace the model to a graph (one per mode where its forward branches on ``self.training``),
   shard it (before partitioning: the cost model must see sharded compute) and cut it into
   ``pp * chunks`` stages: ``planning.plan_pipeline``, which ``autopipe report`` runs too; the
   plan is made on tp rank 0's graph, so every rank computes the same plan; then shard the
   graphs for this tp rank;
5. build the (pp, dp, tp) mesh, the first collective;
6. emit this rank's stages, move them to the device, make dp replicas start equal;
7. hand them to the pipeline driver.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import os
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from .arguments import PRECISIONS, check_deadline, check_on_this_rank, check_parameters, costs_label, resolve_device
from .errors import ConfigError, ShardingError
from .measure import MeasureOptions, RunSetup, measured_plan, stage_scale
from .measure.host_pace import recent_probe_seconds
from .measure.profile import on_rank0
from .partition.device import execution_mode
from .partition.measured import MeasuredCosts
from .partition.plan import PartitionPlan
from .runtime.batchnorm import BatchNormStats, check_batchnorm
from .runtime.timeline import gather
from .failure.monitor import FailureMonitor
from .planning import Cut, PlannedModel, default_profile, default_schedule, plan_pipeline
from .shard import apply_sharding, plan_sharding, register_group
from .search import plan_layout
from .tracer import TracedModel
from .training.agreement import agree
from .training.mesh import build_mesh
from .training.parallel_model import ParallelModel
from .training.stage_runtime import ModeStages, build_runtime
from .training.training_state import TrainingState
from .stages import emit_stages, follow_plan, share_state, cut_mlps
from .stages.variants import export_retracer, meta_copy, planned_size_only

__all__ = ["parallelize"]

def _shard_eval_graph(eval_traced: TracedModel, shard_plan: Any, tp_rank: int, rules: Any,
                      sequence_parallel: bool) -> TracedModel:
    """The eval-mode graph sharded as the train-mode graph is: every parameter both hold split alike."""
    eval_plan = plan_sharding(eval_traced, shard_plan.tp, rules=rules, sequence_parallel=sequence_parallel)

    def layout(p: Any) -> tuple:  # how it splits; which rule said so may differ
        return p.shape, p.local_shape, p.split, p.dim, p.outer, p.dtype

    differing = sorted(n for n, p in eval_plan.params.items()
                       if n in shard_plan.params and layout(shard_plan.params[n]) != layout(p))
    if differing:
        raise ShardingError(
            f"the model's eval-mode graph shards {', '.join(differing[:3])} otherwise than its train-mode graph "
            f"({eval_plan.params[differing[0]].split} against {shard_plan.params[differing[0]].split}); keep them "
            "replicated: parallelize(..., shard_rules=[ShardRule('keep', match='<module path>', style='replicated')])")
    return apply_sharding(eval_traced, eval_plan, tp_rank, group="tp")


def parallelize(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    pp: int | str = 1,
    tp: int = 1,
    microbatches: int = 1,
    schedule: str | None = None,
    chunks: int = 1,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    balance: str | Sequence[str] = "cost",
    shard_rules: Sequence[Any] | None = None,
    sequence_parallel: bool = False,
    leaf_modules: Iterable[type | str] = (),
    exec_sequence: Sequence[Any] | None = None,
    mixed_precision: str | None = None,
    activation_checkpointing: bool = False,
    device: torch.device | str | None = None,
    profile: str | None = None,
    deadline: float = 300.0,
    record_timeline: bool = False,
    cuda_graphs: bool = False,
    split_mlps: bool | str = True,
    compile_stages: bool = False,
    batchnorm: str = "deferred",
    costs: str | os.PathLike | MeasuredCosts = "analytic",
    measure: MeasureOptions | None = None,
    batch_split: str = "equal",
    batch: int | None = None,
) -> ParallelModel:
    """Parallelize ``model`` over the processes torchrun started; returns a :class:`ParallelModel`.

    ``example_inputs`` are the model's positional inputs for ONE micro-batch. ``dp`` is
    ``world_size // (pp * tp)``. ``schedule`` defaults to "1f1b" (``interleaved_1f1b`` when
    ``chunks > 1``). ``mixed_precision="bf16"`` runs stages under autocast; "fp16" adds a dynamic
    loss scale (step with :meth:`ParallelModel.step`). ``cuda_graphs=True`` captures each
    stage's forward and backward in CUDA graphs at the first train step and replays them (GPU,
    tp=1; see autopipe/runtime/graphs.py): worth it where micro-batches are small enough for
    kernel launches to dominate. ``sequence_parallel=True`` (tp > 1) splits the layers between
    the sharded pairs (norms, residual adds) across the tp ranks by sample, with reduce-scatter
    and all-gather in place of each all-reduce (see [Note: sequence parallelism]).
    ``split_mlps`` (tp=1, balance="cost") lets a stage boundary fall inside a large MLP when
    that balances the stages better: its hidden units are split between the two stages, held
    as ``<fc1>_piece<i>`` and ``<fc2>_piece<i>`` (see [Note: MLP pieces]); ``full_state_dict``
    and checkpoints keep the model's own names. It also cuts a pooling by sample (a ResNet
    stem's max-pool; see [Note: sample pieces]). ``split_mlps="convolutions"`` also cuts
    convolutions by channel (a ResNet block's conv pair, or a convolution and its norm, its
    pieces concatenated); off by default, as on an H200 the pieces cost more than they balance.
    ``pp="auto"`` turns it off, to run the stages
    the search priced ([Note: priced cuts] in autopipe/search/layouts.py).
    ``compile_stages=True`` compiles each stage's graph with ``torch.compile`` (inductor fuses
    the norms, activations and casts between the GEMMs; the first step pays the compilation;
    see [Note: compiled stages]).
    ``batchnorm`` says what BatchNorm layers compute in train() (docs/batchnorm.md): "deferred"
    (default) normalises each micro-batch with its own statistics and updates the running
    statistics once per ``train_step``, from the whole batch of every dp replica; "sync" also
    normalises each micro-batch over the dp replicas together (SyncBatchNorm semantics; with
    ``microbatches=1``, one process on the global batch); "microbatch" updates them once per
    micro-batch on each replica, as an unmodified stage does.
    ``costs`` says what prices the nodes when cutting: "analytic" (the cost model of ``profile``,
    calibrated for the GPU where the project has a table; by default the profile of the GPU the
    run is on, h200 on an H200 and h100 on others, and cpu on the CPU), "measured" (the graph timed on this
    device in the mode it will run, cached on disk, then the emitted stages timed and cut again
    while unbalanced; collective: ranks share the timing and agree on one plan), or a profile
    made by ``autopipe profile`` (a path or a MeasuredCosts; see [Note: measured costs]).
    ``measure`` tunes the measuring (autopipe.measure.MeasureOptions: segments, repetitions, the
    max/mean target of the closed loop, the cache).
    ``pp="auto"`` chooses pp, tp, dp, micro-batches, chunks, schedule, sequence parallelism,
    activation checkpointing and CUDA graphs / compiled stages for ``batch`` samples per step
    over all replicas (each rank's train_step then takes ``batch // dp`` of them); the arguments
    it chooses are ignored, ``example_inputs`` give the other dimensions, and ``pm.search`` holds
    the ranked layouts and why the others were refused (``print(pm.search)``).

    Batches may hold any number of samples: stage boundary shapes follow from the batch (see
    [Note: stage variants]). ``batch_split="equal"`` requires a training batch that splits into
    ``microbatches`` equal micro-batches; ``"uneven"`` splits any batch into micro-batches whose
    sizes differ by at most one, weighing each micro-batch's loss by its share of the batch,
    and runs a batch smaller than ``microbatches`` as one micro-batch per sample (see [Note:
    batch splits]). Evaluation batches always split unevenly.
    ``device`` defaults to this rank's GPU where CUDA is available and the process group is not
    gloo alone, else the CPU. Every rank must pass the same arguments (checked: see [Note:
    argument agreement]); ``deadline`` (seconds) bounds every wait for another rank, so that a
    rank that fails, dies or does not come makes the others raise instead of hanging (see
    [Note: failure propagation]).
    """
    # 0. pp="auto": the layout search chooses the degrees and how to run; see [Note: layout search].
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    search = None
    if pp == "auto":
        search, chosen, example_inputs = _choose_layout(
            model, tuple(example_inputs), batch=batch, device=device, profile=profile, costs=costs,
            mixed_precision=mixed_precision, deadline=deadline)
        kw = chosen.parallelize_kwargs()  # run as priced: [Note: priced cuts] in search/layouts.py
        pp, tp, microbatches, chunks, schedule = kw["pp"], kw["tp"], kw["microbatches"], kw["chunks"], kw["schedule"]
        sequence_parallel, activation_checkpointing = kw["sequence_parallel"], kw["activation_checkpointing"]
        cuda_graphs, compile_stages, split_mlps = kw["cuda_graphs"], kw["compile_stages"], kw["split_mlps"]
    elif batch is not None:
        raise ConfigError(f"batch={batch!r} is for pp='auto' (the global batch the layout is chosen for); with "
                          "pp given, example_inputs are one micro-batch")

    measure = _scaled_in_pipeline(model, tuple(example_inputs), measure, _trial_settings(locals()))
    # 1. The same arguments on every rank, then local checks: every rank raises the same error
    #    before any collective.
    leaf_modules = tuple(leaf_modules)  # read again by re-traces at other batch sizes
    schedule = schedule or default_schedule(chunks)
    check_deadline(deadline)
    agree(dict(
        model=model, example_inputs=tuple(example_inputs), pp=pp, tp=tp, microbatches=microbatches,
        schedule=schedule, chunks=chunks, balance=balance, shard_rules=shard_rules,
        sequence_parallel=sequence_parallel, leaf_modules=leaf_modules, exec_sequence=exec_sequence,
        mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        device=None if device is None else torch.device(device).type, profile=profile, cuda_graphs=cuda_graphs,
        split_mlps=split_mlps, compile_stages=compile_stages, batchnorm=batchnorm, batch_split=batch_split,
        costs=costs_label(costs), stage_scale=getattr(measure, "stage_scale", None),
    ), deadline=deadline)
    dims, device, rank = check_on_this_rank(
        loss_fn, schedule, pp=pp, tp=tp, chunks=chunks, microbatches=microbatches, mixed_precision=mixed_precision,
        batch_split=batch_split, costs=costs, measure=measure, batchnorm=batchnorm, cuda_graphs=cuda_graphs,
        compile_stages=compile_stages, sequence_parallel=sequence_parallel, device=device)
    pp_rank, _, tp_rank = dims.coords(rank)

    # 2-4. Trace, shard and partition (see the module's docstring), then this rank's graphs.
    mode = execution_mode(cuda_graphs=cuda_graphs, compile_stages=compile_stages)
    front = plan_pipeline(
        model, example_inputs, pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, schedule=schedule,
        balance=balance, profile=_planning_profile(profile, device, mode), mode=mode, shard_rules=shard_rules,
        sequence_parallel=sequence_parallel, leaf_modules=leaf_modules, exec_sequence=exec_sequence,
        split_mlps=split_mlps, cut=_measured_cut(costs, measure, device, mode, PRECISIONS[mixed_precision],
                                                 activation_checkpointing),
        # Under autocast, floating activations cross stage boundaries in the compute dtype (the
        # stages cast them; see runtime/preparation.py): the cuts are priced and sized in it.
        activation_dtype=PRECISIONS[mixed_precision],
    )
    plan, shard_plan = front.plan, front.shard_plan
    template = _export_template(model, front.traced)
    traced, eval_traced = _rank_graphs(front, tp_rank, shard_rules, sequence_parallel)
    retrace = _retracer(template, traced, front, leaf_modules=leaf_modules, tp_rank=tp_rank,
                        shard_rules=shard_rules, sequence_parallel=sequence_parallel)
    check_batchnorm(traced.gm, batchnorm)
    check_parameters(plan)

    # 5. Mesh (the first collective).
    mesh = build_mesh(dims, device)
    if tp > 1:
        register_group("tp", mesh.tp_group)

    # 6. This rank's stages. From here on a rank that fails alone (out of memory) records it,
    #    and the others raise instead of waiting: see [Note: failure propagation].
    monitor = FailureMonitor.for_world(dims.name(rank), deadline=deadline, threaded=device.type == "cpu")
    with monitor.guard():
        stages, eval_stages = _emit(traced, eval_traced, plan, pp_rank, device)
    norms = BatchNormStats.install(stages.values(), batchnorm, mesh.dp_group, dims.dp)

    # 7. The runtime: stages prepared to run, the driver started.
    runtime = build_runtime(
        plan=plan, traced=traced, stages=stages, mesh=mesh, schedule=schedule, loss_fn=loss_fn,
        compute_dtype=PRECISIONS[mixed_precision], activation_checkpointing=activation_checkpointing,
        deadline=deadline, record_timeline=record_timeline, cuda_graphs=cuda_graphs,
        compile_stages=compile_stages, batchnorm=norms, retrace=retrace, batch_split=batch_split, monitor=monitor,
        eval_stages=eval_stages, training=model.training, state=TrainingState.for_precision(mixed_precision == "fp16"),
    )
    pm = ParallelModel(model, runtime, shard_plan=shard_plan)
    pm.search = search
    return pm


PIPELINE_WARMUP = 2  # stand-in steps before the recorded ones (the first captures CUDA graphs)
# What the stand-in pipeline is built with, as parallelize was called (after pp="auto" chose).
TRIAL_SETTINGS = ("pp", "tp", "microbatches", "schedule", "chunks", "balance", "shard_rules", "sequence_parallel",
                  "leaf_modules", "exec_sequence", "mixed_precision", "activation_checkpointing", "device", "profile",
                  "deadline", "cuda_graphs", "split_mlps", "compile_stages", "batchnorm", "costs", "batch_split")


def _trial_settings(names: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in names.items() if k in TRIAL_SETTINGS}


def _scaled_in_pipeline(model: nn.Module, example_inputs: tuple, measure: Any, settings: dict[str, Any]) -> Any:
    """``measure`` with the stage scale a stand-in pipeline shows, where it asks for one
    (``pipeline_steps``, then spent); otherwise ``measure`` as given."""
    if not (isinstance(measure, MeasureOptions) and measure.pipeline_steps):
        return measure
    steps = measure.pipeline_steps
    measure = dataclasses.replace(measure, pipeline_steps=0)
    return dataclasses.replace(measure, stage_scale=_stage_scale_in_pipeline(
        model, example_inputs, measure, steps, settings))


def _stage_scale_in_pipeline(model: nn.Module, example_inputs: tuple, measure: MeasureOptions, steps: int,
                             settings: dict[str, Any]) -> tuple[float, ...]:
    """``MeasureOptions(pipeline_steps=n)``: a copy of ``model`` parallelized as asked, n steps
    recorded after a warm-up on the example micro-batch repeated, with a loss of zero (its
    gradients are zeros; the kernels run all the same), and each stage's time in that pipeline
    over its time alone (:func:`autopipe.measure.stage_scale`, [Note: stage scale]), the same on
    every rank. The model, its gradients and the random number generators are left as they were."""
    if isinstance(settings["costs"], str) and settings["costs"] == "analytic":
        raise ConfigError("measure=MeasureOptions(pipeline_steps=...) compares stages timed alone with the "
                          "pipeline; pass costs='measured' (or a profile) with it")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ConfigError(f"pipeline_steps must be a non-negative integer, got {steps!r}")
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    trial = parallelize(copy.deepcopy(model), example_inputs, loss_fn=_zero_loss, record_timeline=True,
                        measure=measure, **settings)
    try:
        m = trial.plan.microbatches
        inputs = tuple(torch.cat([x] * m) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        targets = torch.zeros(inputs[0].shape[0])
        for step in range(PIPELINE_WARMUP + steps):
            if step == PIPELINE_WARMUP:
                trial.timeline.clear()
            trial.train_step(inputs[0] if len(inputs) == 1 else inputs, targets)
            for p in trial.parameters():
                p.grad = None
        several = dist.is_initialized() and dist.get_world_size() > 1
        events = gather(trial.timeline) if several else trial.timeline.events()
        found = [None if events is None else stage_scale(events, trial.plan, scale=measure.stage_scale)]
        if several:
            dist.broadcast_object_list(found, src=0)
    finally:
        trial.close()
        del trial
        gc.collect()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
            torch.cuda.empty_cache()
    return tuple(found[0])


def _zero_loss(output: Any, target: Any) -> torch.Tensor:
    """A loss of zero that reaches every floating output (the stand-in pipeline's)."""
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum((t.float() * 0).sum() for t in leaves)


def _planning_profile(profile: Any, device: torch.device, mode: str) -> Any:
    """The profile the analytic model plans with: ``profile``, else this device's, its eager
    host terms at this host's pace where it runs eager stages on a GPU (rank 0's probe on every
    rank, so that every rank makes the same plan; [Note: host pace])."""
    chosen = default_profile(profile, device)
    if profile is None and mode == "eager" and device.type == "cuda":
        chosen = chosen.at_host_pace(on_rank0(lambda: recent_probe_seconds(device)))
    return chosen


def _measured_cut(costs: Any, measure: MeasureOptions | None, device: torch.device, mode: str,
                  compute_dtype: torch.dtype | None, recompute: bool) -> Cut | None:
    """How the front door cuts with measured costs (None: with the analytic model); see
    [Note: measured costs]."""
    if isinstance(costs, str) and costs == "analytic":
        return None
    setup = RunSetup(device, mode, compute_dtype, recompute=recompute)

    def cut(graph: TracedModel, args: dict[str, Any]) -> PartitionPlan:
        return measured_plan(graph, setup, args, options=measure or MeasureOptions(),
                             measured=None if costs == "measured" else costs)

    return cut


def _export_template(model: nn.Module, traced: TracedModel) -> nn.Module | str | None:
    """torch.export bakes the micro-batch size in: other sizes trace a copy of the model again,
    taken before any module is changed (see [Note: stage variants]). None where the graph
    follows any size; why not, where the model cannot be copied."""
    if traced.route != "export":
        return None
    try:
        return meta_copy(model)
    except Exception as exc:  # noqa: BLE001 - only other batch sizes need it; they say why
        return f"{type(model).__name__} could not be copied to trace it again ({type(exc).__name__}: {exc})"


def _retracer(template: nn.Module | str | None, traced: TracedModel, front: PlannedModel, *, leaf_modules: tuple,
              tp_rank: int, shard_rules: Any, sequence_parallel: bool) -> Any:
    """How this rank's graph is made at another micro-batch size, from :func:`_export_template`."""
    if template is None:
        return None
    if isinstance(template, str):
        return planned_size_only(template)
    tp = front.shard_plan.tp if front.shard_plan is not None else 1
    return export_retracer(template, traced, front.plan, leaf_modules=leaf_modules, tp=tp, tp_rank=tp_rank,
                           shard_rules=shard_rules, sequence_parallel=sequence_parallel)


def _rank_graphs(front: PlannedModel, tp_rank: int, shard_rules: Any,
                 sequence_parallel: bool) -> tuple[TracedModel, TracedModel | None]:
    """This tp rank's train-mode graph as the plan names it (MLP pieces cut), and its eval-mode
    graph where the model has one."""
    traced, eval_traced = front.traced, front.traced.eval_traced
    if front.shard_plan is not None:
        traced = apply_sharding(traced, front.shard_plan, tp_rank, group="tp")
        if eval_traced is not None:
            eval_traced = _shard_eval_graph(eval_traced, front.shard_plan, tp_rank, shard_rules, sequence_parallel)
    return cut_mlps(traced, front.plan.mlp_pieces), eval_traced


def _emit(traced: TracedModel, eval_traced: TracedModel | None, plan: PartitionPlan, pp_rank: int,
          device: torch.device) -> tuple[dict[int, nn.Module], ModeStages | None]:
    """This pipeline rank's stages on ``device``, and its eval-mode stages sharing their state."""
    local = [s.index for s in plan.stages if s.pp_rank == pp_rank]
    stages = {i: m.to(device) for i, m in emit_stages(traced, plan, local).items()}
    if eval_traced is None:
        return stages, None
    eval_traced, eval_plan = follow_plan(traced, plan, eval_traced)  # see [Note: one graph per mode]
    return stages, ModeStages(eval_plan, eval_traced, {
        i: share_state(m, stages[i]).to(device) for i, m in emit_stages(eval_traced, eval_plan, local).items()})


def _choose_layout(model: nn.Module, example_inputs: tuple, *, batch: Any, device: Any, profile: str | None,
                   costs: Any, mixed_precision: str | None, deadline: float) -> tuple[Any, Any, tuple]:
    """The search's best layout for this world, the same on every rank (rank 0 searches), and one
    micro-batch of the example inputs at its size."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"pp='auto' needs batch=, the global batch per step over every replica, got {batch!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = resolve_device(device)
    name = _planning_profile(profile, device, "eager")  # eager layouts at this host's pace; others have no host terms
    memory = torch.cuda.get_device_properties(device).total_memory * 0.9 if device.type == "cuda" else None
    measured = None
    if isinstance(costs, MeasuredCosts) or (isinstance(costs, (str, os.PathLike)) and costs not in ("analytic", "measured")):
        measured = costs if isinstance(costs, MeasuredCosts) else MeasuredCosts.load(costs)
    sample = tuple(x[:1] for x in example_inputs)
    result = on_rank0(lambda: plan_layout(model, devices=world, batch=batch, device=name, memory=memory,
                                          measured=measured, example_inputs=sample, mixed_precision=mixed_precision,
                                          timeline=False))
    best = result.best.layout
    size = best.microbatch_size(batch)
    inputs = tuple(x[:1].expand(size, *x.shape[1:]).contiguous() if x.shape[0] < size else x[:size]
                   for x in example_inputs)
    return result, best, inputs
