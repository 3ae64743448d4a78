"""Where a profile's node times and the stages of a plan disagree, node by node (GPU).

    python benchmarks/node_times_in_stages.py --model convnext_base --microbatch 128 --pp 8

Profiles the model (graphs mode by default, bf16 autocast), cuts it into ``pp`` stages by that
profile, times every stage with each node's own kernel times, and prints per stage: the
profile's time for its nodes, the stage timed, the sum of its nodes' kernels, and the nodes
whose profiled time differs most from their kernels inside the stage (profiled - in stage,
in stage, profile's forward and backward; ms). A node that is slow at the start of a stage or
of a profile segment and fast inside one shows up here (ConvNeXt's depthwise convolutions
before the received-layout fix: [Note: received layout] in autopipe/stages/emit.py).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.measure import RunSetup, profile_graph  # noqa: E402
from autopipe.measure.timer import device_name, time_stages  # noqa: E402
from autopipe.models import default_input, load_model  # noqa: E402
from autopipe.partition.device import PROFILES, gpu_profile_name  # noqa: E402
from autopipe.stages import plan_stages  # noqa: E402
from autopipe.tracer import trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="convnext_base", help="a timm model name")
    parser.add_argument("--microbatch", type=int, default=128)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--mode", default="graphs", choices=["graphs", "eager"])
    parser.add_argument("--top", type=int, default=4, help="nodes shown per stage")
    args = parser.parse_args(argv)
    model = load_model(f"timm:{args.model}")
    traced = trace(model, (default_input(model, args.microbatch),))
    setup = RunSetup(torch.device("cuda"), args.mode, torch.bfloat16, reps=10)
    profile = profile_graph(traced, setup)
    gpu = PROFILES[gpu_profile_name(device_name(setup.device))].with_mode(args.mode)
    plan = plan_stages(traced, args.pp, 1, device=gpu, measured=profile, activation_dtype=torch.bfloat16,
                       microbatches=2 * args.pp, split_mlps=False)
    timed = time_stages(traced, plan, setup, kernels=True)
    order = [n.name for n in traced.gm.graph.nodes]
    print(f"{device_name(setup.device)}: {args.model}, {args.microbatch} images, {args.mode}; profile segments start at",
          [order[s.start] for s in profile.segments])
    for i, stage in enumerate(plan.stages):
        inside = {n: sum(v) for n, v in timed[i].nodes.device.items()}
        profiled = sum(profile.node_seconds.get(n, 0.0) for n in stage.nodes)
        print(f"stage {i} {stage.nodes[0]}..{stage.nodes[-1]}: profile {profiled * 1e3:.2f} ms "
              f"(+{profile.stage_overhead * 1e3:.2f} per stage), timed {timed[i].seconds * 1e3:.2f}, "
              f"kernels in stage {sum(inside.values()) * 1e3:.2f}")
        worst = sorted(stage.nodes, key=lambda n: -abs(profile.node_seconds.get(n, 0.0) - inside.get(n, 0.0)))
        for n in worst[:args.top]:
            detail = profile.node_detail.get(n, [0.0, 0.0])
            print(f"    {n:40s} {(profile.node_seconds.get(n, 0.0) - inside.get(n, 0.0)) * 1e3:+8.3f} "
                  f"in stage {inside.get(n, 0.0) * 1e3:7.3f}  profile fwd {detail[0] * 1e3:.3f} bwd {detail[1] * 1e3:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
