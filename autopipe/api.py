"""``parallelize()``: pipeline x tensor x data parallelism for an unmodified model, in one call.

The steps run in this order, each a function of the last (see ARCHITECTURE):
1. check every argument on this rank (no collective yet, so a mistake cannot hang a peer);
2. trace the model to a graph (one per mode where its forward branches on ``self.training``);
3. shard it for this tp rank (before partitioning: the cost model must see sharded compute);
4. cut it into ``pp * chunks`` stages (deterministic: every rank computes the same plan);
5. build the (pp, dp, tp) mesh, the first collective;
6. emit this rank's stages, move them to the device, make dp replicas start equal;
7. hand them to the pipeline driver.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.torch_version import TorchVersion

from .emit import emit_stages, share_state
from .errors import ConfigError, ShardingError
from .mesh import ParallelDims, build_mesh, default_device
from .model import ModeStages, ParallelModel, StageRuntime
from .partition.mlp_pieces import split_mlps as cut_mlps
from .partition.mode_plan import follow_plan
from .partition.partitioner import partition
from .runtime.schedule import SCHEDULES, validate
from .tracer import TracedModel, trace

__all__ = ["parallelize"]

_PRECISIONS = {None: None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check(loss_fn: Any, schedule: str, pp: int, chunks: int, microbatches: int, mixed_precision: Any) -> None:
    if not callable(loss_fn):
        raise ConfigError("loss_fn must be a callable loss_fn(model_output, target) -> scalar tensor")
    if schedule not in SCHEDULES or schedule == "forward_only":
        raise ConfigError(
            f"schedule={schedule!r}; training schedules are 'gpipe', '1f1b', 'interleaved_1f1b'"
        )
    if mixed_precision not in _PRECISIONS:
        raise ConfigError(f"mixed_precision={mixed_precision!r}; use None, 'bf16' or 'fp16'")
    validate(schedule, pp, microbatches, chunks)


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
    pp: int = 1,
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
    """
    # 1. Local checks: every rank raises the same error before any collective.
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    schedule = schedule or ("interleaved_1f1b" if chunks > 1 else "1f1b")
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
    _check(loss_fn, schedule, pp, chunks, microbatches, mixed_precision)
    device = torch.device(device) if device is not None else default_device()
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
    eval_traced = traced.eval_traced

    # 3. Shard for this tp rank.
    shard_plan = None
    if tp > 1:
        from .shard import apply_sharding, plan_sharding

        shard_plan = plan_sharding(traced, tp, rules=shard_rules, sequence_parallel=sequence_parallel)
        traced = apply_sharding(traced, shard_plan, tp_rank, group="tp")
        if eval_traced is not None:
            eval_traced = _shard_eval_graph(eval_traced, shard_plan, tp_rank, shard_rules, sequence_parallel)

    # 4. Partition.
    plan = partition(
        traced, pp, chunks, tp=tp, microbatches=microbatches, balance=balance,
        device=profile or ("h100" if device.type == "cuda" else "cpu"), schedule=schedule,
        model_name=type(model).__name__,
        # Under autocast, floating activations cross stage boundaries in the compute dtype (the
        # stages cast them; see model._wrap_forward): the cuts are priced and sized in it.
        activation_dtype=_PRECISIONS[mixed_precision], split_mlps=split_mlps,
    )
    traced = cut_mlps(traced, plan.mlp_pieces)  # the graph the plan names

    # 5. Mesh (the first collective).
    mesh = build_mesh(dims, device)
    if tp > 1:
        from .shard.collectives import register_group

        register_group("tp", mesh.tp_group)

    # 6. This rank's stages.
    local = [s.index for s in plan.stages if s.pp_rank == pp_rank]
    stages = {i: m.to(device) for i, m in emit_stages(traced, plan, local).items()}
    eval_stages = None
    if eval_traced is not None:  # see [Note: one graph per mode]
        eval_traced, eval_plan = follow_plan(traced, plan, eval_traced)
        eval_stages = ModeStages(eval_plan, eval_traced, {
            i: share_state(m, stages[i]).to(device) for i, m in emit_stages(eval_traced, eval_plan, local).items()})

    runtime = StageRuntime(
        plan=plan, traced=traced, stages=stages, mesh=mesh, schedule=schedule, loss_fn=loss_fn,
        compute_dtype=_PRECISIONS[mixed_precision], activation_checkpointing=activation_checkpointing,
        deadline=deadline, record_timeline=record_timeline, cuda_graphs=cuda_graphs,
        compile_stages=compile_stages, eval_stages=eval_stages, training=model.training,
    )
    return ParallelModel(model, runtime, shard_plan=shard_plan, fp16=mixed_precision == "fp16")
