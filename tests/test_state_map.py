"""The state map: each stage tensor as (full key, MLP piece, tp split), the one description
full_state_dict, load_full_state_dict and the checkpoints read."""
from __future__ import annotations

import torch
import torch.nn as nn

from autopipe.shard import apply_sharding, plan_sharding
from autopipe.stages.mlp_pieces import cut_mlps
from autopipe.stages.piece_state import PieceParam, piece_params
from autopipe.tracer import trace
from autopipe.training.state_map import load_local_state, local_full_state, state_map
from tests.models import timm_vit

PIECES = {"blocks.0.mlp.fc1": {"fc2": "blocks.0.mlp.fc2", "hidden": [0, 64, 256]}}


def test_a_piece_is_stored_under_a_name_that_reads_back_as_the_piece() -> None:
    pieces = piece_params(PIECES)
    stored = {k: p.stored for k, p in pieces.items()}
    assert stored["blocks.0.mlp.fc1_piece1.weight"] == "blocks.0.mlp.fc1.weight[64:256]"
    assert stored["blocks.0.mlp.fc2_piece0.weight"] == "blocks.0.mlp.fc2.weight[:,0:64]"
    assert stored["blocks.0.mlp.fc2_piece0.bias"] == "blocks.0.mlp.fc2.bias"  # whole, held by piece 0
    assert all(PieceParam.from_stored(p.stored) == p for p in pieces.values())
    assert PieceParam.from_stored("head.weight") == PieceParam("head.weight", None, 0, 0)


def test_entries_name_the_full_key_the_piece_and_the_split() -> None:
    traced = trace(timm_vit(), (torch.randn(2, 3, 32, 32),))
    plan = plan_sharding(traced, 2)
    entries = state_map(traced.gm.state_dict(), plan, {})
    qkv = entries["blocks.0.attn.qkv.weight"]
    assert qkv.full == "blocks.0.attn.qkv.weight" and qkv.piece is None and qkv.tp == 2
    assert qkv.split is plan.params["blocks.0.attn.qkv.weight"]
    assert entries["blocks.0.norm1.weight"].split is None  # replicated
    full = traced.gm.state_dict()["blocks.0.attn.qkv.weight"]
    for r in range(2):  # each rank's part is what the rewrite gives that rank
        assert torch.equal(qkv.cut(full, r), apply_sharding(traced, plan, r).gm.state_dict()[qkv.key])
    pieces = state_map(piece_params(PIECES), None, PIECES)
    assert pieces["blocks.0.mlp.fc2_piece1.weight"].full == "blocks.0.mlp.fc2.weight"
    assert pieces["blocks.0.mlp.fc2_piece1.weight"].piece == PieceParam("blocks.0.mlp.fc2.weight", 1, 64, 256)


def test_stages_load_and_give_back_the_models_tensors() -> None:
    """Pieces taken from the full tensors on load, and given back under their own keys."""
    torch.manual_seed(0)
    model = timm_vit()
    split = cut_mlps(trace(model, (torch.randn(2, 3, 32, 32),)), PIECES).gm
    full = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    stages: dict[int, nn.Module] = {0: split}
    load_local_state(stages, full, None, 0, PIECES)
    held = local_full_state(stages, None, None)
    for key, entry in state_map(held, None, PIECES).items():
        expected = entry.piece.of(full[entry.full]) if entry.piece is not None else full[entry.full]
        assert torch.equal(held[key], expected), key
