"""``parallelize()``: pipeline x tensor x data parallelism for an unmodified model, in one call.

The steps run in this order, each a function of the last (see ARCHITECTURE):
1. agree on the arguments with every other rank (over the store, with the deadline: see
   [Note: argument agreement]), then check them on this rank (no collective yet, so a mistake
   cannot hang a peer); from here on a failure on any rank reaches every rank;
2. trace the model to a graph (one per mode where its forward branches on ``self.training``);
3. shard it for this tp rank (before partitioning: the cost model must see sharded compute);
4. cut it into ``pp * chunks`` stages (deterministic: every rank computes the same plan);
5. build the (pp, dp, tp) mesh, the first collective;
6. emit this rank's stages, move them to the device, make dp replicas start equal;
7. hand them to the pipeline driver.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.torch_version import TorchVersion

from .errors import ConfigError, PartitionError, ShardingError
from .measure import MeasureOptions, RunSetup, measured_plan
from .partition.device import execution_mode, get_profile
from .partition.measured import MeasuredCosts
from .partition.plan import PartitionPlan
from .runtime.batchnorm import BatchNormStats, check_batchnorm
from .failure.monitor import FailureMonitor
from .runtime.microbatch import SPLITS
from .runtime.schedule import SCHEDULES, validate
from .tracer import TracedModel, trace
from .training.agreement import agree
from .training.mesh import ParallelDims, build_mesh, default_device
from .training.parallel_model import ModeStages, ParallelModel, StageRuntime
from .stages import emit_stages, follow_plan, plan_stages, share_state, split_mlps as cut_mlps
from .stages.variants import export_retracer, meta_copy, planned_size_only

__all__ = ["parallelize"]

_PRECISIONS = {None: None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check(loss_fn: Any, schedule: str, pp: int, chunks: int, microbatches: int, mixed_precision: Any,
           batch_split: str) -> None:
    if not callable(loss_fn):
        raise ConfigError("loss_fn must be a callable loss_fn(model_output, target) -> scalar tensor")
    if schedule not in SCHEDULES or schedule == "forward_only":
        raise ConfigError(
            f"schedule={schedule!r}; training schedules are 'gpipe', '1f1b', 'interleaved_1f1b'"
        )
    if mixed_precision not in _PRECISIONS:
        raise ConfigError(f"mixed_precision={mixed_precision!r}; use None, 'bf16' or 'fp16'")
    if batch_split not in SPLITS:
        raise ConfigError(f"batch_split={batch_split!r}; use one of {', '.join(map(repr, SPLITS))}")
    validate(schedule, pp, microbatches, chunks)


def _check_costs(costs: Any, measure: Any) -> None:
    if not (isinstance(costs, (MeasuredCosts, os.PathLike)) or isinstance(costs, str)):
        raise ConfigError(f"costs={costs!r}; use 'analytic', 'measured', a profile file's path or a MeasuredCosts")
    if measure is not None and not isinstance(measure, MeasureOptions):
        raise ConfigError(f"measure={measure!r}; pass autopipe.measure.MeasureOptions(...) or None")


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"device={str(device)!r}, but there is no CUDA on this machine ({why}: "
                          "torch.cuda.is_available() is False); pass device='cpu', or run on a machine with a GPU")
    return device


def _check_parameters(plan: PartitionPlan) -> None:
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


def _shard_eval_graph(eval_traced: TracedModel, shard_plan: Any, tp_rank: int, rules: Any,
                      sequence_parallel: bool) -> TracedModel:
    """The eval-mode graph sharded as the train-mode graph is: every parameter both hold split alike."""
    from .shard import apply_sharding, plan_sharding

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
    split_mlps: bool = True,
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
    and checkpoints keep the model's own names. ``compile_stages=True`` compiles each stage's
    graph with ``torch.compile`` (inductor fuses the norms, activations and casts between the
    GEMMs; the first step pays the compilation; see [Note: compiled stages]).
    ``batchnorm`` says what BatchNorm layers compute in train() (docs/batchnorm.md): "deferred"
    (default) normalises each micro-batch with its own statistics and updates the running
    statistics once per ``train_step``, from the whole batch of every dp replica; "sync" also
    normalises each micro-batch over the dp replicas together (SyncBatchNorm semantics; with
    ``microbatches=1``, one process on the global batch); "microbatch" updates them once per
    micro-batch on each replica, as an unmodified stage does.
    ``costs`` says what prices the nodes when cutting: "analytic" (the cost model of ``profile``,
    calibrated for the GPU where the project has a table), "measured" (the graph timed on this
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
        pp, tp, microbatches, chunks = chosen.pp, chosen.tp, chosen.microbatches, chosen.chunks
        schedule, sequence_parallel = chosen.schedule, chosen.sequence_parallel
        activation_checkpointing = chosen.recompute
        cuda_graphs, compile_stages = chosen.mode.endswith("graphs"), chosen.mode.startswith("compiled")
    elif batch is not None:
        raise ConfigError(f"batch={batch!r} is for pp='auto' (the global batch the layout is chosen for); with "
                          "pp given, example_inputs are one micro-batch")

    # 1. The same arguments on every rank, then local checks: every rank raises the same error
    #    before any collective.
    leaf_modules = tuple(leaf_modules)  # read again by re-traces at other batch sizes
    schedule = schedule or ("interleaved_1f1b" if chunks > 1 else "1f1b")
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline < math.inf:
        raise ConfigError(f"deadline={deadline!r}; pass a positive number of seconds (how long a rank waits "
                          "for its peers before deciding that one has failed)")
    agree(dict(
        model=model, example_inputs=tuple(example_inputs), pp=pp, tp=tp, microbatches=microbatches,
        schedule=schedule, chunks=chunks, balance=balance, shard_rules=shard_rules,
        sequence_parallel=sequence_parallel, leaf_modules=leaf_modules, exec_sequence=exec_sequence,
        mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        device=None if device is None else torch.device(device).type, profile=profile, cuda_graphs=cuda_graphs,
        split_mlps=split_mlps, compile_stages=compile_stages, batchnorm=batchnorm, batch_split=batch_split,
        costs=costs if isinstance(costs, str) else os.fspath(costs) if isinstance(costs, os.PathLike) else
        getattr(costs, "fingerprint", type(costs).__name__),
    ), deadline=deadline)
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
    device = _device(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    pp_rank, dp_rank, tp_rank = dims.coords(rank)
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

    # 2. Trace (two graphs where the model's forward branches on self.training).
    traced = trace(model, tuple(example_inputs), leaf_modules=leaf_modules, exec_sequence=exec_sequence)
    # torch.export bakes the micro-batch size in: other sizes trace this copy again, taken
    # before any module is changed (see [Note: stage variants]).
    template, uncopied = None, ""
    if traced.route == "export":
        try:
            template = meta_copy(model)
        except Exception as exc:  # noqa: BLE001 - only other batch sizes need it; they say why
            uncopied = f"{type(model).__name__} could not be copied to trace it again ({type(exc).__name__}: {exc})"
    eval_traced = traced.eval_traced

    # 3. Shard for this tp rank. Measured costs time tp rank 0's graph with its collectives
    # standing in (no group yet, and every rank must time the same graph): a plan names nodes,
    # which every rank's sharded graph shares.
    shard_plan = None
    planning_graph = traced
    if tp > 1:
        from .shard import apply_sharding, plan_sharding

        shard_plan = plan_sharding(traced, tp, rules=shard_rules, sequence_parallel=sequence_parallel)
        rank_graph = apply_sharding(traced, shard_plan, tp_rank, group="tp")
        planning_graph = rank_graph if costs == "analytic" else apply_sharding(traced, shard_plan, 0)
        traced = rank_graph
        if eval_traced is not None:
            eval_traced = _shard_eval_graph(eval_traced, shard_plan, tp_rank, shard_rules, sequence_parallel)

    # 4. Partition.
    mode = execution_mode(cuda_graphs=cuda_graphs, compile_stages=compile_stages)
    args = dict(
        pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, balance=balance, schedule=schedule,
        device=get_profile(profile or ("h100" if device.type == "cuda" else "cpu")).with_mode(mode),
        model_name=type(model).__name__,
        # Under autocast, floating activations cross stage boundaries in the compute dtype (the
        # stages cast them; see model._wrap_forward): the cuts are priced and sized in it.
        activation_dtype=_PRECISIONS[mixed_precision], split_mlps=split_mlps,
    )
    if costs == "analytic":
        plan = plan_stages(traced, **args)
    else:  # see [Note: measured costs]
        setup = RunSetup(device, mode, _PRECISIONS[mixed_precision], recompute=activation_checkpointing)
        plan = measured_plan(planning_graph, setup, args, options=measure or MeasureOptions(),
                             measured=None if costs == "measured" else costs)
    traced = cut_mlps(traced, plan.mlp_pieces)  # the graph the plan names
    check_batchnorm(traced.gm, batchnorm)
    _check_parameters(plan)

    # 5. Mesh (the first collective).
    mesh = build_mesh(dims, device)
    if tp > 1:
        from .shard.collectives import register_group

        register_group("tp", mesh.tp_group)

    # 6. This rank's stages. From here on a rank that fails alone (out of memory) records it,
    #    and the others raise instead of waiting: see [Note: failure propagation].
    monitor = FailureMonitor.for_world(dims.name(rank), deadline=deadline, threaded=device.type == "cpu")
    local = [s.index for s in plan.stages if s.pp_rank == pp_rank]
    with monitor.guard():
        stages = {i: m.to(device) for i, m in emit_stages(traced, plan, local).items()}
        eval_stages = None
        if eval_traced is not None:  # see [Note: one graph per mode]
            eval_traced, eval_plan = follow_plan(traced, plan, eval_traced)
            eval_stages = ModeStages(eval_plan, eval_traced, {
                i: share_state(m, stages[i]).to(device) for i, m in emit_stages(eval_traced, eval_plan, local).items()})
    norms = BatchNormStats.install(stages.values(), batchnorm, mesh.dp_group, dims.dp)

    retrace = planned_size_only(uncopied) if uncopied else None
    if template is not None:
        retrace = export_retracer(template, traced, plan, leaf_modules=leaf_modules, tp=tp, tp_rank=tp_rank,
                                  shard_rules=shard_rules, sequence_parallel=sequence_parallel)
    runtime = StageRuntime(
        plan=plan, traced=traced, stages=stages, mesh=mesh, schedule=schedule, loss_fn=loss_fn,
        compute_dtype=_PRECISIONS[mixed_precision], activation_checkpointing=activation_checkpointing,
        deadline=deadline, record_timeline=record_timeline, cuda_graphs=cuda_graphs,
        compile_stages=compile_stages, batchnorm=norms, retrace=retrace, batch_split=batch_split, monitor=monitor,
        eval_stages=eval_stages, training=model.training,
    )
    pm = ParallelModel(model, runtime, shard_plan=shard_plan, fp16=mixed_precision == "fp16")
    pm.search = search
    return pm


def _choose_layout(model: nn.Module, example_inputs: tuple, *, batch: Any, device: Any, profile: str | None,
                   costs: Any, mixed_precision: str | None, deadline: float) -> tuple[Any, Any, tuple]:
    """The search's best layout for this world, the same on every rank (rank 0 searches), and one
    micro-batch of the example inputs at its size."""
    from .measure.profile import on_rank0
    from .search import plan_layout

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"pp='auto' needs batch=, the global batch per step over every replica, got {batch!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = _device(device)
    name = profile or ("h100" if device.type == "cuda" else "cpu")
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
