"""The Colossal-AI tutorials' training recipes, run by examples/vit_cifar10.py under torchrun on
4 CPU processes (digits data): every run asserts what the recipe must achieve.

* data parallel alone: timm's Lamb with linear warm-up and decay, mixup and cutmix, 2 batches
  accumulated per step, fp16 with its loss scale, ZeRO; test accuracy well above chance after
  one epoch (6 steps), and TensorBoard scalars read back with tensorboard's EventAccumulator;
* pipeline x dp with ZeRO, bf16, activation checkpointing and accumulation: a run stopped after
  its first epoch and resumed from its checkpoint ends where an uninterrupted run ends.
"""
from __future__ import annotations

import re

import pytest
import torch

from tests.test_examples import _run

SMALL = ["--depth", "2", "--epochs", "1"]


def _scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logdir)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_data_parallel_recipe_learns_and_logs_to_tensorboard(tmp_path):
    tb = str(tmp_path / "tb")
    code, out = _run("vit_cifar10.py", [
        "--parallel", "data", *SMALL, "--batch-size", "32", "--microbatches", "1",
        "--optimizer", "lamb", "--lr", "1.8e-2", "--weight-decay", "0.1", "--lr-decay", "linear",
        "--mixup", "0.2", "--cutmix", "1.0", "--accumulate", "2", "--precision", "fp16", "--zero",
        "--tensorboard", tb])
    assert code == 0, out[-4000:]
    assert "pp 1 x chunks 1 x tp 1" in out  # dp = 4: data parallelism alone
    accuracy = float(re.findall(r"^final test accuracy: (\S+)$", out, re.M)[0])
    assert accuracy > 0.3, out[-2000:]  # chance is 0.1
    # 1500 digits over 4 replicas of 32: 11 full batches and one of 22 (an even share), 2 per step.
    scalars = _scalars(tb)
    for tag in ("train/loss", "train/accuracy", "train/lr", "train/samples_per_s", "train/loss_scale"):
        assert [s for s, _ in scalars[tag]] == list(range(1, 7)), tag
    assert [s for s, _ in scalars["test/accuracy"]] == [6]
    assert scalars["test/accuracy"][0][1] == pytest.approx(accuracy, abs=1e-4)
    # Linear warm-up over round(0.1 * 6) = 1 step, then linear decay to 0: each step's lr.
    lrs = [v for _, v in scalars["train/lr"]]
    assert lrs == pytest.approx([1.8e-2 * f for f in (1, 1, 0.8, 0.6, 0.4, 0.2)], rel=1e-5)
    assert all(0 <= v <= 1 for _, v in scalars["train/accuracy"])  # mixed targets count by share
    assert all(1 <= v <= 2.0**16 for _, v in scalars["train/loss_scale"])
    assert all(v > 0 for _, v in scalars["train/samples_per_s"] + scalars["train/loss"])


def _checkpoint(path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = path / open(path / "latest").read().strip()
    dcp_to_torch_save(str(target), str(path / "flat.pt"))
    return torch.load(path / "flat.pt", weights_only=True)


def test_resumed_run_continues_the_uninterrupted_trajectory(tmp_path):
    common = ["--parallel", "pipeline", "--depth", "2", "--epochs", "2", "--batch-size", "128", "--microbatches", "2",
              "--accumulate", "2", "--precision", "bf16", "--activation-checkpointing", "--zero"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    runs = [["--checkpoint", str(whole)], ["--checkpoint", str(split), "--stop-after-epoch", "1"],
            ["--checkpoint", str(split), "--resume"]]
    outs = []
    for extra in runs:
        code, out = _run("vit_cifar10.py", common + extra)
        assert code == 0, out[-4000:]
        outs.append(out)
    assert "resumed from" in outs[2] and "after epoch 1 (step 3)" in outs[2]
    epoch2 = [re.findall(r"^epoch 2/2: train loss (\S+), test accuracy (\S+),", o, re.M) for o in (outs[0], outs[2])]
    assert epoch2[0] and epoch2[0] == epoch2[1]
    assert not re.findall(r"^epoch 2/2", outs[1], re.M)
    a, b = _checkpoint(whole), _checkpoint(split)
    assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(b[k], v, rtol=1e-6, atol=1e-6, msg=k)
        else:
            assert b[k] == v, k


def test_mixed_accuracy_counts_each_sample_by_its_share_of_the_prediction():
    import sys

    from timm.data.mixup import mixup_target

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "examples"))
    from _common import batch_sizes
    from _recipes import mixed_accuracy

    labels = torch.tensor([1, 2, 3, 3])  # mixed with the batch reversed: (1, 3), (2, 3), (3, 2), (3, 1)
    targets = mixup_target(labels, 10, lam=0.7, smoothing=0.1)
    logits = torch.nn.functional.one_hot(torch.tensor([1, 3, 5, 3]), 10).float()  # a, b, neither, a
    assert mixed_accuracy(logits, targets, 0.1) == pytest.approx((0.7 + 0.3 + 0 + 0.7) / 4)
    same = mixup_target(torch.tensor([4, 4]), 10, lam=0.6, smoothing=0.1)  # a sample mixed with its own class
    hit_and_miss = torch.nn.functional.one_hot(torch.tensor([4, 0]), 10).float()
    assert mixed_accuracy(hit_and_miss, same, 0.1) == pytest.approx(0.5)
    assert mixed_accuracy(logits, torch.tensor([1, 2, 5, 0]), 0.1) == 0.5  # plain labels
    # The last batch of an epoch is kept, one even size on every replica.
    assert batch_sizes(1500, 32, 4, multiple=2) == [32] * 11 + [22]
    assert batch_sizes(1500, 16, 1) == [16] * 93 + [12]
    assert batch_sizes(10, 4, 4) == [2]
