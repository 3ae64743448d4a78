"""CUDA-graph slots: what can be checked without a GPU (the GPU equivalence runs in
benchmarks/gpu_throughput.py, whose results are in docs/benchmarks.md), and the graphs' memory
on a GPU."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.errors import ConfigError
from autopipe.runtime.graphs import StageGraphs, slots_per_stage
from autopipe.runtime.p2p import TensorSpec
from autopipe.runtime.schedule import ActionKind, rank_actions
from tests.models import MODELS


def _slots(schedule: str, pp: int, m: int, chunks: int, rank: int) -> dict[int, int]:
    actions: dict[int, list] = {}
    for a in rank_actions(schedule, pp, m, chunks, rank):
        if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
            actions.setdefault(a.stage, []).append(("F" if a.kind is ActionKind.FORWARD else "B", a.microbatch))
    return slots_per_stage(actions)


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_holds_pp_minus_rank_micro_batches(pp: int) -> None:
    for rank in range(pp):
        assert _slots("1f1b", pp, 8, 1, rank) == {rank: pp - rank}


def test_gpipe_holds_every_micro_batch() -> None:
    assert _slots("gpipe", 2, 6, 1, 0) == {0: 6}


def test_interleaved_slots_cover_every_local_stage_and_stay_below_m() -> None:
    slots = _slots("interleaved_1f1b", 2, 8, 2, 0)
    assert sorted(slots) == [0, 2] and all(1 <= n <= 8 for n in slots.values())


def test_slots_count_the_most_held_at_once() -> None:
    assert slots_per_stage({0: [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]}) == {0: 2}


def test_cuda_graphs_are_refused_where_they_cannot_run() -> None:
    model = MODELS["timm_vit"]()
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        autopipe.parallelize(model, (x,), loss_fn=F.cross_entropy, cuda_graphs=True, device="cpu")
    with pytest.raises(ConfigError, match="tp=2"):
        autopipe.parallelize(model, (x,), tp=2, loss_fn=F.cross_entropy, cuda_graphs=True)


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
