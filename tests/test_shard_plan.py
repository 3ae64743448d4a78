"""Shard plans and per-rank rewrites, checked without processes (collectives are identity)."""
from __future__ import annotations

import functools
import math
import operator
import pickle
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopipe.errors import ConfigError, ShardingError
from autopipe.graph import value_of
from autopipe.shard import (ShardPlan, ShardRule, apply_sharding, collective_bytes, column_parallel_head,
                            plan_sharding, register_rule, shard_state_dict, unregister_rule)
from autopipe.shard.collectives import copy_to_tp
from autopipe.shard.modules import RowParallelLinear, ShardedMultiheadAttention, TPDropout
from autopipe.shard.state import merge_shards
from autopipe.tracer import TracedModel, trace
from tests import models
from tests.test_shard_equivalence import DropMLP, bottleneck_resnet

__all__: list[str] = []

FACTORIES = {
    "timm_vit": models.timm_vit,
    "hf_vit": models.hf_vit,
    "tv_vit": models.tv_vit,
    "timm_mixer": models.timm_mixer,
    "tv_resnet_bottleneck": bottleneck_resnet,
}

# node -> sharding expected at tp=2, per model (first block; the others repeat it).
EXPECTED = {
    "timm_vit": {"blocks_0_attn_qkv": "heads:4->2", "blocks_0_attn_proj": "row", "blocks_0_mlp_fc1": "column",
                 "blocks_0_mlp_fc2": "row", "head": "replicated"},
    "hf_vit": {"vit_layers_0_attention_q_proj": "heads:4->2", "vit_layers_0_attention_k_proj": "heads:4->2",
               "vit_layers_0_attention_v_proj": "heads:4->2", "vit_layers_0_attention_o_proj": "row",
               "vit_layers_0_mlp_fc1": "column", "vit_layers_0_mlp_fc2": "row", "classifier": "replicated"},
    "tv_vit": {"encoder_layers_encoder_layer_0_self_attention": "heads:4->2",
               "encoder_layers_encoder_layer_0_mlp_0": "column", "encoder_layers_encoder_layer_0_mlp_3": "row",
               "heads_head": "replicated"},
    "timm_mixer": {"blocks_0_mlp_tokens_fc1": "column", "blocks_0_mlp_tokens_fc2": "row",
                   "blocks_0_mlp_channels_fc1": "column", "blocks_0_mlp_channels_fc2": "row"},
    "tv_resnet_bottleneck": {"layer1_0_conv1": "column", "layer1_0_bn1": "channel", "layer1_0_conv2": "row",
                             "layer1_0_conv3": "replicated", "fc": "replicated"},
}


@functools.cache
def traced(name: str) -> TracedModel:
    torch.manual_seed(0)
    return trace(FACTORIES[name](), (models.image_batch(2),))


class Attention(nn.Module):
    """timm-style attention whose widths come from ``x.shape``: sizes that are graph nodes."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class SumAfterColumn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum(-1)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_builtin_rules_plan_every_model(name: str) -> None:
    plan = plan_sharding(traced(name), 2)
    got = {n: plan.nodes[n].sharding for n in EXPECTED[name]}
    assert got == EXPECTED[name]
    assert plan.collectives and plan.route == traced(name).route


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_sharded_parameters_hold_one_tp_th_each(name: str, tp: int) -> None:
    t = traced(name)
    plan = plan_sharding(t, tp)
    sharded = {k: p for k, p in plan.params.items() if p.sharded}
    assert sharded
    for k, p in sharded.items():
        assert math.prod(p.local_shape) * tp == math.prod(p.shape), k
    locals_ = [apply_sharding(t, plan, r).gm.state_dict() for r in range(tp)]
    for sd in locals_:
        assert list(sd) == list(t.gm.state_dict())  # original names, original order
        for k, p in plan.params.items():
            assert tuple(sd[k].shape) == p.local_shape, k
    for k in sharded:  # exactly 1/tp each: the shards together are the whole, once
        assert sum(sd[k].numel() * sd[k].element_size() for sd in locals_) == t.gm.state_dict()[k].numel() * 4


def test_head_aware_qkv_slicing_keeps_each_ranks_heads() -> None:
    t = traced("timm_vit")
    plan = plan_sharding(t, 2)
    full = t.gm.state_dict()["blocks.0.attn.qkv.weight"]  # rows: [3, heads=4, head_dim=16]
    for r in range(2):
        local = shard_state_dict({"blocks.0.attn.qkv.weight": full}, plan, r)["blocks.0.attn.qkv.weight"]
        expected = full.view(3, 4, 16, 64)[:, 2 * r:2 * r + 2].reshape(96, 64)
        assert torch.equal(local, expected)


@pytest.mark.parametrize("name", ["timm_vit", "tv_vit", "tv_resnet_bottleneck"])
def test_state_dict_round_trips_through_shards(name: str) -> None:
    t = traced(name)
    plan = plan_sharding(t, 2)
    full = t.gm.state_dict()
    shards = [shard_state_dict(full, plan, r) for r in range(2)]
    for r, sd in enumerate(shards):
        gm_sd = apply_sharding(t, plan, r).gm.state_dict()
        assert all(torch.equal(sd[k], gm_sd[k]) for k in full)
    for k, p in plan.params.items():
        assert torch.equal(merge_shards([s[k] for s in shards], p), full[k]), k


def test_shape_constants_are_rewritten_in_the_graph() -> None:
    t = traced("timm_vit")
    gm = apply_sharding(t, plan_sharding(t, 2), 1).gm
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["reshape"].args[3:] == (3, 2, 16)  # (B, N, 3, heads, head_dim)
    assert nodes["reshape_1"].args[3] == 32  # (B, N, C)
    assert tuple(value_of(nodes["blocks_0_attn_qkv"]).shape) == (2, 17, 96)
    assert tuple(value_of(nodes["blocks_0_mlp_fc1"]).shape) == (2, 17, 128)

    hf = traced("hf_vit")
    gm = apply_sharding(hf, plan_sharding(hf, 2), 0).gm
    views = [n for n in gm.graph.nodes if n.target == torch.ops.aten.view.default]
    assert [tuple(value_of(v).shape) for v in views[:3]] == [(2, 17, 2, 16)] * 3


def test_sizes_read_from_x_shape_become_floordiv_nodes() -> None:
    model = Attention()
    x = torch.randn(2, 5, 32)
    t = trace(model, (x,))
    plan = plan_sharding(t, 2)
    assert [(e.node, e.index, e.new) for e in plan.shape_edits] == [("reshape", 3, 2), ("reshape_1", 2, "//tp")]
    gm = apply_sharding(t, plan, 0).gm
    final = next(n for n in gm.graph.nodes if n.name == "reshape_1")
    size = final.args[3]
    assert size.target is operator.floordiv and size.args[1] == 2
    assert gm(x)[0].shape == (2, 5, 32)  # runs: collectives are identity without a group


def test_heads_not_divisible_names_layer_and_valid_tp() -> None:
    t = trace(models.timm_vit(embed_dim=48, num_heads=3), (models.image_batch(2),))
    with pytest.raises(ShardingError, match=r"layer 'blocks.0.attn' has 3 heads.*valid tp for it: 1, 3") as info:
        plan_sharding(t, 2)
    assert "layer 'blocks.1.attn'" in str(info.value)  # every problem, at once
    assert "accepts: 1, 3" in str(info.value)
    # The fix in both spellings: parallelize's keyword and plan_sharding's.
    assert "parallelize(..., shard_rules=[ShardRule('keep'" in str(info.value)
    assert "plan_sharding(..., rules=[...])" in str(info.value)


def test_split_that_does_not_fit_names_rule_parameter_and_shape() -> None:
    t = traced("timm_vit")
    bad = ShardRule("fc1-bias-rows", match="blocks.0.mlp.fc1", style="column", params={"bias": "row"})
    with pytest.raises(ShardingError, match=r"rule 'fc1-bias-rows': parameter 'blocks.0.mlp.fc1.bias' \[256\]"):
        plan_sharding(t, 2, rules=[bad])

    def halve_wrongly(p: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        return p.view(3, -1)[rank]

    custom = ShardRule("odd-split", match="blocks.0.mlp.fc1", style="column", params={"weight": halve_wrongly})
    with pytest.raises(ShardingError, match=r"rule 'odd-split'.*'blocks.0.mlp.fc1.weight' \[256, 64\].*halve_wrongly"):
        plan_sharding(t, 2, rules=[custom])
    with pytest.raises(ShardingError, match=r"'head.weight' \[10, 64\].*tp=4"):
        plan_sharding(t, 4, rules=[column_parallel_head()])


def test_custom_split_is_used() -> None:
    t = traced("timm_vit")

    def rows_reversed(p: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        return p.flip(0).chunk(tp)[rank]

    def cols_reversed(p: torch.Tensor, rank: int, tp: int) -> torch.Tensor:  # fc2 must match fc1's rows
        return p.flip(1).chunk(tp, dim=1)[rank]

    rule = ShardRule("rev", match="blocks.0.mlp.fc1", style="column",
                     params={"weight": rows_reversed, "bias": rows_reversed})
    with pytest.raises(ShardingError, match=r"make it row-parallel.*match='blocks.0.mlp.fc2', style='row'"):
        plan_sharding(t, 2, rules=[rule])  # the pair rule no longer sees fc1: fc2 must be said too
    row = ShardRule("row", match="blocks.0.mlp.fc2", style="row", params={"weight": cols_reversed})
    plan = plan_sharding(t, 2, rules=[rule, row])
    assert plan.params["blocks.0.mlp.fc1.weight"].split == "custom:rows_reversed"
    w = apply_sharding(t, plan, 1).gm.state_dict()["blocks.0.mlp.fc1.weight"]
    assert torch.equal(w, t.gm.state_dict()["blocks.0.mlp.fc1.weight"].flip(0)[128:])


def test_unmatched_pattern_warns() -> None:
    with pytest.warns(UserWarning, match=r"'nothing-here'.*'blocks\.\*\.mlpp\.fc1' matches no module"):
        plan_sharding(traced("timm_vit"), 2, rules=[ShardRule("nothing-here", match="blocks.*.mlpp.fc1")])


def test_user_rule_keeps_mlp_fc2_replicated() -> None:
    t = traced("timm_vit")
    keep = ShardRule("keep-fc2", match="mlp.fc2", style="replicated")
    for plan in (plan_sharding(t, 2, rules=[keep]), _registered(keep, lambda: plan_sharding(t, 2))):
        assert plan.nodes["blocks_1_mlp_fc2"].sharding == "replicated"
        assert plan.nodes["blocks_1_mlp_fc2"].rule == "keep-fc2"
        assert plan.nodes["blocks_1_mlp_fc1"].sharding == "replicated"  # the pair is broken
        assert plan.nodes["blocks_1_attn_qkv"].sharding == "heads:4->2"
        assert not plan.params["blocks.1.mlp.fc1.weight"].sharded
    assert plan_sharding(t, 2).nodes["blocks_1_mlp_fc2"].sharding == "row"  # unregistered again


def _registered(rule: ShardRule, fn):  # type: ignore[no-untyped-def]
    register_rule(rule)
    try:
        return fn()
    finally:
        unregister_rule(rule.name)


def test_per_call_rules_beat_registered_rules() -> None:
    t = traced("timm_vit")
    plan = _registered(ShardRule("keep", match="blocks.0.mlp.fc2", style="replicated"),
                       lambda: plan_sharding(t, 2, rules=[ShardRule("keep", match="blocks.0.mlp", style="replicated"),
                                                          ShardRule("row2", match="blocks.0.mlp.fc2", style="row")]))
    assert plan.nodes["blocks_0_mlp_fc2"].rule == "keep"
    assert plan.nodes["blocks_0_mlp_fc1"].rule == "keep"  # a subtree pattern keeps the whole MLP


def test_column_parallel_head_gathers_logits() -> None:
    t = trace(models.timm_vit(num_classes=12), (models.image_batch(2),))
    plan = plan_sharding(t, 4, rules=[column_parallel_head()])
    assert plan.nodes["head"].sharding == "column+gather"
    gather = [c for c in plan.collectives if c.kind == "gather_from_tp"]
    assert [(c.src, c.users, c.dim) for c in gather] == [("head", ("output",), 1)]
    gm = apply_sharding(t, plan, 3).gm
    assert gm.get_submodule("head").weight.shape == (3, 64)
    assert gm(models.image_batch(2))[0].shape == (2, 12)


def test_sharded_leaves_are_swapped_without_touching_the_model() -> None:
    t = traced("tv_vit")
    before = {k: v.clone() for k, v in t.gm.state_dict().items()}
    code = t.gm.code
    gm = apply_sharding(t, plan_sharding(t, 2), 1).gm
    attn = gm.get_submodule("encoder.layers.encoder_layer_0.self_attention")
    assert isinstance(attn, ShardedMultiheadAttention) and attn.num_heads == 2
    assert isinstance(gm.get_submodule("encoder.layers.encoder_layer_0.mlp.3"), RowParallelLinear)
    assert t.gm.code == code
    assert all(torch.equal(before[k], v) for k, v in t.gm.state_dict().items())
    assert isinstance(t.gm.get_submodule("encoder.layers.encoder_layer_0.self_attention"), nn.MultiheadAttention)
    assert not any(p is q for p in gm.parameters() for q in t.gm.parameters())


def test_dropout_in_a_sharded_region_draws_from_the_tp_stream() -> None:
    t = trace(DropMLP(), (torch.randn(8, 16),))
    plan = plan_sharding(t, 2)
    assert plan.swaps == {"drop1": "tp_dropout", "fc2": "row"}
    gm = apply_sharding(t, plan, 1).gm
    assert isinstance(gm.get_submodule("drop1"), TPDropout) and gm.get_submodule("drop1").tp_rank == 1
    assert type(gm.get_submodule("drop2")) is nn.Dropout


def test_meta_model_plans_and_shards() -> None:
    with torch.device("meta"):
        model = models.timm_vit()
    t = trace(model, (torch.empty(2, 3, 32, 32, device="meta"),))
    plan = plan_sharding(t, 4)
    gm = apply_sharding(t, plan, 2).gm
    w = gm.get_submodule("blocks.0.mlp.fc1").weight
    assert w.device.type == "meta" and w.shape == (64, 64)
    qkv = next(n for n in gm.graph.nodes if n.name == "blocks_0_attn_qkv")
    assert tuple(value_of(qkv).shape) == (2, 17, 48)


def test_op_that_mixes_a_split_dim_is_refused_with_the_fix() -> None:
    t = trace(SumAfterColumn(), (torch.randn(2, 8),))
    with pytest.raises(ShardingError, match=r"node 'sum_1'.*split dim.*keep 'fc' replicated.*"
                                            r"parallelize\(\.\.\., shard_rules=.*plan_sharding\(\.\.\., rules="):
        plan_sharding(t, 2, rules=[ShardRule("col", match="fc", style="column")])


def test_plan_is_plain_data() -> None:
    plan = plan_sharding(traced("timm_vit"), 2)
    again = ShardPlan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert "heads:4->2" in plan.summary() and "reduce_from_tp" in plan.summary()
    sizes = collective_bytes(plan)
    assert sizes["reduce_from_tp_blocks_0_mlp_fc2"] == (2 * 17 * 64 * 4, 0)
    assert sizes["copy_to_tp_layer_norm_1"] == (0, 2 * 17 * 64 * 4)
    assert pickle.loads(pickle.dumps(plan)).params == plan.params


def test_tp_one_and_bad_degrees() -> None:
    plan = plan_sharding(traced("timm_vit"), 1)
    assert not plan.collectives and not any(p.sharded for p in plan.params.values())
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        plan_sharding(traced("timm_vit"), 0)
    with pytest.raises(ConfigError, match=r"tp_rank must be in \[0, 2\)"):
        apply_sharding(traced("timm_vit"), plan_sharding(traced("timm_vit"), 2), 2)


def test_rule_validation() -> None:
    with pytest.raises(ShardingError, match="style 'diagonal'"):
        ShardRule("x", match="fc", style="diagonal")
    with pytest.raises(ShardingError, match="partial sum"):
        ShardRule("x", match="fc", style="row", collectives=())
    with pytest.raises(ShardingError, match="split 'rows'"):
        ShardRule("x", match="fc", style="column", params={"weight": "rows"})


def test_sharded_graph_pickles() -> None:
    t = traced("tv_vit")
    gm = apply_sharding(t, plan_sharding(t, 2), 0).gm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = pickle.loads(pickle.dumps(gm))
    x = models.image_batch(2)
    torch.testing.assert_close(again(x)[0], gm(x)[0])
    assert any(n.target is copy_to_tp for n in again.graph.nodes)


@st.composite
def reshapes(draw):  # type: ignore[no-untyped-def]
    """A shape with a split dim (outer blocks of tp pieces) and a regrouping of its dims."""
    tp, outer = draw(st.sampled_from([2, 4])), draw(st.sampled_from([1, 3]))
    before, after = draw(st.lists(st.integers(1, 4), max_size=2)), draw(st.lists(st.integers(1, 4), max_size=2))
    per_rank = draw(st.integers(1, 3))
    src = (*before, outer * tp * per_rank, *after)
    # Regroup: the dims before stay, the split dim may be factored as (outer, tp * per_rank)
    # or merged with the dims after it.
    factor = draw(st.booleans()) and outer > 1
    merged = draw(st.booleans()) and after
    mid = ((outer, tp * per_rank) if factor else (outer * tp * per_rank,))
    tail = (math.prod(after),) if merged else tuple(after)
    if merged:
        mid, tail = (*mid[:-1], mid[-1] * tail[0]), ()
    return src, (*before, *mid, *tail), len(before), outer, tp


@given(reshapes())
@settings(max_examples=60, deadline=None)
def test_locate_split_commutes_sharding_and_reshape(case) -> None:  # type: ignore[no-untyped-def]
    from autopipe.shard.ops import locate_split
    from autopipe.shard.plan import ParamShard
    from autopipe.shard.state import shard_tensor

    src, out, dim, outer, tp = case
    found = locate_split(src, out, dim, outer, tp)
    assert found is not None
    j, new_outer = found
    full = torch.arange(math.prod(src)).reshape(src)
    split = ParamShard(src, src, "column", dim, outer)
    moved = ParamShard(out, out, "column", j, new_outer)
    local_out = list(out)
    local_out[j] //= tp
    for r in range(tp):
        assert torch.equal(shard_tensor(full, split, r, tp).reshape(local_out),
                           shard_tensor(full.reshape(out), moved, r, tp))


@pytest.mark.parametrize("index,expected", [
    ((slice(None), 0), 1), ((0,), 1), ((Ellipsis, 0), 2), ((None, slice(None), slice(None)), 3),
    ((slice(None), slice(None), slice(None)), 2), ((slice(None), slice(None), 1), None),
])
def test_indexed_dim(index, expected) -> None:  # type: ignore[no-untyped-def]
    from autopipe.shard.ops import indexed_dim

    assert indexed_dim(index, 4, 2) == expected


def test_sequence_parallel_needs_micro_batches_that_split_across_tp():
    from autopipe.errors import ConfigError
    from autopipe.shard import plan_sharding
    from autopipe.tracer import trace
    from tests.models import MODELS

    traced = trace(MODELS["timm_vit"](), (torch.randn(3, 3, 32, 32),))
    with pytest.raises(ConfigError, match="micro-batch's 3 samples across tp=2 ranks; use a micro-batch size divisible by 2"):
        plan_sharding(traced, 2, sequence_parallel=True)
    assert not plan_sharding(traced, 2).sequence_parallel  # without it, any size shards


class _MaskedInput(nn.Module):
    """A non-persistent buffer read through get_attr before a column/row pair."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("mask", torch.arange(8.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x * self.mask)))


def test_non_persistent_buffers_stay_out_of_sharded_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' Swin ``relative_position_index`` read through get_attr, on torch 2.11's fx."""
    from tests.test_emit import _copy_attr_as_torch_2_11

    monkeypatch.setattr(torch.fx.graph_module, "_copy_attr", _copy_attr_as_torch_2_11)
    model = _MaskedInput()
    traced = trace(model, (torch.randn(4, 8),))
    plan = plan_sharding(traced, 2)
    assert plan.collectives, "nothing was sharded"
    for rank in range(2):
        gm = apply_sharding(traced, plan, rank).gm
        assert "mask" in dict(gm.named_buffers())  # the sharded graph does read it
        assert set(gm.state_dict()) <= set(model.state_dict()), set(gm.state_dict()) - set(model.state_dict())
