"""Transparency of tensor parallelism: each tp rank's sharded graph computes the unsharded model.

Plans and per-rank graphs are made here and handed to one gloo world per tp (through files:
each rank loads only its own graph); the ranks compare against references computed here.
"""
from __future__ import annotations

import copy
import functools
import os
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from autopipe.shard import (ShardRule, apply_sharding, column_parallel_head, gather_full_state_dict,
                            manual_seed_tp, plan_sharding, register_group,
                            register_rule, unregister_rule)
from autopipe.tracer import trace
from autopipe.training.gradients import reduce_sequence_parallel_grads
from tests import models
from tests.distributed import run_distributed

__all__: list[str] = []

STEPS, BATCH, CLASSES = 3, 4, 10
OPTIMIZERS = ("sgd", "adamw")
RTOL, ATOL = 1e-5, 1e-6  # |a - b| <= RTOL * max|b| + ATOL, element-wise, per tensor

# [Note: a reference that rounding cannot move]
# TP sums partial products in another order, so it differs from one process by rounding.
# Outputs are compared in fp32. Training is compared in fp64, because 3 steps of some of
# these models amplify rounding past any useful tolerance in one process alone: BatchNorm
# over 4 samples at 1x1 spatial size moves weights by 1e-1 after a 1e-7 perturbation, and
# AdamW turns gradients that are zero in exact arithmetic (attention key biases under
# softmax's shift invariance, MLP-Mixer's token-MLP output bias under LayerNorm) but
# rounding noise in practice into lr-sized steps of random sign. In fp64 that noise is 1e-16
# and the 1e-5 tolerance still catches any real error (a missing all-reduce is O(1)).


def bottleneck_resnet() -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], width_per_group=16, num_classes=CLASSES)


def swinv2_cr() -> nn.Module:
    """timm's SwinV2-CR, its post-norms at 1 (at their default 0 the attention would not reach
    the outputs), and its position MLPs' dropout off (train-mode outputs are compared unseeded)."""
    model = models.timm_model("swinv2_cr_base_224", img_size=32, window_size=4, depths=(2, 2), num_heads=(2, 4),
                              embed_dim=32, init_values=1.0)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


class DropMLP(nn.Module):
    """A sharded-region dropout (between fc1 and fc2) and a replicated-region one (after fc2)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5)
        self.fc2, self.drop2 = nn.Linear(64, 16), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


USER_RULES = "timm_vit+user_rules"
CASES: dict[str, Callable[[], nn.Module]] = {
    "timm_vit": models.timm_vit,
    "hf_vit": models.hf_vit,
    "tv_vit": models.tv_vit,
    "timm_mixer": models.timm_mixer,
    # Relative position bias sliced to each rank's heads; no stochastic depth: train-mode outputs
    # are compared without seeding.
    "hf_swin": functools.partial(models.hf_swin, drop_path_rate=0.0),
    # Traced through its attention (one graph serves both modes): an nn.Softmax, the bias table
    # indexed by a view of a buffer, and the shifted windows' mask.
    "timm_swin": functools.partial(models.timm_swin, drop_path_rate=0.0),
    # Rotary embeddings: each head's q and k halves stacked, the class token joined back on.
    "timm_eva02": functools.partial(models.timm_model, "eva02_base_patch14_224", img_size=32, patch_size=8,
                                    depth=2, embed_dim=64, num_heads=4),
    # Cosine attention: q and k normalised per head (F.normalize), a learned scale per head.
    "timm_swinv2_cr": swinv2_cr,
    "timm_convnext": models.timm_convnext,  # row-parallel 1x1 convs with a bias over channels
    "tv_resnet_bottleneck": bottleneck_resnet,
    USER_RULES: functools.partial(models.timm_vit, num_classes=12),  # a column-parallel head: 12 / 4
}


# The same models with sequence parallelism: the regions between sharded pairs split by sample.
SP_CASES = ("timm_vit", "hf_vit", "tv_vit", "timm_mixer", "timm_convnext", "tv_resnet_bottleneck")
SP = "+sequence_parallel"
ALL_CASES = [*CASES, *(c + SP for c in SP_CASES)]
TPS = {"hf_swin": (2,), "timm_swin": (2,), "timm_swinv2_cr": (2,)}  # their first stage has 2 heads; the others run at tp 2 and 4


def cases_for(tp: int) -> list[str]:
    return [c for c in ALL_CASES if tp in TPS.get(c, (2, 4))]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train(forward: Callable[[torch.Tensor], torch.Tensor], params: Any, opt_name: str,
          x: torch.Tensor, y: torch.Tensor, after_backward: Callable[[], None] = lambda: None) -> None:
    opt = make_optimizer(opt_name, params)
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        after_backward()
        opt.step()


def excess(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| as a multiple of the tolerance: <= 1 passes."""
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return float("inf") if torch.any(a != b) else 0.0
    return float((a - b).abs().max() / (RTOL * b.abs().max() + ATOL))


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    ref = {}
    for mode in (False, True):
        m = copy.deepcopy(model).train(mode)
        with torch.no_grad():
            ref[f"out_{'train' if mode else 'eval'}"] = pytree.tree_leaves(m(x))[0]
    for opt in OPTIMIZERS:  # in fp64: see [Note: a reference that rounding cannot move]
        m = copy.deepcopy(model).double().train()
        train(lambda t: models.logits(m(t)), m.parameters(), opt, x.double(), y)
        ref[opt] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return ref


def prepare(tp: int, tmp: str) -> dict[str, Any]:
    """Plans, per-rank graphs (saved per rank) and references (saved once) of every case."""
    x = models.image_batch(BATCH)
    y = torch.arange(BATCH) % CLASSES
    per_rank: list[dict[str, Any]] = [{} for _ in range(tp)]
    refs: dict[str, Any] = {"x": x, "y": y}
    plans = {}
    for case, factory in CASES.items():
        if case not in cases_for(tp):
            continue
        torch.manual_seed(0)
        model = factory()
        with torch.no_grad():  # torchvision's ViT and timm's Mixer zero their heads: outputs would be 0
            for p in model.parameters():
                if p.dim() > 1 and not p.any():
                    nn.init.normal_(p, std=0.02)
        traced = trace(model, (x,))
        if case == USER_RULES:
            register_rule(ShardRule("keep-fc2", match="mlp.fc2", style="replicated"))
            try:
                plan = plan_sharding(traced, tp, rules=[column_parallel_head()])
            finally:
                unregister_rule("keep-fc2")
        else:
            plan = plan_sharding(traced, tp)
        plans[case] = plan
        for r in range(tp):
            per_rank[r][case] = (apply_sharding(traced, plan, r, group="tp").gm, plan)
        refs[case] = reference(model, x, y)
        if case in SP_CASES:
            plan = plans[case + SP] = plan_sharding(traced, tp, sequence_parallel=True)
            for r in range(tp):
                per_rank[r][case + SP] = (apply_sharding(traced, plan, r, group="tp").gm, plan)
            refs[case + SP] = refs[case]
    torch.manual_seed(0)
    drop = DropMLP()
    traced = trace(drop, (torch.randn(8, 16),))
    plan = plan_sharding(traced, tp)
    sp_plan = plan_sharding(traced, tp, sequence_parallel=True)
    for r in range(tp):
        per_rank[r]["dropout"] = apply_sharding(traced, plan, r, group="tp").gm
        per_rank[r]["dropout" + SP] = apply_sharding(traced, sp_plan, r, group="tp").gm
    for r in range(tp):
        per_rank[r]["non_persistent"] = {case: _non_persistent(entry[0]) for case, entry in per_rank[r].items()
                                         if isinstance(entry, tuple)}
        torch.save(per_rank[r], os.path.join(tmp, f"rank{r}.pt"))
    torch.save(refs, os.path.join(tmp, "ref.pt"))
    return plans


def masks(gm: fx.GraphModule, x: torch.Tensor) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n.name in ("drop1", "drop2"):
                seen[n.name] = out == 0
            return out

    Recorder(gm).run(x)
    return seen


def _non_persistent(gm: nn.Module) -> set[str]:
    return {name for name, _ in gm.named_buffers()} - gm.state_dict().keys()


def _restore_non_persistent(gm: nn.Module, names: set[str]) -> None:
    """torch 2.11 unpickles a GraphModule with every buffer persistent (later versions keep
    ``persistent=False``): re-register the ones the sharded graph had before pickling."""
    for name in names:
        owner_path, _, field = name.rpartition(".")
        owner = gm.get_submodule(owner_path)
        owner.register_buffer(field, owner._buffers[field], persistent=False)


def world_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    register_group("tp", dist.group.WORLD)
    mine = torch.load(os.path.join(tmp, f"rank{rank}.pt"), weights_only=False)
    for case, names in mine.pop("non_persistent").items():
        _restore_non_persistent(mine[case][0], names)
    refs = torch.load(os.path.join(tmp, "ref.pt"), weights_only=False)
    x, y = refs["x"], refs["y"]
    results: dict[str, Any] = {}
    for case in cases_for(world_size):
        gm, plan = mine[case]
        ref = refs[case]
        got = {}
        for mode in ("eval", "train"):
            g = copy.deepcopy(gm).train(mode == "train")
            with torch.no_grad():
                got[f"out_{mode}"] = excess(g(x)[0], ref[f"out_{mode}"])
        for opt in OPTIMIZERS:
            g = copy.deepcopy(gm).double().train()
            train(lambda t: g(t)[0], g.parameters(), opt, x.double(), y,
                  lambda: reduce_sequence_parallel_grads(g.named_parameters(), plan, dist.group.WORLD))
            full = gather_full_state_dict(g, plan, dist.group.WORLD)
            # Unpickling re-traces a GraphModule's code, which may add _tensor_constant buffers.
            extra = {k for k in full.keys() - ref[opt].keys() if not k.startswith("_tensor_constant")}
            missing = ref[opt].keys() - full.keys()
            assert not extra and not missing, \
                f"{case}: state_dict keys differ: extra {sorted(extra)[:8]}, missing {sorted(missing)[:8]}"
            got[opt] = {k: excess(full[k], ref[opt][k]) for k in ref[opt]}
        results[case] = got
    torch.manual_seed(0)
    manual_seed_tp(0)
    drop = mine["dropout"].train()
    results["dropout"] = masks(drop, torch.randn(8, 16))
    torch.manual_seed(0)
    manual_seed_tp(0)
    results["dropout" + SP] = masks(mine["dropout" + SP].train(), torch.randn(8, 16))
    results["after"] = torch.rand(4)  # the default stream must stay in step across tp ranks
    return results


_worlds: dict[int, tuple[list[dict[str, Any]], dict[str, Any]]] = {}


def world(tp: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if tp not in _worlds:
        with tempfile.TemporaryDirectory(prefix="autopipe-tp-") as tmp:
            plans = prepare(tp, tmp)
            _worlds[tp] = (run_distributed(world_worker, tp, tmp, timeout=200), plans)
    return _worlds[tp]


@pytest.mark.parametrize(("case", "tp"), [(c, tp) for tp in (2, 4) for c in cases_for(tp)])
def test_sharded_model_matches_unsharded(case: str, tp: int) -> None:
    results, plans = world(tp)
    assert plans[case].collectives, "nothing was sharded"
    for rank, res in enumerate(results):
        got = res[case]
        for mode in ("eval", "train"):
            assert got[f"out_{mode}"] <= 1, f"rank {rank}: {mode} output off by {got[f'out_{mode}']:.1f}x the tolerance"
        for opt in OPTIMIZERS:
            worst = max(got[opt], key=got[opt].get)
            assert got[opt][worst] <= 1, f"rank {rank}, {opt}: '{worst}' off by {got[opt][worst]:.1f}x the tolerance"


def test_sequence_parallel_replaces_all_reduces_with_reduce_scatter_and_all_gather() -> None:
    _, plans = world(2)
    for case in ("timm_vit", "hf_vit", "tv_vit", "timm_mixer"):
        kinds = [c.kind for c in plans[case + SP].collectives]
        plain = [c.kind for c in plans[case].collectives]
        assert "reduce_from_tp" not in kinds and kinds.count("reduce_scatter_tp") == plain.count("reduce_from_tp"), case
        # Every sharded pair but the first takes its input by all-gather; the first, replicated, by f.
        assert kinds.count("all_gather_tp") == plain.count("copy_to_tp") - 1, case
        assert plans[case + SP].sequence_parallel and not plans[case].sequence_parallel


def test_user_rules_change_the_plan() -> None:
    _, plans = world(2)
    nodes = plans[USER_RULES].nodes
    assert nodes["blocks_0_mlp_fc2"].sharding == "replicated" and nodes["blocks_0_mlp_fc2"].rule == "keep-fc2"
    assert nodes["blocks_0_mlp_fc1"].sharding == "replicated"  # its pair partner was taken
    assert nodes["head"].sharding == "column+gather"
    assert nodes["blocks_0_attn_qkv"].sharding == "heads:4->2"


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_masks_differ_on_sharded_and_agree_on_replicated_activations(tp: int) -> None:
    results, _ = world(tp)
    sharded = [r["dropout"]["drop1"] for r in results]
    replicated = [r["dropout"]["drop2"] for r in results]
    assert all(0.2 < m.float().mean() < 0.8 for m in sharded + replicated)
    for a in range(tp):
        for b in range(a + 1, tp):
            assert not torch.equal(sharded[a], sharded[b]), f"ranks {a} and {b} drew the same mask"
    for m in replicated[1:]:
        assert torch.equal(m, replicated[0])
    # Sequence parallelism gathers the samples before a dropout of the replicated region: the
    # same mask on every rank, the one of the plain plan.
    for r in results:
        assert torch.equal(r["dropout" + SP]["drop2"], replicated[0])
    for r in results[1:]:
        assert torch.equal(r["after"], results[0]["after"])
