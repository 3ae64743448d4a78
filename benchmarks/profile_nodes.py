"""Where a model's measured time sits: the largest nodes of its profile, and the best cuts.

    python benchmarks/profile_nodes.py --model timm:resnet50 [--microbatch 32,128] [--stages 4,8]
        [--channels-last] [--mode graphs] [--top 8] [--out nodes.json]

Profiles the traced graph on the GPU (``profile_graph``: bf16 autocast, forward and backward, in
the mode given), then prints, per micro-batch size, the total, the ``--top`` nodes by their
share, the node times of the stem (every node before the first node of a ``layer1``/``stages.0``
/``blocks.0`` module, where there is one), and for each stage count the stage times of the best
cut between whole nodes (``balance.solve``) with their max/mean: the floor a measured plan
cannot go under. A node's time is its segment's measured time shared by the analytic model
(see [Note: segments] in autopipe/measure/profile.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIRST_BODY = ("layer1", "stages.0", "stages_0", "blocks.0", "blocks_0", "layers.0", "layers_0")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="timm:resnet50")
    parser.add_argument("--microbatch", default="32,128")
    parser.add_argument("--stages", default="4,8")
    parser.add_argument("--mode", default="graphs", choices=("eager", "graphs", "compiled"))
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from autopipe.measure import RunSetup, profile_graph
    from autopipe.models import default_input, load_model
    from autopipe.partition.balance import solve, stage_costs
    from autopipe.tracer import trace

    if not torch.cuda.is_available():
        print("profile_nodes.py times the graph on a GPU; none is visible")
        return 2
    rows = []
    for mb in (int(m) for m in args.microbatch.split(",")):
        model = load_model(args.model)
        x = default_input(model, mb)
        if args.channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        traced = trace(model, (x,))
        profile = profile_graph(traced, RunSetup(torch.device("cuda"), args.mode, torch.bfloat16, reps=10))
        order = [n.name for n in traced.gm.graph.nodes if n.name in profile.node_seconds]
        cost = [profile.node_seconds[n] for n in order]
        total = sum(cost)
        top = sorted(zip(cost, order), reverse=True)[:args.top]
        body = next((i for i, n in enumerate(order) if any(n.startswith(p) for p in FIRST_BODY)), 0)
        row = {"microbatch": mb, "total_ms": total * 1e3, "top": [(n, c * 1e3) for c, n in top],
               "stem_ms": [(n, c * 1e3) for n, c in zip(order[:body], cost[:body])], "cuts": {}}
        print(f"{args.model} {mb} images, {args.mode}: {total * 1e3:.2f} ms; largest: "
              + ", ".join(f"{n} {c / total:.1%}" for c, n in top))
        if body:
            print("  stem: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in row["stem_ms"]))
        for stages in (int(s) for s in args.stages.split(",")):
            times = stage_costs(cost, solve(cost, stages))
            floor = max(times) / (sum(times) / stages)
            row["cuts"][stages] = {"stage_ms": [t * 1e3 for t in times], "floor": floor}
            print(f"  {stages} stages: " + " ".join(f"{t * 1e3:.2f}" for t in times) + f" ms, max/mean {floor:.3f}")
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "mode": args.mode, "channels_last": args.channels_last, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
