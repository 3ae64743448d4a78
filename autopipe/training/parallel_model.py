"""``ParallelModel``: what ``parallelize()`` returns, the one object users hold.

It runs training and evaluation steps through the pipeline driver, averages gradients over
data-parallel replicas (once per accumulation, see ``no_sync``), clips and scales them across
the whole mesh, converts between this rank's sharded stages and the unmodified model's full
state_dict, and saves and loads sharded checkpoints (checkpoint.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import CheckpointError, ConfigError, InputError
from ..failure.monitor import FailureMonitor, synced, wait_works
from ..failure.objects import all_gather_objects
from ..partition.plan import PartitionPlan
from ..runtime.timeline import Timeline
from ..stages.piece_state import merge_pieces
from .checkpoint import save_checkpoint
from .checkpoint_load import load_checkpoint
from .gradients import average_gradients, clip_gradients, global_grad_norm, reduce_sequence_parallel_grads
from .checkpoint_ranks import release_checkpoint_group
from .mesh import Mesh, release_groups
from .stage_runtime import StageRuntime
from .state_map import load_local_state, local_full_state
from .training_state import TrainingState
from .zero import zero_optimizer

__all__ = ["ParallelModel", "StepResult"]


@dataclass
class StepResult:
    """What :meth:`ParallelModel.step` did: the global gradient norm (None where it was not
    computed), whether the update was skipped (fp16 overflow, or a non-finite norm), the fp16
    loss scale (1.0 without fp16)."""

    grad_norm: float | None
    skipped: bool
    loss_scale: float


class ParallelModel:
    """A model split over a (pp, dp, tp) mesh. See ``autopipe.parallelize``."""

    def __init__(self, model: nn.Module, runtime: StageRuntime, *, shard_plan: Any = None):
        self.search: Any = None  # the layout search, when parallelize(pp="auto") chose the layout
        self._model = model
        self._runtime = runtime
        self._shard_plan = shard_plan
        mesh = runtime.mesh
        self._mesh = mesh
        # What the user's model looked like when it was parallelized: full_state_dict checks it.
        self._signature = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self._closed = False
        self._sync = True  # False inside no_sync()
        self._unsynced = False  # .grad holds this replica's sum of calls under no_sync()
        with self._monitor.guard():
            self._sync_replicas()

    # ----------------------------------------------------------------------------- layout
    @property
    def plan(self) -> PartitionPlan:
        return self._runtime.plan

    @property
    def shard_plan(self) -> Any:
        return self._shard_plan

    @property
    def mesh(self) -> Mesh:
        """The (pp, dp, tp) process groups and this rank's place in them."""
        return self._mesh

    @property
    def training_state(self) -> TrainingState:
        """The loss scale and the updates skipped; checkpoints save and restore it."""
        return self._runtime.state

    @property
    def model_name(self) -> str:
        """The class name of the model that was parallelized."""
        return type(self._model).__name__

    @property
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's state_dict keys and full shapes, as they were when it was parallelized."""
        return dict(self._signature)

    @property
    def dp_rank(self) -> int:
        return self._mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self._mesh.dims.dp

    @property
    def pp_rank(self) -> int:
        return self._mesh.pp_rank

    @property
    def tp_rank(self) -> int:
        return self._mesh.tp_rank

    @property
    def device(self) -> torch.device:
        return self._mesh.device

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (where losses and outputs are)."""
        return (self.plan.num_stages - 1) in self._runtime.stages

    @property
    def stages(self) -> dict[int, nn.Module]:
        return self._runtime.stages

    @property
    def timeline(self) -> Timeline | None:
        return self._runtime.timeline

    def report(self) -> PartitionPlan:
        """The partition plan: ``print(pm.report())`` for the table, ``.to_json()``, ``plot``."""
        return self.plan

    # ----------------------------------------------------------------------------- parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters (sharded ones local), under the original model's names; the
        rows of a linear cut across stages as ``<module>_piece<i>.weight`` (plan.mlp_pieces)."""
        for s in sorted(self._runtime.stages):
            yield from self._runtime.stages[s].named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _counted_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients this rank alone contributes to global norms."""
        out = []
        for name, p in self.named_parameters():
            ps = self._shard_plan.params.get(name) if self._shard_plan is not None else None
            if (ps is not None and ps.sharded) or self.tp_rank == 0:
                out.append(p)
        return out

    def train(self, mode: bool = True) -> "ParallelModel":
        self._runtime.driver.train(mode)
        return self

    def eval(self) -> "ParallelModel":
        return self.train(False)

    # ----------------------------------------------------------------------------- steps
    def train_step(self, inputs: Any, targets: Any, *, return_outputs: bool = False,
                   grad_scale: float = 1.0) -> Any:
        """Forward and backward of this dp replica's batch, split into the plan's micro-batches
        (any batch size: see ``parallelize(batch_split=...)``).

        Adds to ``.grad`` (as ``loss.backward()`` does) ``grad_scale`` times the gradients of
        the mean loss over the global batch (every dp replica), so ``optimizer.step()`` matches
        single-process training. Returns this replica's mean loss (not scaled) on every rank
        (and, with ``return_outputs``, the outputs on the last stage's ranks, None elsewhere).

        Gradient accumulation over n calls: pass ``grad_scale=1 / n`` and run the first n - 1
        calls under :meth:`no_sync`; see [Note: gradient accumulation].
        """
        self._check_open()
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) \
                or not math.isfinite(grad_scale) or grad_scale <= 0:
            raise InputError(f"grad_scale={grad_scale!r}; pass a positive number, e.g. 1 / n to "
                             "accumulate the gradients of n train_step calls")
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        if isinstance(targets, torch.Tensor) and inputs and targets.shape[0] != inputs[0].shape[0]:
            raise InputError(
                f"targets batch {targets.shape[0]} does not match inputs batch {inputs[0].shape[0]}; "
                "pass one target per sample"
            )
        self._check_split(inputs, training=True)
        self._runtime.grad_scale = float(grad_scale)
        self._refresh_weight_casts()
        self._runtime.prepare_gradients()
        norms = self._runtime.batchnorm  # see [Note: deferred batch norm]
        with self._monitor.guard():
            try:
                with norms.step() if norms is not None else contextlib.nullcontext():
                    result = self._runtime.driver.train_step(inputs, targets, return_outputs=return_outputs)
            finally:
                self._runtime.grad_scale = 1.0
            if self._shard_plan is not None and self._shard_plan.sequence_parallel_params:
                reduce_sequence_parallel_grads(self.named_parameters(), self._shard_plan, self._mesh.tp_group)
            self._unsynced = True
            if self._sync:
                self._average_gradients()
        loss = result[0] if return_outputs else result
        scale = self.training_state.loss_scale * grad_scale
        if scale != 1.0:
            loss = loss / scale
        return (loss, result[1]) if return_outputs else loss

    # [Note: gradient accumulation]
    # train_step adds to .grad like loss.backward(): n calls with grad_scale=1/n leave the
    # gradients of the mean loss over all n batches. Averaging over dp is linear, so it may
    # run once, on the sum: calls under no_sync() skip it (as DistributedDataParallel's do)
    # and the next call outside it averages everything accumulated so far. If every call ran
    # under no_sync(), step() and clip_grad_norm_() average before using the gradients.
    # Every rank makes the same calls, so they agree on whether to average.
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """train_step calls inside skip the data-parallel gradient all-reduce (accumulate first)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _average_gradients(self) -> None:
        if self._unsynced:
            average_gradients(self.parameters(), self._mesh.dp_group, self.dp_size)
            self._unsynced = False

    @torch.no_grad()
    def eval_step(self, inputs: Any) -> Any:
        """Forward only, keeping no activations, on a batch of any size; the model's outputs (a
        ModelOutput stays one) on the ranks of the last stage, None on the others. Uses the
        current train/eval mode."""
        self._check_open()
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        self._check_split(inputs, training=False)
        self._refresh_weight_casts()
        return self._runtime.driver.eval_step(inputs)

    def _check_split(self, inputs: tuple, *, training: bool) -> None:
        """Sequence parallelism splits every micro-batch by sample across the tp ranks."""
        plan = self._shard_plan
        if plan is None or not plan.sequence_parallel or plan.tp == 1 or not inputs \
                or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() == 0:
            return
        batch = inputs[0].shape[0]
        sizes = self._runtime.driver.microbatch_sizes(batch, training=training)
        if any(n % plan.tp for n in sizes):
            raise InputError(f"a batch of {batch} samples runs as micro-batches of {sizes} samples, and "
                             f"sequence_parallel=True splits each across tp={plan.tp} ranks; use batches whose "
                             f"micro-batches hold a multiple of {plan.tp} samples, or sequence_parallel=False")

    def _refresh_weight_casts(self) -> None:
        # The optimizer (or a load) may have changed the weights since the last step.
        if self._runtime.weight_casts is not None:
            self._runtime.weight_casts.refresh()

    def close(self) -> None:
        """Releases the process groups of this model's mesh, pipeline links and checkpoints, and
        the threads that wait on gloo's transfers. Collective: every rank calls it when done
        with the model (and with a :meth:`zero_optimizer`, which uses the dp group); the model
        cannot run afterwards. Groups and threads left behind slow every model built later in
        the process (on CPUs, with gloo)."""
        if not self._closed:
            self._closed = True
            self._runtime.driver.close()
            self._monitor.close()
            release_groups(self._mesh, release_checkpoint_group(self))

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this ParallelModel was closed (pm.close() released its process groups); "
                              "build it again with autopipe.parallelize(...)")

    @property
    def _monitor(self) -> FailureMonitor:
        return self._runtime.driver.monitor

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the (dp-averaged) gradients, the same on every rank."""
        self._average_gradients()
        norm = global_grad_norm(self._counted_parameters(), [self._mesh.pp_group, self._mesh.tp_group],
                                self.device)
        return synced(norm, "the global gradient norm")

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip gradients by their global L2 norm over the whole model; returns the norm."""
        with self._monitor.guard():
            norm = self._grad_norm()
            clip_gradients(self.parameters(), norm, max_norm)
            return float(norm)

    def step(self, optimizer: torch.optim.Optimizer, *, max_norm: float | None = None,
             skip_nonfinite: bool = True) -> StepResult:
        """Unscale (fp16), skip on overflow (the same decision on every rank), clip, step.

        With fp16, an inf or NaN in any rank's gradients skips the step on every rank and
        halves the loss scale; the (unscaled) gradients are left for ``zero_grad()``.
        Otherwise, with ``skip_nonfinite`` (the default), a global gradient norm that is inf or
        NaN skips the update on every rank alike (``StepResult.skipped``, and a warning on
        rank 0): one NaN pixel would otherwise turn every parameter and the optimizer's state
        into NaN for good, where skipping loses one batch. It costs one scalar all-reduce per
        step, none with ``max_norm`` (clipping computes the norm anyway). Pass False to apply
        every update as ``optimizer.step()`` alone would.
        """
        with self._monitor.guard():
            self._average_gradients()
            skipped, norm = False, None
            scaler = self.training_state.scaler
            if scaler is not None:
                skipped = scaler.found_inf(self.parameters(), None, self.device)
            elif max_norm is not None or skip_nonfinite:
                total = self._grad_norm()
                norm = float(total)
                skipped = skip_nonfinite and not math.isfinite(norm)
                if skipped:
                    self._report_skip(norm)
                elif max_norm is not None:
                    clip_gradients(self.parameters(), total, max_norm)
            if not skipped:
                if max_norm is not None and norm is None:
                    norm = self.clip_grad_norm_(max_norm)
                optimizer.step()
        self.training_state.after_step(skipped)
        return StepResult(norm, skipped, self.training_state.loss_scale)

    def _report_skip(self, norm: float) -> None:
        skipped = self.training_state.record_skip()
        if self._mesh.rank == 0:
            warnings.warn(f"ParallelModel.step skipped the update: the global gradient norm is {norm} "
                          f"({skipped} step(s) skipped so far); the gradients were left for "
                          "zero_grad(). Look for inf/NaN in the inputs or the loss, or lower the learning rate "
                          "(step(..., skip_nonfinite=False) applies such updates)", RuntimeWarning, stacklevel=3)

    # ----------------------------------------------------------------------------- state
    def _sync_replicas(self) -> None:
        """dp replicas start from rank 0's values, as DistributedDataParallel does."""
        group = self._mesh.dp_group
        if group is None or self.dp_size == 1:
            return
        src = dist.get_global_rank(group, 0)
        works = [dist.broadcast(t, src=src, group=group, async_op=True)
                 for s in sorted(self._runtime.stages) for t in self._runtime.stages[s].state_dict().values()]
        wait_works(works, "broadcast of the parameters from dp replica 0", group, self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unmodified model's state_dict (its keys, full shapes) on every rank, on CPU.

        Loads with ``strict=True`` into a fresh instance of the model. Collective: a rank that
        calls it alone raises PipelineFailure after ``deadline`` seconds, naming the others.
        """
        self._monitor.arrive("full_state_dict()")
        with self._monitor.guard():
            return self._full_state_dict()

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        current = {k: tuple(v.shape) for k, v in self._model.state_dict().items()}
        if current != self._signature:
            changed = sorted(set(current) ^ set(self._signature)) or \
                sorted(k for k in current if current[k] != self._signature.get(k))
            raise CheckpointError(
                f"the model was changed after parallelize() ({', '.join(changed[:5])}...); its stages "
                "no longer match it. Call parallelize() again on the changed model"
            )
        local = local_full_state(self.stages, self._shard_plan, self._mesh.tp_group)
        group = self._mesh.pp_group
        if group is not None and dist.get_world_size(group) > 1:
            parts = all_gather_objects(local, group, self.device, "all-gather of the state over the pipeline ranks")
            for part in parts:
                local.update(part)
        local = merge_pieces(local, self.plan.mlp_pieces)
        missing = sorted(set(self._signature) - set(local))
        if missing:
            raise CheckpointError(f"state for {', '.join(missing[:5])} is held by no stage")
        return {k: local[k] for k in self._signature}

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state_dict, e.g. a timm or transformers checkpoint."""
        missing = sorted(set(self._signature) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._signature))
        if missing or unexpected:
            raise CheckpointError(
                f"state_dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        load_local_state(self.stages, state_dict, self._shard_plan, self.tp_rank, self.plan.mlp_pieces)

    def zero_optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any = None,
                       **defaults: Any) -> torch.optim.Optimizer:
        """``optimizer_class(self.parameters(), **defaults)`` whose state is sharded over the dp
        replicas (torch's ZeroRedundancyOptimizer over this rank's dp group; the plain
        optimizer when dp = 1). ``pm.step``, clipping, fp16 loss scaling, LR schedulers and
        checkpoints take it as any optimizer. See [Note: zero redundancy] in zero.py."""
        return zero_optimizer(self, optimizer_class, params, **defaults)

    def save_checkpoint(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                        *, extra: Any = None) -> str:
        """Save a sharded checkpoint into the directory ``path`` (collective; every rank calls it).

        Saves the model, ``optimizer`` (built over :meth:`parameters`), the fp16 loss scale and
        ``extra`` (plain data from rank 0: a step count, scheduler.state_dict()...). Atomic: a
        save that fails on any rank raises CheckpointError on every rank and leaves the previous
        checkpoint in ``path`` as the one that loads. Keys are the original model's names with
        full shapes, so it loads into any pp/tp/dp layout. Returns the directory written.
        See [Note: checkpoint layout] in checkpoint.py.
        """
        self._monitor.arrive("save_checkpoint()")
        with self._monitor.guard(record=False):  # see [Note: no rank left waiting] in checkpoint.py
            return save_checkpoint(self, path, optimizer, extra=extra)

    def load_checkpoint(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Load the last complete checkpoint saved into ``path`` (collective); returns its ``extra``.

        ``optimizer`` gets its state and hyperparameters back (build it over :meth:`parameters`
        first). Raises CheckpointError naming the path and the mismatch if none fits.
        """
        self._monitor.arrive("load_checkpoint()")
        with self._monitor.guard(record=False):
            return load_checkpoint(self, path, optimizer)
