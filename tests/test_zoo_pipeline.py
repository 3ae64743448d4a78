"""A sample of the model zoo (benchmarks/zoo_sweep.py) trains in a pipeline exactly like one process.

Small configurations of models that once failed to plan or to run: a torchvision RegNet (its
constructor computes with tensors), GoogLeNet (its forward branches on self.training: one graph
per mode, auxiliary logits reach the loss in train()), timm's Swin and LeViT (attention leaves),
Hiera (``mask=None`` traced at its default), ResNet-18 interleaved over 2 chunks (a received
tensor reaches an in-place ReLU through an Identity) and transformers' Bit (a weight-standardised
conv through the export route). ViTs and ResNets of each library are tests/test_pipeline_models.py's.

Each takes one SGD step at pp=2 in train() on a batch of 4 in 2 micro-batches; its reference is
the unsplit model on the same micro-batches (batch norm statistics per micro-batch, as a stage
sees them; see docs/batchnorm.md). Every parameter and buffer must agree after the step within
rtol 1e-5 (atol 1e-6), and the loss too; then ``eval_step`` in eval() must give the reference
model's eval outputs. One gloo world of 2 processes runs every model.
"""
from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from tests.distributed import run_distributed
from tests.models import logits

BATCH, M = 4, 2
RTOL, ATOL = 1e-5, 1e-6


def tv_regnet() -> nn.Module:
    from torchvision.models.regnet import BlockParams, RegNet

    return RegNet(BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8), num_classes=10)


def tv_googlenet() -> nn.Module:
    import torchvision

    return torchvision.models.googlenet(num_classes=10, aux_logits=True, init_weights=True, dropout=0.0,
                                        dropout_aux=0.0)


def timm_swin() -> nn.Module:
    import timm

    return timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                             depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10,
                             drop_path_rate=0.0)  # its default, 0.1, draws random numbers in train()


def timm_levit() -> nn.Module:
    import timm

    return timm.create_model("levit_128s", img_size=32, embed_dim=(32, 48, 64), num_heads=(2, 3, 4),
                             depth=(1, 1, 1), key_dim=8, num_classes=10)


def timm_hiera() -> nn.Module:
    import timm

    return timm.create_model("hiera_tiny_224", img_size=(32, 32), embed_dim=16, num_heads=1, stages=(1, 1, 1, 1),
                             mask_unit_size=(4, 4), q_pool=2, num_classes=10)


def timm_resnet18() -> nn.Module:
    import timm

    return timm.create_model("resnet18", num_classes=10)


def hf_bit() -> nn.Module:
    from transformers import BitConfig, BitForImageClassification

    return BitForImageClassification(BitConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                               num_groups=4, num_labels=10))


# name -> (builder, chunks)
SAMPLE: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "tv_regnet": (tv_regnet, 1),
    "tv_googlenet": (tv_googlenet, 1),
    "timm_swin": (timm_swin, 1),
    "timm_levit": (timm_levit, 1),
    "timm_hiera": (timm_hiera, 1),
    "timm_resnet18_interleaved": (timm_resnet18, 2),
    "hf_bit": (hf_bit, 1),
}


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    if hasattr(out, "aux_logits1"):  # torchvision's GoogLeNetOutputs in train(): its recipe's weights
        return F.cross_entropy(out.logits, y) + 0.3 * (F.cross_entropy(out.aux_logits1, y)
                                                       + F.cross_entropy(out.aux_logits2, y))
    return F.cross_entropy(logits(out), y)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return SAMPLE[name][0]().train()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(name: str) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: kernels sum in another order with more threads
    try:
        model = _build(name)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = _optimizer(model.parameters())
        x, y = _data()
        loss = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            mb_loss = _loss(model(xm), ym)
            (mb_loss / M).backward()
            loss += mb_loss.item() / M
        optimizer.step()
        after = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            evaluated = logits(model.eval()(x))
    finally:
        torch.set_num_threads(threads)
    moved = max(float((after[k].double() - before[k].double()).abs().max()) for k in after
                if after[k].is_floating_point())
    return {"loss": loss, "state": after, "moved": moved, "eval": evaluated}


def _excess(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if not want.is_floating_point():
        return 0.0 if torch.equal(got, want) else float("inf")
    err = (got.double() - want.double()).abs()
    return float((err / (ATOL + RTOL * want.double().abs())).max()) if err.numel() else 0.0


def _run(name: str, ref: dict[str, Any]) -> dict[str, Any]:
    model = _build(name)
    # The reference updates BatchNorm's running statistics once per micro-batch: so does this one.
    pm = autopipe.parallelize(model, (torch.zeros(BATCH // M, 3, 32, 32),), pp=2, chunks=SAMPLE[name][1],
                              microbatches=M, loss_fn=_loss, device="cpu", deadline=120, batchnorm="microbatch")
    optimizer = _optimizer(pm.parameters())
    x, y = _data()
    loss = float(pm.train_step(x, y))
    pm.step(optimizer)
    state = pm.full_state_dict()  # every rank: the whole model under its own names (MLP pieces merged)
    worst = max(((_excess(v, ref["state"][k]) if k in ref["state"] else float("inf"), k) for k, v in state.items()),
                default=(0.0, ""))
    out = pm.eval().eval_step(x)  # eval mode: GoogLeNet's other graph, LeViT's cached attention biases
    return {"loss": loss, "keys": sorted(state), "worst": worst,
            "eval": None if out is None else _excess(logits(out), ref["eval"])}


def world_worker(rank: int, world: int, ref_path: str) -> dict[str, dict[str, Any]]:
    refs = torch.load(ref_path, weights_only=True)
    out = {}
    for name in SAMPLE:
        try:
            out[name] = _run(name, refs[name])
        except Exception:  # noqa: BLE001 - the peer failed too (failure propagation); go on
            out[name] = {"error": f"rank {rank}: {traceback.format_exc()}"}
    return out


_REFS: dict[str, dict[str, Any]] = {}
_WORLD: list[Any] = []


def results() -> list[dict[str, dict[str, Any]]]:
    if not _WORLD:
        try:
            for name in SAMPLE:
                _REFS[name] = reference(name)
            with tempfile.TemporaryDirectory(prefix="autopipe-zoo-") as tmp:
                path = os.path.join(tmp, "refs.pt")
                torch.save(_REFS, path)
                _WORLD.append(run_distributed(world_worker, 2, path, timeout=400))
        except Exception as exc:  # fail every model once, not after one timeout each
            _WORLD.append(exc)
    if isinstance(_WORLD[0], Exception):
        raise _WORLD[0]
    return _WORLD[0]


@pytest.mark.parametrize("name", list(SAMPLE))
def test_one_pipelined_train_step_equals_one_process(name: str) -> None:
    got = [r[name] for r in results()]
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    ref = _REFS[name]
    assert ref["moved"] > 100 * ATOL  # the step moves the parameters far beyond the tolerance
    for rank, g in enumerate(got):
        assert g["keys"] == sorted(ref["state"]), f"rank {rank}: full_state_dict() keys"
        ratio, key = g["worst"]
        assert ratio <= 1.0, f"rank {rank}: {key} differs from one process by {ratio:.3g}x the tolerance"
        assert g["loss"] == pytest.approx(ref["loss"], rel=RTOL), f"rank {rank}"
    assert got[0]["eval"] is None and got[1]["eval"] <= 1.0, "eval_step after the step, against one process"
