"""How steady the timer's stage times are: one plan timed again and again, in sweeps (every stage on
the device at once, each sweep running every stage once; the default for stages at the host's
pace, [Note: timing sweeps]), in rounds (every stage on the device at once, each round timing each
stage ``reps`` times back to back, each stage keeping its fastest round; the default under CUDA
graphs) and in passes (the plan emitted and timed stage after stage, each pass whole; what the
timer falls back to when the stages do not fit at once). See [Note: timing passes] in
autopipe/measure/timer.py.

    python benchmarks/timing_rounds.py --cases convnext_base:32,resnet50:32:4 --ways sweeps,rounds --out r.json

Each case is MODEL:IMAGES[:STAGES] (8 stages by default), a plan by the analytic model
(channels-last, bf16, eager), timed ``--repeats`` times each way, alternating. It prints each
timing's stage times, max/mean and seconds taken, and per way the spread of max/mean.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from autopipe.measure import RunSetup, timer  # noqa: E402
from autopipe.models import default_input, load_model  # noqa: E402
from autopipe.partition.device import PROFILES, gpu_profile_name  # noqa: E402
from autopipe.stages import plan_stages  # noqa: E402
from autopipe.tracer import trace  # noqa: E402


def _passes(traced, plan, setup, wanted, *, kernels):
    best: dict = {}
    for _ in range(setup.timing_passes):
        for i, t in timer._time_pass(traced, plan, setup, wanted, kernels=kernels).items():
            if i not in best or t.seconds < best[i].seconds:
                best[i] = t
    return best


WAYS = {"sweeps": timer._time_sweeps, "rounds": timer._time_rounds, "passes": _passes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="convnext_base:32,resnet50:32,efficientnet_b0:128")
    parser.add_argument("--ways", default="sweeps,rounds", help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    result: dict[str, list] = {"device": timer.device_name("cuda"), "torch": torch.__version__, "cases": {}}
    for case in args.cases.split(","):
        name, mb, *stages = case.split(":")
        model = load_model(f"timm:{name}").to(memory_format=torch.channels_last)
        x = default_input(model, int(mb)).contiguous(memory_format=torch.channels_last)
        traced = trace(model, (x,))
        gpu = PROFILES[gpu_profile_name(timer.device_name("cuda"))].with_mode("eager")
        plan = plan_stages(traced, device=gpu, pp=int(stages[0]) if stages else 8, chunks=1, microbatches=16,
                           activation_dtype=torch.bfloat16)
        for how in ways * args.repeats:
            setup = RunSetup(torch.device("cuda"), "eager", torch.bfloat16, reps=10,
                             passes=3 if how == "passes" else timer.PASSES)
            begin = time.perf_counter()
            t = WAYS[how](traced, plan, setup, set(range(plan.num_stages)), kernels=False)
            seconds = time.perf_counter() - begin
            ms = [t[i].seconds * 1e3 for i in range(plan.num_stages)]
            ratio = max(ms) / (sum(ms) / len(ms))
            print(f"{case} {how:6s}: " + " ".join(f"{v:6.2f}" for v in ms) + f"  max/mean {ratio:.3f}  {seconds:.1f} s",
                  flush=True)
            result["cases"].setdefault(case, []).append({"how": how, "ms": ms, "max_mean": ratio, "seconds": seconds})
        for how in ways:
            ratios = [r["max_mean"] for r in result["cases"][case] if r["how"] == how]
            print(f"{case} {how:6s}: max/mean {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} timings",
                  flush=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
