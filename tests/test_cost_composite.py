"""Composite modules: a call_module node whose module has no cost rule but has children.

The sequence route (exec_sequence) and a user's leaf_modules keep whole blocks opaque, such as
torchvision ResNet's ``layer1``. The cost model prices such a node by tracing the block, so it
must cost what the fx-traced graph of the same block costs; see [Note: composite modules].
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torchvision

from autopipe.graph import owning_module
from autopipe.partition import cost as cost_module, rule_tables
from autopipe.partition.cost import MATMUL_KINDS, NodeCost, graph_costs
from autopipe.partition.device import get_profile
from autopipe.stages import plan_stages
from autopipe.tracer import trace

SEQUENCE = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool",
            functools.partial(torch.flatten, start_dim=1), "fc"]
LAYERS = ["layer1", "layer2", "layer3", "layer4"]


@functools.lru_cache(maxsize=None)
def _resnet50(batch: int):
    """ResNet-50 on the meta device (64x64 images), fx-traced and exec_sequence-traced."""
    with torch.device("meta"):
        model = torchvision.models.resnet50(num_classes=10)
        x = torch.randn(batch, 3, 64, 64)
    return model, trace(model, (x,)), trace(model, (x,), exec_sequence=SEQUENCE)


def _time(profile, c: NodeCost) -> float:
    return profile.node_time(c) + profile.node_time(c, backward=True)


def test_exec_sequence_block_costs_what_its_fx_graph_costs():
    _, fx_traced, seq_traced = _resnet50(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no block may fall back to the elementwise guess
        fx_costs, seq_costs = graph_costs(fx_traced.gm), graph_costs(seq_traced.gm)
    seq_nodes = {n.target: n for n in seq_traced.gm.graph.nodes if n.op == "call_module"}
    for layer in LAYERS:
        c = seq_costs[seq_nodes[layer].name]
        inner = [fx_costs[n.name] for n in fx_traced.gm.graph.nodes
                 if owning_module(n) == layer or owning_module(n).startswith(layer + ".")]

        def total(field: str) -> float:
            return sum(getattr(x, field) for x in inner)

        assert c.kind == "composite"
        assert c.fwd_flops == pytest.approx(total("fwd_flops"), rel=0.01), layer
        assert c.bwd_flops == pytest.approx(total("bwd_flops"), rel=0.01), layer
        for field in ("fwd_bytes", "bwd_bytes", "saved_bytes", "param_count", "param_bytes"):
            assert getattr(c, field) == pytest.approx(total(field), rel=0.01), (layer, field)
        for name in ("h200", "cpu"):  # convs on matmul units, norms and relus on vector units
            profile = get_profile(name)
            assert _time(profile, c) == pytest.approx(sum(_time(profile, x) for x in inner), rel=0.02)
        assert {p.kind for p in c.parts} >= {"matmul", "norm", "elementwise"}
    assert sum(c.param_count for c in seq_costs.values()) == sum(
        p.numel() for p in seq_traced.gm.parameters())


def test_composite_time_is_the_sum_of_its_parts():
    # One summed cost of one kind would put the block's elementwise FLOPs on matmul units (or
    # its convs on vector units) and launch it once; the parts are priced one by one instead.
    _, _, seq_traced = _resnet50(2)
    layer1 = next(n for n in seq_traced.gm.graph.nodes if n.target == "layer1")
    c = graph_costs(seq_traced.gm)[layer1.name]
    profile = get_profile("h200")
    parts_time = sum(_time(profile, p) for p in c.parts)
    assert _time(profile, c) == pytest.approx(parts_time)
    assert sum(p.fwd_flops for p in c.parts if p.kind in MATMUL_KINDS) < c.fwd_flops
    assert c.out_bytes == layer1.meta["val"].numel() * 4


def test_exec_sequence_resnet50_cost_balance():
    # The exec_sequence graph can only cut between its items (whole layers), so its best
    # split cannot match the fx graph's in-block cuts; but it must be priced as the fx graph
    # prices the same split. Costing layer1..4 as elementwise (the old fallback) cut before
    # layer1, layer3 and layer4: imbalance 1.14 by its own model, 1.71 priced on the fx graph.
    _, fx_traced, seq_traced = _resnet50(8)
    seq_plan = plan_stages(seq_traced, 4, balance="cost", device="h200")
    starts = [s.modules[0] for s in seq_plan.stages[1:]]
    assert starts == ["layer2", "layer3", "layer4"]  # the best whole-layer split at this size
    repriced = plan_stages(fx_traced, 4, balance=starts, device="h200")
    assert seq_plan.imbalance == pytest.approx(repriced.imbalance, abs=0.01)
    fx_plan = plan_stages(fx_traced, 4, balance="cost", device="h200")
    assert fx_plan.imbalance <= seq_plan.imbalance < 1.45


def test_user_leaf_block_costs_what_it_runs():
    # The same fallback hit a block kept opaque by leaf_modules: now the totals are unchanged.
    model, x = torchvision.models.resnet18(num_classes=10).eval(), torch.randn(2, 3, 32, 32)
    plain = graph_costs(trace(model, (x,)).gm)
    leafy_traced = trace(model, (x,), leaf_modules=[torchvision.models.resnet.BasicBlock])
    assert "layer2.0" in {n.target for n in leafy_traced.gm.graph.nodes}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        leafy = graph_costs(leafy_traced.gm)
    for field in ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "saved_bytes", "param_count"):
        assert sum(getattr(c, field) for c in leafy.values()) == pytest.approx(
            sum(getattr(c, field) for c in plain.values()), rel=1e-6), field


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: cannot be traced
            return self.fc(x)
        return -x


def test_untraceable_block_falls_back_to_the_elementwise_guess():
    model = nn.Sequential(_Gated())

    class Leaf(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, _Gated) or super().is_leaf_module(m, qualname)

    gm = fx.GraphModule(model, Leaf().trace(model))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    for n in gm.graph.nodes:
        n.meta["val"] = torch.empty(3, 4, device="meta")
    rule_tables._warned_modules.discard(_Gated)
    with pytest.warns(UserWarning, match="MODULE_RULES"):
        c = graph_costs(gm)[node.name]
    assert (c.kind, c.fwd_flops, c.param_count, c.parts) == ("elementwise", 12, 20, ())


def test_composite_trace_is_cached_and_keeps_train_modes(monkeypatch):
    model = torchvision.models.resnet18(num_classes=10).train()
    model.layer1[0].bn1.eval()  # a frozen norm inside a training block stays frozen
    x = torch.randn(2, 3, 32, 32)
    traced = trace(model, (x,), exec_sequence=SEQUENCE)
    calls = []
    real = cost_module.trace_fx
    monkeypatch.setattr(cost_module, "trace_fx", lambda m, *a, **k: calls.append(m) or real(m, *a, **k))
    first = graph_costs(traced.gm)
    assert len(calls) == 4  # layer1..layer4
    assert graph_costs(traced.gm) == first and len(calls) == 4  # cached: no second trace
    assert not model.layer1[0].bn1.training and model.layer1[0].bn2.training


def _attention_leaves(model: nn.Module, size: int) -> list[tuple[str, NodeCost, float]]:
    """(type, cost, torch.utils.flop_counter's forward FLOPs) of every attention leaf."""
    from torch.utils.flop_counter import FlopCounterMode

    model.eval()
    traced = trace(model, (torch.randn(2, 3, size, size),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "costed as elementwise" fallback
        costs = graph_costs(traced.gm)
    out = []
    for node in traced.gm.graph.nodes:
        module = traced.gm.get_submodule(node.target) if node.op == "call_module" else None
        if module is None or "Attention" not in type(module).__name__:
            continue

        def real(a):
            return torch.randn(a.meta["val"].shape) if isinstance(a, fx.Node) else a

        with FlopCounterMode(display=False) as counter, torch.no_grad():
            module(*map(real, node.args), **{k: real(v) for k, v in node.kwargs.items()})
        out.append((type(module).__name__, costs[node.name], counter.get_total_flops()))
    return out


@pytest.mark.parametrize("model,size,kinds", [
    ("levit", 64, {"Attention", "AttentionDownsample"}),  # leaves: they cache their bias in eval()
])
def test_attention_leaves_cost_what_they_run(model, size, kinds):
    import timm

    built = timm.create_model("levit_128s", img_size=size, num_classes=10)
    leaves = _attention_leaves(built, size)
    assert {kind for kind, _, _ in leaves} == kinds
    for kind, cost, flops in leaves:
        assert cost.kind == "composite", kind
        # flop_counter counts the matmuls alone; the cost model adds softmax, scale and bias adds.
        assert flops <= cost.fwd_flops <= 1.05 * flops, (kind, cost.fwd_flops, flops)
        assert {p.kind for p in cost.parts} & set(MATMUL_KINDS)


@pytest.mark.parametrize("act", ["silu", None])
def test_a_norm_with_an_activation_of_its_own_costs_the_norm_and_the_activation(act):
    """timm's BatchNormAct2d runs its norm, then its ``act``: priced as a BatchNorm2d followed by
    that activation, two kernels ([Note: norms with an activation]); without one, as the norm."""
    from timm.layers import BatchNormAct2d

    x = torch.randn(4, 16, 8, 8)
    fused = trace(nn.Sequential(BatchNormAct2d(16, act_layer=act or nn.Identity, apply_act=act is not None)), (x,))
    apart = trace(nn.Sequential(nn.BatchNorm2d(16), *([nn.SiLU()] if act else [])), (x,))
    (node,) = [n for n in fused.gm.graph.nodes if n.op == "call_module"]
    cost = graph_costs(fused.gm)[node.name]
    inner = [c for n, c in graph_costs(apart.gm).items() if c.kind not in ("view", "none")]
    assert [p.kind for p in (cost.parts or (cost,))] == [c.kind for c in inner] == \
        (["norm", "elementwise"] if act else ["norm"])
    for field in ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "saved_bytes", "param_count"):
        assert getattr(cost, field) == sum(getattr(c, field) for c in inner), field
    profile = get_profile("h100")
    assert _time(profile, cost) == pytest.approx(sum(_time(profile, c) for c in inner))
