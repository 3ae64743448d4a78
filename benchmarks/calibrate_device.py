"""Fit the analytic cost model's kernel efficiencies to a GPU: collect on the GPU, fit anywhere.

    # on the GPU machine: time fine segments of real models, forward and backward, in CUDA
    # graphs (GPU time) and eagerly (host time), under bf16 autocast
    python benchmarks/calibrate_device.py collect --out rows.json
    # anywhere: fit the factors, write the table the h100 profile loads, print the fit's error
    python benchmarks/calibrate_device.py fit rows.json --name h100

What is fitted is [Note: calibrated roofline] (autopipe/partition/calibration.py). Each segment
of each model (cut at every candidate stage boundary: a node or a few) gives one row per
direction: its measured seconds and, per kernel class, the plain roofline seconds of its
kernels in that class, with the number of kernels it launches. The factors and the per-kernel
launch time are the non-negative least squares solution of

    measured_graphs(segment) ~= sum over classes of factor[class] * roofline[class] + launch * kernels

on relative error (each row divided by its measured time), with a light pull of every factor
towards the median factor so that classes seen in few rows stay sensible. The host time per
launched node in eager mode is the value that best predicts the eager timings as
max(GPU time, host * kernels) per node. The error is reported in-sample per segment and,
leaving each model out of the fit in turn, on contiguous groups of segments the size of pp=4
and pp=8 stages: the error a plan's stage times carry for a model the fit has not seen.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ["resnet50", "resnet152", "convnext_base", "swin_base_patch4_window7_224", "vit_base_patch16_224",
          "vit_large_patch16_224", "efficientnet_b0"]
MICROBATCHES = (32, 128)
PRIOR_WEIGHT = 0.05  # pull of each factor towards the median factor, against rows weighted 1


# ---------------------------------------------------------------------------------- collect
def collect(models: list[str], microbatches: list[int], reps: int, out: str, device: str = "cuda",
            modes: tuple[str, ...] = ("graphs", "eager"), image_size: int | None = None) -> None:
    import torch

    from autopipe.measure import RunSetup, segment_starts, time_stages
    from autopipe.measure.timer import device_name
    from autopipe.models import default_input, load_model
    from autopipe.partition.calibration import kernel_features, launched
    from autopipe.partition.cost import graph_costs
    from autopipe.partition.device import PROFILES
    from autopipe.partition.partitioner import partition_at
    from autopipe.tracer import trace

    device = torch.device(device)
    base = PROFILES["h100"]
    rows: list[dict[str, Any]] = []
    for name in models:
        for mb in microbatches:
            begin = time.perf_counter()
            model = load_model(name if ":" in name else f"timm:{name}", image_size=image_size)
            traced = trace(model, (default_input(model, mb, image_size=image_size),))
            costs = graph_costs(traced.gm)
            starts = segment_starts(traced, 10**6, base)
            plan = partition_at(traced, starts, device=base, activation_dtype=torch.bfloat16)
            timed = {mode: time_stages(traced, plan, RunSetup(device, mode, torch.bfloat16, reps=reps))
                     for mode in modes}
            for mode in ("graphs", "eager"):  # a CPU smoke run has no graphs: its eager times stand in
                timed.setdefault(mode, timed[modes[0]])
            for i, stage in enumerate(plan.stages):
                row: dict[str, Any] = {"model": name, "microbatch": mb, "segment": i}
                for direction, backward in (("fwd", False), ("bwd", True)):
                    feats: dict[str, float] = defaultdict(float)
                    kernels = 0
                    for n in stage.nodes:
                        for cls, seconds in kernel_features(costs[n], base, backward=backward):
                            feats[cls] += seconds
                            kernels += 1
                    row[direction] = {"features": dict(feats), "kernels": kernels,
                                      "graphs": getattr(timed["graphs"][i], "forward" if not backward else "backward"),
                                      "eager": getattr(timed["eager"][i], "forward" if not backward else "backward")}
                rows.append(row)
            print(f"{name} mb={mb}: {plan.num_stages} segments in {time.perf_counter() - begin:.1f} s", flush=True)
            del model, traced
    meta = {"device": device_name(device), "torch": torch.__version__, "dtype": "bfloat16",
            "date": datetime.date.today().isoformat(), "reps": reps, "models": models,
            "microbatches": microbatches, "host": platform.node()}
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f)
    print(f"wrote {len(rows)} rows to {out}")


# ---------------------------------------------------------------------------------- fit
def _design(rows: list[dict], direction: str, classes: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, kernels, measured): A[row, class] roofline seconds; last column is the kernel count."""
    index = {c: i for i, c in enumerate(classes)}
    a = np.zeros((len(rows), len(classes) + 1))
    y = np.zeros(len(rows))
    for r, row in enumerate(rows):
        d = row[direction]
        for cls, seconds in d["features"].items():
            if cls in index:
                a[r, index[cls]] += seconds
        a[r, -1] = d["kernels"]
        y[r] = d["graphs"]
    return a, a[:, -1].copy(), y


def _nnls_relative(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    keep = (y > 0) & (a.sum(axis=1) > 0)
    w = 1.0 / y[keep]
    aw, yw = a[keep] * w[:, None], y[keep] * w
    first, _ = nnls(aw, yw, maxiter=5000)
    factors = first[:-1]
    used = (a[keep][:, :-1] > 0).any(axis=0)
    prior = float(np.median(factors[used])) if used.any() else 1.0
    # Pull every factor towards the median; the launch term is free.
    n = a.shape[1]
    reg = np.zeros((n - 1, n))
    reg[:, : n - 1] = np.eye(n - 1) * PRIOR_WEIGHT * math.sqrt(len(yw))
    sol, _ = nnls(np.vstack([aw, reg]), np.concatenate([yw, np.full(n - 1, PRIOR_WEIGHT * math.sqrt(len(yw)) * prior)]),
                  maxiter=5000)
    return sol


def _host(rows: list[dict], direction: str, classes: list[str], sol: np.ndarray) -> float:
    """The host seconds per kernel that best predicts eager times as max(gpu, host * kernels)."""
    a, kernels, _ = _design(rows, direction, classes)
    gpu = a @ sol
    eager = np.array([row[direction]["eager"] for row in rows])
    keep = (eager > 0) & (kernels > 0)
    best, best_err = 0.0, float("inf")
    for h in np.geomspace(1e-6, 2e-4, 200):
        pred = np.maximum(gpu[keep], h * kernels[keep])
        err = float(np.median(np.abs(pred - eager[keep]) / eager[keep]))
        if err < best_err:
            best, best_err = float(h), err
    return best


def fit(rows: list[dict]) -> dict[str, Any]:
    classes = sorted({c for row in rows for d in ("fwd", "bwd") for c in row[d]["features"]})
    sols = {d: _nnls_relative(*_design(rows, d, classes)[::2]) for d in ("fwd", "bwd")}
    hosts = {d: _host(rows, d, classes, sols[d]) for d in ("fwd", "bwd")}
    factors = {c: (float(sols["fwd"][i]), float(sols["bwd"][i])) for i, c in enumerate(classes)}
    return {"classes": classes, "factors": factors, "launch": (float(sols["fwd"][-1]), float(sols["bwd"][-1])),
            "host": (hosts["fwd"], hosts["bwd"]), "sols": sols}


def _predict(rows: list[dict], model: dict[str, Any], mode: str) -> np.ndarray:
    """Predicted forward+backward seconds of each row's segment."""
    out = np.zeros(len(rows))
    for d, k in (("fwd", 0), ("bwd", 1)):
        a, kernels, _ = _design(rows, d, model["classes"])
        gpu = a @ model["sols"][d]
        out += np.maximum(gpu, model["host"][k] * kernels) if mode == "eager" else gpu
    return out


def _measured(rows: list[dict], mode: str) -> np.ndarray:
    return np.array([row["fwd"][mode] + row["bwd"][mode] for row in rows])


def _group_error(rows: list[dict], pred: np.ndarray, meas: np.ndarray, parts: int) -> list[float]:
    """Relative error of contiguous groups of segments, ``parts`` groups per (model, microbatch)."""
    errs = []
    by_run: dict[tuple, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_run[(row["model"], row["microbatch"])].append(i)
    for idx in by_run.values():
        for chunk in np.array_split(np.array(idx), parts):
            if len(chunk):
                m = meas[chunk].sum()
                errs.append(abs(pred[chunk].sum() - m) / m)
    return errs


def _summary(errs: list[float]) -> dict[str, float]:
    return {"median": float(np.median(errs)), "p90": float(np.percentile(errs, 90)), "max": float(np.max(errs))}


def report(rows: list[dict], name: str, meta: dict[str, Any]) -> dict[str, Any]:
    model = fit(rows)
    errors: dict[str, Any] = {}
    for mode in ("graphs", "eager"):
        meas, pred = _measured(rows, mode), _predict(rows, model, mode)
        seg = np.abs(pred - meas) / meas
        errors[mode] = {"segments_in_sample": _summary(list(seg)), "leave_one_model_out": {}}
        for parts in (4, 8):
            loo: list[float] = []
            per_model: dict[str, float] = {}
            for held in sorted({r["model"] for r in rows}):
                train = [r for r in rows if r["model"] != held]
                test = [r for r in rows if r["model"] == held]
                m = fit(train)
                e = _group_error(test, _predict(test, m, mode), _measured(test, mode), parts)
                loo += e
                per_model[held] = float(np.max(e))
            errors[mode]["leave_one_model_out"][f"{parts}_stages"] = {**_summary(loo), "max_by_model": per_model}
    table = {
        "schema": 1, "device": meta["device"], "launch": model["launch"], "host": model["host"],
        "factors": model["factors"],
        "fit": {"made_by": "benchmarks/calibrate_device.py", "dtype": meta["dtype"], "torch": meta["torch"],
                "date": meta["date"], "models": meta["models"], "microbatches": meta["microbatches"],
                "rows": len(rows), "error": errors},
    }
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--models", default=",".join(MODELS))
    c.add_argument("--microbatch", default=",".join(map(str, MICROBATCHES)))
    c.add_argument("--reps", type=int, default=10)
    c.add_argument("--out", required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--modes", default="graphs,eager")
    c.add_argument("--image-size", type=int, default=None)
    f = sub.add_parser("fit")
    f.add_argument("rows", nargs="+")
    f.add_argument("--name", required=True, help="profile name: writes autopipe/partition/calibration/NAME.json")
    args = parser.parse_args(argv)
    if args.cmd == "collect":
        collect(args.models.split(","), [int(x) for x in args.microbatch.split(",")], args.reps, args.out,
                args.device, tuple(args.modes.split(",")), args.image_size)
        return 0
    rows, meta = [], None
    for path in args.rows:
        with open(path) as fh:
            data = json.load(fh)
        rows += data["rows"]
        meta = meta or data["meta"]
    assert meta is not None
    meta["models"] = sorted({r["model"] for r in rows})
    table = report(rows, args.name, meta)
    from autopipe.partition.calibration import CALIBRATION_DIR

    path = os.path.join(CALIBRATION_DIR, f"{args.name}.json")
    with open(path, "w") as fh:
        json.dump(table, fh, indent=1, sort_keys=True)
    print(f"wrote {path}")
    for mode, e in table["fit"]["error"].items():
        seg = e["segments_in_sample"]
        print(f"{mode:6s} segments in sample: median {seg['median']:.3f} p90 {seg['p90']:.3f}")
        for parts, loo in e["leave_one_model_out"].items():
            print(f"{mode:6s} leave-one-model-out, {parts}: median {loo['median']:.3f} p90 {loo['p90']:.3f} "
                  f"max {loo['max']:.3f}  " + " ".join(f"{k}={v:.3f}" for k, v in loo["max_by_model"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
