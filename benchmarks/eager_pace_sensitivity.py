"""How an eager plan cut at one host pace fares at another, by the analytic model alone.

    python benchmarks/eager_pace_sensitivity.py --models resnet50 --microbatch 128 \
        --layouts 4x1,8x1,4x2 --paces 230,320 [--hedges 0.03,0.05] [--device h200] [--out results.json]

An eager stage costs its host's launches as well as its kernels, and the analytic model prices
the host's part at the pace a probe reads ([Note: host pace] in autopipe/measure/host_pace.py).
A stage bound by its kernels (ResNet-50's stem over large maps) costs the same at any pace; one
bound by its launches (layer4 over 7x7 maps at 128 images) costs in proportion to the pace. So
a cut balanced at one pace is not balanced at another. For each model, micro-batch and layout,
this cuts the graph at each pace of ``--paces`` (probe microseconds, as ``plan_stages`` cuts for
a host whose probe reads that) and prices every cut at every pace (``partition_at``): max/mean
of the stages. It then finds the cut whose worst max/mean over all the paces is least: a min-max dynamic
program over every stage's cost at each pace, each against that pace's mean stage
(``least_worst``; the mean of the cut made at that pace), then priced as above. That is what a
plan that had to hold at every pace could reach. And the plan at the first pace with each
``--hedges`` value (``plan_stages(pace_hedge=...)``: [Note: a cut hedged over paces]), priced
at every pace. Nothing runs on a GPU; models at the
``--image-size`` of their config, channels-last as ``measured_balance.py --channels-last``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.models import default_input, load_model  # noqa: E402
from autopipe.partition.balance_problem import stage_time  # noqa: E402
from autopipe.partition.cost import graph_costs  # noqa: E402
from autopipe.partition.cuts import allowed_cuts, cut_dag  # noqa: E402
from autopipe.partition.device import PROFILES, DeviceProfile  # noqa: E402
from autopipe.partition.launch_queue import pass_replays  # noqa: E402
from autopipe.partition.partitioner import partition_at  # noqa: E402
from autopipe.partition.transfers import boundary_copy_seconds, cut_latency_seconds, cut_seconds  # noqa: E402
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


def stage_seconds(traced: Any, profile: DeviceProfile) -> np.ndarray:
    """Every eager stage [i, j) of the graph as ``partition_at`` prices it on ``profile``
    (its launches replayed from idle, the cuts' transfers and copies): an (n + 1) x (n + 1)
    array, infinite where j <= i."""
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    costs = graph_costs(traced.gm)
    order = [n.name for n in nodes]
    launches = profile.launches([costs[n] for n in order])
    analytic = [f + b for f, b in profile.node_times([costs[n] for n in order], launches)]
    cut_bytes = [int(b) for b in cut_dag(traced, costs, torch.bfloat16).cut_bytes[: len(order) - 1]]
    n = len(order)
    cut_t = np.array([0.0] + [cut_seconds(b, profile) for b in cut_bytes] + [0.0])
    cut_l = np.array([0.0] + [cut_latency_seconds(b, profile) + boundary_copy_seconds(b, profile)
                              for b in cut_bytes] + [0.0])
    overhead = profile.calibration.stage.get(profile.mode, 0.0) if profile.calibration is not None else 0.0
    heads, ends = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = ends > heads
    h, e = np.where(valid, heads, 0), np.where(valid, ends, 1)
    if launches is None:
        prefix = np.concatenate(([0.0], np.cumsum(analytic)))
        compute = prefix[e] - prefix[h]
    else:
        compute = sum(pass_replays(p, h, e) for p in launches)
    _, comm, latency, _ = stage_time(np.zeros(n + 1), cut_t, cut_l, h, e)
    return np.where(valid, np.maximum(compute + overhead, comm) + latency, np.inf)


def least_worst(traced: Any, pp: int, chunks: int, gpu: DeviceProfile, paces: Sequence[float],
                means: Sequence[float]) -> list[int]:
    """The cut (stage starts) whose largest stage, over every pace, is least against that
    pace's mean stage (``means``): a min-max dynamic program over the stages' costs at each pace
    (``stage_seconds``), the cuts allowed where ``partition`` allows them."""
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    n, stages = len(nodes), pp * chunks
    cost = np.max([stage_seconds(traced, gpu.at_host_pace(p)) / m for p, m in zip(paces, means)], axis=0)
    allowed = np.array([True] + list(allowed_cuts(nodes, traced.gm)) + [True])  # may a stage start at k
    best = np.full((stages + 1, n + 1), np.inf)
    choice = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, stages + 1):
        # stage s - 1 runs [i, j): best[s, j] = min over i of max(best[s - 1, i], cost[i, j])
        through = np.maximum(np.where(allowed[:, None], best[s - 1][:, None], np.inf), cost)
        choice[s] = np.argmin(through, axis=0)
        best[s] = through[choice[s], np.arange(n + 1)]
    starts, j = [], n
    for s in range(stages, 0, -1):
        j = int(choice[s, j])
        starts.append(j)
    return starts[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--microbatch", default="128")
    parser.add_argument("--layouts", default="4x1,8x1,4x2")
    parser.add_argument("--paces", default="230,320", help="host probe readings, microseconds")
    parser.add_argument("--device", default="h200", help="the calibrated table that prices the stages")
    parser.add_argument("--hedges", default="0.03,0.05",
                        help="also the plan cut at the first pace with each of these pace_hedge values")
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
                means = [sum(s.cost for s in partition_at(traced, cut, device=gpu.at_host_pace(p),
                                                            **_args(pp, chunks)).stages) / (pp * chunks)
                         for cut, p in zip(cuts, paces)]
                row["least_worst_cut"] = least_worst(traced, pp, chunks, gpu, paces, means)
                row["least_worst"] = imbalances(traced, row["least_worst_cut"], pp, chunks, gpu, paces)
                row["hedged"] = {}
                for hedge in (float(h) for h in args.hedges.split(",") if float(h) > 0):
                    plan = plan_stages(traced, device=gpu.at_host_pace(paces[0]), split_mlps=False, pace_hedge=hedge,
                                       **_args(pp, chunks))
                    row["hedged"][str(hedge)] = imbalances(traced, [order.index(s.nodes[0]) for s in plan.stages], pp,
                                                           chunks, gpu, paces)
                rows.append(row)
                cells = "  ".join(f"{label} {k}: " + " ".join(f"{v:.3f}" for v in vals)
                                  for label, part in (("cut at", row["cuts"]), ("hedged", row["hedged"]))
                                  for k, vals in part.items())
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
