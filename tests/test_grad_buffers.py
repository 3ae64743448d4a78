"""Gradients as views of one buffer ([Note: gradients as views of one buffer]): laid out back to
back, found again as one tensor, and all-reduced in place over the data-parallel group."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autopipe.runtime.grad_buffers import GradientViews, flat_gradients, flat_view
from autopipe.training.gradients import average_gradients
from tests.distributed import run_distributed


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5)),
            nn.Parameter(torch.randn(2, 2, dtype=torch.float64)), nn.Parameter(torch.randn(7))]


def test_gradients_lie_back_to_back_per_dtype_and_keep_what_they_held():
    params = _params()
    params[1].grad = torch.full((5,), 2.0)
    views = flat_gradients(params)
    assert [v.shape for v in views] == [p.shape for p in params] and [v.dtype for v in views] == [p.dtype for p in params]
    assert torch.equal(views[1], params[1].grad) and not views[0].any() and not views[3].any()
    fp32 = [views[0], views[1], views[3]]
    whole = flat_view(fp32)
    assert whole is not None and whole.numel() == 12 + 5 + 7
    assert whole.data_ptr() == views[0].data_ptr()
    whole.add_(1.0)  # one tensor over the same memory
    assert torch.equal(views[1], torch.full((5,), 3.0)) and torch.equal(views[3], torch.ones(7))
    assert flat_view([views[2]]) is not None and flat_view([views[2]]).dtype == torch.float64


def test_gradients_keep_their_parameters_layout():
    """A channels-last convolution weight gets a channels-last gradient view (autograd's layout
    contract), which backward adds into where it lies and which stays part of the one buffer."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    weight = conv.weight
    assert not weight.is_contiguous() and weight.is_contiguous(memory_format=torch.channels_last)
    views = flat_gradients([weight, conv.bias])
    assert views[0].stride() == weight.stride() and views[1].data_ptr() == views[0].data_ptr() + 4 * weight.numel()
    weight.grad, conv.bias.grad = views
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    conv(x).square().sum().backward()
    assert weight.grad.data_ptr() == views[0].data_ptr() and weight.grad.stride() == weight.stride()
    ref = nn.Conv2d(4, 8, 3)
    ref.load_state_dict(conv.state_dict())
    ref(x.contiguous()).square().sum().backward()
    torch.testing.assert_close(weight.grad, ref.weight.grad)
    whole = flat_view(views)
    assert whole is not None and whole.numel() == weight.numel() + 8 and whole.data_ptr() == views[0].data_ptr()


def test_gradients_not_back_to_back_are_not_one_tensor():
    views = flat_gradients(_params())
    assert flat_view([views[1], views[0]]) is None  # out of order
    assert flat_view([views[0], views[3]]) is None  # a gap between them
    assert flat_view([torch.zeros(3), torch.zeros(3)]) is None  # separate allocations
    assert flat_view([views[0][:, ::2]]) is None  # not dense (a transposed view is: it lies back to back)
    alone = torch.arange(6.0)
    assert torch.equal(flat_view([alone]), alone)


def test_prepared_gradients_are_their_views_again_holding_what_they_had():
    params = _params()
    views = GradientViews(params + [params[0]])  # a tied parameter once
    assert views.params == params
    views.prepare()  # every gradient None: one zeroing pass over each buffer
    assert all(p.grad is v for p, v in zip(params, views.views)) and not any(v.any() for v in views.views)
    params[0].grad.fill_(1.0)  # kept: left as it is
    params[1].grad = torch.full((5,), 2.0)  # replaced: copied in
    params[3].grad = None  # set to None alone: zeroed alone
    views.views[3].fill_(7.0)
    views.prepare()
    assert all(p.grad is v for p, v in zip(params, views.views))
    assert torch.equal(params[0].grad, torch.ones(3, 4)) and torch.equal(params[1].grad, torch.full((5,), 2.0))
    assert not params[3].grad.any()
    for p in params:
        p.grad = None
    views.views[1].fill_(3.0)
    views.prepare()
    assert not any(v.any() for v in views.views)


def average_worker(rank: int, world_size: int) -> dict:
    from autopipe.training import gradients

    flattened = []
    flatten = gradients._flatten_dense_tensors
    gradients._flatten_dense_tensors = lambda ts: flattened.append(len(ts)) or flatten(ts)
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(5)),
              nn.Parameter(torch.zeros(2, dtype=torch.float64)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    for p, v in zip(params, flat_gradients(params[:2])):  # two in one buffer; the float64 two apart
        p.grad = v
    buffer = flat_view([params[0].grad, params[1].grad])
    average_gradients(params, dist.group.WORLD, world_size)
    return {"grads": [p.grad.clone() for p in params], "buffer": buffer.clone(), "flattened": flattened}


def test_views_of_one_buffer_are_averaged_in_place_beside_gradients_copied_flat():
    for got in run_distributed(average_worker, 2, timeout=60):
        assert got["flattened"] == [2]  # only the float64 bucket was copied
        assert torch.equal(got["buffer"], torch.full((17,), 1.5))  # averaged where it lies
        for g in got["grads"]:
            assert torch.equal(g, torch.full_like(g, 1.5))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]


def data_parallel_worker(rank: int, world_size: int) -> dict:
    """dp=2 eager training with the default ``zero_grad()`` (gradients set to None each step) and
    one step of two accumulated calls under ``no_sync``."""
    import torch.nn.functional as F

    import autopipe
    from autopipe.training import gradients

    flattened = []
    flatten = gradients._flatten_dense_tensors
    gradients._flatten_dense_tensors = lambda ts: flattened.append(len(ts)) or flatten(ts)
    pm = autopipe.parallelize(_conv_net(), (torch.randn(4, 3, 8, 8),), loss_fn=F.cross_entropy, device="cpu",
                              pp=1, tp=1)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    mine = slice(4 * pm.dp_rank, 4 * pm.dp_rank + 4)
    one_buffer = []
    for i, (x, y) in enumerate(_batches()):
        if i == 2:
            with pm.no_sync():
                pm.train_step(x[mine][:2], y[mine][:2], grad_scale=0.5)
            pm.train_step(x[mine][2:], y[mine][2:], grad_scale=0.5)
        else:
            pm.train_step(x[mine], y[mine])
        one_buffer.append(flat_view([p.grad for p in pm.parameters()]) is not None)
        pm.step(opt)
        opt.zero_grad()
    state = pm.full_state_dict()  # every rank takes part
    pm.close()
    return {"state": {k: v.clone() for k, v in state.items()} if rank == 0 else None,
            "flattened": flattened, "one_buffer": one_buffer}


def test_eager_data_parallel_gradients_are_views_of_one_buffer_and_train_as_one_process():
    """The gradients of eager dp stages are made views of one buffer before every step (after
    ``zero_grad()`` set them to None too), so the all-reduce copies nothing; training matches one
    process on the whole batch, accumulation included."""
    import torch.nn.functional as F

    got = run_distributed(data_parallel_worker, 2, timeout=120)
    for r in got:
        assert r["one_buffer"] == [True, True, True] and r["flattened"] == []
    ref = _conv_net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(_batches()):
        if i == 2:  # the mean over the batch, as two halves of each replica's share accumulated
            for half in (slice(0, 2), slice(2, 4)):
                idx = torch.cat([torch.arange(8)[r * 4:(r + 1) * 4][half] for r in range(2)])
                (F.cross_entropy(ref(x[idx]), y[idx]) * 0.5).backward()
        else:
            F.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[0]["state"][k], v, rtol=1e-5, atol=1e-6)
