"""Convolutional models in channels-last layout under autopipe, on one GPU.

    python benchmarks/channels_last.py --out results.json [--model resnet50] [--batch 128]
        [--microbatches 4] [--modes eager,graphs]

torchvision's model with random weights, bf16 autocast, one process (pp = 1), the default batch
norm. Each step is a ``train_step`` and an SGD step, median of 10 after 3 of warm-up, with the
model and its inputs as they come (NCHW) and converted by the user to channels-last
(``model.to(memory_format=torch.channels_last)``, inputs ``.contiguous(memory_format=...)``):
autopipe keeps the layout through its stages. Then one BatchNorm2d(64) forward and backward on
the input of ResNet-50's first norm (32 x 64 x 112 x 112, bf16) in each layout: the node that
sets the floor of ResNet-50's finer pipeline cuts (issue: measured balance). Prints a table;
writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopipe  # noqa: E402

LAYOUTS = {"NCHW": torch.contiguous_format, "channels_last": torch.channels_last}


def step_ms(args: argparse.Namespace, layout: str, mode: str) -> float:
    import torchvision

    fmt, device = LAYOUTS[layout], torch.device("cuda")
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().to(memory_format=fmt)
    example = torch.randn(args.batch // args.microbatches, 3, 224, 224).contiguous(memory_format=fmt)
    pm = autopipe.parallelize(model, (example,), microbatches=args.microbatches, loss_fn=F.cross_entropy,
                              device=device, mixed_precision="bf16", cuda_graphs=mode == "graphs")
    x = torch.randn(args.batch, 3, 224, 224, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    times = []
    for i in range(13):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        pm.train_step(x, y)
        pm.step(opt)
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - begin)
    pm.close()
    return statistics.median(times) * 1e3


def norm_ms(layout: str) -> float:
    device = torch.device("cuda")
    bn = torch.nn.BatchNorm2d(64).to(device)
    x = torch.randn(32, 64, 112, 112, device=device, dtype=torch.bfloat16)
    x = x.contiguous(memory_format=LAYOUTS[layout]).requires_grad_(True)
    grad = torch.ones_like(x)
    for _ in range(3):
        bn(x).backward(grad)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(20):
        bn(x).backward(grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) / 20 * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--modes", default="eager,graphs")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("channels_last.py measures on a GPU; none is visible")
        return 1
    rows = []
    for mode in args.modes.split(","):
        for layout in LAYOUTS:
            ms = step_ms(args, layout, mode)
            rows.append({"mode": mode, "layout": layout, "step_ms": ms})
            print(f"{args.model} {mode:6s} {layout:13s} {ms:7.1f} ms", flush=True)
    norms = {layout: norm_ms(layout) for layout in LAYOUTS}
    print("BatchNorm2d(64), 32 x 64 x 112 x 112 bf16, forward + backward: "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in norms.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "rows": rows,
                       "batch_norm_ms": norms}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
