"""Where a profile's node times and the stages of a plan disagree, node by node (GPU).

    python benchmarks/node_times_in_stages.py --model convnext_base --microbatch 128 --pp 8
    python benchmarks/node_times_in_stages.py --model resnet50 --microbatch 32 --plans analytic --channels-last

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
from autopipe.partition.cost import graph_costs  # noqa: E402
from autopipe.partition.device import PROFILES, gpu_profile_name  # noqa: E402
from autopipe.stages import plan_stages  # noqa: E402
from autopipe.tracer import trace  # noqa: E402


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its micro-batch, the stages and the layout: what this script and
    stage_kernels.py plan."""
    parser.add_argument("--model", default="convnext_base", help="a timm model name")
    parser.add_argument("--microbatch", type=int, default=128)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--channels-last", action="store_true", help="model and input channels-last")


def traced_model(args: argparse.Namespace):
    """The timm model ``args.model`` traced on one micro-batch, channels-last where asked."""
    model = load_model(f"timm:{args.model}")
    example = default_input(model, args.microbatch)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        example = example.contiguous(memory_format=torch.channels_last)
    return trace(model, (example,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--mode", default="graphs", choices=["graphs", "eager"])
    parser.add_argument("--top", type=int, default=4, help="nodes shown per stage")
    parser.add_argument("--plans", default="measured", choices=["measured", "analytic"],
                        help="cut by a profile of the model, or by the device's calibrated analytic model")
    args = parser.parse_args(argv)
    traced = traced_model(args)
    setup = RunSetup(torch.device("cuda"), args.mode, torch.bfloat16, reps=10)
    gpu = PROFILES[gpu_profile_name(device_name(setup.device))].with_mode(args.mode)
    profile = profile_graph(traced, setup) if args.plans == "measured" else None
    plan = plan_stages(traced, args.pp, 1, device=gpu, measured=profile, activation_dtype=torch.bfloat16,
                       microbatches=2 * args.pp, split_mlps=False)
    timed = time_stages(traced, plan, setup, kernels=True)
    print(f"{device_name(setup.device)}: {args.model}, {args.microbatch} images, {args.mode}, {args.plans} plan"
          + (", channels-last" if args.channels_last else ""))
    if profile is not None:
        order = [n.name for n in traced.gm.graph.nodes]
        print("profile segments start at", [order[s.start] for s in profile.segments])
    costs = graph_costs(traced.gm)
    for i, stage in enumerate(plan.stages):
        _print_stage(i, stage, timed[i], profile, gpu, costs, args.top)
    return 0


def _print_stage(i: int, stage, timing, profile, gpu, costs, top: int) -> None:
    """One stage: what it was priced at, timed at, and what its nodes' kernels took inside it; then
    the ``top`` nodes whose price differs most from their kernels (ms)."""
    inside = {n: sum(v) for n, v in timing.nodes.device.items()}
    if profile is not None:
        priced = {n: profile.node_seconds.get(n, 0.0) for n in stage.nodes}
    else:
        priced = {n: gpu.node_time(costs[n]) + gpu.node_time(costs[n], backward=True) for n in stage.nodes}
    spare = timing.nodes.unattributed
    print(f"stage {i} {stage.nodes[0]}..{stage.nodes[-1]}: priced {stage.compute_time * 1e3:.2f} ms "
          f"(nodes {sum(priced.values()) * 1e3:.2f}), timed {timing.seconds * 1e3:.2f}, "
          f"kernels in stage {sum(inside.values()) * 1e3:.2f}, unattributed fwd {spare[0] * 1e3:.3f} "
          f"bwd {spare[1] * 1e3:.3f}")
    for n in sorted(stage.nodes, key=lambda n: -abs(priced[n] - inside.get(n, 0.0)))[:top]:
        fwd, bwd = timing.nodes.device.get(n, (0.0, 0.0))
        print(f"    {n:40s} priced - in stage {(priced[n] - inside.get(n, 0.0)) * 1e3:+8.3f}  "
              f"in stage fwd {fwd * 1e3:.3f} bwd {bwd * 1e3:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
