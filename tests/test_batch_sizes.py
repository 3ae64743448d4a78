"""Batches of any size after one ``parallelize``: the last incomplete batch of an epoch and
evaluation batches of any size train and evaluate like one process ([Note: stage variants],
[Note: batch splits]).

The plan is made for micro-batches of 3 samples, m = 2. With ``batch_split="uneven"`` a batch
of 6 runs as [3, 3], 5 as [3, 2], 3 as [2, 1] and 1 as [1] (fewer micro-batches); each
micro-batch's loss is weighed by its share of the batch. AdamW runs in fp64 (see test_api.py).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import autopipe
from autopipe.errors import ConfigError, InputError
from autopipe.runtime import host_links
from autopipe.runtime.microbatch import microbatch_sizes
from tests.distributed import run_distributed
from tests.models import ADAMW_MODELS, MODELS, logits

TRAIN = (6, 5, 3, 1)  # samples per step
EVAL = (5, 1, 7)
MB = 3  # planned micro-batch size


def _loss(out, y):
    return F.cross_entropy(logits(out), y)


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)


def _model(name: str):
    torch.manual_seed(0)
    return (ADAMW_MODELS.get(name) or MODELS[name])().eval().double()


def _reference(name: str):
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step, n in enumerate(TRAIN):
        x, y = _data(n, step)
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        outs = [logits(model(_data(n, 100 + n)[0])) for n in EVAL]
    return losses, model.state_dict(), outs


def _parallel(rank, world, name, pp, tp, chunks):
    pm = autopipe.parallelize(_model(name), (torch.randn(MB, 3, 32, 32, dtype=torch.float64),), pp=pp, tp=tp,
                              chunks=chunks, microbatches=2, loss_fn=_loss, batch_split="uneven").eval()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step, n in enumerate(TRAIN):
        x, y = _data(n, step)
        opt.zero_grad()
        losses.append(float(pm.train_step(x, y)))
        pm.step(opt)
    outs = [pm.eval_step(_data(n, 100 + n)[0]) for n in EVAL]
    new_graphs = {size: sum(stage is not pm.stages[i] for i, stage in stages.items())
                  for size, (stages, _) in pm._runtime.driver.shapes.built().items()}
    shared = pm._runtime.driver.p2p.shared
    received = None if shared is None else sum(ring.count for ring in shared.inbox.values())
    return losses, pm.full_state_dict(), [logits(o) if o is not None else None for o in outs], new_graphs, received


@pytest.mark.parametrize("name,pp,tp,chunks", [
    ("timm_vit", 2, 2, 1),  # fx route, tensor-parallel shards
    ("hf_vit", 2, 1, 1),  # export route: the size is baked into the graph, traced again per size
    ("timm_swin", 2, 1, 2),  # fx route, interleaved; sizes handed between stages are baked per stage
], ids=["timm-vit-pp2-tp2", "hf-vit-export-pp2", "timm-swin-interleaved"])
def test_odd_batches_train_and_evaluate_like_one_process(name, pp, tp, chunks):
    results = run_distributed(_parallel, pp * tp, name, pp, tp, chunks, timeout=400)
    ref_losses, ref_state, ref_outs = _reference(name)
    for losses, state, outs, new_graphs, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-6)  # losses are reported in fp32
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-7, atol=1e-9, msg=k)
        for got, want in zip(outs, ref_outs):
            if got is not None:  # the last stage's ranks
                torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
        # Every other micro-batch size was built once: 2 (the [3, 2] split), 1, and 4 (eval of 7).
        assert sorted(new_graphs) == [1, 2, 4]
    assert any(r[2][0] is not None for r in results)
    if name == "hf_vit":  # torch.export baked the size in: every stage is a new graph (one per rank)
        assert all(n == 1 for r in results for n in r[3].values())
    if name == "timm_vit":
        assert all(n == 0 for r in results for n in r[3].values())  # fx graphs read sizes from tensors


def _shared_links(rank, world, name, pp, tp, chunks):
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # one host, as torchrun says
    host_links.SHARED_LINKS = True  # [Note: shared-memory links]
    return _parallel(rank, world, name, pp, tp, chunks)


def test_shared_memory_links_carry_the_planned_size_and_leave_larger_ones_to_the_backend():
    """Eval batches of 7 in 2 micro-batches are 4 samples each, over the planned 3: their
    messages do not fit a slot and go over gloo, the others through shared memory."""
    results = run_distributed(_shared_links, 2, "timm_swin", 2, 1, 2, timeout=400)
    ref_losses, ref_state, ref_outs = _reference("timm_swin")
    received = []
    for losses, state, outs, _, got_shared in results:
        received.append(got_shared)
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-7, atol=1e-9, msg=k)
        for got, want in zip(outs, ref_outs):
            if got is not None:
                torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    # Training: 7 micro-batches of at most 3 samples (6, 5 and 3 in two, 1 in one) cross the 3
    # boundaries of 4 stages forward and back; evaluation: 5 ([3, 2]), 1, and of 7 ([4, 3]) the
    # 3 samples, forward. Of the 4 samples' messages, those of boundaries smaller than the
    # largest fit a slot too; the largest boundary's does not.
    fit = 2 * 3 * 7 + 3 * 4
    assert fit <= sum(received) < fit + 3


def test_equal_split_runs_any_divisible_batch_and_refuses_the_rest():
    torch.manual_seed(0)
    model, ref = _model("timm_vit"), _model("timm_vit")
    pm = autopipe.parallelize(model, (torch.randn(MB, 3, 32, 32, dtype=torch.float64),), chunks=2,
                              microbatches=2, loss_fn=_loss).eval()
    x, y = _data(4, 0)  # two micro-batches of 2, not the planned 3
    loss = pm.train_step(x, y)
    want = _loss(ref(x), y)
    want.backward()
    assert float(loss) == pytest.approx(want.item(), rel=1e-6)
    grads = dict(pm.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-9, atol=1e-12, msg=n)
    with pytest.raises(InputError, match=r"input batch size 5 does not split into 2 equal micro-batches \(5 % 2 = 1\); "
                                         r"use a batch size of 4 or 6.*batch_split='uneven'"):
        pm.train_step(*_data(5, 0))
    with pytest.raises(InputError, match=r"expected micro-batch \(2, 3, 32, 32\) float64, given \(2, 3, 16, 16\)"):
        pm.train_step(torch.zeros(4, 3, 16, 16, dtype=torch.float64), y)
    # Evaluation takes any batch.
    torch.testing.assert_close(pm.eval_step(x[:3]), ref(x[:3]), rtol=1e-9, atol=1e-12)
    with pytest.raises(ConfigError, match=r"batch_split='ragged'; use one of 'equal', 'uneven'"):
        autopipe.parallelize(_model("timm_vit"), (torch.randn(MB, 3, 32, 32),), loss_fn=_loss, batch_split="ragged")


def test_microbatch_sizes():
    assert microbatch_sizes(7, 3, "uneven") == [3, 2, 2]
    assert microbatch_sizes(2, 4, "uneven") == [1, 1]  # fewer micro-batches
    assert microbatch_sizes(8, 4, "equal") == [2] * 4
    with pytest.raises(InputError, match="batch size 7 does not split into 3 equal micro-batches"):
        microbatch_sizes(7, 3, "equal")


def _sequence_parallel(rank, world):
    torch.manual_seed(0)
    pm = autopipe.parallelize(MODELS["timm_vit"]().eval(), (torch.randn(4, 3, 32, 32),), tp=2, microbatches=2,
                              loss_fn=_loss, sequence_parallel=True, batch_split="uneven")
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    try:
        pm.train_step(x, y)
    except InputError as exc:
        refused = str(exc)
    else:
        refused = ""
    loss = float(pm.train_step(torch.cat([x, x[:2]]), torch.cat([y, y[:2]])))  # [4, 4]: splits across tp
    return refused, loss


def test_sequence_parallel_refuses_micro_batches_that_do_not_split_across_tp():
    for refused, loss in run_distributed(_sequence_parallel, 2, timeout=300):
        assert "a batch of 6 samples runs as micro-batches of [3, 3] samples, and sequence_parallel=True " \
               "splits each across tp=2 ranks" in refused
        assert loss > 0


def test_export_route_model_that_cannot_be_copied_runs_the_planned_size_only(monkeypatch):
    import autopipe.api

    def refuse(model):
        raise TypeError("cannot pickle '_thread.lock' object")

    monkeypatch.setattr(autopipe.api, "meta_copy", refuse)
    pm = autopipe.parallelize(_model("hf_vit"), (torch.randn(MB, 3, 32, 32, dtype=torch.float64),), microbatches=2,
                              loss_fn=_loss).eval()
    pm.train_step(*_data(6, 0))  # the planned size
    with pytest.raises(InputError, match=r"micro-batches of 2 samples need the model traced again at that size, and "
                                         r"ViTForImageClassification could not be copied .*_thread.lock"):
        pm.train_step(*_data(4, 0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_planned_size_and_run_other_sizes_eagerly():
    torch.manual_seed(0)
    model, ref = MODELS["timm_vit"]().eval(), MODELS["timm_vit"]().eval().cuda()
    ref.load_state_dict(model.state_dict())
    pm = autopipe.parallelize(model, (torch.randn(MB, 3, 32, 32),), chunks=2, schedule="gpipe", microbatches=2,
                              loss_fn=_loss, cuda_graphs=True, batch_split="uneven", device="cuda").eval()
    for n in (6, 5, 3, 6):  # planned [3, 3] (graphs), [3, 2] (mixed), [2, 1] (eager), planned again
        x, y = (t.float().cuda() if t.is_floating_point() else t.cuda() for t in _data(n, n))
        for p in list(pm.parameters()) + list(ref.parameters()):
            p.grad = None
        loss = pm.train_step(x, y)
        want = _loss(ref(x), y)
        want.backward()
        assert float(loss) == pytest.approx(want.item(), rel=1e-5)
        grads = dict(pm.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert sorted(pm._runtime.driver.shapes.built()) == [1, 2]
