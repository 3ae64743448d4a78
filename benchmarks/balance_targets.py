"""Where the balance targets stand: every case's latest timings, from the committed results.

    python benchmarks/balance_targets.py [--results benchmarks/results] [--device h200] [--json out.json]
        [--commands]

``measured_balance.py`` writes one JSON per run; runs time a few cases each, on different days
and code. This reads them all and keeps, for each case (device, plans, mode, model, images per
micro-batch, layout), the timings of the last commit of results that timed it (a run's results
are committed with the code that made them or after it; files not committed yet count as the
newest): the measured max/mean of each (its median of three), and for measured plans the
profile's calibration error. Runs of options other than the defaults (``--split-convolutions``,
``--image-size``, ``--pace-hedge``) and runs not in channels-last layout (the convolutional
models run so on GPUs) are left out.

Targets (issue: balance that holds on the GPU), for the seven models at 32 and 128 images,
4x1, 8x1 and 4x2 stages, under CUDA graphs and eager: measured plans <= 1.05, their profile
within 10% of the stages' times, analytic plans <= 1.15. A case holds when every timing of its
last commit does. Prints a table per device, plans and mode (each cell: the last commit's max/mean,
their range where there were several, ``*`` where it misses, ``-`` where never timed) and the
cases that miss or were never timed; exits 1 if any does. ``--commands`` also prints the
``measured_balance.py`` runs that time those cases again, one per model, images and mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import subprocess
import sys
import time
from typing import Any, Iterable

MODELS = {
    "resnet50": "ResNet-50", "resnet152": "ResNet-152", "convnext_base": "ConvNeXt-B",
    "swin_base_patch4_window7_224": "Swin-B", "vit_base_patch16_224": "ViT-B/16",
    "vit_large_patch16_224": "ViT-L/16", "efficientnet_b0": "EfficientNet-B0",
}
MICROBATCHES = (32, 128)
LAYOUTS = ("4x1", "8x1", "4x2")
MODES = ("graphs", "eager")
TARGETS = {"measured": 1.05, "analytic": 1.15}
TARGET_CALIBRATION = 0.10
OFF_DEFAULT = ("--split-convolutions", "--image-size", "--pace-hedge")


@dataclasses.dataclass
class Timing:
    """One timed plan of one run, and when its results were committed (seconds since the epoch)."""
    date: str
    committed: float
    imbalance: float
    calibration_error: float | None
    source: str


@dataclasses.dataclass
class Case:
    """A case's timings of the last commit that timed it, and whether they hold its targets."""
    device: str
    plans: str
    mode: str
    model: str
    microbatch: int
    layout: str
    timings: list[Timing]

    @property
    def holds(self) -> bool:
        return bool(self.timings) and all(
            t.imbalance <= TARGETS[self.plans]
            and (t.calibration_error is None or t.calibration_error <= TARGET_CALIBRATION) for t in self.timings)

    def cell(self) -> str:
        if not self.timings:
            return "-"
        lo, hi = min(t.imbalance for t in self.timings), max(t.imbalance for t in self.timings)
        text = f"{hi:.3f}" if hi - lo < 0.0005 else f"{lo:.3f}-{hi:.3f}"
        return text + ("" if self.holds else "*")


def device_key(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    for word in name.lower().split():
        if word[:1] in "abhl" and word[1:].isdigit():
            return word
    return name.lower().replace(" ", "-")


def read_runs(paths: Iterable[str]) -> Iterable[tuple[str, dict[str, Any]]]:
    """(path, run) for every file that is a ``measured_balance.py`` run at the default options."""
    for path in sorted(paths):
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError):
            continue
        if not (isinstance(run, dict) and isinstance(run.get("rows"), list) and "device" in run and "date" in run):
            continue
        command = run.get("command", "")
        if "measured_balance" not in command or not run.get("channels_last") \
                or any(flag in command for flag in OFF_DEFAULT):
            continue
        yield path, run


def committed_times(folder: str) -> dict[str, float]:
    """When each file in ``folder`` was first committed, by file name ({} outside a git checkout)."""
    try:
        log = subprocess.run(["git", "log", "--diff-filter=A", "--name-only", "--format=@%ct", "--", "."],
                             cwd=folder, capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[str, float] = {}
    when = 0.0
    for line in log.splitlines():
        if line.startswith("@"):
            when = float(line[1:])
        elif line.strip():
            out.setdefault(os.path.basename(line.strip()), when)  # newest first: a re-added file, its last add
    return out


def collect(paths: Iterable[str], committed: dict[str, float] | None = None) -> dict[tuple, list[Timing]]:
    """Each case's timings of its last commit: {(device, plans, mode, model, mb, layout): [Timing]}.
    ``committed``: when each file (by name) was committed; files not in it count as the newest."""
    committed = {} if committed is None else committed
    now = time.time()
    out: dict[tuple, list[Timing]] = {}
    for path, run in read_runs(paths):
        for row in run["rows"]:
            if not isinstance(row, dict) or "pp" not in row or "mode" not in row:
                continue
            for plans in TARGETS:
                timed = row.get(plans)
                if not isinstance(timed, dict) or not timed.get("measured_imbalance"):
                    continue
                key = (device_key(run["device"]), plans, row["mode"], row["model"], int(row["microbatch"]),
                       f"{row['pp']}x{row['chunks']}")
                timing = Timing(run["date"], committed.get(os.path.basename(path), now),
                                float(timed["measured_imbalance"]),
                                timed.get("calibration_error") if plans == "measured" else None,
                                os.path.basename(path))
                kept = out.setdefault(key, [])
                if kept and kept[0].committed > timing.committed:
                    continue
                if kept and kept[0].committed < timing.committed:
                    kept.clear()
                kept.append(timing)
    return out


def cases(timings: dict[tuple, list[Timing]], devices: Iterable[str]) -> list[Case]:
    """Every case of the targets on each device, timed or not."""
    return [Case(d, p, mode, m, mb, lay, timings.get((d, p, mode, m, mb, lay), []))
            for d in devices for p in TARGETS for mode in MODES for m in MODELS for mb in MICROBATCHES
            for lay in LAYOUTS]


def table(chosen: list[Case]) -> list[str]:
    """One table per device, plans and mode: a row per model, a column per images x layout."""
    lines = []
    for d, p, mode in dict.fromkeys((c.device, c.plans, c.mode) for c in chosen):
        group = [c for c in chosen if (c.device, c.plans, c.mode) == (d, p, mode)]
        held = sum(c.holds for c in group)
        lines += ["", f"{d}, {p} plans, {'CUDA graphs' if mode == 'graphs' else 'eager'}: "
                      f"{held} of {len(group)} within {TARGETS[p]}"
                  + (f" (profile within {TARGET_CALIBRATION:.0%})" if p == "measured" else ""),
                  f"| model | {' | '.join(f'{mb} {lay}' for mb in MICROBATCHES for lay in LAYOUTS)} |",
                  "|---" * (1 + len(MICROBATCHES) * len(LAYOUTS)) + "|"]
        for m, label in MODELS.items():
            row = [c for c in group if c.model == m]
            lines.append(f"| {label} | {' | '.join(c.cell() for c in row)} |")
    return lines


def commands(missing: list[Case]) -> list[str]:
    """The ``measured_balance.py`` runs that time ``missing`` again: one per model, images, mode
    and plans, with the layouts that miss."""
    runs: dict[tuple, list[str]] = {}
    for c in missing:
        runs.setdefault((c.model, c.microbatch, c.mode, c.plans), []).append(c.layout)
    return [f"python benchmarks/measured_balance.py --models {m} --microbatch {mb} --modes {mode} --plans {p} "
            f"--layouts {','.join(layouts)} --channels-last --out RESULTS.json"
            for (m, mb, mode, p), layouts in runs.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--device", help="h100 or h200 (default: every device with results)")
    parser.add_argument("--json", metavar="PATH", help="also write every case as JSON")
    parser.add_argument("--commands", action="store_true", help="also print the runs that time the misses again")
    args = parser.parse_args(argv)
    timings = collect(glob.glob(os.path.join(args.results, "*.json")), committed_times(args.results))
    devices = sorted({k[0] for k in timings}) if args.device is None else [args.device.lower()]
    if not devices:
        print(f"no measured_balance.py results in {args.results}", file=sys.stderr)
        return 1
    chosen = cases(timings, devices)
    print("\n".join(table(chosen)[1:]))
    missing = [c for c in chosen if not c.holds]
    print(f"\n{len(chosen) - len(missing)} of {len(chosen)} cases hold their targets")
    for c in missing:
        what = "never timed" if not c.timings else ", ".join(
            f"{t.imbalance:.3f}" + (f" (profile {t.calibration_error:.1%} off)" if t.calibration_error else "")
            + f" {t.source} ({t.date})" for t in c.timings)
        print(f"MISS {c.device} {c.plans} {c.mode} {MODELS[c.model]} {c.microbatch} images {c.layout}: "
              f"{what}")
    if args.commands and missing:
        print("\nto time them again, on the GPU:")
        print("\n".join(commands(missing)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(c) | {"holds": c.holds} for c in chosen], f, indent=1)
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
