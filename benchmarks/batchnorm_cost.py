"""What the default batch norm (``batchnorm="deferred"``) costs a training step, on one device.

    python benchmarks/batchnorm_cost.py --out results.json [--model resnet50] [--batch 128]
        [--microbatches 4] [--modes eager,graphs] [--steps 10]

torchvision's model, random weights and images (224 x 224; 32 x 32 on the CPU), bf16 autocast on
a GPU, one process (pp = 1). Each step is a ``train_step`` and an SGD step, median of ``--steps``
after 3 of warm-up, for:
- ``microbatch``: torch's own batch norm, running statistics updated per micro-batch;
- ``deferred``: the default, which also collects each micro-batch's statistics, from the norm's
  own kernel (runtime/batchnorm.py, [Note: statistics from the norm's own kernel]);
- ``deferred, second pass``: the collection as it was before, a forward pre-hook reducing the
  input again (``torch.var_mean`` in fp32) and folding the result in with a dozen small ops.
Then the second pass's kernels alone on the input of the model's first batch norm (one
micro-batch): ``torch.var_mean``, and ``_shifted_moments`` (what the pre-hook, kept for
BatchNorm subclasses with a forward of their own, runs now). And the commit at a step's end
alone (``--commit-only``: only that), its time and ATen ops.
Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopipe  # noqa: E402
from autopipe.runtime import batchnorm as bn  # noqa: E402


def _var_mean(x: torch.Tensor, center: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The collection's kernel before: Welford over an fp32 copy."""
    var, mean = torch.var_mean(x.to(center.dtype), dim=[0, *range(2, x.dim())], correction=0)
    return mean - center, var


@contextmanager
def second_pass(on: bool) -> Iterator[None]:
    """The collection as it was: every norm through the pre-hook, with ``torch.var_mean``."""
    saved = bn._shifted_moments, bn._plain_forward
    if on:
        bn._shifted_moments, bn._plain_forward = _var_mean, lambda m: False
    try:
        yield
    finally:
        bn._shifted_moments, bn._plain_forward = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(args: argparse.Namespace, device: torch.device, batchnorm: str, mode: str) -> float:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)()
    img = 224 if device.type == "cuda" else 32
    size = args.batch // args.microbatches
    pm = autopipe.parallelize(model, (torch.randn(size, 3, img, img),), microbatches=args.microbatches,
                              loss_fn=F.cross_entropy, device=device, batchnorm=batchnorm,
                              mixed_precision="bf16" if device.type == "cuda" else None,
                              cuda_graphs=mode == "graphs")
    x = torch.randn(args.batch, 3, img, img, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    times = []
    for i in range(3 + args.steps):
        _sync(device)
        begin = time.perf_counter()
        pm.train_step(x, y)
        pm.step(opt)
        opt.zero_grad(set_to_none=False)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - begin)
    pm.close()
    return statistics.median(times)


def time_kernels(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """The two collection kernels on the first batch norm's input (one micro-batch)."""
    import torchvision

    model = getattr(torchvision.models, args.model)().eval()
    img = 224 if device.type == "cuda" else 32
    seen: list[torch.Size] = []
    handle = model.bn1.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    with torch.no_grad():
        model(torch.randn(1, 3, img, img))
    handle.remove()
    shape = (args.batch // args.microbatches, *seen[0][1:])
    x = torch.randn(shape, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    center = torch.zeros(shape[1], device=device)
    out = {"shape": list(shape)}
    for name, fn in (("var_mean", _var_mean), ("shifted_moments", bn._shifted_moments)):
        for _ in range(3):
            fn(x, center)
        _sync(device)
        begin = time.perf_counter()
        for _ in range(20):
            fn(x, center)
        _sync(device)
        out[name + "_ms"] = (time.perf_counter() - begin) / 20 * 1e3
    return out


def time_commit(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """The end of a step alone: the model's norms' collected statistics committed ([Note: one
    commit for every layer]), median of 30, and the ATen ops of one commit."""
    import torchvision
    from torch.profiler import ProfilerActivity, profile

    model = getattr(torchvision.models, args.model)().to(device).train()
    stats = bn.BatchNormStats.install([model], "deferred")
    stats.collecting = True
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32, device=device))
    stats.collecting = False
    times = []
    for _ in range(33):
        _sync(device)
        begin = time.perf_counter()
        stats.commit()
        _sync(device)
        times.append(time.perf_counter() - begin)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stats.commit()
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return {"norms": len(stats.norms), "commit_ms": statistics.median(times[3:]) * 1e3, "aten_ops": ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--modes", default="eager,graphs")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="")
    parser.add_argument("--commit-only", action="store_true", help="time the commit of the statistics alone")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modes = args.modes.split(",") if device.type == "cuda" else ["eager"]
    rows: list[dict[str, Any]] = []
    for mode in [] if args.commit_only else modes:
        for label, batchnorm, before in (("microbatch", "microbatch", False), ("deferred", "deferred", False),
                                         ("deferred, second pass", "deferred", True)):
            with second_pass(before):
                seconds = time_step(args, device, batchnorm, mode)
            rows.append({"mode": mode, "batchnorm": label, "step_ms": seconds * 1e3})
            print(f"{args.model} {mode:6s} {label:20s} {seconds * 1e3:8.2f} ms", flush=True)
    commit = time_commit(args, device)
    print(f"commit of {commit['norms']} norms' statistics: {commit['commit_ms']:.2f} ms, {commit['aten_ops']} ATen ops")
    if args.commit_only:
        return 0
    kernels = time_kernels(args, device)
    print(f"collection kernels on {kernels['shape']}: var_mean {kernels['var_mean_ms']:.3f} ms, "
          f"shifted_moments {kernels['shifted_moments_ms']:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "command": " ".join(sys.argv), "rows": rows, "kernels": kernels, "commit": commit}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
