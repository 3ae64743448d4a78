"""``parallelize(..., compile_stages=True)``: stages run through torch.compile (inductor) and
train to the same numbers as one process ([Note: compiled stages] in autopipe/runtime/preparation.py)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.torch_version import TorchVersion

import autopipe
import tests.test_api as api
from tests.distributed import cuda_present, run_distributed


def _compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _train(rank, world, pp, tp, chunks, sequence_parallel):
    torch.manual_seed(0)
    model = api._build("timm_vit", "sgd")
    pm = autopipe.parallelize(model, (torch.randn(api.BATCH // 4, 3, 32, 32),), pp=pp, tp=tp, chunks=chunks,
                              microbatches=4, loss_fn=api._loss, sequence_parallel=sequence_parallel,
                              compile_stages=True)
    pm.eval()
    opt = api._optimizer("sgd", pm.parameters())
    losses = []
    for step in range(api.STEPS):
        x, y = api._data(step, pm.dp_size)
        opt.zero_grad()
        losses.append(float(pm.train_step(x, y)))
        pm.step(opt)
    return losses, pm.full_state_dict(), pm.dp_size, (_compiled_graphs(), _graph_breaks())


_OLD_TORCH = TorchVersion(torch.__version__) < "2.14"


@pytest.mark.parametrize("pp,tp,chunks,sequence_parallel", [
    (2, 1, 2, False),
    pytest.param(1, 2, 1, True, marks=pytest.mark.skipif(
        _OLD_TORCH, reason="refused before torch 2.14: test_compiled_sequence_parallel_stages_need_torch_2_14")),
    (1, 2, 1, False),
], ids=["pp2-interleaved", "tp2-sequence-parallel", "tp2"])
def test_compiled_stages_train_like_one_process(pp, tp, chunks, sequence_parallel):
    results = run_distributed(_train, pp * tp, pp, tp, chunks, sequence_parallel, timeout=400)
    # Every stage compiled whole: one graph each, the tensor-parallel collectives traced inside
    # (see [Note: traceable collectives]), nothing left to run eagerly between regions.
    assert [r[3] for r in results] == [(chunks, 0)] * (pp * tp)
    api._check([r[:3] for r in results], "timm_vit", "sgd")


def test_compiled_stages_with_recompute_and_eval_match_the_model():
    torch.manual_seed(0)
    model = api._build("timm_vit", "sgd")
    ref = api._build("timm_vit", "sgd")
    ref.load_state_dict(model.state_dict())
    before = _compiled_graphs()
    pm = autopipe.parallelize(model, (torch.randn(4, 3, 32, 32),), microbatches=2, loss_fn=api._loss,
                              activation_checkpointing=True, compile_stages=True, device="cpu")
    pm.eval()
    x, y = api._data(0, 1)
    loss = pm.train_step(x, y)
    assert _compiled_graphs() > before
    ref_loss = api._loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(pm.eval_step(x), ref(x), rtol=1e-5, atol=1e-5)


def test_warm_up_leaves_buffers_gradients_and_random_state_alone():
    from autopipe.runtime.p2p import TensorSpec
    from autopipe.runtime.warmup import warm_up

    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 4)).train()
    buffers = {k: v.clone() for k, v in stage.named_buffers()}
    rng = torch.get_rng_state()
    calls = []
    stage.register_forward_hook(lambda *_: calls.append(1))
    warm_up(stage, [TensorSpec((6, 8), torch.float32)], [True], torch.device("cpu"), backward=True)
    assert calls == [1]  # it did run the stage
    for k, v in stage.named_buffers():
        torch.testing.assert_close(v, buffers[k], rtol=0, atol=0, msg=k)
    assert all(p.grad is None for p in stage.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.is_grad_enabled()


def _refused_on_gloo_cuda(rank, world):
    from autopipe.errors import ConfigError

    with cuda_present(), \
            pytest.raises(ConfigError, match=r"compile_stages=True with tp=2 on CUDA needs the NCCL backend, not gloo"):
        autopipe.parallelize(api._build("timm_vit", "sgd"), (torch.randn(2, 3, 32, 32),), tp=2, microbatches=2,
                             loss_fn=api._loss, device="cuda", compile_stages=True)
    return True


def test_compiled_tensor_parallel_stages_on_cuda_over_gloo_are_refused():
    assert run_distributed(_refused_on_gloo_cuda, 2) == [True, True]


def test_compiled_sequence_parallel_stages_need_torch_2_14(monkeypatch):
    from autopipe.errors import ConfigError

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ConfigError, match=r"sequence_parallel=True needs torch >= 2.14; torch 2.11.0\+cu130"):
        autopipe.parallelize(api._build("timm_vit", "sgd"), (torch.randn(2, 3, 32, 32),), tp=2, microbatches=2,
                             loss_fn=api._loss, sequence_parallel=True, compile_stages=True)
