"""The slowest kernels and ops of one stage of a plan, under torch.profiler (GPU).

    python benchmarks/stage_kernels.py --model convnext_base --microbatch 128 --pp 8 --channels-last

Cuts the model by the device's calibrated analytic model, prepares the chosen stage (the last by
default) on the real outputs of the stages before it, as the stage timer does, runs its forward
and backward eagerly a few times and then once under the profiler, and prints its slowest kernels
and its ops grouped by input shape. Where node_times_in_stages.py says which node of a stage
runs slow, this says which kernel and why: ConvNeXt-B's last stage at 128 images showed one
batched GEMM of 0.9 ms per stage-3 ``fc2`` backward ([Note: a gradient in rows] in
autopipe/runtime/weight_casts.py).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.measure import RunSetup  # noqa: E402
from autopipe.measure.timer import _stage_runs, device_name  # noqa: E402
from autopipe.partition.device import PROFILES, gpu_profile_name  # noqa: E402
from autopipe.stages import plan_stages  # noqa: E402
from node_times_in_stages import add_model_arguments, traced_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from torch.profiler import ProfilerActivity, profile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--stage", type=int, default=-1, help="which stage (default: the last)")
    parser.add_argument("--top", type=int, default=20, help="kernels and ops listed")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its algorithms (torch.backends.cudnn.benchmark)")
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    traced = traced_model(args)
    setup = RunSetup(torch.device("cuda"), "eager", torch.bfloat16, reps=10)
    gpu = PROFILES[gpu_profile_name(device_name(setup.device))].with_mode("graphs")
    plan = plan_stages(traced, args.pp, 1, device=gpu, activation_dtype=torch.bfloat16,
                       microbatches=2 * args.pp, split_mlps=False)
    wanted = args.stage % args.pp
    for i, run in _stage_runs(traced, plan, setup, {wanted}):
        for _ in range(5):
            run.backward(*run.forward())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            run.backward(*run.forward())
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: -e.device_time)
        print(f"{device_name(setup.device)}: {args.model}, {args.microbatch} images, stage {i} of {args.pp} "
              f"({plan.stages[i].nodes[0]}..{plan.stages[i].nodes[-1]}), eager: {len(kernels)} kernels, "
              f"{sum(e.device_time for e in kernels) / 1e3:.2f} ms" + (", cudnn.benchmark" if args.cudnn_benchmark else ""))
        for e in kernels[:args.top]:
            print(f"  {e.device_time / 1e3:7.3f} ms  {e.name[:140]}")
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="device_time_total", row_limit=args.top, max_name_column_width=60, max_shapes_column_width=80))
        run.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
