"""A model in channels-last layout keeps it across stage boundaries ([Note: boundary layout] in
autopipe/memory_format.py): 4-D activations made channels-last, and their gradients, are sent,
received and timed in channels-last; other 4-D tensors (a block's NHWC maps) plain contiguous;
and the pipeline trains exactly as one process does."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.measure import time_plan, timer
from autopipe.memory_format import boundary_layout, channels_last_model
from autopipe.partition.partitioner import partition
from autopipe.runtime.p2p import TensorSpec
from autopipe.tracer import trace
from tests.distributed import run_distributed

CL = torch.channels_last


def convnet() -> nn.Module:
    torch.manual_seed(0)
    block = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())  # noqa: E731
    return nn.Sequential(block(3, 16), block(16, 16), block(16, 32), block(32, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class Permute(nn.Module):
    def __init__(self, *dims: int) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.dims)


def nhwc_net() -> nn.Module:
    """A conv stem, then a block on NHWC maps (as Swin's and ConvNeXt's are): split at "5", the
    boundary is a (B, H, W, C) map that is plain contiguous, not channels-last."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), Permute(0, 2, 3, 1), nn.LayerNorm(16),
                         nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), Permute(0, 3, 1, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 16, 16, generator=g).contiguous(memory_format=CL), torch.randint(0, 10, (8,), generator=g)


def test_a_model_is_channels_last_where_its_kernels_are():
    model = convnet()
    assert not channels_last_model(model)
    assert channels_last_model(model.to(memory_format=CL))
    assert not channels_last_model(nn.Sequential(nn.Conv2d(3, 4, 1)).to(memory_format=CL))  # a 1x1 kernel is both
    assert not channels_last_model(nn.Linear(4, 4))


def test_spec_lays_out_4d_tensors_only():
    spec = TensorSpec((2, 3, 4, 5), torch.float32, channels_last=True)
    assert spec.empty(torch.device("cpu")).is_contiguous(memory_format=CL) and not spec.empty(torch.device("cpu")).is_contiguous()
    assert spec.packed(torch.randn(2, 3, 4, 5)).is_contiguous(memory_format=CL)
    flat = TensorSpec((2, 3), torch.float32, channels_last=True)
    assert not flat.channels_last and flat.empty(torch.device("cpu")).is_contiguous()
    assert TensorSpec((2, 3, 4, 5), torch.float32).memory_format == torch.contiguous_format


def test_the_timer_hands_stages_channels_last_inputs():
    model = convnet().to(memory_format=CL)
    traced = trace(model, (data()[0][:2],))
    plan = partition(traced, 2, device="cpu")
    seen = _timed_inputs(traced, plan, lambda x: x.is_contiguous(memory_format=CL))
    assert seen == [[True], [True]]


def _timed_inputs(traced: Any, plan: Any, look: Any) -> list[list[Any]]:
    """``look(x)`` of each 4-D input the timer hands each stage of ``plan``."""
    seen = []
    original = timer.StageRun.__init__

    def spy(self, stage, inputs, grads, setup):
        seen.append([look(x) for x in inputs if x.dim() == 4])
        original(self, stage, inputs, grads, setup)

    timer.StageRun.__init__ = spy
    try:
        time_plan(traced, plan, timer.RunSetup("cpu", reps=1, warmup=1))
    finally:
        timer.StageRun.__init__ = original
    return seen


def test_a_boundary_travels_in_the_layout_it_was_traced_in():
    model = nhwc_net().to(memory_format=CL)
    traced = trace(model, (data()[0][:2],))
    layouts = {n.name: boundary_layout(n.meta.get("val")) for n in traced.gm.graph.nodes}
    assert layouts["input_1"] == layouts["_1"] == CL  # the input and the batch norm's maps
    assert layouts["_4"] == layouts["_5"] == torch.contiguous_format  # NHWC maps, 4-D but not channels-last
    assert layouts["permute_1"] == CL  # permuted back: channels-last strides
    assert boundary_layout(torch.randn(2, 3)) == boundary_layout(None) == torch.contiguous_format


def test_the_timer_hands_an_nhwc_boundary_over_contiguous():
    model = nhwc_net().to(memory_format=CL)
    traced = trace(model, (data()[0][:2],))
    plan = partition(traced, 2, device="cpu", balance=["5"])
    seen = _timed_inputs(traced, plan, lambda x: (x.is_contiguous(), x.is_contiguous(memory_format=CL)))
    assert seen == [[(False, True)], [(True, False)]]


def _train(rank: int, world: int, layout: Any, make: Any = None, split: Any = None) -> Any:
    model = (make or convnet)()
    if layout is not None:
        model = model.to(memory_format=layout)
    x, y = data()
    pm = autopipe.parallelize(model, (x[:2],), pp=2, microbatches=4, loss_fn=F.cross_entropy, device="cpu",
                              batchnorm="microbatch", **({} if split is None else {"balance": split}))
    received = []
    for stage in pm._runtime.stages.values():
        stage.register_forward_pre_hook(lambda m, args: received.append(
            [(a.is_contiguous(), a.is_contiguous(memory_format=CL)) if make else a.is_contiguous(memory_format=CL)
             for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        losses.append(pm.train_step(x, y))
        pm.step(opt)
        opt.zero_grad()
    state = pm.full_state_dict()
    pm.close()
    return rank, [None if l is None else float(l) for l in losses], received, state


def _check_trained_as_one_process(results: list, make: Any, stage1_received: list) -> None:
    """Two SGD steps of ``make()`` in one process, 4 micro-batches accumulated, against every
    rank's full state; and what stage 1 received, on rank 1."""
    reference = make().to(memory_format=CL)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = data()
    for _ in range(2):
        for xm, ym in zip(x.split(2), y.split(2)):
            (F.cross_entropy(reference(xm), ym) / 4).backward()
        opt.step()
        opt.zero_grad()
    for rank, losses, received, state in results:
        if rank == 1:
            assert received and all(r == stage1_received for r in received)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_channels_last_pipeline_keeps_the_layout_and_trains_as_one_process():
    results = run_distributed(_train, 2, CL, timeout=200)
    _check_trained_as_one_process(results, convnet, [True])  # stage 1's inputs arrived over gloo in channels-last


def test_an_nhwc_boundary_of_a_channels_last_model_arrives_contiguous_and_trains_as_one_process():
    results = run_distributed(_train, 2, CL, nhwc_net, ["5"], timeout=200)
    _check_trained_as_one_process(results, nhwc_net, [(True, False)])  # the NHWC map as made: plain contiguous


def stem_net() -> nn.Module:
    """ResNet's stem: a 7x7 stride-2 convolution over 3 channels (which the CPU and meta kernels
    write plain contiguous, and cuDNN channels-last), a batch norm and a pool."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("channels_last", [True, False])
def test_a_convolution_is_traced_in_the_layout_the_gpu_writes(channels_last: bool, device: str):
    # See [Note: a convolution's layout as the GPU makes it] in tracer/shapes.py. On the meta
    # device (where `autopipe report` and the benchmarks plan) the convolutions' outputs came
    # out plain contiguous whatever the layout of their inputs and weights.
    with torch.device(device):
        model, x = stem_net(), torch.empty(2, 3, 16, 16).normal_()
    model, x = (model.to(memory_format=CL), x.contiguous(memory_format=CL)) if channels_last else (model, x)
    traced = trace(model, (x,))
    layouts = {n.name: boundary_layout(n.meta.get("val")) for n in traced.gm.graph.nodes}
    expected = CL if channels_last else torch.contiguous_format
    assert [layouts[k] for k in ("_0", "_1", "_2", "_3", "_4")] == [expected] * 5, layouts
