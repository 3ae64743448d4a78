"""Model specs: each prefix builds a tiny model on meta; mistakes raise ConfigError saying the fix."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.models import default_input, load_model

HF_TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def tiny_factory(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


class Computing(nn.Module):
    """Its constructor reads a tensor's value back, as torchvision's RegNets do."""

    def __init__(self) -> None:
        super().__init__()
        width = int(torch.tensor([2.6]).round().item()) * 4
        self.fc = nn.Linear(8, width)
        self.register_buffer("scale", torch.arange(width, dtype=torch.float32))


def computing_factory() -> nn.Module:
    return Computing()


class NoMetaKernel(nn.Module):
    """Its constructor runs an op that has no meta kernel, as timm's RegNets do with torch.unique
    on torch 2.11 (the message is that torch's own)."""

    def __init__(self) -> None:
        super().__init__()
        if torch.empty(0).is_meta:
            raise NotImplementedError("aten::_unique2: attempted to run this operator with Meta tensors, but "
                                      "there was no fake impl or Meta kernel registered.")
        self.fc = nn.Linear(8, 6)


def no_meta_kernel_factory() -> nn.Module:
    return NoMetaKernel()


def needs_a_package() -> nn.Module:
    raise ImportError("Needs requires the natten library but it was not found in your environment.")


class TokenModel(nn.Module):
    """Takes token ids first, as transformers' ImageGPT does."""

    main_input_name = "input_ids"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


def not_a_model() -> int:
    return 3


def on_meta(model: nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


def test_timm_on_meta_with_its_image_size() -> None:
    model = load_model("timm:vit_tiny_patch16_224", image_size=32, depth=1)
    assert type(model).__name__ == "VisionTransformer" and on_meta(model)
    assert default_input(model, 4).shape == (4, 3, 32, 32)
    assert default_input(model, 4).is_meta


def test_timm_image_size_ignored_where_the_model_takes_any() -> None:
    model = load_model("timm:resnet18", image_size=64)
    assert default_input(model, 2).shape == (2, 3, 224, 224)  # its pretrained_cfg
    assert default_input(model, 2, image_size=64).shape == (2, 3, 64, 64)


def test_torchvision() -> None:
    model = load_model("torchvision:resnet18", num_classes=10)
    assert model.fc.out_features == 10 and on_meta(model)
    assert default_input(model, 1).shape == (1, 3, 224, 224)
    vit = load_model("torchvision:vit_b_16", image_size=32)
    assert default_input(vit, 1).shape == (1, 3, 32, 32)


def test_hf_default_config_with_overrides() -> None:
    model = load_model("hf:ViTForImageClassification", image_size=32, num_channels=1, **HF_TINY)
    assert model.config.hidden_size == 32 and on_meta(model)
    assert default_input(model, 2).shape == (2, 1, 32, 32)


def test_factory_and_real_weights() -> None:
    model = load_model(f"{__name__}:tiny_factory", width=4)
    assert on_meta(model) and model[0].in_features == 4
    real = load_model(f"{__name__}:tiny_factory", meta=False)
    assert not on_meta(real) and torch.isfinite(real[0].weight).all()
    assert default_input(model, 3).shape == (3, 3, 224, 224)


def test_constructor_that_computes_still_builds_on_meta() -> None:
    # Under the meta device its .item() has no data to read; see [Note: constructors that compute].
    with pytest.raises(RuntimeError, match="meta tensor"), torch.device("meta"):
        Computing()
    model = load_model(f"{__name__}:computing_factory")
    assert model.fc.out_features == 12 and on_meta(model) and model.scale.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is undone
    regnet = load_model("torchvision:regnet_x_400mf")
    assert on_meta(regnet) and all(b.is_meta for b in regnet.buffers())
    assert sum(p.numel() for p in regnet.parameters()) == 5_495_976
    other = load_model(f"{__name__}:no_meta_kernel_factory")
    assert other.fc.out_features == 6 and on_meta(other)


def test_torchvision_default_size_is_its_weights_smallest() -> None:
    # Inception v3's auxiliary head needs 299 in train(); ViT-H/14's weights come at 518 and 224.
    assert default_input(load_model("torchvision:inception_v3"), 1).shape == (1, 3, 299, 299)
    assert default_input(load_model("torchvision:vit_h_14"), 1).shape == (1, 3, 224, 224)


def test_a_missing_package_of_the_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"needs a package that is not installed: .*natten"):
        load_model(f"{__name__}:needs_a_package")


def test_a_model_that_takes_no_image_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"TokenModel takes 'input_ids', not an image batch.*example_inputs"):
        default_input(TokenModel(), 2)


def test_default_input_from_a_spec() -> None:
    assert default_input("timm:vit_tiny_patch16_224", 2, image_size=32).shape == (2, 3, 32, 32)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("resnet50", r"not PREFIX:NAME.*timm:NAME"),
        ("timmm:resnet50", r"cannot import module 'timmm'.*did you mean 'timm:resnet50'"),
        ("timm:resnet5", r"unknown timm model 'resnet5'; close matches: .*resnet50"),
        ("torchvision:resnet5", r"unknown torchvision model 'resnet5'; close matches: .*resnet50"),
        ("hf:ViTForImageClassificaton", r"unknown transformers model .*ViTForImageClassification"),
        (f"{__name__}:tiny_factori", r"has no factory 'tiny_factori'; close matches: tiny_factory"),
        (f"{__name__}:not_a_model", r"returned a int, not an nn.Module"),
        (f"{__name__}:HF_TINY", r"is a dict, not callable"),
    ],
)
def test_bad_specs(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_model(spec)


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # makes `import timm` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install 'autopipe\[timm\]'"):
        load_model("timm:resnet18")


def test_bad_batch() -> None:
    with pytest.raises(ConfigError, match="batch must be a positive integer, got 0"):
        default_input(tiny_factory(), 0)
