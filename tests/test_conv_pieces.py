"""Convolutions cut by channel across stages (stages/mlp_pieces.py): a ResNet block's
conv1 -> bn1 -> relu -> conv2 (a pair, its pieces added up) and its stem conv1 -> bn1 -> relu ->
maxpool (a run, its pieces concatenated) are cut exactly, BatchNorm included, the partitioner
cuts them when that balances better, and training keeps the numbers of one process, running
statistics over the whole batch included (the reference of tests/test_batchnorm.py)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn as nn

import autopipe
from autopipe.errors import PartitionError
from autopipe.partition.partitioner import partition
from autopipe.partition.plan import PartitionPlan
from autopipe.stages.emit import emit_stages, run_chain
from autopipe.stages.mlp_pieces import PIECE, cut_mlps, find_mlps
from autopipe.stages.piece_plan import plan_stages
from autopipe.stages.piece_state import merge_pieces
from autopipe.tracer import trace
from tests.distributed import run_distributed
from tests.models import logits
from tests.test_batchnorm import DTYPE, _loss, _sgd, batch, excess, micro_batches, reference, resnet18, train

# Micro-batches of 4 images of 40 x 40, 2 steps. The partial sums round differently from one
# convolution (1e-16), and the BatchNorms of layer4 (over 2 x 2 maps here, 1 x 1 at 32 x 32)
# amplify that each step; at 32 x 32 with micro-batches of 2 it passes the tolerance (1e-10) in
# the first step. On the CPU profile this size is one the partitioner cuts convolution pairs at.
BATCH, M, STEPS, IMAGE = 8, 2, 2, 40

PIECES = {"layer1.0.conv1": {"fc2": "layer1.0.conv2", "hidden": [0, 8, 40, 64], "norms": ["layer1.0.bn1"]},
          "layer3.1.conv1": {"fc2": "layer3.1.conv2", "hidden": [0, 128, 256], "norms": ["layer3.1.bn1"]},
          "conv1": {"fc2": None, "hidden": [0, 24, 64], "norms": ["bn1"]},  # the stem, up to its max pool
          "layer4.0.downsample.0": {"fc2": None, "hidden": [0, 256, 384, 512], "norms": ["layer4.0.downsample.1"]}}


def _resnet() -> nn.Module:
    """torchvision's ResNet-18 (fp64) with every BatchNorm's weight, bias and running statistics
    drawn at random, so that a piece holding the wrong channels shows."""
    model, g = resnet18(), torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                for t, (low, high) in zip((m.weight, m.bias, m.running_mean, m.running_var),
                                          ((0.5, 1.5), (-0.2, 0.2), (-0.5, 0.5), (0.5, 2.0))):
                    t.copy_(torch.rand(t.shape, generator=g, dtype=t.dtype) * (high - low) + low)
    return model


def _traced(n: int = 4):
    return trace(_resnet(), (batch(0, n)[0],))


class _Grouped(nn.Module):
    """Two conv pairs neither of which is cut by channel: the first conv grouped, and a
    BatchNorm called twice between the second two."""

    def __init__(self):
        super().__init__()
        self.a1, self.a2 = nn.Conv2d(8, 32, 3, padding=1, groups=2), nn.Conv2d(32, 8, 1)
        self.b1, self.bn, self.b2 = nn.Conv2d(8, 32, 1), nn.BatchNorm2d(32), nn.Conv2d(32, 8, 1)

    def forward(self, x):
        x = self.a2(torch.relu(self.a1(x)))
        return self.b2(self.bn(self.bn(self.b1(x))))


def test_conv_pairs_and_runs_are_found_with_their_batchnorms():
    found = {(m.fc1.target, m.fc2 and m.fc2.target, m.norms) for m in find_mlps(_traced().gm)}
    blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    downsample = [f"layer{i}.0.downsample" for i in range(2, 5)]
    assert found == ({(f"{b}.conv1", f"{b}.conv2", (f"{b}.bn1",)) for b in blocks}
                     | {(f"{d}.0", None, (f"{d}.1",)) for d in downsample} | {("conv1", None, ("bn1",))})
    stem = next(m for m in find_mlps(_traced().gm) if m.fc1.target == "conv1")
    assert [n.target for n in stem.chain] == ["bn1", "relu", "maxpool"]
    # Neither a grouped convolution nor a norm called twice is cut by channel: runs stop before them.
    runs = {(m.fc1.target, m.fc2, len(m.chain)) for m in find_mlps(trace(_Grouped(), (torch.randn(2, 8, 4, 4),)).gm)}
    assert runs == {("b1", None, 0)}


def test_a_cut_conv_pair_gives_the_same_outputs_gradients_and_statistics():
    traced = _traced()
    split = cut_mlps(traced, PIECES)
    modules = {n.target for n in split.gm.graph.nodes if n.op == "call_module"}
    assert {"layer1.0.bn1_piece2", "layer3.1.conv2_piece1", "bn1_piece1", "layer4.0.downsample.1_piece2"} <= modules
    assert not {"layer1.0.bn1", "conv1", "layer4.0.downsample.0"} & modules
    assert split.gm.get_submodule("layer1.0.bn1_piece1").running_mean.shape == (32,)
    assert sum(n.target is torch.cat for n in split.gm.graph.nodes) == 2
    x = batch(1, 4)[0]
    ref, out = traced.gm(x)[0], split.gm(x)[0]  # train(): batch statistics, running ones updated
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)  # fp64 sums in another order
    ref.square().sum().backward()
    out.square().sum().backward()
    grads = merge_pieces({k: p.grad for k, p in split.gm.named_parameters()}, PIECES)
    want = {k: p.grad for k, p in traced.gm.named_parameters()}
    assert grads.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(grads[k], want[k], rtol=1e-10, atol=1e-10, msg=k)  # sums of ~1e3 terms
    state, want = merge_pieces(split.gm.state_dict(), PIECES), traced.gm.state_dict()
    assert state.keys() == want.keys() and int(state["bn1.num_batches_tracked"]) == 1
    for k in want:
        torch.testing.assert_close(state[k], want[k], rtol=1e-12, atol=1e-12, msg=k)
    traced.gm.eval(), split.gm.eval()  # eval(): the running statistics, piece by piece
    torch.testing.assert_close(split.gm(x), traced.gm(x), rtol=1e-10, atol=1e-10)
    with pytest.raises(PartitionError, match="norms"):
        cut_mlps(traced, {"layer1.0.conv1": {"fc2": "layer1.0.conv2", "hidden": [0, 8, 64]}})
    with pytest.raises(PartitionError, match="'layer1.0.conv2'"):  # the pair's second layer, not a run
        cut_mlps(traced, {"layer1.0.conv2": {"fc2": None, "hidden": [0, 8, 64], "norms": ["layer1.0.bn2"]}})


def test_the_partitioner_cuts_convolutions_when_that_balances_better():
    traced = _traced(2)
    plain = partition(traced, 4, device="cpu")
    plan = plan_stages(traced, 4, device="cpu", split_mlps="convolutions")
    assert plan_stages(traced, 4, device="cpu").mlp_pieces == {}  # convolutions are cut only when asked
    assert plan.mlp_pieces and not plain.mlp_pieces
    assert plan.imbalance < plain.imbalance - 0.05
    assert all(spec["norms"] for spec in plan.mlp_pieces.values())
    # Every kept MLP or run has a boundary inside: its pieces' nodes are not all in one stage.
    stage_of, nodes = plan.stage_of(), cut_mlps(traced, plan.mlp_pieces).gm.graph.nodes
    for fc1 in plan.mlp_pieces:
        assert len({stage_of[n.name] for n in nodes if n.meta.get(PIECE, ("",))[0] == fc1}) > 1, fc1
    x = batch(2, 2)[0]
    out = run_chain(list(emit_stages(traced, plan).values()), x)
    torch.testing.assert_close(out, traced.gm(x), rtol=1e-10, atol=1e-10)  # 1.8e-12 seen on another CPU
    assert PartitionPlan.from_dict(plan.to_dict()).mlp_pieces == plan.mlp_pieces
    assert "convolution cut across stages by channel: layer" in str(plan)


# ----------------------------------------------------------------------------- on 2 processes
def _worst(state: dict[str, torch.Tensor], ref: nn.Module) -> tuple[float, str]:
    """The entry of ``state`` furthest from ``ref``'s, as (excess over the tolerance, key)."""
    want = ref.state_dict()
    assert state.keys() == want.keys()
    return max((excess(v, want[k]), k) for k, v in state.items())


def _parallelize(split: bool | str, **kwargs):
    return autopipe.parallelize(_resnet(), (torch.zeros(BATCH // M, 3, IMAGE, IMAGE, dtype=DTYPE),), pp=2,
                                microbatches=M, loss_fn=_loss, deadline=120, split_mlps=split, **kwargs)


def _train_in_pieces(rank: int, world: int, root: str) -> dict:
    ref = reference(_resnet(), BATCH, micro_batches(BATCH, M), steps=STEPS, image=IMAGE)
    pm = _parallelize("convolutions", schedule="interleaved_1f1b", chunks=2)
    optimizer = _sgd(pm.parameters())
    train(pm, BATCH, steps=STEPS, optimizer=optimizer, image=IMAGE)
    out = {"pieces": pm.plan.mlp_pieces, "names": [n for s in pm.stages.values() for n in s.state_dict()],
           "state": _worst(pm.full_state_dict(), ref)}
    x_eval = batch(99, BATCH, IMAGE)[0]
    pm.eval()
    got = pm.eval_step(x_eval)
    ref.eval()
    with torch.no_grad():
        out["eval"] = None if got is None else excess(logits(got), logits(ref(x_eval)))
    # The pieces' checkpoint loads into a layout without them, statistics and momentum included.
    pm.save_checkpoint(os.path.join(root, "pieces"), optimizer)
    plain = _parallelize(False)
    plain_optimizer = _sgd(plain.parameters())
    plain.load_checkpoint(os.path.join(root, "pieces"), plain_optimizer)
    out["plain_pieces"] = plain.plan.mlp_pieces
    out["loaded"] = _worst(plain.full_state_dict(), ref)
    return out


def test_training_in_conv_pieces_equals_one_process_with_whole_batch_statistics():
    """pp=2 x 2 chunks, 2 micro-batches, 2 SGD steps with momentum, fp64: every parameter, running statistic
    and num_batches_tracked, and the eval() outputs, equal the one-process reference; the
    checkpoint loads into a plan without pieces."""
    with tempfile.TemporaryDirectory(prefix="autopipe-conv-pieces-") as tmp:
        results = run_distributed(_train_in_pieces, 2, tmp, timeout=400)
    r0 = results[0]
    assert r0["pieces"] and all(spec["norms"] for spec in r0["pieces"].values()) and not r0["plain_pieces"]
    assert any("bn1_piece" in n for r in results for n in r["names"])
    for r in results:
        assert r["state"][0] <= 1.0 and r["loaded"][0] <= 1.0, (r["state"], r["loaded"])
    # eval() outputs to 1e-8: the last stage's logits carry the rounding of every partial sum before
    evals = [r["eval"] for r in results if r["eval"] is not None]
    assert len(evals) == 1 and evals[0] <= 100.0, evals
