"""Tiny configurations of the models autopipe must handle, shared by the tests (32x32 images)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


def timm_vit(**kw) -> nn.Module:
    import timm

    args = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4, num_classes=10)
    args.update(kw)
    return timm.create_model("vit_tiny_patch16_224", **args)


def timm_deit() -> nn.Module:
    import timm

    return timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=64,
                             num_heads=4, num_classes=10)


def timm_resnet() -> nn.Module:
    import timm

    return timm.create_model("resnet18", num_classes=10)


def timm_model(name: str, **kw: Any) -> nn.Module:
    """timm's ``name``, randomly initialised, with 10 classes and ``kw`` (a tiny config)."""
    import timm

    return timm.create_model(name, num_classes=10, **kw)


def timm_swin(**kw: Any) -> nn.Module:
    import timm

    return timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                             depths=(2, 2), num_heads=(2, 4), embed_dim=32, num_classes=10, **kw)


def timm_convnext() -> nn.Module:
    import timm

    return timm.create_model("convnext_atto", num_classes=10)


def timm_mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=64, num_classes=10)


def tv_resnet() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def tv_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                             mlp_dim=128, num_classes=10)


def tv_convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    cfg = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    return ConvNeXt(cfg, num_classes=10)


def hf_vit(**kw) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    args = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, num_labels=10)
    args.update(kw)
    return ViTForImageClassification(ViTConfig(**args))


def hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                     num_labels=10))


def hf_swin(**config: Any) -> nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    return SwinForImageClassification(SwinConfig(image_size=32, patch_size=2, embed_dim=32, depths=[2, 2],
                                                 num_heads=[2, 4], window_size=4, num_labels=10, **config))


class AuxNet(nn.Module):
    """GoogLeNet's and Inception v3's shape, small: its own forward branches on self.training,
    returning auxiliary logits in torchvision's ``InceptionOutputs`` in train() only and
    applying dropout before the classifier (p=0 by default, so train steps are deterministic)."""

    def __init__(self, num_classes: int = 10, drop: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.block1 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.aux = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, num_classes))
        self.block2 = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.block3 = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True))
        self.fc = nn.Linear(64, num_classes)
        self.drop = drop

    def forward(self, x: torch.Tensor) -> Any:
        from torchvision.models.inception import InceptionOutputs

        x = self.block1(self.stem(x))
        aux = self.aux(x) if self.training else None
        x = self.block3(self.block2(x))
        x = nn.functional.dropout(x.mean((2, 3)), self.drop, self.training)
        logits = self.fc(x)
        return InceptionOutputs(logits, aux) if self.training else logits


def aux_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """torchvision's recipe for GoogLeNet and Inception: the auxiliary loss weighted 0.4."""
    if isinstance(output, torch.Tensor):
        return nn.functional.cross_entropy(output, target)
    return nn.functional.cross_entropy(output.logits, target) + 0.4 * nn.functional.cross_entropy(
        output.aux_logits, target)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "timm_vit": timm_vit,
    "timm_deit": timm_deit,
    "timm_resnet": timm_resnet,
    "timm_swin": timm_swin,
    "timm_convnext": timm_convnext,
    "timm_mixer": timm_mixer,
    "tv_resnet": tv_resnet,
    "tv_vit": tv_vit,
    "tv_convnext": tv_convnext,
    "hf_vit": hf_vit,
    "hf_resnet": hf_resnet,
    "hf_swin": hf_swin,
}


def image_batch(n: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g)


def logits(output) -> torch.Tensor:
    """The logits of whatever a model returns (tensor, tuple, transformers ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return output[0]


# AdamW turns rounding noise into full-size updates where the exact gradient is zero, and the
# key bias of attention always has a zero gradient (softmax ignores a shift shared by all keys).
# Equivalence tests that use AdamW therefore take attention without qkv bias.
ADAMW_MODELS: dict[str, Callable[[], nn.Module]] = {
    "timm_vit": lambda: timm_vit(qkv_bias=False),
    "hf_vit": lambda: hf_vit(qkv_bias=False),
}
