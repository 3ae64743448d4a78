"""Linear layers under mixed precision read weights cast once per step (runtime/weight_casts.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from autopipe.runtime.weight_casts import WeightCasts


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d, bias=False)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _pair():
    torch.manual_seed(0)
    ref = Block()
    gm = fx.symbolic_trace(copy.deepcopy(ref))
    return ref, gm


def _run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        out = model(x)
    out.float().square().mean().backward()
    return out


def test_forward_is_autocasts_bit_for_bit_and_weight_grads_are_fp32_products():
    ref, gm = _pair()
    casts = WeightCasts.install([gm], torch.bfloat16)
    # fc1 (weight, bias) and fc2 (weight): MultiheadAttention's out_proj is not called by the graph.
    assert len(casts) == 3
    x = torch.randn(4, 8, 32)
    out_ref, out = _run(ref, x), _run(gm, x)
    assert out.dtype == out_ref.dtype
    assert torch.equal(out, out_ref)
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "norm.weight", "attn.in_proj_weight"):
        g, g_ref = gm.get_parameter(name).grad, ref.get_parameter(name).grad
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, g_ref, rtol=2e-2, atol=2e-3)


def test_weight_gradient_is_not_rounded_to_bf16():
    torch.manual_seed(1)
    lin = nn.Linear(64, 48)
    gm = fx.symbolic_trace(nn.Sequential(lin))
    WeightCasts.install([gm], torch.bfloat16)
    x = torch.randn(16, 64)
    g = torch.randn(16, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        y = gm(x)
    y.backward(g.to(y.dtype))
    # The GEMM of the bf16 operands, accumulated in fp32: what autocast would round to bf16.
    expected = g.bfloat16().float().t() @ x.bfloat16().float()
    torch.testing.assert_close(lin.weight.grad, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(lin.weight.grad, expected.bfloat16().float())
    torch.testing.assert_close(lin.bias.grad, g.bfloat16().float().sum(0), rtol=1e-6, atol=1e-6)


def test_refresh_picks_up_an_optimizer_step():
    ref, gm = _pair()
    casts = WeightCasts.install([gm], torch.bfloat16)
    x = torch.randn(2, 8, 32)
    for model in (ref, gm):
        _run(model, x)
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    stale = _run(gm, x)
    casts.refresh()
    ref.load_state_dict(gm.state_dict())  # the same stepped weights, under plain autocast
    fresh, expected = _run(gm, x), _run(ref, x)
    assert torch.equal(fresh, expected)
    assert not torch.equal(stale, expected)


def test_frozen_weights_get_no_gradient():
    torch.manual_seed(2)
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    gm.get_submodule("0").weight.requires_grad_(False)
    WeightCasts.install([gm], torch.bfloat16)
    x = torch.randn(3, 8, requires_grad=True)
    _run(gm, x)
    assert gm.get_submodule("0").weight.grad is None
    assert gm.get_submodule("0").bias.grad is not None and x.grad is not None


def test_parallel_model_bf16_steps_track_autocast():
    """One process, pp=1: parallelize(mixed_precision="bf16") trains like torch.autocast."""
    import autopipe

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    loss_fn = nn.functional.cross_entropy
    pm = autopipe.parallelize(model, (torch.randn(4, 16),), microbatches=2, loss_fn=loss_fn,
                              mixed_precision="bf16", device="cpu")
    assert pm._runtime.weight_casts is not None and len(pm._runtime.weight_casts) == 4
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pm, ref))
    for step in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        loss = pm.train_step(x, y)
        opt.step()
        opt.zero_grad()
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                part = loss_fn(ref(xs), ys) / 2
            part.backward()
            ref_loss += float(part.detach())
        opt_ref.step()
        opt_ref.zero_grad()
        assert float(loss) == pytest.approx(ref_loss, rel=2e-2, abs=2e-2)
    for (name, p), p_ref in zip(pm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output GEMM runs on CUDA")
def test_cuda_weight_gradient_is_one_fp32_output_gemm():
    from autopipe.runtime import weight_casts

    torch.manual_seed(4)
    lin = nn.Linear(256, 512).cuda()
    gm = fx.symbolic_trace(nn.Sequential(lin))
    WeightCasts.install([gm], torch.bfloat16)
    x = torch.randn(8, 64, 256, device="cuda")
    g = torch.randn(8, 64, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        y = gm(x)
    y.backward(g.bfloat16())
    assert weight_casts._mm_out_dtype is True  # torch.mm(..., out_dtype=float32), not a fallback
    expected = g.bfloat16().double().reshape(-1, 512).t() @ x.bfloat16().double().reshape(-1, 256)
    torch.testing.assert_close(lin.weight.grad.double(), expected, rtol=1e-4, atol=1e-4)


def test_row_parallel_layers_cast_their_weight_and_leave_the_bias_to_the_graph():
    from autopipe.shard.modules import RowParallelLinear, copy_module

    torch.manual_seed(5)
    lin = nn.Linear(16, 8)
    row = copy_module(lin, RowParallelLinear)
    class LinearLeaves(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, nn.Linear)

    root = nn.Sequential(row)
    gm = fx.GraphModule(root, LinearLeaves().trace(root))
    casts = WeightCasts.install([gm], torch.bfloat16)
    assert len(casts) == 1  # the weight; the bias is not read by this layer
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        got, want = gm(x), torch.nn.functional.linear(x, lin.weight)
    assert torch.equal(got, want)


def test_an_input_gradient_that_does_not_fold_into_rows_is_one_gemm():
    """A gradient permuted from NCHW (ConvNeXt's last blocks behind the global pool) is copied
    into rows for one GEMM: no batched product over its leading dimensions ([Note: a gradient in
    rows]), and the same input gradient as autocast's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(5)
    lin = nn.Linear(64, 32)
    gm = fx.symbolic_trace(nn.Sequential(copy.deepcopy(lin)))
    WeightCasts.install([gm], torch.bfloat16)
    x = torch.randn(4, 3, 3, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(4, 32, 3, 3).permute(0, 2, 3, 1)  # (4, 3, 3, 32), strides (288, 3, 1, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        y, y_ref = gm(x), lin(x_ref)
    ops = Ops()
    with ops:
        y.backward(grad.to(y.dtype))
    y_ref.backward(grad.to(y_ref.dtype))
    assert "bmm" not in ops.names and ops.names.count("mm") == 2  # the input's gradient, the weight's
    assert x.grad.shape == x.shape
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=2e-2, atol=2e-2)
