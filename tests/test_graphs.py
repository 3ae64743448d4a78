"""CUDA-graph slots: what can be checked without a GPU (the GPU equivalence runs in
benchmarks/gpu_throughput.py, whose results are in docs/benchmarks.md), and the graphs' memory
on a GPU."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.errors import ConfigError
from autopipe.runtime.graphs import StageGraphs
from autopipe.runtime.p2p import TensorSpec
from autopipe.runtime.schedule import max_in_flight_bound, stage_slots as _slots
from tests.models import MODELS


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_holds_pp_minus_rank_micro_batches(pp: int) -> None:
    for rank in range(pp):
        assert _slots("1f1b", pp, 8, 1, rank) == {rank: pp - rank}


def test_gpipe_holds_every_micro_batch() -> None:
    assert _slots("gpipe", 2, 6, 1, 0) == {0: 6}


def test_interleaved_slots_cover_every_local_stage_and_stay_below_m() -> None:
    slots = _slots("interleaved_1f1b", 2, 8, 2, 0)
    assert sorted(slots) == [0, 2] and all(1 <= n <= 8 for n in slots.values())


@pytest.mark.parametrize("schedule,pp,m,chunks", [("1f1b", 2, 8, 1), ("interleaved_1f1b", 2, 4, 4),
                                                  ("interleaved_1f1b", 4, 8, 2), ("gpipe", 2, 3, 1)])
def test_slots_count_each_stage_at_its_own_most(schedule: str, pp: int, m: int, chunks: int) -> None:
    """Every stage holds at most m micro-batches, and the stages' slots together cover the most
    the rank holds at once (more, for interleaved: each stage peaks at its own time)."""
    for rank in range(pp):
        slots = _slots(schedule, pp, m, chunks, rank)
        assert all(1 <= n <= m for n in slots.values())
        assert sum(slots.values()) >= max_in_flight_bound(schedule, pp, m, chunks, rank)
    assert sum(_slots("interleaved_1f1b", 2, 4, 4, 0).values()) == 12  # against 9 held at once


def test_cuda_graphs_are_refused_where_they_cannot_run() -> None:
    model = MODELS["timm_vit"]()
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        autopipe.parallelize(model, (x,), loss_fn=F.cross_entropy, cuda_graphs=True, device="cpu")
    with pytest.raises(ConfigError, match="tp=2"):
        autopipe.parallelize(model, (x,), tp=2, loss_fn=F.cross_entropy, cuda_graphs=True)


def test_a_receive_lands_in_a_slot_only_where_the_slot_is_laid_out_as_its_specs() -> None:
    """[Note: graph slots as boundaries]: both ends of a transfer must see the same bytes, so a
    slot's static tensors take a message only where shape, dtype and strides are the specs'."""
    graphs = StageGraphs.__new__(StageGraphs)  # the check alone: no capture (which needs a GPU)
    graphs._fits = {}
    graphs._slots = [SimpleNamespace(inputs=(torch.empty(2, 3, 4, 4).contiguous(memory_format=torch.channels_last),),
                                     grad_outputs=[torch.empty(2, 5)])]
    assert graphs._fit(True, [TensorSpec((2, 3, 4, 4), torch.float32, channels_last=True)])
    assert not graphs._fit(True, [TensorSpec((2, 3, 4, 4), torch.float32)])  # another layout
    assert not graphs._fit(True, [TensorSpec((2, 3, 4, 4), torch.float32, True)] * 2)  # another count
    assert graphs._fit(False, [TensorSpec((2, 5), torch.float32)])
    assert not graphs._fit(False, [TensorSpec((2, 5), torch.bfloat16)]) and not graphs._fit(False, [TensorSpec((4, 5), torch.float32)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_no_longer_used_are_freed_before_the_next_capture():
    """A stage's graphs sit in reference cycles; left to the collector, the memory pools of
    stages timed one after another pile up until a capture fails. The next capture frees them."""
    device = torch.device("cuda")
    stage = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).to(device)
    specs = [TensorSpec((8, 64), torch.float32)]
    enabled = gc.isenabled()
    gc.disable()  # nothing but StageGraphs may collect here
    try:
        first = StageGraphs(stage, specs, [True], 1, device)
        slot = weakref.ref(first._slots[0])
        del first
        StageGraphs(stage, specs, [True], 1, device)
        assert slot() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("set_to_none", [True, False])
def test_graphed_backward_accumulates_gradients_as_eager_does(set_to_none: bool) -> None:
    """The backward graphs add every micro-batch's parameter gradients into .grad themselves;
    the optimizer's zero_grad (to None, or in place) between steps changes nothing."""
    results = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(8, 10))
        pm = autopipe.parallelize(model, (torch.randn(2, 3, 16, 16),), microbatches=4, chunks=2, schedule="gpipe",
                                  loss_fn=F.cross_entropy, device="cuda", cuda_graphs=graphs)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = torch.randn(8, 3, 16, 16, generator=g).cuda(), torch.randint(0, 10, (8,), generator=g).cuda()
            losses.append(float(pm.train_step(x, y)))
            grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        results[graphs] = losses, grads, {k: v.cpu() for k, v in pm.full_state_dict().items()}
    (eager_losses, eager_grads, eager_state), (losses, grads, state) = results[False], results[True]
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, value in eager_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=name)
