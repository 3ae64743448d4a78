"""BatchNorm as one batch: running statistics over the whole mini-batch, committed once per step.

[Note: deferred batch norm]
A pipeline stage sees one micro-batch at a time. torch's BatchNorm would update its running
statistics once per micro-batch, ``m`` momentum steps of ``B / m`` samples each. With
``batchnorm="deferred"`` (the default) each tracked BatchNorm layer of a stage instead
* normalises with the micro-batch's statistics, as before: ``track_running_stats`` is set to
  False, which makes torch's forward (and timm's ``BatchNormAct2d``, a copy of it) use batch
  statistics and leave the buffers alone in train(), and still use the running statistics in
  eval();
* collects the micro-batch's per-channel mean and biased variance (from the norm's own kernel,
  see [Note: statistics from the norm's own kernel], or in a forward pre-hook) into
  preallocated buffers (``autopipe_sums``: the sums over micro-batches of ``mean - running_mean``,
  of its square and of the variance; ``autopipe_counts``: micro-batches and elements). Only
  in-place tensor ops, so a CUDA graph replays them and a compiled stage keeps them in its graph;
* at the end of ``train_step`` (``BatchNormStats.commit``, every layer at once: [Note: one
  commit for every layer] in batchnorm_commit.py), combines them into the mean and the
  unbiased variance of the whole mini-batch, gathers them over the dp replicas (one all-gather
  per step, combined by sample counts as in Chan's parallel variance), and updates
  ``running_mean``, ``running_var`` and ``num_batches_tracked`` once, with torch's momentum
  rule (``momentum=None``: the cumulative average).
The result is what one process computes if every BatchNorm layer updates its running statistics
from its inputs of the whole global batch at once, while its outputs are normalised per
micro-batch. Shifting by the running mean (fixed during a step) keeps the sums of squares small,
so fp32 loses nothing to cancellation; the buffers are non-persistent: never in a checkpoint,
and zero between steps.

What must not count: ``eval_step`` (collection is on only inside ``train_step``), the recompute of
activation checkpointing (``paused()``, entered by the recompute's context), the warm-up passes of
compiled stages and of CUDA graph capture (both restore every buffer of the stage afterwards). A
step that fails discards what it collected.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopipe.errors import ConfigError
from autopipe.graph import MODULE_KEY
from autopipe.runtime.batchnorm_commit import commit_statistics
from autopipe.runtime.sync_batchnorm import synchronise

__all__ = ["MODES", "BatchNormStats", "check_batchnorm"]

MODES = ("deferred", "sync", "microbatch")
_SUMS, _COUNTS, _BATCH, _HOOK = "autopipe_sums", "autopipe_counts", "autopipe_batch", "_autopipe_hook"

def _is_tracked(m: nn.Module) -> bool:
    """A BatchNorm layer that keeps running statistics (or kept them before an earlier install)."""
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None \
        and (m.track_running_stats or hasattr(m, _HOOK))


def tracked_norms(modules: Iterable[nn.Module]) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers among ``modules`` that keep running statistics, each once."""
    out, seen = [], set()
    for m in modules:
        if _is_tracked(m) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def _uninstall(m: nn.modules.batchnorm._BatchNorm) -> None:
    """Undo an earlier install on ``m`` (the model was parallelized before): its own forward,
    per-micro-batch updates, no collection."""
    if hasattr(m, _HOOK):
        handle = getattr(m, _HOOK)
        if handle is not None:
            handle.remove()
        delattr(m, _HOOK)
    m.__dict__.pop("forward", None)
    m.track_running_stats = True


# ----------------------------------------------------------------------------- checks
def check_batchnorm(gm: fx.GraphModule | None, mode: str, *, cuda_graphs: bool = False) -> None:
    """Raise ConfigError where ``mode`` cannot hold for the traced model ``gm`` (None: check the
    option alone). Every rank holds the whole graph, so every rank raises the same error."""
    if mode not in MODES:
        raise ConfigError(f"batchnorm={mode!r}; use 'deferred' (running statistics of the whole batch, the "
                          "default), 'sync' (normalise over the dp replicas too) or 'microbatch' (per "
                          "micro-batch, as each stage computes by itself); see docs/batchnorm.md")
    if mode == "sync" and cuda_graphs:
        raise ConfigError("batchnorm='sync' with cuda_graphs=True: stages with collectives inside are not "
                          "captured; use batchnorm='deferred' or cuda_graphs=False")
    if mode == "microbatch" or gm is None:
        return
    problems, honours = [], {}
    for name, m in gm.named_modules():
        if isinstance(m, nn.SyncBatchNorm):
            problems.append(f"'{name}' is an nn.SyncBatchNorm, whose collectives span its own process group "
                            "(the world by default) while the pipeline ranks run other stages: keep the "
                            "model's nn.BatchNorm layers and pass batchnorm='sync'")
        elif _is_tracked(m):
            problem = _unsupported(m, mode, honours)
            if problem:
                problems.append(f"'{name}' ({type(m).__name__}) {problem}")
    for node in gm.graph.nodes:
        if _updates_running_stats(node):
            problems.append(f"node '{node.name}' (in module '{node.meta.get(MODULE_KEY, '')}') calls "
                            f"{_op_name(node)} in training mode on running statistics of its own, not through "
                            "a BatchNorm module: compute it with an nn.BatchNorm module")
    if problems:
        fallback = "" if all("SyncBatchNorm" in p for p in problems) else \
            "\nOr pass batchnorm='microbatch' (running statistics updated per micro-batch)"
        raise ConfigError(f"batchnorm={mode!r} cannot keep the running statistics of this model:\n"
                          + "\n".join(f"  - {p}" for p in problems) + fallback)


def _op_name(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(node.target, "__name__", str(node.target))


def _arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _updates_running_stats(node: fx.Node) -> bool:
    """A functional batch norm that updates running statistics: ``F.batch_norm`` or
    ``torch.batch_norm`` with ``training=True``, or an ATen batch-norm op (torch.export's
    ``_native_batch_norm_legit``, ``_batch_norm_with_update``...) in training on running statistics."""
    if node.op != "call_function":
        return False
    if node.target is torch.nn.functional.batch_norm:
        where, default = {"running_mean": 1, "training": 5}, False
    elif node.target is torch.batch_norm:
        where, default = {"running_mean": 3, "training": 5}, False
    else:
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None and "batch_norm" in schema.name else []
        if "running_mean" not in names:
            return False  # not a batch norm, or one without running statistics (no_stats)
        if "training" not in names:  # _batch_norm_with_update updates, *_no_update and *_no_training do not
            return "with_update" in schema.name and _arg(node, names.index("running_mean"), "running_mean") is not None
        where, default = {n: names.index(n) for n in ("running_mean", "training")}, True
    training = _arg(node, where["training"], "training", default)
    return _arg(node, where["running_mean"], "running_mean") is not None and training is not False


def _unsupported(m: nn.Module, mode: str, honours: dict[type, bool]) -> str | None:
    """Why ``m`` cannot be deferred (or synchronised), or None. ``honours`` caches the probe by class."""
    own = type(m).forward is not nn.modules.batchnorm._BatchNorm.forward
    if mode == "sync" and own and not _is_timm_norm_act(m):
        return ("has a forward of its own, which batchnorm='sync' cannot reproduce (it handles torch's "
                "BatchNorm layers and timm's BatchNormAct2d); use batchnorm='deferred'")
    if own and type(m) not in honours:
        honours[type(m)] = _honours_track_running_stats(m)
    if own and not honours[type(m)]:
        return ("updates its running statistics in train() even with track_running_stats=False, so they "
                "cannot be deferred")
    return None


def _is_timm_norm_act(m: nn.Module) -> bool:
    return type(m).__name__ == "BatchNormAct2d" and type(m).__module__.startswith("timm.") \
        and hasattr(m, "act") and hasattr(m, "drop")


def _honours_track_running_stats(m: nn.Module) -> bool:
    """Run a copy of a BatchNorm subclass with its own forward (timm's BatchNormAct2d...) in train()
    with ``track_running_stats=False``: its buffers must stay as they were."""
    like = m.running_mean
    if like.device.type == "meta":
        return True
    probe = copy.deepcopy(m).train()
    probe.track_running_stats = False
    before = [b.clone() for b in probe.buffers()]
    devices = [like.device.index if like.device.index is not None else torch.cuda.current_device()] \
        if like.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):  # its dropout draws nothing the run would
        for rank in (4, 3, 5, 2):  # BatchNorm2d first: the common case
            try:
                probe(torch.randn(2, like.numel(), *[2] * (rank - 2), dtype=like.dtype).to(like.device))
                break
            except (ValueError, RuntimeError, AssertionError):
                continue
        else:
            return True  # no input it accepts: nothing to learn, and its own forward raises in training
    return all(torch.equal(a, b) for a, b in zip(before, probe.buffers()))


# ----------------------------------------------------------------------------- the statistics
class BatchNormStats:
    """The deferred running statistics of one rank's BatchNorm layers; see [Note: deferred batch norm].

    Build it with :meth:`install`. ``train_step`` runs inside :meth:`step`; the recompute of
    activation checkpointing inside :meth:`paused`.
    """

    def __init__(self, norms: Sequence[nn.modules.batchnorm._BatchNorm], dp_group: dist.ProcessGroup | None,
                 dp: int, *, own_kernel: bool = True) -> None:
        self.norms = list(norms)
        self.dp_group, self.dp = dp_group, dp
        self.collecting = False
        for m in self.norms:
            like = m.running_mean
            m.register_buffer(_SUMS, torch.zeros(3, like.numel(), dtype=like.dtype, device=like.device),
                              persistent=False)
            m.register_buffer(_COUNTS, torch.zeros(2, dtype=like.dtype, device=like.device), persistent=False)
            m.track_running_stats = False  # normalise per micro-batch, leave the buffers to commit()
            if own_kernel and _plain_forward(m):  # see [Note: statistics from the norm's own kernel]
                m.register_buffer(_BATCH, torch.zeros(2, like.numel(), dtype=like.dtype, device=like.device),
                                  persistent=False)
                m.forward = functools.partial(_collecting_forward, self, m, m.forward)
                setattr(m, _HOOK, None)
            else:
                setattr(m, _HOOK, m.register_forward_pre_hook(self._collect))

    @classmethod
    def install(cls, stages: Iterable[nn.Module], mode: str, dp_group: dist.ProcessGroup | None = None,
                dp: int = 1) -> BatchNormStats | None:
        """Defer the running statistics of the BatchNorm layers of ``stages`` (and, for
        ``mode="sync"`` with dp > 1, normalise them over ``dp_group``); None for "microbatch" or
        where the stages hold no BatchNorm layer that tracks running statistics. Call it on
        stages already on their device, after :func:`check_batchnorm` passed."""
        norms = tracked_norms(m for stage in stages for m in stage.modules())
        for m in norms:
            _uninstall(m)
        if mode == "microbatch" or not norms:
            return None
        if mode == "sync" and dp > 1:
            for m in norms:
                synchronise(m, dp_group)
        return cls(norms, dp_group, dp, own_kernel=mode == "deferred")

    # ------------------------------------------------------------------------- collection
    def _collect(self, module: nn.modules.batchnorm._BatchNorm, args: tuple) -> None:
        if not (self.collecting and module.training):
            return
        sums, counts = getattr(module, _SUMS), getattr(module, _COUNTS)
        x = args[0]
        with torch.no_grad():
            shift, var = _shifted_moments(x.detach(), module.running_mean)
            sums[0].add_(shift)
            sums[1].addcmul_(shift, shift)
            sums[2].add_(var)
            counts[0].add_(1)
            counts[1].add_(x.numel() // x.shape[1])

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Collect during one ``train_step``; commit at its end, discard if it fails."""
        self.collecting = True
        try:
            yield
        except BaseException:
            self.collecting = False
            self.discard()
            raise
        self.collecting = False
        self.commit()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A forward that must not count (the recompute of a checkpointed stage)."""
        previous, self.collecting = self.collecting, False
        try:
            yield
        finally:
            self.collecting = previous

    @torch.no_grad()
    def discard(self) -> None:
        for m in self.norms:
            getattr(m, _SUMS).zero_()
            getattr(m, _COUNTS).zero_()

    # ------------------------------------------------------------------------- commit
    def commit(self) -> None:
        """Fold what the step collected into the running statistics (collective over dp), every
        layer at once: see [Note: one commit for every layer] in batchnorm_commit.py."""
        commit_statistics(self.norms, _SUMS, _COUNTS, self.dp_group, self.dp)


# [Note: statistics from the norm's own kernel]
# Computing a micro-batch's statistics a second time (a reduction over the input, then a dozen
# small kernels to fold them in) cost ResNet-50 on one H200 (bf16, 4 micro-batches of 32) 36% of
# an eager step and 32% with CUDA graphs over per-micro-batch norms (benchmarks/batchnorm_cost.py):
# 53 norms x 4 micro-batches of kernel launches; this way, 21% and 7%. The batch norm's own training kernel already reduces its
# input and can write the result: a layer of torch's BatchNorm classes (or timm's
# BatchNormAct2d) runs, while collecting, as ``F.batch_norm`` with running statistics of its own
# (``autopipe_batch``, momentum 1: the kernel leaves the micro-batch's mean and unbiased variance
# there) and the same output; four small in-place ops fold them into the sums. Other BatchNorm
# subclasses keep a forward pre-hook that computes the statistics itself (``_shifted_moments``).


def _plain_forward(m: nn.Module) -> bool:
    """Whether ``m`` computes what ``F.batch_norm`` (then timm's drop and activation) does."""
    return "forward" not in m.__dict__ and (type(m).forward is nn.modules.batchnorm._BatchNorm.forward
                                            or _is_timm_norm_act(m))


def _collecting_forward(stats: BatchNormStats, m: nn.modules.batchnorm._BatchNorm, original: object,
                        x: torch.Tensor) -> torch.Tensor:
    if not m.training:
        return original(x)  # type: ignore[operator]
    # In training the same ops run whether collecting or not: a checkpointed stage's
    # recomputation (not collecting) must save what its first forward saved.
    m._check_input_dim(x)
    batch = getattr(m, _BATCH)
    y = F.batch_norm(x, batch[0], batch[1], m.weight, m.bias, True, 1.0, m.eps)
    if type(m).forward is not nn.modules.batchnorm._BatchNorm.forward:  # timm's BatchNormAct2d
        y = m.act(m.drop(y))
    if not stats.collecting:
        return y
    with torch.no_grad():
        n = x.numel() // x.shape[1]
        sums, counts = getattr(m, _SUMS), getattr(m, _COUNTS)
        shift = batch[0] - m.running_mean
        sums[0].add_(shift)
        sums[1].addcmul_(shift, shift)
        sums[2].add_(batch[1], alpha=(n - 1) / n)  # the biased variance
        counts[0].add_(1)
        counts[1].add_(n)
    return y


def _shifted_moments(x: torch.Tensor, center: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (dim 1) of ``x``: its mean less ``center``, and its biased variance, in
    ``center``'s dtype, by the faster exact kernels of the device (benchmarks/batchnorm_cost.py):
    * CUDA: ``torch.var_mean`` over ``x`` in ``center``'s dtype (0.18 ms for 32 x 64 x 112 x 112
      bf16 on an H200, where SyncBatchNorm's ``torch.batch_norm_stats`` took 0.34);
    * CPU: sums of ``x - center`` (the shift keeps the squares small, see [Note: deferred batch
      norm]); ``torch.var_mean`` took longer than the batch norm's own forward and backward
      (one thread, 8 x 64 x 16 x 16: 0.73 ms against 0.63; the sums 0.07).
    """
    dims = [0, *range(2, x.dim())]
    if x.is_cuda:
        var, mean = torch.var_mean(x.to(center.dtype), dim=dims, correction=0)
        return mean - center, var
    d = x - center.view(1, -1, *[1] * (x.dim() - 2))  # in center's (fp32) dtype
    n = d.numel() // d.shape[1]
    shift = d.sum(dims) / n
    return shift, (d.square().sum(dims) / n - shift * shift).clamp_min(0)
