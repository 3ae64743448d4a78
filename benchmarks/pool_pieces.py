"""What cutting a max-pool by sample costs ([Note: sample pieces] in autopipe/stages/sample_pieces.py).

    python benchmarks/pool_pieces.py [--batch 128] [--out results.json]

ResNet-50's stem max-pool (3 x 3, stride 2) on a batch of 64-channel 112 x 112 maps, bf16 and
channels-last on a GPU (fp32 on the CPU), forward and backward, CUDA events, mean of 20 after 3
of warm-up:
- ``whole``: the pooling as the model runs it;
- ``cut k | B-k``: the graph's rewrite, ``torch.split`` by sample, each part pooled,
  ``torch.cat`` (a stage boundary would fall between the two parts);
- ``part of k alone``: one part's pooling alone, what the partitioner prices at k/B of the whole.
Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from typing import Callable

import torch


def _mean_ms(step: Callable[[], None], device: torch.device, reps: int = 20) -> float:
    for _ in range(3):
        step()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    t = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - t) * 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, size = (torch.bfloat16, 112) if device.type == "cuda" else (torch.float32, 32)
    b = args.batch
    pool = torch.nn.MaxPool2d(3, 2, 1)
    x = torch.randn(b, 64, size, size, device=device, dtype=dtype).to(memory_format=torch.channels_last)
    x.requires_grad_()

    def whole() -> None:
        y = pool(x)
        y.backward(torch.ones_like(y))

    def cut(k: int) -> None:
        first, rest = torch.split(x, [k, b - k])
        y = torch.cat([pool(first), pool(rest)])
        y.backward(torch.ones_like(y))

    def part(k: int) -> None:
        piece = x[:k].detach().requires_grad_()
        y = pool(piece)
        y.backward(torch.ones_like(y))

    rows = [{"case": "whole", "ms": _mean_ms(whole, device)}]
    for k in (b // 4, 3 * b // 8, b // 2, 3 * b // 4):
        rows.append({"case": f"cut {k} | {b - k}", "ms": _mean_ms(lambda: cut(k), device)})
        rows.append({"case": f"part of {k} alone", "ms": _mean_ms(lambda: part(k), device),
                     "share_ms": rows[0]["ms"] * k / b})
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, batch {b} x 64 x {size} x {size}, {dtype}")
    for r in rows:
        share = f"   (its share of whole: {r['share_ms']:.3f})" if "share_ms" in r else ""
        print(f"{r['case']:22s} {r['ms']:.3f} ms{share}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                       "batch": b, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
