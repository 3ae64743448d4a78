"""How the analytic cost model's plans balance, judged by node times measured on the GPU.

    python benchmarks/analytic_balance.py ROWS.json[.gz] [ROWS.json[.gz] ...] --out results.json

ROWS are the calibration rows ``measured_balance.py --calibration-rows`` or ``calibrate_device.py
collect`` wrote on the GPU: every node's own forward + backward kernel time (the profiler's
kernel records), per model and micro-batch size. For each model, micro-batch size and layout
(pp=4, pp=8, pp=4 x 2 chunks) this plans with the uncalibrated roofline and with the
calibrated model of the GPU the rows came from (h100 or h200; nothing measured goes into either
plan) and prices each plan's stages by the measured node times: the max/mean a CUDA-graph run
of the plan would show, less the fixed cost every stage pays alike. It is a prediction from
measurements, not a timed run of these plans: ``measured_balance.py --plans analytic`` times
them on the GPU.

A third plan is cut by the measured node times themselves ("node_times"): the balance this
partitioner reaches when it knows every node's time exactly, the floor that no cost model
can beat with these cut points (a stage can be no shorter than its largest node, and cuts fall
only between nodes or MLP pieces).

The calibration is fitted on the same models (in sample); ``calibrate_device.py fit`` reports
the error on models left out of the fit. Target: <= 1.15.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.models import default_input, load_model  # noqa: E402
from autopipe.partition.device import PROFILES, gpu_profile_name  # noqa: E402
from autopipe.stages import mlp_pieces, plan_stages  # noqa: E402
from autopipe.tracer import trace  # noqa: E402

LAYOUTS = ((4, 1), (8, 1), (4, 2))
TARGET = 1.15


def _stage_seconds(plan: Any, node_seconds: dict[str, float], traced: Any) -> list[float]:
    piece_of = {}
    if plan.mlp_pieces:
        split = mlp_pieces.cut_mlps(traced, plan.mlp_pieces)
        piece_of = {n.name: n.meta[mlp_pieces.PIECE_OF] for n in split.gm.graph.nodes if mlp_pieces.PIECE_OF in n.meta}
    out = []
    for stage in plan.stages:
        total = 0.0
        for n in stage.nodes:
            whole, share = piece_of.get(n, (n, 1.0))
            total += share * node_seconds.get(whole, 0.0)
        out.append(total)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    truth: dict[tuple[str, int], dict[str, float]] = {}
    device = ""
    for path in args.rows:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            data = json.load(f)
        device = device or data["meta"]["device"]
        for r in data["nodes"]:
            truth.setdefault((r["model"], r["microbatch"]), {})[r["node"]] = r["fwd"]["device"] + r["bwd"]["device"]
    base = PROFILES[gpu_profile_name(device)]
    profiles = {"uncalibrated": dataclasses.replace(base, calibration=None), "analytic": base.with_mode("graphs")}
    rows, failures = [], []
    for (name, mb), seconds in sorted(truth.items()):
        model = load_model(f"timm:{name}")
        traced = trace(model, (default_input(model, mb),))
        for pp, chunks in LAYOUTS:
            row: dict[str, Any] = {"model": name, "microbatch": mb, "pp": pp, "chunks": chunks}
            for kind, profile, node_seconds in [*((k, p, None) for k, p in profiles.items()),
                                                ("node_times", profiles["analytic"], seconds)]:
                plan = plan_stages(traced, pp, chunks, device=profile, activation_dtype=torch.bfloat16,
                                   microbatches=2 * pp, schedule="1f1b" if chunks == 1 else "interleaved_1f1b",
                                   node_seconds=node_seconds)
                times = _stage_seconds(plan, seconds, traced)
                row[kind] = {"stage_ms": [t * 1e3 for t in times],
                             "imbalance": max(times) / (sum(times) / len(times))}
            rows.append(row)
            print(f"{name:30s} mb {mb:3d} pp {pp}x{chunks}  uncalibrated {row['uncalibrated']['imbalance']:.3f}"
                  f"  calibrated {row['analytic']['imbalance']:.3f}"
                  f"  by node times {row['node_times']['imbalance']:.3f}", flush=True)
            if row["analytic"]["imbalance"] > TARGET:
                failures.append(f"{name} mb={mb} pp={pp}x{chunks}: {row['analytic']['imbalance']:.3f} > {TARGET}")
    with open(args.out, "w") as f:
        json.dump({"device": device, "profile": gpu_profile_name(device),
                   "source": "node kernel times measured on the device; plans not timed",
                   "rows": rows}, f, indent=1)
    print(f"{len(rows)} cases, {len(failures)} above {TARGET}")
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
