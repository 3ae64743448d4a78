"""The end of a step, as it runs and as the layout search prices it: the global gradient norm in
multi-tensor kernels, torch's default AdamW on CUDA, and stages slowed by the NCCL kernels
beside them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopipe.partition.device import get_profile
from autopipe.search import Layout, LinkModel, Pricing, plan_layout
from autopipe.search.costs import GraphCosts
from autopipe.search.plan import STEP_DEFAULTS
from autopipe.search.predict import ADAMW_FOREACH_BYTES_PER_PARAM, NORM_OPS_PER_TENSOR, predict
from autopipe.tracer import trace
from autopipe.training.gradients import global_grad_norm
from tests.models import timm_vit


def _graph() -> GraphCosts:
    torch.manual_seed(0)
    return GraphCosts(trace(timm_vit(depth=4), (torch.randn(2, 3, 32, 32),)), 2)


def _pricing(**changes) -> Pricing:
    profile = get_profile("h100")
    return dataclasses.replace(Pricing(profile, LinkModel.from_profile(profile), 8), **changes)


def test_the_global_norm_equals_torchs_over_mixed_dtypes():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 7)) for _ in range(3)]
    params += [torch.nn.Parameter(torch.randn(11, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    params[-1].grad = None  # a parameter without a gradient is left out
    ours = global_grad_norm(params, [], torch.device("cpu"))
    theirs = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in params[:-1]]))
    assert ours.dtype == torch.float32
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert float(global_grad_norm(params[-1:], [], torch.device("cpu"))) == 0.0


def test_stages_next_to_nccl_kernels_are_slowed_and_lone_ones_are_not():
    graph = _graph()
    plain, slowed = _pricing(), _pricing(neighbour_scale=1.5)
    for layout in (Layout(2, 1, 1, 4, 1, "1f1b", False, False, "graphs"),
                   Layout(1, 2, 1, 1, 1, "1f1b", False, False, "graphs")):
        a, b = predict(graph, layout, plain), predict(graph, layout, slowed)
        assert b.parts["pipeline"] > a.parts["pipeline"] * 1.2, layout
    # dp replicas compute alone (their all-reduce runs after the last backward)
    alone = Layout(1, 1, 2, 1, 1, "1f1b", False, False, "graphs")
    assert predict(graph, alone, slowed).step_seconds == pytest.approx(predict(graph, alone, plain).step_seconds)


def test_the_norm_pays_its_own_host_cost_per_tensor():
    graph = _graph()
    layout = Layout(1, 1, 1, 1, 1, "1f1b", False, False, "graphs")
    tensors = float(graph.param_tensors.sum())
    base = predict(graph, layout, _pricing(tensor_overhead=20e-6))
    assert predict(graph, layout, _pricing(tensor_overhead=20e-6, norm_tensor_overhead=None)).parts["grad_norm"] == \
        pytest.approx(base.parts["grad_norm"])  # None: a tenth of the optimizer's per tensor
    own = predict(graph, layout, _pricing(tensor_overhead=20e-6, norm_tensor_overhead=7e-6))
    assert own.parts["grad_norm"] - base.parts["grad_norm"] == \
        pytest.approx(tensors * (7e-6 - 20e-6 / NORM_OPS_PER_TENSOR))


def test_gpu_searches_price_torchs_default_adamw_and_cpu_searches_keep_theirs():
    cuda, cpu = STEP_DEFAULTS["cuda"], STEP_DEFAULTS["cpu"]
    assert cuda.optimizer_bytes == ADAMW_FOREACH_BYTES_PER_PARAM > cpu.optimizer_bytes
    assert cuda.neighbour_scale > 1.0 == cpu.neighbour_scale
    model = timm_vit(depth=2)
    kwargs = dict(devices=2, batch=16, example_inputs=(torch.randn(2, 3, 32, 32),), modes=("graphs",))
    gpu = plan_layout(model, device="h100", **kwargs)
    fused = plan_layout(model, device="h100", optimizer_bytes=32.0, **kwargs)
    by_name = {str(p.layout): p for p in fused.ranked}
    for p in gpu.ranked:
        assert p.parts["optimizer"] > by_name[str(p.layout)].parts["optimizer"]


def test_a_pipelines_own_scale_prices_pp_and_the_collectives_scale_prices_tp():
    graph = _graph()
    pp = Layout(2, 1, 1, 4, 1, "1f1b", False, False, "graphs")
    tp = Layout(1, 2, 1, 1, 1, "1f1b", False, False, "graphs")
    both = _pricing(neighbour_scale=1.5)
    split = _pricing(neighbour_scale=1.5, pipeline_scale=1.0)
    assert predict(graph, pp, split).parts["pipeline"] < predict(graph, pp, both).parts["pipeline"] / 1.2
    assert predict(graph, pp, split).parts["pipeline"] == pytest.approx(predict(graph, pp, _pricing()).parts["pipeline"])
    assert predict(graph, tp, split).parts["pipeline"] == pytest.approx(predict(graph, tp, both).parts["pipeline"])
    # Receives posted just in time between GPUs of one host: a pipeline loses less than tp does.
    assert 1.0 < STEP_DEFAULTS["cuda"].pipeline_scale < STEP_DEFAULTS["cuda"].neighbour_scale
