"""Models whose own forward branches on ``self.training`` get one graph per mode.

GoogLeNet and Inception v3 return auxiliary logits in train() only; see [Note: one graph per
mode] in autopipe/partition/mode_plan.py. ``AuxNet`` (tests/models.py) has their shape, small.
The train-mode graph is partitioned; the eval-mode graph follows its cuts, its stages share the
train stages' parameters, and a pipeline trains and evaluates like one process.
"""
from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.nn as nn
from torchvision.models.inception import InceptionOutputs

import autopipe
from autopipe.emit import emit_stages, run_chain, share_state
from autopipe.errors import PartitionError
from autopipe.graph import owning_module
from autopipe.partition.mode_plan import follow_plan
from autopipe.partition.partitioner import partition
from autopipe.tracer import trace
from tests.distributed import run_distributed
from tests.models import AuxNet, aux_loss, image_batch, timm_vit

STEPS, BATCH, M = 2, 8, 4


def test_a_forward_that_branches_on_training_is_traced_once_per_mode() -> None:
    traced = trace(AuxNet(), (image_batch(2),))
    assert traced.eval_traced is not None and traced.route == "fx"
    train_modules = {owning_module(n) for n in traced.gm.graph.nodes}
    eval_modules = {owning_module(n) for n in traced.eval_traced.gm.graph.nodes}
    assert "aux.2" in train_modules and not any(m.startswith("aux") for m in eval_modules)
    outputs = traced.unflatten_output([torch.zeros(1), torch.ones(1)])
    assert isinstance(outputs, InceptionOutputs) and outputs.aux_logits.item() == 1.0
    assert traced.eval_traced.unflatten_output([torch.zeros(1)]).shape == (1,)
    # One graph serves both modes where only submodules branch (their dropouts are leaves).
    assert trace(timm_vit(), (image_batch(2),)).eval_traced is None


@pytest.mark.parametrize("pp,chunks", [(2, 1), (2, 2), (3, 1)])
def test_eval_stages_cut_at_the_same_modules_and_share_state(pp: int, chunks: int) -> None:
    model = AuxNet().train()
    x = image_batch(4)
    traced = trace(model, (x,))
    plan = partition(traced, pp, chunks, device="cpu", balance="uniform")
    eval_traced, eval_plan = follow_plan(traced, plan, traced.eval_traced)
    train_stages = emit_stages(traced, plan)
    eval_stages = {i: share_state(m, train_stages[i]) for i, m in emit_stages(eval_traced, eval_plan).items()}
    for i, stage in eval_stages.items():
        for name, p in stage.named_parameters():
            assert p is train_stages[i].get_parameter(name), (i, name)
        for name, b in stage.named_buffers():
            assert b is train_stages[i].get_buffer(name), (i, name)
    ordered = [eval_stages[i] for i in range(plan.num_stages)]

    reference = model(x)  # train mode: batch statistics, auxiliary logits
    got = traced.unflatten_output(run_chain([train_stages[i] for i in range(plan.num_stages)], x))
    assert isinstance(got, InceptionOutputs)
    torch.testing.assert_close(got.logits, reference.logits)
    torch.testing.assert_close(got.aux_logits, reference.aux_logits)
    model.eval()
    for stage in ordered:
        stage.eval()
    torch.testing.assert_close(eval_traced.unflatten_output(run_chain(ordered, x)), model(x))


class _Reordered(nn.Module):
    """Runs its two layers in the other order in eval(): no cut serves both graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) if self.training else self.a(self.b(x * 2))


def test_a_module_that_would_change_stage_is_a_partition_error() -> None:
    traced = trace(_Reordered(), (torch.randn(2, 8),))
    plan = partition(traced, 2, balance=["b"], device="cpu")
    with pytest.raises(PartitionError, match=r"'a\.weight'.* stage 1.* stage 0.*split points"):
        follow_plan(traced, plan, traced.eval_traced)


# ----------------------------------------------------------------------------- one process
def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _reference() -> dict[str, Any]:
    """Train mode (batch norm per micro-batch, as a stage sees it), SGD; then eval mode."""
    torch.manual_seed(0)
    model = AuxNet().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        total = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = aux_loss(model(xm), ym)
            (loss / M).backward()
            total += loss.item() / M
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    model.eval()
    x, y = _data(STEPS)
    with torch.no_grad():
        out = model(x)
        eval_loss = sum(aux_loss(model(xm), ym).item() for xm, ym in zip(x.chunk(M), y.chunk(M))) / M
    return {"losses": losses, "state": model.state_dict(), "eval": out, "eval_loss": eval_loss}


def _pipelined(rank: int, world: int, pp: int, tp: int, chunks: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = AuxNet().train()
    pm = autopipe.parallelize(model, (torch.randn(BATCH // M, 3, 32, 32),), pp=pp, tp=tp, chunks=chunks,
                              microbatches=M, loss_fn=aux_loss, device="cpu", batchnorm="microbatch")
    optimizer = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        losses.append(pm.train_step(x, y).item())
        optimizer.step()
        optimizer.zero_grad()
    pm.eval()
    x, y = _data(STEPS)
    out = pm.eval_step(x)
    eval_loss = pm.train_step(x, y).item()  # a train step in eval(): the eval graph and its backward
    optimizer.zero_grad()
    return {"losses": losses, "state": pm.full_state_dict(), "eval": out, "eval_loss": eval_loss}


LAYOUTS = [(2, 1, 1), (2, 1, 2), (1, 2, 1)]  # (pp, tp, chunks), each over 2 processes


def _world(rank: int, world: int) -> dict[tuple[int, int, int], dict[str, Any]]:
    out = {}
    for layout in LAYOUTS:
        try:
            out[layout] = _pipelined(rank, world, *layout)
        except Exception:  # noqa: BLE001 - the peer failed too (failure propagation); go on
            out[layout] = {"error": f"rank {rank}: {traceback.format_exc()}"}
    return out


_RESULTS: list[Any] = []


def _results() -> tuple[dict[str, Any], list[dict]]:
    if not _RESULTS:  # one world runs every layout, and one reference serves them all
        _RESULTS.append((_reference(), run_distributed(_world, 2, timeout=300)))
    return _RESULTS[0]


@pytest.mark.parametrize("pp,tp,chunks", LAYOUTS)
def test_pipeline_trains_with_aux_logits_and_evaluates_without_like_one_process(pp: int, tp: int,
                                                                                 chunks: int) -> None:
    # With tp=2 each graph is sharded on its own (convolution pairs by channels) and the eval
    # stages read the train stages' shards: after the optimizer's steps, eval_step must see them.
    ref, worlds = _results()
    results = [w[(pp, tp, chunks)] for w in worlds]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
        assert r["state"].keys() == ref["state"].keys()
        for k, v in ref["state"].items():  # running statistics included
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    if pp == 2:
        assert results[0]["eval"] is None
    torch.testing.assert_close(results[-1]["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
