"""How an eager plan cut at one host pace fares at another, by the analytic model alone.

    python benchmarks/eager_pace_sensitivity.py --models resnet50 --microbatch 128 \
        --layouts 4x1,8x1,4x2 --paces 230,320 [--device h200] [--out results.json]

An eager stage costs its host's launches as well as its kernels, and the analytic model prices
the host's part at the pace a probe reads ([Note: host pace] in autopipe/measure/host_pace.py).
A stage bound by its kernels (ResNet-50's stem over large maps) costs the same at any pace; one
bound by its launches (layer4 over 7x7 maps at 128 images) costs in proportion to the pace. So
a cut balanced at one pace is not balanced at another. For each model, micro-batch and layout,
this cuts the graph at each pace of ``--paces`` (probe microseconds, as ``plan_stages`` cuts for
a host whose probe reads that) and prices every cut at every pace (``partition_at``): max/mean
of the stages. It then looks for the cut whose worst max/mean over all the paces is least
(boundary moves of up to three nodes from the first pace's cut, while one lowers it): what a
plan that had to hold at every pace could reach. Nothing runs on a GPU; models at the
``--image-size`` of their config, channels-last as ``measured_balance.py --channels-last``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.models import default_input, load_model  # noqa: E402
from autopipe.partition.device import PROFILES, DeviceProfile  # noqa: E402
from autopipe.partition.partitioner import partition_at  # noqa: E402
from autopipe.stages import plan_stages  # noqa: E402
from autopipe.tracer import trace  # noqa: E402


def _args(pp: int, chunks: int) -> dict[str, Any]:
    return dict(pp=pp, chunks=chunks, microbatches=2 * pp, activation_dtype=torch.bfloat16,
                schedule="1f1b" if chunks == 1 else "interleaved_1f1b")


def imbalances(traced: Any, starts: Sequence[int], pp: int, chunks: int, gpu: DeviceProfile,
               paces: Sequence[float]) -> list[float]:
    """Max/mean of the stages starting at ``starts`` (``plan.imbalance``, as the plan's report
    gives it), priced at each pace."""
    return [float(partition_at(traced, starts, device=gpu.at_host_pace(pace), **_args(pp, chunks)).imbalance)
            for pace in paces]


def least_worst(traced: Any, starts: list[int], pp: int, chunks: int, gpu: DeviceProfile,
                paces: Sequence[float], reach: int = 3) -> tuple[list[int], list[float]]:
    """From ``starts``, boundary moves of up to ``reach`` nodes while one lowers the worst
    max/mean over ``paces``; the cut reached and its max/mean at each pace."""
    best, worst = list(starts), max(imbalances(traced, starts, pp, chunks, gpu, paces))
    moved = True
    while moved:
        moved = False
        for i in range(1, len(best)):
            for step in (d for r in range(1, reach + 1) for d in (-r, r)):
                cut = list(best)
                cut[i] += step
                if not cut[i - 1] < cut[i] < (cut[i + 1] if i + 1 < len(cut) else len(traced.gm.graph.nodes) - 1):
                    continue
                value = max(imbalances(traced, cut, pp, chunks, gpu, paces))
                if value < worst - 1e-4:
                    best, worst, moved = cut, value, True
    return best, imbalances(traced, best, pp, chunks, gpu, paces)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--microbatch", default="128")
    parser.add_argument("--layouts", default="4x1,8x1,4x2")
    parser.add_argument("--paces", default="230,320", help="host probe readings, microseconds")
    parser.add_argument("--device", default="h200", help="the calibrated table that prices the stages")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    paces = [float(p) * 1e-6 for p in args.paces.split(",")]
    layouts = [tuple(int(v) for v in x.split("x")) for x in args.layouts.split(",")]
    gpu = PROFILES[args.device].with_mode("eager")
    rows = []
    for name in args.models.split(","):
        model = load_model(f"timm:{name}").to(memory_format=torch.channels_last)
        for mb in (int(b) for b in args.microbatch.split(",")):
            traced = trace(model, (default_input(model, mb).contiguous(memory_format=torch.channels_last),))
            order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
            for pp, chunks in layouts:
                row: dict[str, Any] = {"model": name, "microbatch": mb, "pp": pp, "chunks": chunks, "cuts": {}}
                cuts = []
                for pace in paces:
                    plan = plan_stages(traced, device=gpu.at_host_pace(pace), split_mlps=False, **_args(pp, chunks))
                    cuts.append([order.index(s.nodes[0]) for s in plan.stages])
                    row["cuts"][f"{pace * 1e6:.0f}"] = imbalances(traced, cuts[-1], pp, chunks, gpu, paces)
                _, row["least_worst"] = least_worst(traced, cuts[0], pp, chunks, gpu, paces)
                rows.append(row)
                cells = "  ".join(f"cut at {k}: " + " ".join(f"{v:.3f}" for v in vals)
                                  for k, vals in row["cuts"].items())
                print(f"{name:10s} mb {mb:3d} pp {pp}x{chunks}  max/mean at {args.paces} us -- {cells}  "
                      f"least worst: " + " ".join(f"{v:.3f}" for v in row["least_worst"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device_table": args.device, "paces_us": [p * 1e6 for p in paces], "torch": torch.__version__,
                       "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
