"""Pipelined real models train exactly like one process running the same micro-batches.

``autopipe.parallelize`` (pp only, tp = 1) cuts a small timm ViT, a torchvision ResNet-18 and a
transformers ViT into ``pp * chunks`` stages; every valid (pp, chunks, schedule, optimizer)
then takes 3 optimizer steps on a batch of 8 in 4 micro-batches. The reference runs in this
process: the unsplit model, the same 4 micro-batches, ``(loss_mb / 4).backward()`` each
(gradient accumulation), then one optimizer step. After 3 steps every parameter and buffer
must agree within 1e-5 relative (atol 1e-6), the returned losses must be the reference's, and
the forward-only schedule (``eval_step`` after ``pm.eval()``) must give the reference model's
eval outputs.

Precision. Everything is compared in fp32, AdamW included. Pipelining alone does not reorder
any arithmetic: each stage runs the same micro-batches through the same kernels as the
reference, and gradients accumulate over micro-batches in the same order, so even AdamW, which
turns rounding-sized gradients (attention key biases) into lr-sized steps, agrees. (With tp > 1
partial sums are added in another order; tests/test_api.py compares AdamW in fp64 there.) The
ViTs drop their qkv bias for AdamW (``ADAMW_MODELS``), as in tests/test_api.py.

Modes. The parameter comparison runs in eval() (dropout off, BatchNorm on running stats). The
BatchNorm test trains the ResNet in train(): a pipeline stage only ever sees one micro-batch,
so BatchNorm normalises with per-micro-batch statistics and updates its running stats once
per micro-batch (m times per step). Its reference does the same, one micro-batch at a time in
train(); parameters AND running_mean / running_var / num_batches_tracked are compared. It runs
with ``batchnorm="microbatch"`` (deferred statistics, the default, are tests/test_batchnorm.py's).
See docs/batchnorm.md. The dropout test checks that ``pm.train()`` / ``pm.eval()`` reach the
dropout of every stage.

Valid schedules (``autopipe.runtime.schedule.validate``): with chunks = 1, gpipe, 1f1b and
interleaved_1f1b (which then is 1f1b); with chunks = 2, gpipe (chunk-major) and
interleaved_1f1b. 1f1b with chunks > 1 is invalid by design (one chunk per rank) and must
raise ScheduleError before any collective.

Speed (2 shared cores): one gloo world of 2 processes and one of 4; each rank loops over all its
configurations in-process, compares its own stages with the references (computed once here,
handed over in a file) and returns a few numbers per configuration; the parametrized tests
read them from a module-level cache. A world that fails fails each of its tests once.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
import traceback
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.errors import ScheduleError
from tests.distributed import run_distributed
from tests.models import ADAMW_MODELS, MODELS, logits, timm_vit

__all__: list[str] = []

STEPS, BATCH, M = 3, 8, 4  # micro-batches of 2
DTYPE = torch.float32  # every comparison, AdamW included: see "Precision" above
RTOL, ATOL = 1e-5, 1e-6
MODEL_NAMES = ("timm_vit", "tv_resnet", "hf_vit")
OPTIMIZERS = ("sgd", "adamw")
# Every (chunks, schedule) that validate() accepts; (2, "1f1b") is invalid by design.
SCHEDULES = ((1, "gpipe"), (1, "1f1b"), (1, "interleaved_1f1b"), (2, "gpipe"), (2, "interleaved_1f1b"))
INVALID = ((2, "1f1b"),)
PPS = (2, 4)
TIMEOUT = {2: 300, 4: 480}


# ----------------------------------------------------------------------------- configurations
def param_configs(pp: int) -> list[tuple]:
    """("params", pp, model, chunks, schedule, optimizer): everything, for both pp."""
    return [("params", pp, name, c, s, o) for name in MODEL_NAMES for c, s in SCHEDULES for o in OPTIMIZERS]


def bn_configs(pp: int) -> list[tuple]:
    """("bn", pp, "tv_resnet", chunks, schedule, "sgd"): train-mode BatchNorm, fp32 SGD."""
    return [("bn", pp, "tv_resnet", c, s, "sgd") for c, s in SCHEDULES]


def dropout_configs(pp: int) -> list[tuple]:
    return [("dropout", pp, "timm_vit_dropout", 2, "interleaved_1f1b", "-")] if pp == 2 else []


def configs(pp: int) -> list[tuple]:
    return param_configs(pp) + bn_configs(pp) + dropout_configs(pp)


def cfg_id(cfg: tuple) -> str:
    kind, pp, name, chunks, schedule, opt = cfg
    return f"pp{pp}-v{chunks}-{schedule}-{name}-{opt}"


# ----------------------------------------------------------------------------- shared pieces
def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits(out), y)


def _build(name: str, opt: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "timm_vit_dropout":
        return timm_vit(drop_rate=0.3, pos_drop_rate=0.3, proj_drop_rate=0.3, attn_drop_rate=0.3)
    model = (ADAMW_MODELS if opt == "adamw" and name in ADAMW_MODELS else MODELS)[name]()
    return model.to(DTYPE)


def _optimizer(opt: str, params: Any) -> torch.optim.Optimizer:
    if opt == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _data(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 10, (BATCH,), generator=g)


EVAL_STEP = 99  # the batch eval_step runs on


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Like the ranks (tests/distributed.py): kernels sum in another order with more threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference(name: str, opt: str, train: bool, per_microbatch: bool = True) -> dict:
    """The unsplit model: 3 steps of gradient accumulation over the same micro-batches.

    ``train`` runs it in train() (BatchNorm on batch statistics); ``per_microbatch=False``
    instead runs the whole batch of 8 at once, which is what single-process training does and
    what a pipeline does NOT compute for BatchNorm in train() (see docs/batchnorm.md).
    """
    with one_thread():
        model = _build(name, opt).train(train)
        optimizer = _optimizer(opt, model.parameters())
        losses = []
        for step in range(STEPS):
            x, y = _data(step, DTYPE)
            optimizer.zero_grad()
            if per_microbatch:
                total = 0.0
                for xm, ym in zip(x.chunk(M), y.chunk(M)):
                    loss = _loss(model(xm), ym)
                    (loss / M).backward()
                    total += loss.item() / M
            else:
                loss = _loss(model(x), y)
                loss.backward()
                total = loss.item()
            optimizer.step()
            losses.append(total)
        model.eval()
        with torch.no_grad():
            out = logits(model(_data(EVAL_STEP, DTYPE)[0]))
        return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "eval": out}


def _ref_key(cfg: tuple) -> tuple[str, str, bool]:
    kind, _, name, _, _, opt = cfg
    return name, opt, kind == "bn"


def excess(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want| / (ATOL + RTOL |want|), max |got - want|); <= 1 passes. Exact for ints."""
    if got.shape != want.shape:
        return math.inf, math.inf
    if not want.is_floating_point():
        return (0.0, 0.0) if torch.equal(got, want) else (math.inf, math.inf)
    err = (got.double() - want.double()).abs()
    if err.numel() == 0:
        return 0.0, 0.0
    return float((err / (ATOL + RTOL * want.double().abs())).max()), float(err.max())


# ----------------------------------------------------------------------------- one rank
def _dropout_run(pm: Any) -> dict:
    """train()/eval() must reach every stage's dropout; eval outputs are deterministic."""
    fired: dict[int, list[bool]] = {}
    hooks = []
    for s, stage in pm.stages.items():
        fired[s] = []
        for mod in stage.modules():
            if isinstance(mod, nn.Dropout) and mod.p > 0:
                hooks.append(mod.register_forward_hook(
                    lambda m, args, out, s=s: fired[s].append(not torch.equal(args[0], out))))
    x = _data(EVAL_STEP, torch.float32)[0]
    runs: dict[str, Any] = {}
    for mode in ("eval", "train"):
        pm.train(mode == "train")
        flags = {mod.training for stage in pm.stages.values() for mod in stage.modules()}
        for s in fired:
            fired[s].clear()
        a, b = pm.eval_step(x), pm.eval_step(x)
        runs[mode] = {
            "flags": sorted(flags),
            "fired": {s: (len(f), sum(f)) for s, f in fired.items()},  # (calls, calls that dropped)
            "outputs": None if a is None else (logits(a), logits(b)),
        }
    for h in hooks:
        h.remove()
    if pm.is_last_stage:
        with torch.no_grad():
            runs["reference"] = logits(_build("timm_vit_dropout", "-").eval()(x))
    return runs


def _run_config(rank: int, pp: int, cfg: tuple, refs: dict) -> dict:
    kind, _, name, chunks, schedule, opt = cfg
    dtype = DTYPE
    model = _build(name, opt).eval()
    pm = autopipe.parallelize(model, (torch.zeros(BATCH // M, 3, 32, 32, dtype=dtype),), pp=pp,
                              chunks=chunks, schedule=schedule, microbatches=M, loss_fn=_loss, deadline=120,
                              batchnorm="microbatch")
    if kind == "dropout":
        return {"dropout": _dropout_run(pm)}
    pm.train(kind == "bn")  # parameters: dropout-free eval(); bn: per-micro-batch statistics
    optimizer = _optimizer(opt, pm.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _data(step, dtype)
        optimizer.zero_grad()
        loss = pm.train_step(x, y)
        pm.step(optimizer)
        losses.append(float(loss))
    ref = refs[_ref_key(cfg)]
    worst = (0.0, 0.0, "")
    keys = []
    for stage in pm.stages.values():
        for key, value in stage.state_dict().items():
            keys.append(key)
            ratio, err = excess(value.detach(), ref["state"][key])
            worst = max(worst, (ratio, err, key))
    full = None
    if kind == "bn" and schedule == "interleaved_1f1b" and chunks == 2:
        # Once per world: the checkpoint path (a collective) carries the running stats too.
        state = pm.full_state_dict()
        full = (sorted(state) == sorted(ref["state"]),
                max((excess(v, ref["state"][k]) + (k,) for k, v in state.items()), default=None))
    pm.eval()
    out = pm.eval_step(_data(EVAL_STEP, dtype)[0])
    eval_excess = None if out is None else excess(logits(out), ref["eval"])
    return {"losses": losses, "keys": keys, "worst": worst, "eval": eval_excess, "full": full,
            "stages": sorted(pm.stages), "last": pm.is_last_stage}


def world_worker(rank: int, world: int, ref_path: str) -> list[dict]:
    refs = torch.load(ref_path, mmap=True, weights_only=True)
    refs = {tuple(k.split("|")[:2]) + (k.endswith("|bn"),): v for k, v in refs.items()}
    results = []
    for cfg in configs(world):
        try:
            results.append(_run_config(rank, world, cfg, refs))
        except Exception:  # noqa: BLE001 - the peers failed too (failure propagation); go on
            results.append({"error": f"rank {rank}: {traceback.format_exc()}"})
    return results


# ----------------------------------------------------------------------------- the worlds
_REFS: dict[tuple, dict] = {}
_WORLDS: dict[int, Any] = {}


def refs_for(keys: set[tuple]) -> dict[tuple, dict]:
    for key in sorted(keys - set(_REFS)):
        _REFS[key] = reference(*key)
    return {k: _REFS[k] for k in keys}


def results_for(pp: int) -> list[list[dict]]:
    if pp not in _WORLDS:
        try:
            refs = refs_for({_ref_key(c) for c in configs(pp) if c[0] != "dropout"})
            with tempfile.TemporaryDirectory(prefix="autopipe-refs-") as tmp:
                path = os.path.join(tmp, "refs.pt")
                torch.save({f"{n}|{o}|{'bn' if bn else 'eval'}": v for (n, o, bn), v in refs.items()}, path)
                _WORLDS[pp] = run_distributed(world_worker, pp, path, timeout=TIMEOUT[pp])
        except Exception as exc:  # fail every configuration once, not after one timeout each
            _WORLDS[pp] = exc
    if isinstance(_WORLDS[pp], Exception):
        raise _WORLDS[pp]
    return _WORLDS[pp]


def per_rank(cfg: tuple) -> list[dict]:
    pp = cfg[1]
    got = [r[configs(pp).index(cfg)] for r in results_for(pp)]
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return got


def check_training(cfg: tuple) -> None:
    got = per_rank(cfg)
    ref = _REFS[_ref_key(cfg)]
    pp, chunks = cfg[1], cfg[3]
    # Stage s on rank s % pp; together the ranks hold the whole state_dict exactly once.
    assert [g["stages"] for g in got] == [[s for s in range(pp * chunks) if s % pp == r] for r in range(pp)]
    keys = [k for g in got for k in g["keys"]]
    assert sorted(keys) == sorted(ref["state"]), "the stages do not hold the model's state_dict exactly once"
    for rank, g in enumerate(got):
        ratio, err, key = g["worst"]
        assert ratio <= 1.0, (f"rank {rank}: {key} differs from the reference by {err:.3g} "
                              f"({ratio:.3g}x the tolerance rtol={RTOL}, atol={ATOL})")
        assert g["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {rank} returned other losses"
        if g["full"] is not None:  # full_state_dict() on every rank: the whole model, buffers too
            same_keys, (ratio, err, key) = g["full"]
            assert same_keys and ratio <= 1.0, f"rank {rank}: full_state_dict()[{key!r}] differs by {err:.3g}"
    # Forward-only schedule: outputs on the last stage's rank only, equal to the reference's.
    assert [g["last"] for g in got] == [r == pp - 1 for r in range(pp)]
    assert all(g["eval"] is None for g in got[:-1])
    ratio, err = got[-1]["eval"]
    assert ratio <= 1.0, f"eval_step outputs differ from the reference model's by {err:.3g}"


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("cfg", param_configs(2) + param_configs(4), ids=cfg_id)
def test_parameters_match_gradient_accumulation(cfg: tuple) -> None:
    """eval() mode; SGD+momentum and AdamW, both in fp32 (see the module docstring)."""
    check_training(cfg)


@pytest.mark.parametrize("cfg", bn_configs(2) + bn_configs(4), ids=cfg_id)
def test_batchnorm_per_microbatch_statistics(cfg: tuple) -> None:
    """train() mode ResNet: parameters and running stats equal a per-micro-batch reference."""
    check_training(cfg)


def test_batchnorm_full_batch_reference_differs() -> None:
    """What the BatchNorm test tells apart: per-micro-batch statistics are not full-batch ones."""
    per_mb = refs_for({("tv_resnet", "sgd", True)})[("tv_resnet", "sgd", True)]
    full = reference("tv_resnet", "sgd", True, per_microbatch=False)
    key = "bn1.running_var"
    assert excess(per_mb["state"][key], full["state"][key])[0] > 100
    assert per_mb["state"]["bn1.num_batches_tracked"].item() == STEPS * M
    assert full["state"]["bn1.num_batches_tracked"].item() == STEPS


def test_references_move_far_beyond_the_tolerance() -> None:
    """3 steps move the parameters by >= 100x the tolerance, so a wrong step cannot pass."""
    keys = {_ref_key(c) for pp in PPS for c in configs(pp) if c[0] != "dropout"}
    for key, ref in refs_for(keys).items():
        init = _build(key[0], key[1]).state_dict()
        moved = max(excess(ref["state"][k], v)[0] for k, v in init.items() if v.is_floating_point())
        assert moved > 100, f"{key}: the reference moves only {moved:.3g}x the tolerance"


@pytest.mark.parametrize("cfg", dropout_configs(2), ids=cfg_id)
def test_train_eval_reach_dropout_in_every_stage(cfg: tuple) -> None:
    got = [g["dropout"] for g in per_rank(cfg)]
    pp, chunks = cfg[1], cfg[3]
    for rank, runs in enumerate(got):
        assert runs["eval"]["flags"] == [False] and runs["train"]["flags"] == [True], f"rank {rank}"
        assert len(runs["train"]["fired"]) == chunks
        for s, (calls, dropped) in runs["train"]["fired"].items():
            # 2 eval_steps x M micro-batches x the stage's dropout modules; every call drops.
            assert calls > 0 and calls % (2 * M) == 0, f"stage {s} has no active dropout to check"
            assert dropped == calls, f"train(): stage {s}'s dropout left {calls - dropped} calls unchanged"
        for s, (calls, dropped) in runs["eval"]["fired"].items():
            assert dropped == 0, f"eval(): stage {s}'s dropout changed its input"
    last = got[pp - 1]
    (e1, e2), (t1, t2) = last["eval"]["outputs"], last["train"]["outputs"]
    torch.testing.assert_close(e1, last["reference"], rtol=RTOL, atol=ATOL)
    assert torch.equal(e1, e2), "eval() outputs are not deterministic"
    assert not torch.allclose(t1, t2) and not torch.allclose(t1, e1), "train() outputs show no dropout"


@pytest.mark.parametrize("chunks,schedule", INVALID)
def test_invalid_schedules_raise_before_any_collective(chunks: int, schedule: str) -> None:
    with pytest.raises(ScheduleError, match="1f1b runs one model chunk per rank"):
        autopipe.parallelize(MODELS["timm_vit"](), (torch.zeros(2, 3, 32, 32),), chunks=chunks,
                             schedule=schedule, microbatches=M, loss_fn=_loss)
