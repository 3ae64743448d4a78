"""Training features of ParallelModel checked against single-process references over gloo:
sharded checkpoints (resume, resharding, failed saves), fp16 loss scaling, gradient
accumulation, bf16 autocast, fine-tuning from a full state_dict, activation checkpointing.

As in test_api.py, AdamW runs in fp64 (where rounding cannot pass for a real error) and
models run in eval mode (no dropout), so a resumed run must repeat the uninterrupted one.
"""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import autopipe
from autopipe.errors import CheckpointError, InputError
from tests import failing_job as job
from tests.distributed import run_distributed
from tests.models import ADAMW_MODELS, MODELS, logits

BATCH = 4  # per dp replica and step


def _loss(out, y):
    return F.cross_entropy(logits(out), y)


def _data(step: int, n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 10, (n,), generator=g)


def _example(dtype=torch.float32):
    return (torch.randn(2, 3, 32, 32, dtype=dtype),)


def _adamw_pm(seed: int, pp: int, tp: int, microbatches: int):
    torch.manual_seed(seed)
    model = ADAMW_MODELS["timm_vit"]().eval().double()
    pm = autopipe.parallelize(model, _example(torch.float64), pp=pp, tp=tp, microbatches=microbatches,
                              loss_fn=_loss).eval()
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.1)


def _train(pm, opt, step: int) -> float:
    """One step on the global batch of ``BATCH`` samples, split over the dp replicas."""
    x, y = _data(step, BATCH, torch.float64)
    n = BATCH // pm.dp_size
    sl = slice(pm.dp_rank * n, (pm.dp_rank + 1) * n)
    opt.zero_grad()
    loss = pm.train_step(x[sl], y[sl])
    pm.step(opt)
    return float(loss)


# ----------------------------------------------------------------------------- checkpoints
def _resume(rank, world, root):
    path = os.path.join(root, "ckpt")
    pm, opt = _adamw_pm(0, pp=2, tp=2, microbatches=2)
    losses = [_train(pm, opt, step) for step in range(2)]
    saved_dir = pm.save_checkpoint(path, opt, extra={"step": 2})
    saved = pm.full_state_dict()
    losses += [_train(pm, opt, step) for step in range(2, 4)]
    final = pm.full_state_dict()

    # Saves of step 4 that fail: after every rank's DCP write (rank 3 then raises), and inside
    # DCP's write on rank 1 only. A killed save's directory is left behind as well.
    errors = []
    real_save, real_write = dcp.save, dcp.FileSystemWriter.write_data

    def save_then_fail(*args, **kwargs):
        real_save(*args, **kwargs)
        if rank == 3:
            raise OSError("disk full (injected)")

    def fail_write(self, *args, **kwargs):
        raise OSError("write refused (injected)")

    for patch in ("after", "inside"):
        if patch == "after":
            dcp.save = save_then_fail
        elif rank == 1:
            dcp.FileSystemWriter.write_data = fail_write
        try:
            pm.save_checkpoint(path, opt, extra={"step": 4})
        except CheckpointError as exc:
            errors.append(str(exc))
        finally:
            dcp.save, dcp.FileSystemWriter.write_data = real_save, real_write
    if rank == 0:
        os.makedirs(os.path.join(path, "ckpt-killed"))
        with open(os.path.join(path, "ckpt-killed", "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
    listing = sorted(os.listdir(path))

    # A fresh model (another seed) resumes from step 2 in the same layout...
    pm2, opt2 = _adamw_pm(1, pp=2, tp=2, microbatches=2)
    extra = pm2.load_checkpoint(path, opt2)
    resumed = [_train(pm2, opt2, step) for step in range(2, 4)]
    resumed_final = pm2.full_state_dict()
    # ...and in another one: pp=1 x dp=2 x tp=2 (keys are full-shape, so any layout loads).
    pm3, opt3 = _adamw_pm(2, pp=1, tp=2, microbatches=1)
    pm3.load_checkpoint(path, opt3)
    resharded_saved = pm3.full_state_dict()
    resharded = [_train(pm3, opt3, step) for step in range(2, 4)]
    resharded_final = pm3.full_state_dict()
    return dict(losses=losses, saved=saved, final=final, errors=errors, listing=listing, dir=saved_dir,
                extra=extra, resumed=resumed, resumed_final=resumed_final, resharded_saved=resharded_saved,
                resharded=resharded, resharded_final=resharded_final, dp=pm3.dp_size)


def test_checkpoint_resume_equals_uninterrupted_run_and_survives_failed_saves(tmp_path):
    results = run_distributed(_resume, 4, str(tmp_path), timeout=400)
    r0 = results[0]
    for r in results:
        # Every rank raised, for both failed saves, naming the failing rank and what was kept.
        assert len(r["errors"]) == 2
        assert "rank 3: OSError: disk full (injected)" in r["errors"][0]
        assert "write refused (injected)" in r["errors"][1]
        assert all(os.path.basename(r0["dir"]) in e and "still the latest" in e for e in r["errors"])
        assert r["extra"] == {"step": 2}
        # The same layout repeats the uninterrupted run to the bit.
        assert r["resumed"] == r0["losses"][2:]
        for k, v in r0["final"].items():
            assert torch.equal(r["resumed_final"][k], v), k
        # Another layout loads the same tensors and trains to the same values (up to rounding).
        for k, v in r0["saved"].items():
            assert torch.equal(r["resharded_saved"][k], v), k
        for k, v in r0["final"].items():
            torch.testing.assert_close(r["resharded_final"][k], v, rtol=1e-7, atol=1e-9, msg=k)
    # The failed saves left no directory behind; the killed one is ignored by loads.
    assert r0["listing"] == sorted(["latest", os.path.basename(r0["dir"]), "ckpt-killed"])
    per_replica = [results[rank]["resharded"] for rank in (0, 2)]  # dp ranks 0 and 1 of pm3
    mean = [sum(x) / 2 for x in zip(*per_replica)]
    assert mean == pytest.approx(r0["losses"][2:], rel=1e-6)  # losses come back in fp32


def _single(seed=0, model=None):
    torch.manual_seed(seed)
    model = MODELS["timm_vit"]().eval() if model is None else model
    return autopipe.parallelize(model, _example(), microbatches=2, loss_fn=_loss, device="cpu").eval()


def test_checkpoint_errors_are_typed_and_a_crash_before_commit_keeps_the_last_one(tmp_path, monkeypatch):
    path = str(tmp_path / "run")
    pm = _single()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="no checkpoint at .*does not exist"):
        pm.load_checkpoint(path)
    os.makedirs(os.path.join(path, "ckpt-partial"))
    with pytest.raises(CheckpointError, match="only unfinished saves \\(ckpt-partial\\)"):
        pm.load_checkpoint(path)
    with pytest.raises(CheckpointError, match="extra \\(a function\\) cannot be stored as plain data"):
        pm.save_checkpoint(path, extra=lambda: 0)

    x, y = _data(0, 4)
    opt.zero_grad()
    pm.train_step(x, y)
    pm.step(opt)
    good = pm.save_checkpoint(path)  # without the optimizer
    assert sorted(os.listdir(path)) == sorted(["latest", os.path.basename(good)])  # the partial one is gone
    with pytest.raises(CheckpointError, match="holds no optimizer state .*without the optimizer"):
        pm.load_checkpoint(path, opt)
    foreign = torch.optim.SGD(MODELS["timm_vit"]().parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="not this rank's stage parameters; build it from pm.parameters"):
        pm.save_checkpoint(path, foreign)

    # The process dies between writing the shards and committing them.
    def crash(*args):
        raise OSError("killed (injected)")

    opt.zero_grad()
    pm.train_step(x, y)
    pm.step(opt)
    with monkeypatch.context() as m:
        m.setattr(os, "replace", crash)
        with pytest.raises(CheckpointError, match="killed \\(injected\\).*still the latest checkpoint"):
            pm.save_checkpoint(path, opt)
    assert sorted(os.listdir(path)) == sorted(["latest", os.path.basename(good)])

    other = _single(seed=1)
    other.load_checkpoint(path)
    x_eval = _data(5, 4)[0]
    want = _single(seed=0).eval_step(x_eval)  # untrained: the checkpoint must not be it
    got = other.eval_step(x_eval)
    assert not torch.equal(got, want)
    pm.load_checkpoint(path)  # back to step 1's weights
    torch.testing.assert_close(got, pm.eval_step(x_eval), rtol=0, atol=0)

    bigger = _single(model=MODELS["timm_vit"](embed_dim=32, num_heads=2).eval())
    with pytest.raises(CheckpointError, match="does not fit this model:\n  - cls_token: \\[1, 1, 64\\] in the "
                                              "checkpoint, \\[1, 1, 32\\] in the model"):
        bigger.load_checkpoint(path)


def test_checkpoint_restores_the_fp16_loss_scale_and_extra(tmp_path):
    torch.manual_seed(0)
    pm = autopipe.parallelize(MODELS["timm_vit"]().eval(), _example(), microbatches=2, loss_fn=_loss,
                              mixed_precision="fp16", device="cpu")
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = _data(0, 4)
    for i in range(2):
        opt.zero_grad()
        pm.train_step(x, y)
        if i == 0:  # an overflow: the step is skipped and the scale halves
            next(pm.parameters()).grad.view(-1)[0] = float("inf")
        scale = pm.step(opt).loss_scale
    state = {"step": 2, "rng": torch.get_rng_state(), "lr": [0.1, 0.01]}
    pm.save_checkpoint(tmp_path, opt, extra=state)
    fresh = autopipe.parallelize(MODELS["timm_vit"]().eval(), _example(), microbatches=2, loss_fn=_loss,
                                 mixed_precision="fp16", device="cpu")
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
    extra = fresh.load_checkpoint(tmp_path, fresh_opt)
    assert extra["step"] == 2 and extra["lr"] == [0.1, 0.01] and torch.equal(extra["rng"], state["rng"])
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    fresh_opt.zero_grad()
    fresh.train_step(x, y)
    assert fresh.step(fresh_opt).loss_scale == scale != 2.0**16


# ----------------------------------------------------------------------------- fp16
def _fp16(rank, world):
    torch.manual_seed(0)
    model = MODELS["timm_vit"]().eval()
    pm = autopipe.parallelize(model, _example(), pp=2, tp=2, microbatches=2, loss_fn=_loss,
                              mixed_precision="fp16").eval()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = _data(0, BATCH)
    steps = []
    for inject in (False, False, True, False):
        before = [p.detach().clone() for p in pm.parameters()]
        opt.zero_grad()
        loss = pm.train_step(x, y)
        if inject and rank == 3:
            next(p for p in pm.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        result = pm.step(opt)
        changed = any(not torch.equal(b, p) for b, p in zip(before, pm.parameters()))
        steps.append((float(loss), result.skipped, result.loss_scale, changed))
    return steps


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_distributed(_fp16, 4, timeout=300)
    assert all(r == results[0] for r in results)  # the same decisions and scales everywhere
    steps = results[0]
    # Up to step 2, overflows come only from the 2**16 initial scale (backs off, as GradScaler).
    assert all(changed != skipped for _, skipped, _, changed in steps)
    assert steps[1][1] is False
    _, skipped, scale, changed = steps[2]
    assert skipped and not changed and scale == steps[1][2] / 2  # rank 3's inf
    assert steps[3][1] is False and steps[3][3] and steps[3][2] == scale
    # The loss is reported unscaled: close to fp32's, the same while parameters do not move.
    torch.manual_seed(0)
    ref = MODELS["timm_vit"]().eval()
    x, y = _data(0, BATCH)
    assert steps[0][0] == pytest.approx(_loss(ref(x), y).item(), rel=1e-2)
    assert steps[2][0] == steps[3][0]



# ----------------------------------------------------------------------------- non-finite gradients
def _nonfinite(rank, world):
    torch.manual_seed(0)
    pm = autopipe.parallelize(job.mlp(), (torch.randn(2, job.IN),), pp=2, tp=2, microbatches=2,
                              loss_fn=F.cross_entropy, device="cpu")
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = job.batch(4)
    steps = []
    for inject, max_norm in ((False, None), (True, None), (True, 1.0), (False, 1.0)):
        before = [p.detach().clone() for p in pm.parameters()]
        opt.zero_grad()
        pm.train_step(x, y)
        if inject and rank == 3:  # one NaN in one rank's gradients
            next(p for p in pm.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = pm.step(opt, max_norm=max_norm)
        changed = any(not torch.equal(b, p) for b, p in zip(before, pm.parameters()))
        steps.append((result.skipped, math.isfinite(result.grad_norm), changed,
                      [str(w.message).split(":")[0] for w in caught]))
    return steps


def test_a_nonfinite_gradient_norm_skips_the_step_on_every_rank_and_says_so():
    results = run_distributed(_nonfinite, 4, timeout=120)
    skip = ["ParallelModel.step skipped the update"]
    assert results[0] == [(False, True, True, []), (True, False, False, skip), (True, False, False, skip),
                          (False, True, True, [])]
    assert all(r == [tuple(s[:3]) + ([],) for s in results[0]] for r in results[1:])  # rank 0 warns


def test_skip_nonfinite_false_applies_the_update_as_torch_would():
    pm = _single()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = _data(0, 4)
    x[0, 0, 0, 0] = float("nan")  # one NaN pixel
    pm.train_step(x, y)
    result = pm.step(opt, skip_nonfinite=False)
    assert not result.skipped and result.grad_norm is None
    assert all(torch.isnan(p).any() for p in pm.parameters() if p.grad is not None)

# ----------------------------------------------------------------------------- accumulation
def _accumulate(rank, world):
    torch.manual_seed(0)
    model = MODELS["timm_vit"]().eval()
    x, y = _data(0, 4 * BATCH)  # 2 dp replicas x 2 calls x BATCH
    pm = autopipe.parallelize(model, _example(), pp=2, microbatches=2, loss_fn=_loss).eval()
    sl = slice(pm.dp_rank * 2 * BATCH, (pm.dp_rank + 1) * 2 * BATCH)
    xr, yr = x[sl], y[sl]

    def grads(m):
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    with pm.no_sync():
        first = pm.train_step(xr[:BATCH], yr[:BATCH], grad_scale=0.5)
    local = grads(pm)  # this replica's own, not averaged yet
    second = pm.train_step(xr[BATCH:], yr[BATCH:], grad_scale=0.5)
    accumulated = grads(pm)
    # Every call under no_sync(): clip_grad_norm_ (and step) average before using them.
    for p in pm.parameters():
        p.grad = None
    with pm.no_sync():
        pm.train_step(xr[:BATCH], yr[:BATCH], grad_scale=0.5)
        pm.train_step(xr[BATCH:], yr[BATCH:], grad_scale=0.5)
        pm.clip_grad_norm_(float("inf"))
    deferred = grads(pm)

    torch.manual_seed(0)  # the same weights, in parameters of its own (stages may share the model's)
    whole = autopipe.parallelize(MODELS["timm_vit"]().eval(), _example(), pp=2, microbatches=4, loss_fn=_loss).eval()
    loss = whole.train_step(xr, yr)
    return dict(first=float(first), second=float(second), local=local, accumulated=accumulated,
                deferred=deferred, whole=grads(whole), whole_loss=float(loss))


def test_gradient_accumulation_with_no_sync_equals_one_big_batch():
    results = run_distributed(_accumulate, 4, timeout=300)
    torch.manual_seed(0)
    ref = MODELS["timm_vit"]().eval()
    x, y = _data(0, 4 * BATCH)
    ref_loss = _loss(ref(x), y)
    ref_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for r in results:
        for name, g in r["accumulated"].items():
            torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(r["whole"][name], want[name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(r["deferred"][name], g, rtol=1e-6, atol=1e-7, msg=name)
        assert r["whole_loss"] == pytest.approx((r["first"] + r["second"]) / 2, rel=1e-5)
    # Under no_sync() the replicas kept their own gradients (ranks 0 and 1: pp rank 0, dp 0 and 1).
    assert any(not torch.allclose(results[0]["local"][n], results[1]["local"][n]) for n in results[0]["local"])
    assert (results[0]["whole_loss"] + results[1]["whole_loss"]) / 2 == pytest.approx(ref_loss.item(), rel=1e-5)


def test_grad_scale_is_checked():
    pm = _single()
    x, y = _data(0, 4)
    for bad in (0, -1.0, float("nan"), "0.5", True):
        with pytest.raises(InputError, match="grad_scale=.*pass a positive number"):
            pm.train_step(x, y, grad_scale=bad)


# ----------------------------------------------------------------------------- bf16
def _bf16(rank, world):
    torch.manual_seed(0)
    model = MODELS["timm_vit"]().eval()
    pm = autopipe.parallelize(model, _example(), pp=2, tp=2, microbatches=2, loss_fn=_loss,
                              mixed_precision="bf16").eval()
    planned = [c.dtype for stage in pm.plan.stages[:-1] for c in stage.outputs]
    sent = []
    if 0 in pm.stages:
        pm.stages[0].register_forward_hook(lambda m, i, out: sent.extend(str(t.dtype) for t in out))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = _data(step, BATCH)
        opt.zero_grad()
        losses.append(float(pm.train_step(x, y)))
        pm.step(opt)
    return losses, planned, sorted(set(sent))


def test_bf16_trains_like_autocast_and_sends_bf16_activations():
    results = run_distributed(_bf16, 4, timeout=300)
    torch.manual_seed(0)
    ref = MODELS["timm_vit"]().eval()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = []
    for step in range(3):
        x, y = _data(step, BATCH)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    for losses, planned, sent in results:
        assert losses == pytest.approx(want, rel=2e-2)
        assert planned and set(planned) == {"bfloat16"}
    assert results[0][2] == ["torch.bfloat16"]  # what stage 0 hands to the p2p sends


# ----------------------------------------------------------------------------- fine-tuning, recompute
def _finetune(rank, world):
    torch.manual_seed(1)
    pretrained = MODELS["timm_vit"]().eval()  # stands for a timm/HF checkpoint
    x, y = _data(0, BATCH)
    out = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        pm = autopipe.parallelize(MODELS["timm_vit"]().eval(), _example(), pp=2, tp=2, microbatches=2,
                                  loss_fn=_loss, activation_checkpointing=recompute).eval()
        pm.load_full_state_dict(pretrained.state_dict())
        calls = []
        for s in pm.stages.values():
            for m in s.modules():
                if next(m.children(), None) is None and next(m.parameters(), None) is not None:
                    m.register_forward_hook(lambda *_: calls.append(1))
        logits_ = pm.eval_step(x)
        n_eval = len(calls)
        loss = pm.train_step(x, y)
        out[recompute] = dict(logits=logits_, loss=float(loss), ratio=(len(calls) - n_eval) / max(n_eval, 1),
                              grads={n: p.grad.clone() for n, p in pm.named_parameters()})
    return out, pretrained(x) if pm.is_last_stage else None


def test_load_full_state_dict_and_activation_checkpointing():
    results = run_distributed(_finetune, 4, timeout=300)
    for out, want in results:
        if want is not None:  # the last stage's ranks hold the outputs
            torch.testing.assert_close(out[False]["logits"], want)
            torch.testing.assert_close(out[True]["logits"], want)
        # Recomputation ran the forward again (up to the last tensor backward needs).
        assert out[False]["ratio"] == 1 and out[True]["ratio"] > 1.5
        assert out[True]["loss"] == out[False]["loss"]
        for name, g in out[False]["grads"].items():
            assert torch.equal(out[True]["grads"][name], g), name


def test_activation_checkpointing_updates_batchnorm_statistics_once_per_micro_batch():
    """The recomputation in backward runs BatchNorm in train mode again; it must not count."""
    states = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = MODELS["tv_resnet"]()
        pm = autopipe.parallelize(model, (torch.randn(2, 3, 32, 32),), microbatches=4, chunks=2,
                                  schedule="gpipe", loss_fn=F.cross_entropy, activation_checkpointing=recompute,
                                  batchnorm="microbatch", device="cpu")
        pm.train()
        g = torch.Generator().manual_seed(1)
        pm.train_step(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
        states.append(pm.full_state_dict())
    plain, recomputed = states
    assert int(recomputed["bn1.num_batches_tracked"]) == 4
    for k, v in plain.items():
        if "running_" in k or "num_batches" in k:
            torch.testing.assert_close(recomputed[k], v, rtol=0, atol=0, msg=k)
