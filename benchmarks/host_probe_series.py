"""The host's pace over time on a GPU machine: the probe of autopipe.measure.host_pace, read in
bursts every 25 ms, idle, after a timm model is loaded and after it trains a few steps.

Prints one line per phase: per half second, the lowest burst reading in us / the CPU the process
ran on. Shows the host's two paces and how long each spell lasts ([Note: planning probe]).

    python benchmarks/host_probe_series.py [--models resnet152,convnext_base] > series.txt
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from autopipe.measure.host_pace import PACE, probe_seconds


def this_cpu() -> int:
    try:
        return int(open("/proc/self/stat").read().split(")")[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def series(label: str, device: torch.device, seconds: float) -> None:
    begin, windows = time.perf_counter(), {}
    while time.perf_counter() - begin < seconds:
        burst = sorted(PACE.probe(device) for _ in range(20))
        windows.setdefault(int((time.perf_counter() - begin) / 0.5), []).append(burst[2] * 1e6)
        time.sleep(0.025)
    print(label, " ".join(f"{min(v):.0f}/{this_cpu()}" for _, v in sorted(windows.items())), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet152,convnext_base,vit_base_patch16_224")
    args = parser.parse_args()
    import timm

    device = torch.device("cuda")
    print("affinity", len(os.sched_getaffinity(0)), "cpu", this_cpu())
    torch.zeros(1, device=device)
    print("probe_seconds idle:", " ".join(f"{probe_seconds(device) * 1e6:.0f}" for _ in range(3)))
    series("idle", device, 3)
    for name in args.models.split(","):
        model = timm.create_model(name).to(device).to(memory_format=torch.channels_last)
        print(name, "probe_seconds right after load:", f"{probe_seconds(device) * 1e6:.0f}", flush=True)
        series(name + " after load", device, 6)
        x = torch.randn(32, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
        for _ in range(5):
            with torch.autocast("cuda", torch.bfloat16):
                model(x).float().sum().backward()
        torch.cuda.synchronize()
        print(name, "probe_seconds after train:", " ".join(f"{probe_seconds(device) * 1e6:.0f}" for _ in range(3)))
        series(name + " after train", device, 3)
        del model, x


if __name__ == "__main__":
    main()
