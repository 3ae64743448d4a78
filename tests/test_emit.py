"""Chaining the emitted stages in one process reproduces the model: outputs and gradients."""
from __future__ import annotations

import pytest
import torch

from autopipe.stages.emit import emit_stages, run_chain
from autopipe.errors import ConfigError, PartitionError
from autopipe.stages.piece_state import merge_pieces, piece_params
from autopipe.partition.partitioner import partition, partition_at
from autopipe.stages import plan_stages
from autopipe.tracer import trace
from tests.models import MODELS, image_batch, logits


def _reference(model, x):
    model.zero_grad()
    out = model(x)
    loss = logits(out).square().mean()
    loss.backward()
    return logits(out).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _chained(model, traced, plan, x):
    model.zero_grad()
    stages = emit_stages(traced, plan)
    out = traced.unflatten_output(run_chain([stages[i] for i in range(plan.num_stages)], x))
    loss = logits(out).square().mean()
    loss.backward()
    # From the stages: an MLP cut across stages holds copies of its rows (plan.mlp_pieces).
    held = {n: p.grad.clone() for st in stages.values() for n, p in st.named_parameters() if p.grad is not None}
    return logits(out).detach(), merge_pieces(held, plan.mlp_pieces), stages


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pp,chunks", [(2, 1), (4, 2)])
def test_chained_stages_reproduce_outputs_and_gradients(name, pp, chunks):
    model = MODELS[name]().eval()  # eval: dropout off, BatchNorm uses running stats in both runs
    x = image_batch(2)
    ref_out, ref_grads = _reference(model, x)
    traced = trace(model, (x,))
    plan = plan_stages(traced, pp, chunks, device="cpu")
    assert plan.num_stages == pp * chunks
    out, grads, stages = _chained(model, traced, plan, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-6, atol=1e-6, msg=k)
    # Each stage owns only its own parameters, under their original names.
    seen: dict[str, int] = {}
    for i, st in stages.items():
        for key in st.state_dict():
            assert key in model.state_dict() or key in piece_params(plan.mlp_pieces)
        for key, _ in st.named_parameters():
            seen[key] = seen.get(key, 0) + 1
    pieces = piece_params(plan.mlp_pieces)
    assert {pieces[k].full if k in pieces else k for k in seen} == {n for n, _ in model.named_parameters()}
    assert all(v == 1 for v in seen.values()), {k: v for k, v in seen.items() if v > 1}


class _Masked(torch.nn.Module):
    """A non-persistent buffer read in the middle of the graph, as timm's Swin ``attn_mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.register_buffer("mask", torch.arange(8.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.mask)


def _copy_attr_as_torch_2_11(from_module, to_module, target):
    """torch 2.11's fx.GraphModule: every tensor it copies becomes a persistent buffer."""
    *prefix, field = target.split(".")
    for item in prefix:
        f, t = getattr(from_module, item), getattr(to_module, item, None)
        if f is t:
            return
        if t is None:
            t = torch.nn.Module()
            setattr(to_module, item, t)
        from_module, to_module = f, t
    orig = getattr(from_module, field)
    if isinstance(orig, torch.Tensor) and not isinstance(orig, torch.nn.Parameter):
        to_module.register_buffer(field, orig)
    else:
        setattr(to_module, field, orig)


def test_non_persistent_buffers_stay_out_of_stage_state(monkeypatch):
    monkeypatch.setattr(torch.fx.graph_module, "_copy_attr", _copy_attr_as_torch_2_11)
    model = _Masked()
    x = torch.randn(4, 8)
    traced = trace(model, (x,))
    stages = emit_stages(traced, partition(traced, 2, device="cpu"))
    assert any("mask" in dict(st.named_buffers()) for st in stages.values())  # the stage does read it
    for st in stages.values():
        assert set(st.state_dict()) <= set(model.state_dict()), set(st.state_dict()) - set(model.state_dict())
    torch.testing.assert_close(run_chain([stages[0], stages[1]], x)[0], model(x))


def test_stage_boundaries_match_plan():
    model = MODELS["timm_vit"]().eval()
    x = image_batch(2)
    traced = trace(model, (x,))
    plan = plan_stages(traced, 4, device="cpu")
    stages = emit_stages(traced, plan)
    values = (x,)
    for i in range(plan.num_stages):
        values = stages[i](*values)
        if i < plan.num_stages - 1:
            spec = plan.stages[i].outputs
            assert [tuple(v.shape) for v in values] == [c.shape for c in spec]
            assert plan.stages[i + 1].inputs == spec


def test_train_mode_batchnorm_updates_running_stats_like_the_model():
    model = MODELS["tv_resnet"]().train()
    x = image_batch(4)
    traced = trace(model, (x,))
    plan = plan_stages(traced, 2, device="cpu")
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    stages = emit_stages(traced, plan)
    run_chain([stages[0], stages[1]], x)
    after_chain = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(ref)
    model(x)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(after_chain[k], v, msg=k)


def test_too_many_stages_is_a_partition_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    traced = trace(model, (torch.randn(2, 4),))
    with pytest.raises(PartitionError, match="at most"):
        plan_stages(traced, 8, device="cpu")


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_degrees_must_be_positive(bad):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    traced = trace(model, (torch.randn(2, 4),))
    with pytest.raises(ConfigError, match="pp must be a positive integer"):
        plan_stages(traced, bad, device="cpu")


def test_split_points_by_module_name():
    model = MODELS["timm_vit"]().eval()
    traced = trace(model, (image_batch(2),))
    plan = plan_stages(traced, 2, balance=["blocks.1"], device="cpu")
    assert plan.stages[1].modules[0].startswith("blocks.1")
    with pytest.raises(PartitionError, match="blocks.9"):
        plan_stages(traced, 2, balance=["blocks.9"], device="cpu")


def _leaf_chain(stages, x):
    """Run the stages as the driver does: each receives its inputs as leaves requiring grad."""
    values = (x,)
    for i, stage in enumerate(stages):
        if i:
            values = tuple(v.detach().requires_grad_(True) for v in values)
        values = tuple(stage(*values))
    return values


@pytest.mark.parametrize("split", ["layer1.0.drop_block", "layer1.0.act1"])
def test_received_tensor_mutated_through_an_identity_is_copied(split):
    # timm's BasicBlock: bn1 -> drop_block (nn.Identity when disabled) -> act1 (in-place ReLU).
    # Cut before drop_block, the received tensor reaches the in-place ReLU through the Identity;
    # cut before act1, directly. See [Note: received tensors mutated in place].
    model = MODELS["timm_resnet"]().eval()
    x = image_batch(2)
    traced = trace(model, (x,))
    plan = plan_stages(traced, 2, balance=[split], device="cpu")
    stages = emit_stages(traced, plan)
    received = {c.name for c in plan.stages[1].inputs}
    assert "maxpool" in received  # the shortcut, read only: not copied
    cloned = {n.args[0].name for n in stages[1].graph.nodes if n.target is torch.clone}
    assert cloned == received - {"maxpool"} and len(cloned) == 1
    out = _leaf_chain([stages[0], stages[1]], x)[0]
    torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)


def test_received_tensor_read_only_is_not_copied():
    model = MODELS["timm_resnet"]().eval()
    traced = trace(model, (image_batch(2),))
    plan = plan_stages(traced, 2, balance=["layer2"], device="cpu")  # a conv and a downsample read it
    stages = emit_stages(traced, plan)
    assert not [n for n in stages[1].graph.nodes if n.target is torch.clone]
    _leaf_chain([stages[0], stages[1]], image_batch(2))


class _ChannelsLastBlock(torch.nn.Module):
    """As timm's ConvNeXt: a pointwise layer on NHWC, permuted back, read by a depthwise conv."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # channels_last strides
        x = self.dw(x)
        return self.head(x.mean((2, 3)))


def test_a_received_channels_last_value_is_restored_to_its_layout():
    """See [Note: received layout]: the value arrives contiguous, the conv reads it as traced."""
    model = _ChannelsLastBlock()
    x = torch.randn(2, 8, 6, 6)
    traced = trace(model, (x,))
    plan = plan_stages(traced, 2, balance=["dw"], device="cpu")
    stages = emit_stages(traced, plan)
    restored = [n for n in stages[1].graph.nodes if n.target == "contiguous"]
    assert [n.kwargs["memory_format"] for n in restored] == [torch.channels_last]
    assert not [n for n in stages[0].graph.nodes if n.target == "contiguous"]  # stage 0 gets the model's input
    seen = []
    stages[1].get_submodule("dw").register_forward_pre_hook(
        lambda _, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    sent = stages[0](x)
    received = tuple(t.detach().contiguous().requires_grad_(True) for t in sent)  # as p2p delivers it
    assert not received[0].is_contiguous(memory_format=torch.channels_last)
    out = stages[1](*received)[0]
    assert seen == [True]
    torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert received[0].grad is not None and received[0].grad.shape == received[0].shape


def test_nodes_a_stage_adds_take_no_name_of_the_model():
    """The restore copy and the clone of a received value are named apart from the model's
    nodes, which keep their own names in the stage (kernel times are read by name)."""

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            x = self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # channels_last strides
            y = x.contiguous() * 2  # a model node named 'contiguous'
            z = y.clone()  # and one named 'clone'
            return x.relu_() + z  # the received value mutated: the stage copies it

    traced = trace(Named(), (torch.randn(2, 3, 4, 4),))
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    assert {"contiguous", "clone"} <= set(order)
    plan = partition_at(traced, [0, order.index("contiguous")], device="cpu")
    stage = emit_stages(traced, plan)[1]
    names = {n.name for n in stage.graph.nodes}
    assert set(plan.stages[1].nodes) <= names  # the model's nodes under their own names
    added = {n.name: n.target for n in stage.graph.nodes if n.op != "output"}.items()
    extra = {name: target for name, target in added if name not in order and name not in
             {c.name for c in plan.stages[1].inputs}}
    assert extra == {"permute_1_layout": "contiguous", "permute_1_copy": torch.clone}
