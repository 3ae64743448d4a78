"""cuDNN's depthwise convolutions one by one: forward, weight gradient and input gradient (GPU).

    python benchmarks/depthwise_weight_gradient.py

The depthwise shapes of EfficientNet-B0 and MobileNetV3-L, at 32 and 128 images, bf16, in
channels-last and NCHW, with cuDNN and without it (PyTorch's own kernels). Each op is timed with
CUDA events, median of 20 after 3 untimed. It shows the one shape whose weight gradient cuDNN
runs far off its neighbours (``blocks.5.0``: 672 channels, 5x5, stride 2, 14x14), and that it
does so at 128 images and not at 32 ([Note: kernels off their class] in
autopipe/partition/calibration.py).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

# (name, channels, kernel side, stride, input side)
SHAPES = [("blocks.5.0 672 k5 s2 14", 672, 5, 2, 14), ("blocks.2.0 144 k5 s2 56", 144, 5, 2, 56),
          ("blocks.3.0 240 k3 s2 28", 240, 3, 2, 28), ("blocks.4 672 k5 s1 14", 672, 5, 1, 14),
          ("blocks.5 1152 k5 s1 7", 1152, 5, 1, 7), ("mnv3 blocks.5.1 960 k5 s1 7", 960, 5, 1, 7)]


def _median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatch", default="32,128")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(torch.__version__, "cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    print(f"{'shape':28s} {'N':>4s} {'layout':6s} {'cudnn':5s} {'fwd':>7s} {'wgrad':>7s} {'dgrad':>7s} {'total':>7s}  ms")
    for name, c, k, s, side in SHAPES:
        for n in (int(v) for v in args.microbatch.split(",")):
            for channels_last in (True, False):
                for cudnn in (True, False):
                    torch.backends.cudnn.enabled = cudnn
                    x = torch.randn(n, c, side, side, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(c, 1, k, k, device="cuda", dtype=torch.bfloat16)
                    if channels_last:
                        x, w = (t.contiguous(memory_format=torch.channels_last) for t in (x, w))
                    g = torch.randn_like(F.conv2d(x, w, None, s, k // 2, 1, c))

                    def grad(mask: list[bool]):
                        return lambda: torch.ops.aten.convolution_backward(
                            g, x, w, None, [s, s], [k // 2, k // 2], [1, 1], False, [0, 0], c, mask)

                    fwd = _median_ms(lambda: F.conv2d(x, w, None, s, k // 2, 1, c))
                    wgrad, dgrad = _median_ms(grad([False, True, False])), _median_ms(grad([True, False, False]))
                    print(f"{name:28s} {n:4d} {'nhwc' if channels_last else 'nchw':6s} {str(cudnn):5s} "
                          f"{fwd:7.3f} {wgrad:7.3f} {dgrad:7.3f} {fwd + wgrad + dgrad:7.3f}")
    torch.backends.cudnn.enabled = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
