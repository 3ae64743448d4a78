"""Every tracing route gives a graph that computes what the model computes, in both modes.

"Transparency" as in torchgpipe: outputs and parameter gradients of the traced graph equal the
unmodified model's, in eval() and in train() with dropout (same seed before each call).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from transformers import (
    ResNetConfig,
    ResNetForImageClassification,
    SwinConfig,
    SwinForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)

from autopipe.errors import TraceError
from autopipe.graph import MODULE_KEY
from autopipe.tracer import TracedModel, trace

# b: micro-batch size of every example input
B = 2


@pytest.fixture(autouse=True)
def seed_one_thread() -> Iterator[None]:
    # Tensors here are tiny: threads cost more than they give, and OpenMP spins on a busy box.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def _image() -> torch.Tensor:
    return torch.randn(B, 3, 32, 32)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _run(fn: Callable[[], Any], seed: int = 1) -> Any:
    torch.manual_seed(seed)
    return fn()


def _grads(model: nn.Module, fn: Callable[[], Any]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _logits(_run(fn)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_transparent(model: nn.Module, x: torch.Tensor, traced: TracedModel) -> None:
    gm = traced.gm
    for training in (False, True):  # eval first: train() forwards move batch-norm running stats
        model.train(training)
        expected = _run(lambda: model(x))
        got = _run(lambda: traced.unflatten_output(gm(x)))
        assert type(got) is type(expected)  # a transformers ModelOutput comes back as one, .logits and all
        torch.testing.assert_close(_logits(got), _logits(expected))
    ref, got = _grads(model, lambda: model(x)), _grads(model, lambda: traced.unflatten_output(gm(x)))
    assert ref.keys() == got.keys() == {n for n, _ in model.named_parameters()}
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], msg=name)
    keys, model_keys = set(gm.state_dict()), set(model.state_dict())
    assert keys <= model_keys, keys - model_keys
    assert {n for n, _ in model.named_parameters()} <= keys
    for node in gm.graph.nodes:
        assert "val" in node.meta and MODULE_KEY in node.meta, node.format_node()


def _tiny_vit(**kw: Any) -> ViTForImageClassification:
    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=10, **kw))


def _tiny_swin(**kw: Any) -> SwinForImageClassification:
    return SwinForImageClassification(SwinConfig(
        image_size=32, patch_size=2, window_size=4, depths=[2, 2], num_heads=[2, 4], embed_dim=32,
        num_labels=10, **kw))


def _tiny_hf_resnet() -> ResNetForImageClassification:
    return ResNetForImageClassification(ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10))


_TINY_VIT = dict(img_size=32, patch_size=8, depth=2, num_classes=10)
MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "timm_vit": (lambda: timm.create_model("vit_tiny_patch16_224", drop_rate=0.1, **_TINY_VIT), "fx"),
    "timm_deit": (lambda: timm.create_model("deit_tiny_patch16_224", **_TINY_VIT), "fx"),
    "timm_resnet18": (lambda: timm.create_model("resnet18", num_classes=10), "fx"),
    "timm_swin": (lambda: timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, depths=(2, 2),
        num_heads=(2, 4), embed_dim=32, num_classes=10), "fx"),
    "timm_convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=10), "fx"),
    "timm_mixer": (lambda: timm.models.mlp_mixer.MlpMixer(
        img_size=32, patch_size=8, num_blocks=2, embed_dim=64, num_classes=10), "fx"),
    "tv_resnet18": (lambda: torchvision.models.resnet18(num_classes=10), "fx"),
    "tv_vit": (lambda: torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10, dropout=0.1), "fx"),
    "tv_convnext_tiny": (lambda: torchvision.models.convnext_tiny(num_classes=10), "fx"),
    "hf_vit_dropout": (lambda: _tiny_vit(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1), "export"),
    "hf_swin_droppath": (lambda: _tiny_swin(drop_path_rate=0.1, hidden_dropout_prob=0.1), "export"),
    "hf_resnet": (_tiny_hf_resnet, "export"),
}


@functools.lru_cache(maxsize=None)
def traced_model(name: str, route: str = "auto") -> tuple[nn.Module, torch.Tensor, TracedModel]:
    """Each model is traced once per route; tests that only read the graph share it."""
    torch.manual_seed(0)
    model, x = MODELS[name][0](), _image()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    traced = trace(model, (x,), route=route)
    for k, v in model.state_dict().items():  # tracing ran nothing for real: no batch-norm update
        torch.testing.assert_close(v, before[k], msg=k)
    return model, x, traced


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_route_is_transparent(name: str) -> None:
    model, x, traced = traced_model(name)
    assert traced.route == MODELS[name][1], traced.attempts
    assert_transparent(model, x, traced)


@pytest.mark.parametrize("name", ["tv_resnet18", "tv_vit"])
def test_export_route_on_fx_models(name: str) -> None:
    # inplace ReLU, `out += identity`, nn.MultiheadAttention(x, x, x, need_weights=False)
    model, x, traced = traced_model(name, "export")
    assert traced.route == "export"
    assert_transparent(model, x, traced)


def test_export_folds_mode_dependent_modules() -> None:
    gm = traced_model("hf_vit_dropout")[2].gm
    targets = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    # nn.Dropout and, since its sdpa dropout_p follows self.training, ViTAttention are calls
    assert {"vit.embeddings.dropout", "vit.layers.0.dropout", "vit.layers.1.attention"} <= targets
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in names if "dropout" in t or "_assert" in t or "rand" in t], names
    assert all(n.meta[MODULE_KEY] == n.target for n in gm.graph.nodes if n.op == "call_module")

    swin = traced_model("hf_swin_droppath")[2].gm
    assert "swin.encoder.layers.1.blocks.1.drop_path" in {n.target for n in swin.graph.nodes}


def test_export_makes_inplace_ops_out_of_place() -> None:
    gm = traced_model("hf_resnet")[2].gm  # `hidden_state += residual`
    inplace = [n for n in gm.graph.nodes if getattr(n.target, "_schema", None) and n.target._schema.name.endswith("_")]
    assert not inplace, inplace
    assert "_guards_fn" not in {n.target for n in gm.graph.nodes}


class _Odd(nn.Module):
    """What export lifts or bakes in: tensors made in forward, plain tensor attributes, in-place ops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3)
        self.scale = torch.full((4,), 2.0)
        self.register_buffer("shift", torch.full((4,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = self.drop(self.bn(self.fc(x))) * self.scale + self.shift + torch.tensor([1.0, 2.0, 3.0, 4.0])
        y = y.relu_()
        return y, {"sum": y.sum(1)}


def test_export_normalises_constants_buffers_and_outputs() -> None:
    model, x = _Odd(), torch.randn(3, 4)
    model.bn.eval()  # frozen inside a training model: tracing must leave that mode alone
    traced = trace(model, (x,), route="export")
    assert model.training and not model.bn.training
    assert set(traced.gm.state_dict()) == set(model.state_dict())
    assert {"fc", "bn", "drop"} <= {n.target for n in traced.gm.graph.nodes if n.op == "call_module"}
    assert "relu_" not in {getattr(n.target, "__name__", "") for n in traced.gm.graph.nodes}
    for training in (False, True):
        model.train(training)
        model.bn.eval()
        torch.testing.assert_close(_run(lambda: traced.unflatten_output(traced.gm(x))), _run(lambda: model(x)))


def test_export_user_leaf_modules() -> None:
    model, x = _tiny_vit(), _image()
    traced = trace(model, (x,), leaf_modules=["vit.layers.0"])
    assert "vit.layers.0" in {n.target for n in traced.gm.graph.nodes if n.op == "call_module"}
    assert_transparent(model, x, traced)
    with pytest.raises(TraceError, match=r"vit\.layers\.0"):
        trace(model, (x,), route="export", leaf_modules=["vit.layer.0"])


def test_meta_device_planning() -> None:
    with torch.device("meta"):
        timm_vit = timm.create_model("vit_base_patch16_224")
        hf_vit = ViTForImageClassification(ViTConfig(num_hidden_layers=4, hidden_dropout_prob=0.1, num_labels=1000))
        x = torch.randn(B, 3, 224, 224)
    for model, route in ((timm_vit, "fx"), (hf_vit, "export")):
        traced = trace(model, (x,))
        assert traced.route == route
        assert all(p.is_meta for p in traced.gm.parameters())
        for node in traced.gm.graph.nodes:
            assert "val" in node.meta and MODULE_KEY in node.meta
        out = [n for n in traced.gm.graph.nodes if n.op == "output"][0].args[0][0].meta["val"]
        assert tuple(out.shape) == (B, 1000) and out.is_meta
    assert traced.unflatten_output([torch.zeros(B, 1000)]).logits.shape == (B, 1000)


RESNET_SEQUENCE = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"]


def test_sequence_route() -> None:
    model, x = torchvision.models.resnet18(num_classes=10), _image()
    traced = trace(model, (x,), exec_sequence=RESNET_SEQUENCE + [lambda x: torch.flatten(x, 1), "fc"])
    assert traced.route == "sequence"
    assert_transparent(model, x, traced)
    owners = [n.meta[MODULE_KEY] for n in traced.gm.graph.nodes if n.op in ("call_module", "call_function")]
    assert owners == RESNET_SEQUENCE + ["", "fc"]

    # a partial is unpacked, so the graph shows torch.flatten itself to the cost model
    partial = functools.partial(torch.flatten, start_dim=1)
    traced = trace(model, (x,), exec_sequence=RESNET_SEQUENCE + [partial, "fc"])
    flatten = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert [(n.target, n.kwargs) for n in flatten] == [(torch.flatten, {"start_dim": 1})]
    model.eval()
    torch.testing.assert_close(traced.unflatten_output(traced.gm(x)), model(x))


def test_sequence_route_errors() -> None:
    model, x = torchvision.models.resnet18(num_classes=10), _image()
    with pytest.raises(TraceError, match=r"'layer_2'.*close matches: layer2"):
        trace(model, (x,), exec_sequence=["conv1", "layer_2"])
    with pytest.raises(TraceError, match="empty"):
        trace(model, (x,), exec_sequence=[])
    with pytest.raises(TraceError, match=r"fc\.weight"):
        trace(model, (x,), exec_sequence=RESNET_SEQUENCE)


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: neither fx nor export can follow it
            return x * 2
        return -x


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.fc(x))


def test_untraceable_model_names_module_and_line() -> None:
    with pytest.raises(TraceError) as info:
        trace(_Gated(), (torch.randn(B, 4),))
    message = str(info.value)
    for part in ("- fx:", "- export:", "module 'gate'", "if x.sum() > 0:", "leaf_modules", "exec_sequence"):
        assert part in message, message


class _RootDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.5, self.training)


class _BufferView(nn.Module):
    """Reads a view of a buffer (``self.index.view(-1)``, as timm's Swin attention does): fx
    makes each view a new ``_tensor_constant<i>`` of the root, numbered per trace. With
    ``per_mode`` it reads another buffer in eval(), and so differs between the modes."""

    def __init__(self, per_mode: bool) -> None:
        super().__init__()
        self.per_mode = per_mode
        self.fc = nn.Linear(4, 4)
        self.register_buffer("index", torch.tensor([[3, 2], [1, 0]]))
        self.register_buffer("other", torch.tensor([[0, 1], [2, 3]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = self.other if self.per_mode and not self.training else self.index
        return self.fc(x)[:, index.view(-1)]


@pytest.mark.parametrize("per_mode", [False, True])
def test_a_module_whose_modes_differ_only_in_a_constants_name_is_traced_through(per_mode: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 4), _BufferView(per_mode))
    traced = trace(model, (torch.randn(B, 4),), route="fx")
    leaves = {n.target for n in traced.gm.graph.nodes if n.op == "call_module"}
    assert ("1" in leaves) == per_mode, leaves  # a leaf only where its graph follows the mode
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]  # fx's, left on the root
    assert_transparent(model, torch.randn(B, 4), traced)


def test_timm_swin_attention_is_traced_through() -> None:
    # WindowAttention's sdpa dropout_p follows self.training but is 0 in both modes: one graph.
    gm = traced_model("timm_swin")[2].gm
    leaves = {type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"}
    assert "WindowAttention" not in leaves, leaves
    attention = [str(n.target) for n in gm.graph.nodes if n.meta[MODULE_KEY].startswith("layers.1.blocks.1.attn")]
    assert "layers.1.blocks.1.attn.softmax" in attention and "<built-in function matmul>" in attention, attention


def test_export_rejects_mode_dependent_root() -> None:
    with pytest.raises(TraceError, match=r"train\(\) and eval\(\)"):
        trace(_RootDropout(), (torch.randn(B, 4),), route="export")


class _Masked(nn.Module):
    """timm's Hiera: ``forward(x, mask=None)`` branches on ``mask is not None``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if mask is not None:
            x = x * mask.view(x.shape[0], 1)
        return self.fc(x)


def test_inputs_left_out_are_traced_at_their_defaults() -> None:
    # fx would trace mask as a proxy, take the mask branch, and fail on None at propagation.
    # **kwargs (transformers' forwards end with one) is bound empty.
    model, x = _Masked(), torch.randn(B, 4)
    traced = trace(model, (x,))
    assert traced.route == "fx"
    assert [n.target for n in traced.gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert "view" not in {n.target for n in traced.gm.graph.nodes}
    torch.testing.assert_close(traced.gm(x)[0], model(x))


class _WeightStandardised(nn.Conv2d):
    """transformers' Bit: batch statistics of the weight itself, in both modes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                         momentum=0.0, eps=1e-6).reshape_as(self.weight)
        with torch.no_grad():  # export keeps this region as a higher-order op with a graph body
            shift = torch.ones(1)
        return F.conv2d(x, w, self.bias, self.stride, self.padding) + shift


def test_export_takes_batch_statistics_without_running_statistics() -> None:
    model, x = nn.Sequential(_WeightStandardised(3, 4, 3), nn.ReLU()), _image()
    traced = trace(model, (x,), route="export")
    for training in (False, True):
        model.train(training)
        torch.testing.assert_close(traced.unflatten_output(traced.gm(x)), model(x))


class _CachedBias(nn.Module):
    """timm's LeViT attention: in eval mode it caches a tensor computed in forward, per device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bias = nn.Linear(4, 4), nn.Parameter(torch.ones(4))
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.fc(x) + self.bias * 2
        key = str(x.device)
        if key not in self.cache:
            self.cache[key] = self.bias * 2
        return self.fc(x) + self.cache[key]


def test_tracing_leaves_no_proxy_or_fake_tensor_in_the_model() -> None:
    # See [Note: caches filled while tracing]: fx would leave a proxy, shape propagation a fake
    # tensor in the cache, and the model would return fake tensors from then on.
    model, x = nn.Sequential(_CachedBias(), nn.ReLU()).eval(), torch.randn(B, 4)
    expected = model(x).detach()
    model[0].cache.clear()
    for _ in range(2):  # a second trace must not meet the first one's proxies
        traced = trace(model, (x,))
        assert model[0].cache == {}
    got = model(x)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(traced.unflatten_output(traced.gm(x)), expected)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norms_propagate_shapes_without_touching_statistics(momentum: float | None) -> None:
    """momentum=None reads num_batches_tracked as a float, which fake tensors refuse on torch 2.11."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU()).train()
    model = model.to(memory_format=torch.channels_last)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = _image().to(memory_format=torch.channels_last)
    traced = trace(model, (x,), route="fx")
    (norm,) = [n for n in traced.gm.graph.nodes if n.op == "call_module" and n.target == "1"]
    want = model(x)
    assert norm.meta["val"].shape == want.shape and norm.meta["val"].dtype == want.dtype
    assert norm.meta["val"].is_contiguous(memory_format=torch.channels_last)
    model.load_state_dict(before)
    traced = trace(model, (x,), route="fx")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
