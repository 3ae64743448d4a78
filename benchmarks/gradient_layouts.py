"""Which layers of a channels-last model get their gradient in another layout (runs on the CPU).

    python benchmarks/gradient_layouts.py --models efficientnet_b0,convnext_tiny,resnet50
    python benchmarks/gradient_layouts.py --time --microbatch 128     # on a GPU: what it costs

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
left out.

With ``--time`` (on a GPU) it times one forward and backward of each timm model as it is and
with the gradient laid out channels-last where it enters the head (bf16, CUDA graphs). On an H100
at 128 images (results/2026-11-27-h100-gradient-layout-at-pool.txt) the layout saves 0.5% or
less in every model: a batch norm that reads the NCHW gradient (EfficientNet-B0's ``bn2``,
MobileNetV3-L's last one) takes its NCHW kernels, about 0.1 ms more at 128 images, and
ConvNeXt's linear layers read it at no cost. The slow ConvNeXt-B stage-3 ``fc2`` backward of the
calibration rows (1.05 ms) was autopipe's own: its cast linear layer multiplied the permuted
gradient through ``torch.matmul``'s batched path ([Note: a gradient in rows] in
autopipe/runtime/weight_casts.py), which timm's eager model, run here, never takes.
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


class _GradientAsInput(torch.autograd.Function):
    """Identity forward; backward lays the gradient out channels-last, as the input is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous(memory_format=torch.channels_last)


def gradient_as_input(x: torch.Tensor) -> torch.Tensor:
    return _GradientAsInput.apply(x)


def _step(model: nn.Module, x: torch.Tensor):
    def run() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
    return run


def _graphed(model: nn.Module, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """One forward and backward of ``model`` on ``x`` captured as a CUDA graph."""
    run = _step(model, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            run()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _ms(replay, iterations: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def timed(name: str, microbatch: int, rounds: int = 5, iterations: int = 20) -> tuple[float, float]:
    """Milliseconds of one forward and backward of timm's ``name`` (bf16 autocast, channels-last,
    CUDA graphs, ``microbatch`` images of 224x224): as it is, and with the gradient laid out as
    the input of its head (``gradient_as_input`` before ``forward_head``). Medians over rounds
    that alternate the two."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(microbatch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    plain = _graphed(model, x)
    head = model.forward_head
    model.forward_head = lambda t, **kw: head(gradient_as_input(t), **kw)  # type: ignore[method-assign]
    laid_out = _graphed(model, x)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for graph, row in ((plain, times[0]), (laid_out, times[1])):
            row.append(_ms(graph.replay, iterations))
    del plain, laid_out, model
    torch.cuda.empty_cache()
    return sorted(times[0])[rounds // 2], sorted(times[1])[rounds // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="efficientnet_b0,mobilenetv3_large_100,convnext_tiny,resnet50,regnety_016")
    parser.add_argument("--size", type=int, default=64, help="image side (models that need 224 get 224)")
    parser.add_argument("--time", action="store_true",
                        help="time forward and backward on the GPU, with and without the gradient laid out at the head")
    parser.add_argument("--microbatch", type=int, default=128)
    args = parser.parse_args(argv)
    if args.time:
        print(f"{'model':26s} {'as it is, ms':>13s} {'laid out, ms':>13s} {'saved':>7s}   "
              f"({torch.cuda.get_device_name()}, {args.microbatch} images, bf16, CUDA graphs)")
        for name in args.models.split(","):
            before, after = timed(name, args.microbatch)
            print(f"{name:26s} {before:13.2f} {after:13.2f} {1 - after / before:7.1%}")
        return 0
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
