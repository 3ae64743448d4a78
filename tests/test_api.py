"""parallelize() end to end over gloo: parameters after 3 optimizer steps equal a single process's.

The reference runs the whole batch of every dp replica in one process, so any mistake in the
pipeline, the shards or the dp averaging shows up. SGD with momentum is compared in fp32.
AdamW divides by the gradient's own magnitude, so where the exact gradient is tiny it turns
fp32 rounding (tp and dp sum in another order) into full-size steps; it is compared in fp64,
where rounding is far below the tolerance and only a real error can move the numbers.
"""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn.functional as F

import autopipe
from autopipe.errors import ConfigError, InputError, PartitionError
from tests.distributed import cuda_present, run_distributed
from tests.models import ADAMW_MODELS, MODELS, logits

STEPS = 3
BATCH = 8  # per dp replica


def _loss(out, y):
    return F.cross_entropy(logits(out), y)


def _data(step: int, replicas: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH * replicas, 3, 32, 32, generator=g, dtype=dtype)
    y = torch.randint(0, 10, (BATCH * replicas,), generator=g)
    return x, y


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _dtype(optimizer):
    return torch.float64 if optimizer == "adamw" else torch.float32


def _build(model_name, optimizer):
    model = (ADAMW_MODELS if optimizer == "adamw" else MODELS)[model_name]().eval()
    return model.to(_dtype(optimizer))


def _reference(model_name, optimizer, replicas, max_norm=None):
    torch.manual_seed(0)
    model = _build(model_name, optimizer)
    opt = _optimizer(optimizer, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _data(step, replicas, _dtype(optimizer))
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parallel(rank, world, model_name, optimizer, pp, tp, chunks, schedule, microbatches, max_norm,
              sequence_parallel=False):
    torch.manual_seed(0)
    model = _build(model_name, optimizer)
    mb = BATCH // microbatches
    pm = autopipe.parallelize(model, (torch.randn(mb, 3, 32, 32, dtype=_dtype(optimizer)),), pp=pp, tp=tp, chunks=chunks,
                              schedule=schedule, microbatches=microbatches, loss_fn=_loss,
                              sequence_parallel=sequence_parallel)
    assert pm.shard_plan is None or pm.shard_plan.sequence_parallel == sequence_parallel
    pm.eval()  # dropout-free reference; BatchNorm statistics are covered in the runtime tests
    opt = _optimizer(optimizer, pm.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _data(step, pm.dp_size, _dtype(optimizer))
        sl = slice(pm.dp_rank * BATCH, (pm.dp_rank + 1) * BATCH)
        opt.zero_grad()
        loss = pm.train_step(x[sl], y[sl])
        pm.step(opt, max_norm=max_norm)
        losses.append(float(loss))
    return losses, pm.full_state_dict(), pm.dp_size


def _check(results, model_name, optimizer, max_norm=None):
    replicas = results[0][2]
    ref_losses, ref_state = _reference(model_name, optimizer, replicas, max_norm)
    for losses, state, _ in results:
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # Each replica reports its own mean loss; their mean is the reference's.
    per_replica = {}
    for r, (losses, _, _) in enumerate(results):
        per_replica.setdefault(tuple(round(x, 6) for x in losses), losses)
    mean = [sum(ls[i] for ls in per_replica.values()) / len(per_replica) for i in range(STEPS)]
    if len(per_replica) == replicas:
        assert mean == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("model_name", ["timm_vit", "hf_vit"])
def test_pp2_tp2(model_name, optimizer):
    results = run_distributed(_parallel, 4, model_name, optimizer, 2, 2, 1, "1f1b", 4, None, timeout=300)
    _check(results, model_name, optimizer)


@pytest.mark.parametrize("model_name", ["timm_vit", "hf_vit"])
def test_pp2_tp2_dp2_with_clipping(model_name):
    results = run_distributed(_parallel, 8, model_name, "sgd", 2, 2, 1, "1f1b", 2, 0.5, timeout=400)
    _check(results, model_name, "sgd", max_norm=0.5)


@pytest.mark.parametrize("model_name", ["timm_vit", "hf_vit"])
def test_pp2_tp2_sequence_parallel(model_name):
    results = run_distributed(_parallel, 4, model_name, "adamw", 2, 2, 1, "1f1b", 4, None, True, timeout=300)
    _check(results, model_name, "adamw")


def test_pp2_tp2_dp2_sequence_parallel_with_clipping():
    results = run_distributed(_parallel, 8, "timm_vit", "sgd", 2, 2, 1, "1f1b", 2, 0.5, True, timeout=400)
    _check(results, "timm_vit", "sgd", max_norm=0.5)


def test_interleaved_pp2_chunks2_dp2():
    results = run_distributed(_parallel, 4, "timm_vit", "adamw", 2, 1, 2, "interleaved_1f1b", 4, 1.0,
                              timeout=300)
    _check(results, "timm_vit", "adamw", max_norm=1.0)


def _full_state_roundtrip(rank, world):
    torch.manual_seed(0)
    model = MODELS["hf_vit"]().eval()
    pm = autopipe.parallelize(model, (torch.randn(2, 3, 32, 32),), pp=2, microbatches=2, loss_fn=_loss)
    sd = pm.full_state_dict()
    fresh = MODELS["hf_vit"]().eval()
    fresh.load_state_dict(sd, strict=True)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    out = pm.eval().eval_step(x)
    return None if out is None else (out.logits, fresh(x).logits)


def test_full_state_dict_loads_strictly_and_eval_outputs_match():
    results = run_distributed(_full_state_roundtrip, 2, timeout=200)
    assert results[0] is None  # outputs live on the last stage's rank
    got, want = results[1]
    torch.testing.assert_close(got, want)


def test_bad_input_is_typed_before_any_collective():
    model = MODELS["timm_vit"]()
    with pytest.raises(ConfigError, match="world size 1 is not a multiple of pp"):
        autopipe.parallelize(model, (torch.randn(2, 3, 32, 32),), pp=2, loss_fn=_loss)
    with pytest.raises(ConfigError, match="loss_fn"):
        autopipe.parallelize(model, (torch.randn(2, 3, 32, 32),), loss_fn=None)
    with pytest.raises(ConfigError, match=r"deadline=inf; pass a positive number of seconds"):
        autopipe.parallelize(model, (torch.randn(2, 3, 32, 32),), loss_fn=_loss, deadline=float("inf"))


def _lone_relu(rank, world):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU())
    start = time.perf_counter()
    with pytest.raises(PartitionError) as info:
        autopipe.parallelize(model, (torch.randn(2, 16),), pp=4, microbatches=4, loss_fn=F.mse_loss, device="cpu")
    return str(info.value), time.perf_counter() - start


def test_a_pipeline_rank_without_parameters_is_refused_on_every_rank():
    # pp=4 leaves a lone ReLU on one rank: its optimizer would get no parameters and fail alone.
    results = run_distributed(_lone_relu, 4, timeout=120)
    assert len({message for message, _ in results}) == 1  # the same error on every rank, before any collective
    assert re.match(r"pipeline rank \d would hold no parameters \(stage \d: module '\d'\), and an optimizer over no "
                    r"parameters fails on that rank .* Use fewer stages \(pp=4 x chunks=1; 3 of these stages hold "
                    r"parameters\)", results[0][0]), results[0][0]
    assert all(took < 30 for _, took in results)


def _pipeline_on_cuda_over_gloo(rank, world):
    with cuda_present(), pytest.raises(ConfigError, match=r"pp=2 on CUDA needs the NCCL backend: gloo sends and "):
        autopipe.parallelize(_build("timm_vit", "sgd"), (torch.randn(2, 3, 32, 32),), pp=2, microbatches=2,
                             loss_fn=_loss, device="cuda")
    return True


def test_a_pipeline_on_cuda_over_gloo_is_refused_before_any_collective():
    assert run_distributed(_pipeline_on_cuda_over_gloo, 2) == [True, True]


def _default_device_under_gloo(rank, world):
    with cuda_present():  # as on a GPU machine
        pm = autopipe.parallelize(_build("timm_vit", "sgd"), (torch.randn(2, 3, 32, 32),), pp=2, microbatches=2,
                                  loss_fn=_loss)
    x, y = _data(0, 1)
    loss = pm.train_step(x[:4], y[:4])
    return str(pm.device), next(pm.parameters()).device.type, float(loss)


def test_a_gloo_process_group_defaults_to_the_cpu_on_a_gpu_machine():
    # The multi-process tests rely on it: gloo sends CPU tensors only, so CUDA would be refused.
    results = run_distributed(_default_device_under_gloo, 2)
    assert [r[:2] for r in results] == [("cpu", "cpu")] * 2
    assert results[0][2] == results[1][2] > 0


def test_cuda_without_a_gpu_is_refused_naming_the_missing_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device='cuda', but there is no CUDA on this machine .*pass device='cpu'"):
        autopipe.parallelize(MODELS["timm_vit"](), (torch.randn(2, 3, 32, 32),), loss_fn=_loss, device="cuda")


def test_single_process_train_step_and_errors():
    torch.manual_seed(0)
    model = MODELS["timm_vit"]().eval()
    pm = autopipe.parallelize(model, (torch.randn(2, 3, 32, 32),), microbatches=2, loss_fn=_loss, device="cpu")
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    loss = pm.train_step(x, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    with pytest.raises(InputError, match="targets batch 3"):
        pm.train_step(x, y[:3])
    with pytest.raises(InputError):
        pm.train_step(torch.randn(5, 3, 32, 32), torch.randint(0, 10, (5,)))


def _closed_models(rank, world):
    import threading

    import torch.distributed as dist

    before = len(dist.distributed_c10d._world.pg_map)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    losses = []
    for _ in range(3):  # each a pipeline (pp=2, its link groups) over gloo, with transfer threads
        torch.manual_seed(0)
        pm = autopipe.parallelize(MODELS["timm_vit"](), (torch.randn(2, 3, 32, 32),), pp=2, microbatches=4,
                                  loss_fn=_loss, device="cpu")
        losses.append(float(pm.train_step(x, y)))
        pm.close()
        pm.close()  # twice is nothing
    try:
        pm.train_step(x, y)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(t.name.startswith("autopipe-") for t in threading.enumerate()):
        time.sleep(0.01)
    return {"groups": len(dist.distributed_c10d._world.pg_map) - before, "losses": losses, "refused": refused,
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("autopipe-"))}


def test_close_releases_the_groups_and_threads_of_a_model():
    for result in run_distributed(_closed_models, 2, timeout=200):
        assert result["groups"] == 0 and result["threads"] == []
        assert "closed" in result["refused"]
        assert result["losses"][0] == result["losses"][1] == result["losses"][2]
