"""Tests of autopipe.partition.cost and autopipe.partition.device.

Graphs come from a local fixture (symbolic tracing + value propagation, or torch.export), so
these tests do not depend on autopipe.tracer. FLOPs are checked against FlopCounterMode.
"""
from __future__ import annotations

import dataclasses
import itertools

import inspect
import operator
import time
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from autopipe.errors import ConfigError
from autopipe.partition.calibration import BYTE_BOUNDS
from autopipe.partition.cost import (
    MATMUL_KINDS,
    NodeCost,
    graph_costs,
    node_cost,
    training_state_bytes,
)
from autopipe.partition.device import (
    PROFILES,
    DeviceProfile,
    get_profile,
    gpu_profile_name,
    measure_node_times,
    measure_profile,
)
from autopipe.planning import default_profile

# --- graphs without autopipe.tracer --------------------------------------------------------


class _Leaves(fx.Tracer):
    """torch.nn leaves, plus every LayerNorm subclass (timm's LayerNorm, LayerNorm2d)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, nn.LayerNorm) or super().is_leaf_module(m, qualname)


class _ValueProp(fx.Interpreter):
    """Runs on real (or meta) tensors and stores meta["val"] as the graph contract asks."""

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        n.meta["val"] = pytree.tree_map(
            lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, result)
        return result


def symbolic(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    # Arguments past the example inputs keep their defaults (timm's attn_mask=None...).
    params = list(inspect.signature(model.forward).parameters.values())[len(inputs):]
    concrete = {p.name: p.default for p in params if p.default is not p.empty}
    gm = fx.GraphModule(model, _Leaves().trace(model, concrete_args=concrete or None))
    with torch.no_grad():
        _ValueProp(gm).run(*inputs)
    return gm


def exported(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    return torch.export.export(model, inputs, strict=False).module()  # FakeTensor meta["val"]


ROUTES = [pytest.param(symbolic, id="fx"), pytest.param(exported, id="export")]


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a, b=None, c=None):  # no *args: symbolic tracing cannot take them
        return self.fn(*[t for t in (a, b, c) if t is not None])


def counted_flops(model: nn.Module, *inputs: torch.Tensor) -> int:
    # The math SDPA backend runs bmm's, which FlopCounterMode counts; the fused CPU kernel
    # has no formula registered.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    return counter.get_total_flops()


def matmul_flops(costs: dict[str, NodeCost]) -> float:
    return sum(c.fwd_flops for c in costs.values() if c.kind in MATMUL_KINDS)


def only(gm: fx.GraphModule, costs: dict[str, NodeCost], kind: str) -> NodeCost:
    (cost,) = [costs[n.name] for n in gm.graph.nodes if costs[n.name].kind == kind]
    return cost


# --- exact formulas ------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_linear_flops_exact(route):
    x = torch.randn(2, 5, 16)
    gm = route(nn.Linear(16, 32), x)
    costs = graph_costs(gm)
    lin = only(gm, costs, "matmul")
    assert lin.fwd_flops == 2 * 10 * 16 * 32
    assert lin.bwd_flops == 2 * lin.fwd_flops
    assert lin.saved_bytes == x.numel() * 4
    assert lin.out_bytes == 2 * 5 * 32 * 4
    assert lin.fwd_bytes == (x.numel() + 16 * 32 + 32 + 2 * 5 * 32) * 4
    assert sum(c.param_count for c in costs.values()) == 16 * 32 + 32


@pytest.mark.parametrize("route", ROUTES)
def test_conv2d_flops_exact(route):
    conv = nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
    gm = route(conv, torch.randn(2, 4, 9, 9))
    c = only(gm, graph_costs(gm), "matmul")
    # 2 * N * C_out * (C_in / groups) * kh * kw * H_out * W_out
    assert c.fwd_flops == 2 * 2 * 8 * 2 * 3 * 3 * 5 * 5
    assert c.saved_bytes == 2 * 4 * 9 * 9 * 4


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Conv1d(3, 6, 5, padding=2), (2, 3, 20)),
    (lambda: nn.Conv3d(2, 4, 3), (1, 2, 6, 6, 6)),
    (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), (2, 4, 5, 5)),
    (lambda: nn.Conv2d(3, 8, 3), (3, 10, 10)),  # unbatched
])
def test_conv_variants_match_flop_counter(route, make, shape):
    model, x = make(), torch.randn(shape)
    assert matmul_flops(graph_costs(route(model, x))) == counted_flops(model, x)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("ev", [8, 16])
def test_sdpa_flops_formula(route, ev):
    b, h, lq, lk, d = 2, 4, 10, 12, 8
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, h, lk, d), torch.randn(b, h, lk, ev)
    model = Fn(F.scaled_dot_product_attention)
    gm = route(model, q, k, v)
    c = only(gm, graph_costs(gm), "attention")
    assert c.fwd_flops == 2 * b * h * lq * lk * (d + ev)
    if ev == d:
        assert c.fwd_flops == 4 * b * h * lq * lk * d
        assert c.bwd_flops == 2.5 * c.fwd_flops
    assert c.fwd_flops == counted_flops(model, q, k, v)
    assert c.saved_bytes >= (q.numel() + k.numel() + v.numel() + b * h * lq * ev) * 4


@pytest.mark.parametrize("op", [
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
])
def test_fused_attention_variants(op):
    # Built by hand on meta: these kernels only run on GPU, but the graph can hold them.
    graph = fx.Graph()
    q, k, v = (torch.empty(2, 4, 16, 8, device="meta") for _ in range(3))
    nodes = []
    for name, t in zip("qkv", (q, k, v)):
        nodes.append(graph.placeholder(name))
        nodes[-1].meta["val"] = t
    args = (*nodes, None, False) if "efficient" in str(op) else tuple(nodes)
    attn = graph.call_function(op, args)
    attn.meta["val"] = op(q, k, v, *args[3:])
    graph.output((attn,))
    c = node_cost(fx.GraphModule(nn.Module(), graph), attn)
    assert (c.kind, c.fwd_flops) == ("attention", 4 * 2 * 4 * 16 * 16 * 8)


def single_op(op, *args):
    """A graph holding one ATen call, for overloads the export of a CPU model never shows."""
    graph = fx.Graph()

    def placeholder(a):
        if not isinstance(a, torch.Tensor):
            return a
        node = graph.placeholder(f"t{len(graph.nodes)}")
        node.meta["val"] = a.to("meta")
        return node

    call = graph.call_function(op, pytree.tree_map(placeholder, args))
    with torch.no_grad():
        call.meta["val"] = pytree.tree_map(
            lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, op(*args))
    graph.output(call)
    return node_cost(fx.GraphModule(nn.Module(), graph), call)


aten = torch.ops.aten
_x = torch.randn(2, 8, 3, 3)
_w8, _b8 = torch.randn(8), torch.randn(8)
_q = torch.randn(2, 5, 8)


@pytest.mark.parametrize("op, args, expected", [
    (aten.native_layer_norm.default, (torch.randn(2, 5, 8), [8], _w8, _b8, 1e-5),
     dict(kind="norm", fwd_flops=5 * 80, saved_bytes=80 * 4 + 2 * 4 * 10)),
    (aten.native_group_norm.default, (_x, _w8, _b8, 2, 8, 9, 2, 1e-5),
     dict(kind="norm", saved_bytes=144 * 4 + 2 * 4 * 2 * 2)),
    (aten._native_batch_norm_legit_no_training.default, (_x, _w8, _b8, _w8.abs(), _b8.abs(), 0.1, 1e-5),
     dict(kind="norm", saved_bytes=144 * 4 + 2 * 4 * 8)),
    (aten.max_pool2d_with_indices.default, (torch.randn(2, 3, 4, 4), [2, 2], [2, 2]),
     dict(kind="reduction", fwd_flops=96, saved_bytes=96 * 4 + 24 * 8)),
    (aten.embedding.default, (torch.randn(10, 4), torch.randint(0, 10, (2, 3))),
     dict(kind="copy", fwd_flops=0, bwd_flops=24, saved_bytes=6 * 8, fwd_bytes=6 * 8 + 2 * 24 * 4)),
    (aten.convolution.default, (torch.randn(2, 4, 5, 5), torch.randn(4, 6, 3, 3), None, [1, 1], [0, 0],
                                [1, 1], True, [0, 0], 1),
     dict(kind="matmul", fwd_flops=2 * 2 * 4 * 6 * 9 * 25)),  # transposed: input positions
    (aten.native_dropout.default, (_x, 0.5, True), dict(kind="elementwise", saved_bytes=144)),
    (aten.dropout.default, (_x, 0.5, False), dict(kind="view", fwd_bytes=0)),
    (aten._native_multi_head_attention.default,
     (_q, _q, _q, 8, 2, torch.randn(24, 8), torch.randn(24), torch.randn(8, 8), _b8),
     dict(kind="attention", fwd_flops=2 * 8 * (10 * 8 * 3 + 10 * 8) + 4 * 10 * 5 * 8)),
    (aten.relu_.default, (_x.clone(),), dict(kind="elementwise", saved_bytes=144 * 4)),
    (aten.add_.Tensor, (_x.clone(), _x), dict(kind="elementwise", saved_bytes=0)),
    (aten.mul.Tensor, (_x, _x.clone()), dict(kind="elementwise", saved_bytes=2 * 144 * 4)),
], ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "")
def test_aten_overloads(op, args, expected):
    cost = single_op(op, *args)
    assert {k: getattr(cost, k) for k in expected} == expected


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(12, 6))
        self.bias = nn.Parameter(torch.randn(12))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("make, shapes", [
    (lambda: Fn(torch.matmul), [(2, 3, 4, 5), (5, 6)]),
    (lambda: Fn(operator.matmul), [(3, 4, 5), (5, 2)]),
    (lambda: Fn(torch.bmm), [(3, 4, 5), (3, 5, 6)]),
    (lambda: Fn(torch.baddbmm), [(3, 4, 6), (3, 4, 5), (3, 5, 6)]),
    (lambda: Fn(torch.addmm), [(4, 6), (4, 5), (5, 6)]),
    (lambda: Fn(lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k)), [(2, 3, 4, 5), (2, 3, 7, 5)]),
    (lambda: Fn(lambda a, b: torch.einsum("...ij,...jk->...ik", a, b)), [(2, 4, 5), (2, 5, 3)]),
    (lambda: _Linear(), [(2, 7, 6)]),
], ids=["matmul", "operator.matmul", "bmm", "baddbmm", "addmm", "einsum", "einsum...", "F.linear"])
def test_matmul_family_matches_flop_counter(route, make, shapes):
    model, inputs = make(), [torch.randn(s) for s in shapes]
    costs = graph_costs(route(model, *inputs))
    assert matmul_flops(costs) == counted_flops(model, *inputs)


@pytest.mark.parametrize("route", ROUTES)
def test_matmul_with_vector_operands(route):
    # FlopCounterMode has no formula for mv/dot, so these are checked by hand.
    gm = route(Fn(lambda a, b, c: (a @ b) @ c), torch.randn(3, 4, 5), torch.randn(5), torch.randn(4))
    costs = [c for c in graph_costs(gm).values() if c.kind == "matmul"]
    assert [c.fwd_flops for c in costs] == [2 * 3 * 4 * 5, 2 * 3 * 4]


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention(batch_first):
    mha = nn.MultiheadAttention(16, 4, kdim=12, vdim=10, batch_first=batch_first, dropout=0.0)
    q = torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16)
    k = torch.randn(2, 7, 12) if batch_first else torch.randn(7, 2, 12)
    v = torch.randn(2, 7, 10) if batch_first else torch.randn(7, 2, 10)
    model = Fn(lambda q, k, v: mha(q, k, v)[0])
    model.mha = mha
    gm = symbolic(model, q, k, v)
    costs = graph_costs(gm)
    c = only(gm, costs, "attention")
    n, lq, lk, e = 2, 5, 7, 16
    proj = 2 * n * (lq * 16 * e + lk * 12 * e + lk * 10 * e + lq * e * e)
    assert c.fwd_flops == proj + 4 * n * lq * lk * e
    assert c.param_count == sum(p.numel() for p in mha.parameters())
    # Train mode keeps MHA off its fused fast path, which FlopCounterMode cannot see into.
    model.train()
    with FlopCounterMode(display=False) as counter:
        model(q, k, v)
    assert c.fwd_flops == counter.get_total_flops()


# --- whole models --------------------------------------------------------------------------


def _timm_vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                             num_classes=10).eval()


def _resnet18() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10).eval()


def _hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, num_labels=10)
    return transformers.ViTForImageClassification(config).eval()


@pytest.mark.parametrize("make, route", [
    pytest.param(_timm_vit, symbolic, id="timm-vit-fx"),
    pytest.param(_timm_vit, exported, id="timm-vit-export"),
    pytest.param(_resnet18, symbolic, id="resnet18-fx"),
    pytest.param(_resnet18, exported, id="resnet18-export"),
    pytest.param(_hf_vit, exported, id="hf-vit-export"),  # transformers 5 fails symbolic_trace
])
def test_models_flops_and_params(make, route):
    model, x = make(), torch.randn(2, 3, 32, 32)
    gm = route(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rule may fail and no leaf may go unpriced
        costs = graph_costs(gm)
    # FlopCounterMode counts matmul/conv/attention only, so compare those nodes.
    assert matmul_flops(costs) == pytest.approx(counted_flops(model, x), rel=0.05)
    assert sum(c.param_count for c in costs.values()) == sum(p.numel() for p in model.parameters())
    assert sum(c.param_bytes for c in costs.values()) == sum(
        p.numel() * p.element_size() for p in model.parameters())
    for node in gm.graph.nodes:
        c = costs[node.name]
        assert min(c.fwd_flops, c.bwd_flops, c.fwd_bytes, c.bwd_bytes, c.saved_bytes) >= 0


def test_resnet_backward_matches_flop_counter():
    model, x = _resnet18(), torch.randn(2, 3, 32, 32, requires_grad=True)
    costs = graph_costs(symbolic(model, x.detach()))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    backward = counter.get_total_flops() - counted_flops(model, x)
    mine = sum(c.bwd_flops for c in costs.values() if c.kind in MATMUL_KINDS)
    assert mine == pytest.approx(backward, rel=0.05)


@pytest.mark.parametrize("route", ROUTES)
def test_shared_parameters_counted_once(route):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.block = nn.Linear(8, 8)

        def forward(self, ids):
            h = self.block(self.block(self.emb(ids)))  # one module called twice
            return F.linear(h, self.emb.weight)  # head tied to the embedding

    model = Tied()
    costs = graph_costs(route(model, torch.randint(0, 10, (2, 3))))
    assert sum(c.param_count for c in costs.values()) == 10 * 8 + 8 * 8 + 8 == sum(
        p.numel() for p in model.parameters())


# --- saved activations, views and defaults -------------------------------------------------


def _costs_by_target(gm: fx.GraphModule) -> dict[str, NodeCost]:
    costs = graph_costs(gm)
    return {str(n.target): costs[n.name] for n in gm.graph.nodes}


def test_saved_bytes_conventions():
    timm = pytest.importorskip("timm")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.ln2d = timm.layers.LayerNorm2d(8)
            self.bn = nn.BatchNorm2d(8)
            self.gn = nn.GroupNorm(2, 8)
            self.drop = nn.Dropout(0.1)
            self.nodrop = nn.Dropout(0.0)
            self.fc = nn.Linear(8 * 36, 4)

        def forward(self, x):
            h = self.gn(self.bn(self.ln2d(self.conv(x))))
            h = torch.relu(h) + h
            h = self.nodrop(self.drop(h)).permute(0, 2, 3, 1)
            return self.fc(h.flatten(1).view(h.shape[0], -1))

    x = torch.randn(2, 3, 6, 6)
    gm = symbolic(Net(), x)
    c = _costs_by_target(gm)
    act = 2 * 8 * 6 * 6 * 4
    assert c["conv"].saved_bytes == x.numel() * 4
    assert c["fc"].saved_bytes == act
    assert c["ln2d"].saved_bytes == act + 2 * 4 * (2 * 6 * 6) and c["ln2d"].kind == "norm"
    assert c["bn"].saved_bytes == act + 2 * 4 * 8
    assert c["gn"].saved_bytes == act + 2 * 4 * (2 * 2)
    assert c["drop"].saved_bytes == act // 4  # a 1-byte mask per element
    relu = next(cost for t, cost in c.items() if "relu" in t)
    assert relu.saved_bytes == act
    assert c["<built-in function add>"].saved_bytes == 0
    assert c["nodrop"] == NodeCost(0, 0, 0, 0, 0, 0, 0, act, "view")
    for view in ("permute", "flatten", "view"):
        assert c[view].saved_bytes == 0 and c[view].fwd_bytes == 0 and c[view].kind == "view"


def test_contiguous_copies_only_when_needed():
    # Meta tensors keep strides; LayerNorm2d, for one, returns a channels-last layout.
    gm = symbolic(Fn(lambda x, y: x.t().contiguous() + y.contiguous()), torch.randn(3, 4), torch.randn(4, 3))
    costs = graph_costs(gm)
    copy, noop = costs["contiguous"], costs["contiguous_1"]
    assert (copy.kind, copy.fwd_bytes, noop.kind, noop.fwd_bytes) == ("copy", 96, "view", 0)
    gm = symbolic(Fn(lambda x: x.contiguous(memory_format=torch.channels_last)), torch.randn(2, 3, 4, 4))
    assert graph_costs(gm)["contiguous"].kind == "copy"


def test_non_tensor_and_unknown_nodes():
    gm = symbolic(Fn(lambda x: torch.erf(x).reshape(x.size(0), -1)), torch.randn(3, 4))
    c = _costs_by_target(gm)
    assert c["size"] == NodeCost(0, 0, 0, 0, 0, 0, 0, 0, "none")
    erf = next(cost for t, cost in c.items() if "erf" in t)
    # Unknown ops: 1 FLOP per output element, read + write, inputs saved.
    assert (erf.kind, erf.fwd_flops, erf.fwd_bytes, erf.saved_bytes) == ("elementwise", 12, 96, 48)
    assert c["a"].kind == "none" and c["a"].out_bytes == 48


def test_integer_and_boolean_ops_have_no_backward():
    gm = exported(Fn(lambda ids, x: ((ids + 1) * 2, x > 0)), torch.randint(0, 9, (4, 4)), torch.randn(3))
    for cost in graph_costs(gm).values():
        assert cost.bwd_flops == cost.bwd_bytes == cost.saved_bytes == 0


def test_unknown_leaf_module_warns_and_counts_params():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.scale

    class CustomLeaf(_Leaves):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Custom) or super().is_leaf_module(m, qualname)

    model = nn.Sequential(Custom())
    gm = fx.GraphModule(model, CustomLeaf().trace(model))
    _ValueProp(gm).run(torch.randn(2, 4))
    with pytest.warns(UserWarning, match="MODULE_RULES"):
        costs = graph_costs(gm)
    assert costs["_0"].param_count == 4 and costs["_0"].fwd_flops == 8


def test_training_state_bytes():
    assert training_state_bytes(400) == 400 + 400 + 2 * 400  # fp32: param, grad, 2 moments
    assert training_state_bytes(400, "sgd") == 400 + 400 + 400
    assert training_state_bytes(200, "AdamW", param_dtype=torch.bfloat16) == 200 + 200 + 2 * 400
    with pytest.raises(ConfigError, match="adamw"):
        training_state_bytes(4, "lion9")


# --- device profiles -----------------------------------------------------------------------


def _cost(kind: str = "elementwise", flops: float = 0.0, nbytes: float = 0.0) -> NodeCost:
    return NodeCost(flops, 2 * flops, nbytes, 2 * nbytes, 0, 0, 0, 0, kind)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(PROFILES)), st.sampled_from(["matmul", "attention", "elementwise", "norm"]),
       st.floats(0, 1e15), st.floats(0, 1e12), st.floats(1, 1e12), st.floats(1, 1e12))
def test_node_time_monotone(name, kind, flops, nbytes, more_flops, more_bytes):
    p = get_profile(name)
    for backward in (False, True):
        t = p.node_time(_cost(kind, flops, nbytes), backward=backward)
        assert t >= 0
        assert p.node_time(_cost(kind, flops + more_flops, nbytes), backward=backward) >= t
        assert p.node_time(_cost(kind, flops, nbytes + more_bytes), backward=backward) >= t


@pytest.mark.parametrize("profile", ["h100", "h200"])
@pytest.mark.parametrize("kind", ["elementwise", "norm", "reduction"])
def test_calibrated_time_grows_across_byte_buckets(kind, profile):
    """A calibration's classes by bytes change factor at each bucket's edge: one byte more
    must still not cost less ([Note: monotone in bytes])."""
    p = get_profile(profile)
    assert p.calibration is not None
    for edge, flops, backward in itertools.product(BYTE_BOUNDS, (1e3, 1e10), (False, True)):
        scale = 2 if backward else 1  # _cost's backward moves twice the bytes
        under = p.node_time(_cost(kind, flops, edge / scale), backward=backward)
        over = p.node_time(_cost(kind, flops, edge / scale + 1), backward=backward)
        assert over >= under, (edge, flops, backward)


def test_node_time_roofline_and_free_nodes():
    p = dataclasses.replace(get_profile("h100"), calibration=None)
    assert p.node_time(_cost("view", 0, 0)) == 0.0
    assert p.node_time(_cost("none", 0, 0), backward=True) == 0.0
    compute_bound = _cost("matmul", 1e12, 1e6)
    assert p.node_time(compute_bound) == pytest.approx(1e12 / p.matmul_flops + p.op_overhead)
    memory_bound = _cost("elementwise", 1e6, 1e9)
    assert p.node_time(memory_bound) == pytest.approx(1e9 / p.mem_bandwidth + p.op_overhead)
    assert dataclasses.replace(get_profile("h200"), calibration=None).node_time(memory_bound) < \
        p.node_time(memory_bound)
    assert p.transfer_time(0) == 0.0
    assert p.transfer_time(1e6) == pytest.approx(p.link_latency + 1e6 / p.link_bandwidth)
    assert p.transfer_time(2e6) > p.transfer_time(1e6)


def test_get_profile_and_json():
    with pytest.raises(ConfigError, match="tpu9.*cpu, h100, h200"):
        get_profile("tpu9")
    assert get_profile("H100") is PROFILES["h100"]
    mine = DeviceProfile("mine", 1e12, 1e11, 1e11, 1e9, 1e-5, 1e-6)
    assert get_profile(mine) is mine
    assert DeviceProfile.from_json(mine.to_json()) == mine
    assert mine.to_json()["schema_version"] == 2
    with pytest.raises(ConfigError, match="mem_bandwidth=0"):
        DeviceProfile("bad", 1e12, 1e11, 0, 1e9, 1e-5, 1e-6)


def test_the_default_profile_is_the_gpu_a_run_is_on():
    assert gpu_profile_name("NVIDIA H200") == "h200"
    assert gpu_profile_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_profile_name("NVIDIA A100-SXM4-80GB") == "h100"  # no table of its own: the H100's
    assert default_profile(None, "cpu") is PROFILES["cpu"]
    assert default_profile("h200", "cpu") is PROFILES["h200"]  # a profile given wins
    mine = DeviceProfile("mine", 1e12, 1e11, 1e11, 1e9, 1e-5, 1e-6)
    assert default_profile(mine, "cuda") is mine
    if torch.cuda.is_available():
        name = gpu_profile_name(torch.cuda.get_device_name(0))
        assert default_profile(None, "cuda:0") is PROFILES[name]
    else:  # planning for a GPU on a machine without one
        assert default_profile(None, "cuda") is PROFILES["h100"]


def test_measure_profile_cpu():
    start = time.perf_counter()
    p = measure_profile("cpu")
    assert time.perf_counter() - start < 5  # a few hundred ms on a 2-core CPU
    assert p.name == "measured:cpu"
    for value in (p.matmul_flops, p.vector_flops, p.mem_bandwidth, p.link_bandwidth, p.op_overhead):
        assert value > 0


@pytest.mark.parametrize("route", ROUTES)
def test_measure_node_times_on_meta_model(route):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))
    x = torch.empty(4, 32, device="meta")
    gm = route(model, x)
    times = measure_node_times(gm, [x], "cpu", runs=3)
    costs = graph_costs(gm)
    assert set(times) >= {n.name for n in gm.graph.nodes if costs[n.name].kind not in ("none",)}
    assert all(t >= 0 for t in times.values())
    assert all(times[name] > 0 for name, c in costs.items() if c.kind == "matmul")
    assert all(p.is_meta for p in gm.parameters())  # the caller's graph is left alone


def test_a_broadcast_operand_that_learns_makes_its_op_a_family_apart():
    """[Note: broadcast operands]: its backward sums the gradient over the broadcast dims."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gamma = nn.Parameter(torch.ones(8))
            self.register_buffer("mask", torch.ones(8))
            self.gate = nn.Conv2d(8, 8, 1)

        def forward(self, x):
            scaled = x * self.gamma.reshape(1, -1, 1, 1)  # layer scale: learns
            masked = scaled + self.mask.reshape(1, -1, 1, 1)  # a buffer: no gradient
            gated = masked * torch.sigmoid(self.gate(x.mean((2, 3), keepdim=True)))  # squeeze-excite
            return gated + x * x + x * 2.0  # same shapes, and a Python scalar

    from autopipe.tracer import trace

    gm = trace(Net(), (torch.randn(2, 8, 4, 4),)).gm
    costs = graph_costs(gm)
    families = {n.name: costs[n.name].family for n in gm.graph.nodes
                if n.op == "call_function" and n.target in (operator.mul, operator.add)}
    # The layer scale is a learned scale of few elements: a family of its own (op_rules.SCALE).
    assert [f for f in families.values()] == ["scale", "", "broadcast", "", "", "", ""], families


def test_softmax_and_roll_are_kernel_families_of_their_own():
    from autopipe.partition.calibration import class_of
    from autopipe.tracer import trace

    class Net(nn.Module):
        def forward(self, x):
            return torch.roll(x, shifts=1, dims=1).softmax(-1) + x.clone()

    costs = graph_costs(trace(Net(), (torch.randn(2, 8, 8),)).gm)
    classes = sorted(class_of(c).split("/")[0] for c in costs.values() if c.kind not in ("view", "none"))
    assert classes == ["copy", "copy:roll", "elementwise", "elementwise:softmax"], classes
