"""BatchNorm as one batch (autopipe/runtime/batchnorm.py, sync_batchnorm.py; docs/batchnorm.md).

The reference is one process. Each step it runs the samples of each normalisation group (a
micro-batch; under "sync" the same micro-batch of every dp replica together) through the unsplit
model with gradient accumulation, BatchNorm normalising over that group and keeping its running
statistics still; then every BatchNorm layer runs once, with torch's own forward, on all of its
inputs of the step concatenated: the update that one process running the whole batch through that
layer makes (mean, unbiased variance, momentum or cumulative average, num_batches_tracked). With
one group of the whole batch it is plain one-process training on that batch.

Everything is fp64 and compared at rtol = atol = 1e-10.
"""
from __future__ import annotations

import copy
import math
import tempfile
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import autopipe
from autopipe.errors import ConfigError
from tests.distributed import run_distributed
from tests.models import logits

STEPS = 3
RTOL = ATOL = 1e-10
DTYPE = torch.float64
_BN = nn.modules.batchnorm._BatchNorm


# ----------------------------------------------------------------------------- pieces
def resnet18(momentum: float | None = 0.1) -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(DTYPE)
    for m in model.modules():
        if isinstance(m, _BN):
            m.momentum = momentum
    return model


def batch(step: int, size: int, image: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 3, image, image, generator=g, dtype=DTYPE), torch.randint(0, 10, (size,), generator=g)


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits(out), y)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference(model: nn.Module, size: int, groups: Sequence[Sequence[int]] | None, steps: int = STEPS,
              per_step_updates: int = 1, image: int = 32) -> nn.Module:
    """See the module docstring; ``groups=None``: plain training on the whole batch.
    ``per_step_updates``: batches of ``size`` accumulated per optimizer step (no_sync)."""
    model.train()
    optimizer = _sgd(model.parameters())
    norms = [m for m in model.modules() if isinstance(m, _BN)]
    for step in range(steps):
        optimizer.zero_grad()
        for part in range(per_step_updates):
            x, y = batch(step * per_step_updates + part, size, image)
            if groups is None:
                (_loss(model(x), y) / per_step_updates).backward()
                continue
            seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in norms}
            hooks = [m.register_forward_pre_hook(lambda m, a: seen[m].append(a[0].detach())) for m in norms]
            for m in norms:
                m.track_running_stats = False
            for g in groups:
                (_loss(model(x[list(g)]), y[list(g)]) * len(g) / size / per_step_updates).backward()
            for h in hooks:
                h.remove()
            with torch.no_grad(), torch.random.fork_rng():
                for m in norms:
                    m.track_running_stats = True
                    m(torch.cat(seen[m]))
        optimizer.step()
    return model


def micro_batches(size: int, m: int, replicas: int = 1, sync: bool = False) -> list[list[int]]:
    """Sample indices of each normalisation group of a global batch of ``size``, replica r
    holding the r-th contiguous share, split into ``m`` micro-batches."""
    local, mb = size // replicas, size // replicas // m
    per = [[list(range(r * local + i * mb, r * local + (i + 1) * mb)) for i in range(m)] for r in range(replicas)]
    if sync:
        return [sum((per[r][i] for r in range(replicas)), []) for i in range(m)]
    return [g for groups in per for g in groups]


def excess(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (ATOL + RTOL |want|); <= 1 passes. Exact for integers."""
    if got.shape != want.shape:
        return math.inf
    if not want.is_floating_point():
        return 0.0 if torch.equal(got.cpu(), want.cpu()) else math.inf
    return float(((got.cpu() - want.cpu()).abs() / (ATOL + RTOL * want.cpu().abs())).max())


def compare(pm: Any, ref: nn.Module, size: int) -> dict:
    """This rank's worst state entry against ``ref`` (running statistics apart) and the eval
    outputs on a batch of ``size`` (None off the last stage)."""
    x_eval = batch(99, size)[0]
    want = ref.state_dict()
    worst = {"stats": (0.0, ""), "params": (0.0, "")}
    for stage in pm.stages.values():
        for k, v in stage.state_dict().items():
            kind = "stats" if "running_" in k or "num_batches" in k else "params"
            worst[kind] = max(worst[kind], (excess(v.detach(), want[k]), k))
    pm.eval()
    out = pm.eval_step(x_eval)
    ref.eval()
    with torch.no_grad():
        worst["eval"] = None if out is None else excess(logits(out), logits(ref(x_eval)))
    return worst


def check(result: dict, what: str) -> None:
    for kind in ("stats", "params"):
        ratio, key = result[kind]
        assert ratio <= 1.0, f"{what}: {key} differs from the reference by {ratio:.3g}x the tolerance"
    if result["eval"] is not None:
        assert result["eval"] <= 1.0, f"{what}: eval() outputs differ by {result['eval']:.3g}x the tolerance"


def train(pm: Any, size: int, steps: int = STEPS, first: int = 0, dp_rank: int = 0, dp: int = 1,
          optimizer: torch.optim.Optimizer | None = None, image: int = 32) -> None:
    pm.train()
    optimizer = optimizer or _sgd(pm.parameters())
    for step in range(first, first + steps):
        x, y = batch(step, size, image)
        local = slice(dp_rank * size // dp, (dp_rank + 1) * size // dp)
        optimizer.zero_grad()
        pm.train_step(x[local], y[local])
        pm.step(optimizer)


# ----------------------------------------------------------------------------- pp = 2
BATCH, M = 8, 4
PIPELINES = {  # name -> parallelize arguments past the model
    "1f1b": dict(schedule="1f1b"),
    "interleaved-chunks2": dict(schedule="interleaved_1f1b", chunks=2),
    "gpipe-checkpointing": dict(schedule="gpipe", activation_checkpointing=True),
}


def _parallelize(model: nn.Module, m: int, size: int, **kwargs: Any) -> Any:
    return autopipe.parallelize(model, (torch.zeros(size // m, 3, 32, 32, dtype=DTYPE),), microbatches=m,
                                loss_fn=_loss, deadline=120, **kwargs)


def _pipelines(rank: int, world: int, tmp: str) -> dict:
    deferred = reference(resnet18(), BATCH, micro_batches(BATCH, M))
    out = {}
    for name, kwargs in PIPELINES.items():
        pm = _parallelize(resnet18(), M, BATCH, pp=2, **kwargs)
        train(pm, BATCH)
        out[name] = compare(pm, deferred, BATCH)
    # momentum=None: the cumulative average over steps.
    pm = _parallelize(resnet18(None), M, BATCH, pp=2)
    train(pm, BATCH)
    out["momentum-none"] = compare(pm, reference(resnet18(None), BATCH, micro_batches(BATCH, M)), BATCH)
    # Today's per-micro-batch statistics stay available, and the reference tells them apart.
    pm = _parallelize(resnet18(), M, BATCH, pp=2, batchnorm="microbatch")
    train(pm, BATCH)
    out["microbatch"] = compare(pm, deferred, BATCH)
    out["microbatch-tracked"] = int(pm.full_state_dict()["bn1.num_batches_tracked"])
    # A checkpoint between steps holds the committed statistics; a run resumed from it (in
    # another layout) goes on as the uninterrupted run does.
    pm = _parallelize(resnet18(), M, BATCH, pp=2)
    optimizer = _sgd(pm.parameters())
    train(pm, BATCH, steps=2, optimizer=optimizer)
    pm.save_checkpoint(tmp, optimizer)
    resumed = _parallelize(resnet18(), M, BATCH, pp=2, schedule="interleaved_1f1b", chunks=2)
    optimizer = _sgd(resumed.parameters())
    resumed.load_checkpoint(tmp, optimizer)
    out["saved"] = compare_state(resumed.full_state_dict(),
                                 reference(resnet18(), BATCH, micro_batches(BATCH, M), steps=2))
    train(resumed, BATCH, steps=1, first=2, optimizer=optimizer)
    out["resumed"] = compare(resumed, deferred, BATCH)
    return out


def compare_state(state: dict[str, torch.Tensor], ref: nn.Module) -> float:
    want = ref.state_dict()
    return max(excess(v, want[k]) for k, v in state.items())


_RESULTS: dict[str, Any] = {}


def _world(name: str, fn: Callable, world: int) -> list:
    if name not in _RESULTS:
        try:
            with tempfile.TemporaryDirectory(prefix="autopipe-bn-") as tmp:
                _RESULTS[name] = run_distributed(fn, world, tmp, timeout=600)
        except Exception as exc:  # fail every test of the world once, not after one timeout each
            _RESULTS[name] = exc
    if isinstance(_RESULTS[name], Exception):
        raise _RESULTS[name]
    return _RESULTS[name]


@pytest.mark.parametrize("config", [*PIPELINES, "momentum-none"])
def test_deferred_statistics_equal_the_whole_batch(config: str) -> None:
    """pp=2, 4 micro-batches, 3 SGD steps: every running statistic, parameter and eval() output
    equals one process whose BatchNorm layers updated once per step from the whole batch."""
    for rank, result in enumerate(_world("pp2", _pipelines, 2)):
        check(result[config], f"rank {rank}, {config}")


def test_per_microbatch_statistics_stay_available_and_differ() -> None:
    for rank, result in enumerate(_world("pp2", _pipelines, 2)):
        assert result["microbatch"]["params"][0] <= 1.0  # normalisation is the same
        assert result["microbatch"]["stats"][0] > 1e4, "the reference does not tell the modes apart"
        assert result["microbatch-tracked"] == STEPS * M


def test_checkpoint_holds_committed_statistics_and_resumes() -> None:
    for rank, result in enumerate(_world("pp2", _pipelines, 2)):
        assert result["saved"] <= 1.0, f"rank {rank}: the checkpoint is not the state after 2 steps"
        check(result["resumed"], f"rank {rank}, resumed after 2 steps")


# ----------------------------------------------------------------------------- dp = 2
def _replicas(rank: int, world: int, tmp: str) -> dict:
    """world 4 = pp 2 x dp 2 (or world 2 = dp 2): sync and deferred statistics over replicas."""
    pp, dp_rank = world // 2, rank % 2
    size = 2 * BATCH  # normalisation groups of 4 samples amplify rounding past 1e-10 within 3 steps
    out = {}
    runs = [(resnet18, "sync", 2), (resnet18, "deferred", 2)]
    if pp == 1:
        runs += [(resnet18, "sync", 1), (timm_norm_act, "sync", 2)]
    for build, mode, m in runs:
        pm = _parallelize(build(), m, size // 2, pp=pp, batchnorm=mode)
        assert pm.dp_rank == dp_rank and pm.dp_size == 2
        train(pm, size, dp_rank=dp_rank, dp=2)
        groups = None if m == 1 else micro_batches(size, m, replicas=2, sync=mode == "sync")
        out[(build.__name__, mode, m)] = compare(pm, reference(build(), size, groups), size // 2)
    return out


@pytest.mark.parametrize("world,mode,m", [(2, "sync", 1), (2, "sync", 2), (2, "deferred", 2), (4, "sync", 2),
                                          (4, "deferred", 2)],
                         ids=["pp1-dp2-sync-m1-global-batch", "pp1-dp2-sync-m2", "pp1-dp2-deferred-m2",
                              "pp2-dp2-sync-m2", "pp2-dp2-deferred-m2"])
def test_statistics_over_data_parallel_replicas(world: int, mode: str, m: int) -> None:
    """dp=2, each replica half of a global batch of 16. sync, microbatches=1: exactly one process
    training on the global batch. sync, m=2: one process normalising micro-batch i of both
    replicas together. deferred: each replica's micro-batches alone. Running statistics are the
    global batch's in all three, and the replicas agree."""
    for rank, result in enumerate(_world(f"dp2-world{world}", _replicas, world)):
        check(result[("resnet18", mode, m)], f"rank {rank}, {mode}, microbatches={m}")


def test_sync_keeps_timm_batchnorm_act_activation() -> None:
    """timm's BatchNormAct2d under "sync" (pp=1, dp=2, 2 micro-batches): norm, then its activation."""
    for rank, result in enumerate(_world("dp2-world2", _replicas, 2)):
        check(result[("timm_norm_act", "sync", 2)], f"rank {rank}")


# ----------------------------------------------------------------------------- one process
def _one_process(build: Callable[[], nn.Module], m: int = 2, size: int = 8, **kwargs: Any) -> None:
    model = build()
    ref = reference(copy.deepcopy(model), size, micro_batches(size, m))
    pm = _parallelize(model, m, size, **kwargs)
    train(pm, size)
    check(compare(pm, ref, size), build.__name__)


def timm_norm_act() -> nn.Module:
    """timm's BatchNormAct2d: a BatchNorm2d subclass with a forward of its own."""
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), BatchNormAct2d(8), nn.Conv2d(8, 8, 3, stride=2),
                         BatchNormAct2d(8, act_layer=nn.GELU), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 10)).to(DTYPE)


def hf_resnet() -> nn.Module:
    """transformers' ResNet: nn.BatchNorm2d layers, traced by the torch.export route."""
    from tests.models import hf_resnet as build

    torch.manual_seed(0)
    return build().to(DTYPE)


class _ScaledNorm(nn.BatchNorm2d):
    """A subclass with a forward of its own (that honours track_running_stats): its statistics
    are collected by the forward pre-hook, not from the norm's own kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


def own_forward_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), _ScaledNorm(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                         nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).to(DTYPE)


@pytest.mark.parametrize("build", [timm_norm_act, hf_resnet, own_forward_norm],
                         ids=["timm-BatchNormAct2d", "transformers-resnet", "own-forward"])
def test_every_batchnorm_flavour_is_deferred(build: Callable[[], nn.Module]) -> None:
    _one_process(build, chunks=2, schedule="gpipe")


def test_eval_step_in_train_mode_leaves_the_statistics_alone() -> None:
    model = resnet18()
    pm = _parallelize(model, 2, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm.train()
    pm.eval_step(batch(0, 8)[0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # ...and leaves nothing behind for the next step to commit.
    train(pm, 8, steps=1)
    check(compare(pm, reference(resnet18(), 8, micro_batches(8, 2), steps=1), 8), "after eval_step")


def test_gradient_accumulation_commits_once_per_train_step() -> None:
    """Two train_step calls per optimizer step (no_sync): two updates, each from its own batch,
    as one process accumulating gradients over two whole batches."""
    pm = _parallelize(resnet18(), 2, 8)
    pm.train()
    optimizer = _sgd(pm.parameters())
    for step in range(2):
        optimizer.zero_grad()
        with pm.no_sync():
            pm.train_step(*batch(2 * step, 8), grad_scale=0.5)
        pm.train_step(*batch(2 * step + 1, 8), grad_scale=0.5)
        pm.step(optimizer)
    ref = reference(resnet18(), 8, micro_batches(8, 2), steps=2, per_step_updates=2)
    check(compare(pm, ref, 8), "no_sync")
    assert int(ref.state_dict()["bn1.num_batches_tracked"]) == 4


def test_a_failed_step_commits_nothing() -> None:
    model = resnet18()
    pm = _parallelize(model, 2, 8)
    pm.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batch(0, 8)
    with pytest.raises(IndexError, match="out of bounds"):
        pm.train_step(x, torch.full_like(y, 99))  # the loss fails after the first forward collected
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    train(pm, 8, steps=1)
    check(compare(pm, reference(resnet18(), 8, micro_batches(8, 2), steps=1), 8), "after a failure")


def test_compiled_stages_collect_inside_the_graph() -> None:
    """compile_stages=True with activation checkpointing: the collection compiles with the stage
    (no graph break) and the compiled recompute does not count."""
    import torch._dynamo

    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    _one_process(timm_norm_act, compile_stages=True, activation_checkpointing=True)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks


# ----------------------------------------------------------------------------- refusals
class _OwnUpdates(nn.BatchNorm2d):
    """Updates its running statistics whatever track_running_stats says."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                            0.1, self.eps)


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.conv(x), self.mean, self.var, training=True).mean((2, 3))


@pytest.mark.parametrize("model,kwargs,match", [
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), dict(batchnorm="global"),
     r"batchnorm='global'; use 'deferred'"),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4)), {},
     r"'1' is an nn.SyncBatchNorm.*pass batchnorm='sync'"),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), _OwnUpdates(4)), {},
     r"'1' \(_OwnUpdates\) updates its running statistics in train\(\) even with track_running_stats=False"),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), _OwnUpdates(4)), dict(batchnorm="sync"),
     r"'1' \(_OwnUpdates\) has a forward of its own"),
    (_Functional, {}, r"(?s)node 'batch_norm' \(in module ''\) calls batch_norm in training mode.*batchnorm='microbatch'"),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), dict(batchnorm="sync", cuda_graphs=True),
     r"batchnorm='sync' with cuda_graphs=True"),
], ids=["unknown-mode", "sync-batchnorm-module", "own-updates", "sync-own-forward", "functional", "sync-graphs"])
def test_what_cannot_be_deferred_is_refused(model: Callable[[], nn.Module], kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        autopipe.parallelize(model(), (torch.zeros(2, 3, 8, 8),), microbatches=1, loss_fn=_loss, **kwargs)


_ATEN = torch.ops.aten


@pytest.mark.parametrize("op,stats,tail,refused", [
    (_ATEN._native_batch_norm_legit.default, True, (True, 0.1, 1e-5), True),
    (_ATEN._native_batch_norm_legit.default, True, (False, 0.1, 1e-5), False),
    (_ATEN._native_batch_norm_legit.no_stats, False, (True, 0.1, 1e-5), False),
    (_ATEN._native_batch_norm_legit_no_training.default, True, (0.1, 1e-5), False),
    (_ATEN._batch_norm_with_update.default, True, (0.1, 1e-5), True),
    (_ATEN._batch_norm_no_update.default, True, (0.1, 1e-5), False),
    (_ATEN.batch_norm.default, True, (True, 0.1, 1e-5, False), True),
], ids=["legit-training", "legit-eval", "legit-no-stats", "legit-no-training", "with-update", "no-update",
        "batch-norm"])
def test_aten_batch_norms_that_update_running_statistics_are_refused(op: Any, stats: bool, tail: tuple,
                                                                      refused: bool) -> None:
    """What torch.export leaves where a batch norm is not a module call: a graph of ATen ops."""
    import torch.fx as fx

    from autopipe.runtime.batchnorm import check_batchnorm

    root = nn.Module()
    root.register_buffer("mean", torch.zeros(4))
    root.register_buffer("var", torch.ones(4))
    graph = fx.Graph()
    x = graph.placeholder("x")
    running = (graph.get_attr("mean"), graph.get_attr("var")) if stats else ()
    graph.output(graph.call_function(op, (x, None, None, *running, *tail)))
    gm = fx.GraphModule(root, graph)
    if refused:
        with pytest.raises(ConfigError, match=rf"calls {op._schema.name.split('::')[1]} in training mode"):
            check_batchnorm(gm, "deferred")
    else:
        check_batchnorm(gm, "deferred")
    check_batchnorm(gm, "microbatch")


def test_refused_models_run_with_per_microbatch_statistics() -> None:
    for build in (_Functional, lambda: nn.Sequential(nn.Conv2d(3, 4, 3), _OwnUpdates(4))):
        pm = autopipe.parallelize(build(), (torch.zeros(2, 3, 8, 8),), microbatches=1, loss_fn=_loss,
                                  batchnorm="microbatch")
        pm.train().eval_step(torch.randn(2, 3, 8, 8))


# ----------------------------------------------------------------------------- CUDA graphs
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batchnorm", ["deferred", "microbatch"])
def test_cuda_graphs_collect_once_per_micro_batch(batchnorm: str) -> None:
    """Capture's warm-up passes leave no trace; each replayed forward collects (or updates) once."""
    states = {}
    for graphs in (False, True):
        model = resnet18()
        pm = autopipe.parallelize(model, (torch.zeros(2, 3, 32, 32, dtype=DTYPE),), microbatches=4, chunks=2,
                                  schedule="gpipe", loss_fn=_loss, device="cuda", cuda_graphs=graphs,
                                  batchnorm=batchnorm)
        train(pm, 8)
        states[graphs] = {k: v.cpu() for k, v in pm.full_state_dict().items()}
    # The eager and the graphed run differ in float64 rounding (layer4 only, measured on an
    # H100 with torch 2.11): up to ~3e-9 of a statistic's largest value after 8 steps, on
    # elements of any size (so the bound is relative to the largest). A warm-up or capture pass that counted, or
    # a forward that collected twice, moves them by a fraction of the momentum (0.1): 1e-3 or more.
    def off(k: str, v: torch.Tensor) -> float:
        return float((states[True][k].double() - v.double()).abs().max())

    differing = [f"{k}: max |difference| {off(k, v):.3g} (eager {float(v.double().abs().max()):.3g})"
                 for k, v in states[False].items() if ("running_" in k or "num_batches" in k)
                 and off(k, v) > 1e-6 * float(v.double().abs().max()) + 1e-12]
    assert not differing, "statistics that CUDA graphs changed:\n" + "\n".join(differing)


# ----------------------------------------------------------------------------- the collection's kernels
def _moments_cases(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    cases = []
    for shape in [(6, 5), (4, 8, 5, 7), (2, 3, 4, 5, 6)]:
        x = torch.randn(*shape, generator=g) * 3 + torch.arange(shape[1]).view(1, -1, *[1] * (len(shape) - 2))
        center = torch.randn(shape[1], generator=g)  # a running mean, off the batch's
        cases.append((x.to(device), center.to(device)))
    return cases


def _check_moments(x: torch.Tensor, center: torch.Tensor, rtol: float) -> None:
    from autopipe.runtime.batchnorm import _shifted_moments

    shift, var = _shifted_moments(x, center)
    ref_var, ref_mean = torch.var_mean(x.double(), dim=[0, *range(2, x.dim())], correction=0)
    assert shift.dtype == var.dtype == center.dtype
    torch.testing.assert_close(shift.double(), ref_mean - center.double(), rtol=rtol, atol=rtol)
    torch.testing.assert_close(var.double(), ref_var, rtol=rtol, atol=rtol)


def test_collected_moments_equal_the_batchs_mean_and_variance() -> None:
    for x, center in _moments_cases("cpu"):
        _check_moments(x, center, 1e-5)
        _check_moments(x.double(), center.double(), 1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel needs a GPU")
def test_collected_moments_on_cuda_in_every_dtype_and_layout() -> None:
    for x, center in _moments_cases("cuda"):
        _check_moments(x, center, 1e-5)
        _check_moments(x.double(), center.double(), 1e-9)
        if x.dim() == 4:
            _check_moments(x.contiguous(memory_format=torch.channels_last), center, 1e-5)
            low = x.bfloat16()  # the statistics of the bf16 values, accumulated in fp32
            from autopipe.runtime.batchnorm import _shifted_moments

            shift, var = _shifted_moments(low, center)
            ref_var, ref_mean = torch.var_mean(low.double(), dim=[0, 2, 3], correction=0)
            torch.testing.assert_close(shift.double(), ref_mean - center.double(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(var.double(), ref_var, rtol=1e-4, atol=1e-4)


def _per_layer_commit(m: nn.modules.batchnorm._BatchNorm, sums: torch.Tensor, counts: torch.Tensor) -> None:
    """torch's momentum rule applied to one layer on its own: the arithmetic [Note: one commit
    for every layer] runs over every layer at once."""
    (s1, s2, v), (k, n) = sums, counts
    k = k.clamp_min(1)
    shift = s1 / k
    mean, var = m.running_mean + shift, (v / k + s2 / k - shift * shift).clamp_min(0)
    var = var * n / (n - 1).clamp_min(1)
    m.num_batches_tracked.add_(1)
    f = m.momentum if m.momentum is not None else 1.0 / m.num_batches_tracked.to(mean.dtype)
    m.running_mean.mul_(1 - f).add_(mean * f)
    m.running_var.mul_(1 - f).add_(var * f)


def test_one_commit_for_every_layer_gives_each_layers_own_rule_to_the_bit() -> None:
    from autopipe.runtime.batchnorm import _COUNTS, _SUMS, BatchNormStats

    torch.manual_seed(0)
    norms = [nn.BatchNorm2d(3, momentum=0.1), nn.BatchNorm2d(5, momentum=None), nn.BatchNorm1d(4, momentum=0.3),
             nn.BatchNorm2d(2)]
    for m in norms:
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 2)
        m.num_batches_tracked.fill_(3)
    norms[3].eval()  # frozen: keeps its statistics
    stats = BatchNormStats(norms, None, 1)
    stats.collecting = True
    with torch.no_grad():
        for _ in range(3):  # three micro-batches
            for m in norms:
                m(torch.randn(6, m.num_features, *((4, 4) if isinstance(m, nn.BatchNorm2d) else ())) * 3 + 1)
    stats.collecting = False
    before = [m.running_mean.clone() for m in norms]
    expected = copy.deepcopy(norms)
    for m, e in zip(norms, expected):
        if m.training:
            _per_layer_commit(e, getattr(m, _SUMS), getattr(m, _COUNTS))
    stats.commit()
    for m, e in zip(norms, expected):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(m, name), getattr(e, name)), (m, name)
        assert not getattr(m, _SUMS).any() and not getattr(m, _COUNTS).any()
    assert [not torch.equal(m.running_mean, b) for m, b in zip(norms, before)] == [True, True, True, False]
