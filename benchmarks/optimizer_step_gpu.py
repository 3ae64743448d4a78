"""What the end of a training step costs on one GPU: the global gradient norm and AdamW's step.

    python benchmarks/optimizer_step_gpu.py --out results.json
    python benchmarks/optimizer_step_gpu.py --smoke          # CPU, tiny (a check of the script)

For each timm model's parameters (fp32 master weights, random gradients; no forward runs), one
GPU times, after a warm-up, the median of ``--steps`` of:
- ``norm loop``: one ``vector_norm`` per gradient, as the runtime's norm did before it used
  multi-tensor kernels;
- ``norm``: ``autopipe.training.gradients.global_grad_norm`` (``_foreach_norm``), then the
  host reads it (``pm.step`` does, to skip non-finite steps);
- ``adamw foreach`` / ``adamw fused``: ``torch.optim.AdamW``'s step (foreach is torch's default
  on CUDA);
- ``norm + adamw foreach``: both, as ``pm.step`` runs them.
Each is timed between two synchronisations (host and GPU time together). A least-squares fit over
the models gives seconds per parameter tensor and bytes per parameter (at the profile's memory
bandwidth) for each, which the layout search's pricing of the optimizer step can be checked
against (autopipe/search/plan.py, STEP_DEFAULTS).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.partition.device import get_profile  # noqa: E402
from autopipe.training.gradients import global_grad_norm  # noqa: E402

MODELS = ("vit_large_patch16_224", "vit_huge_patch14_224", "vit_base_patch16_224", "resnet50", "convnext_base")


def timed(fn: Callable[[], object], device: torch.device, warmup: int, steps: int) -> float:
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, device: torch.device, args: argparse.Namespace) -> dict:
    import timm

    model = timm.create_model(name).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3

    def norm_loop() -> float:
        return float(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]).square().sum().sqrt())

    def norm() -> float:
        return float(global_grad_norm(params, [], device))

    row = {"model": name, "tensors": len(params), "params": sum(p.numel() for p in params)}
    row["norm loop"] = timed(norm_loop, device, args.warmup, args.steps)
    row["norm"] = timed(norm, device, args.warmup, args.steps)
    for kind in ("foreach", "fused"):
        if kind == "fused" and device.type != "cuda":
            continue
        opt = torch.optim.AdamW(params, lr=1e-6, **{kind: True})
        row[f"adamw {kind}"] = timed(opt.step, device, args.warmup, args.steps)
        if kind == "foreach":
            row["norm + adamw foreach"] = timed(lambda: (norm(), opt.step()), device, args.warmup, args.steps)
        del opt
    return row


def fit(rows: list[dict], key: str, bandwidth: float) -> dict:
    """seconds = per_tensor * tensors + bytes_per_param * params / bandwidth (least squares, >= 0)."""
    a = np.array([[r["tensors"], r["params"] / bandwidth] for r in rows if key in r], dtype=float)
    y = np.array([r[key] for r in rows if key in r])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    worst = float(np.max(np.abs(a @ coef / y - 1))) if len(y) else float("nan")
    return {"per_tensor_s": float(coef[0]), "bytes_per_param": float(coef[1]), "max_error": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--profile", default="", help="the device profile whose bandwidth the fit uses "
                        "(default: h200 on an H200, else h100; cpu on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    profile = get_profile(args.profile or ("cpu" if device.type == "cpu" else "h200" if "H200" in name else "h100"))
    models = ("resnet18", "vit_tiny_patch16_224") if args.smoke else tuple(args.models.split(","))
    rows = [measure(m, device, args) for m in models]
    keys = [k for k in ("norm loop", "norm", "adamw foreach", "adamw fused", "norm + adamw foreach") if k in rows[0]]
    fits = {k: fit(rows, k, profile.mem_bandwidth) for k in keys}
    print(f"{'model':24s} {'tensors':>7s} {'Mparams':>8s} " + " ".join(f"{k:>20s}" for k in keys))
    for r in rows:
        print(f"{r['model'][:24]:24s} {r['tensors']:7d} {r['params'] / 1e6:8.1f} "
              + " ".join(f"{r[k] * 1e3:17.2f} ms" for k in keys))
    for k, f in fits.items():
        print(f"fit {k:22s}: {f['per_tensor_s'] * 1e6:6.2f} us per tensor + {f['bytes_per_param']:6.1f} B per "
              f"parameter at {profile.mem_bandwidth / 1e9:.0f} GB/s (max error {f['max_error']:.1%})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                                "device": name, "profile": profile.name, "command": " ".join(sys.argv)},
                       "rows": rows, "fits": fits}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
