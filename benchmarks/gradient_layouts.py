"""Which layers of a channels-last model get their gradient in another layout (runs on the CPU).

    python benchmarks/gradient_layouts.py --models efficientnet_b0,convnext_tiny,resnet50

A model moved to ``memory_format=torch.channels_last`` computes its forward in NHWC, but the
gradient each layer receives in backward is laid out by whatever produced it, and the global
pool's backward (timm's adaptive average pool) writes its gradient NCHW. Where the
layer before the pool reads that gradient itself (a batch norm, a linear layer over a permuted
map), its backward kernel reads a gradient in another layout than its input; a ReLU or a
convolution in between lays it out as its own input again.

This runs one forward and backward of each timm model (random weights, 2 images of 64x64, or
224x224 where the model needs that size) and lists every leaf module with a 4-D output (NCHW,
channels-last, or ConvNeXt's NHWC permutation of a channels-last map) whose gradient is laid
out otherwise, over the dimensions longer than one. Identity modules, which launch nothing, are
left out. How much it costs is a GPU question: on an H100, in the calibration rows at 128 images
(benchmarks/results/calibration/2026-11-26-h100-nhwc-*.json.gz), EfficientNet-B0's ``bn2``
backward took 0.162 ms against 0.052 ms for the batch norms of its class, and ConvNeXt-B's
stage-3 ``fc2`` backward 1.05 ms where it got such a gradient against 0.158 ms for Swin-B's of
the same shape.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _same_layout(out: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad`` is laid out as ``out``: the same strides over every dimension longer than
    one (a 1x1 map is NCHW and NHWC at once)."""
    return grad.shape == out.shape and all(a == b for a, b, n in zip(out.stride(), grad.stride(), out.shape) if n > 1)


def mismatched(name: str, size: int) -> list[tuple[str, str, tuple, tuple]]:
    """(module, type, output strides, gradient strides) of every leaf module of ``name`` whose
    channels-last output gets its gradient in another layout."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, size, size).contiguous(memory_format=torch.channels_last)
    found: list[tuple[str, str, tuple, tuple]] = []

    def watch(module_name: str, module: nn.Module):
        def hook(_: nn.Module, __: tuple, out: object) -> None:
            if not isinstance(out, torch.Tensor) or not out.requires_grad or out.dim() != 4:
                return
            strides = out.stride()

            def on_grad(g: torch.Tensor) -> None:
                if not _same_layout(out, g):
                    found.append((module_name, type(module).__name__, strides, g.stride()))
            out.register_hook(on_grad)
        return hook

    for module_name, module in model.named_modules():
        if not any(True for _ in module.children()) and not isinstance(module, nn.Identity):
            module.register_forward_hook(watch(module_name, module))
    model(x).sum().backward()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="efficientnet_b0,mobilenetv3_large_100,convnext_tiny,resnet50,regnety_016")
    parser.add_argument("--size", type=int, default=64, help="image side (models that need 224 get 224)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        size = 224 if any(k in name for k in ("swin", "vit", "deit")) else args.size
        rows = mismatched(name, size)
        print(f"{name}: {len(rows)} layer(s) get a gradient in another layout than their output")
        for module_name, kind, out, grad in rows:
            print(f"    {module_name:40s} {kind:20s} output strides {out}, gradient strides {grad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
