"""The layout search's memory per device against the peaks a GPU run measured.

    python benchmarks/memory_prediction.py benchmarks/results/2026-11-25-h100x2-layout-choice.json

Reads the rows of a ``layout_choice_gpu.py`` result (each layout's measured peak,
``torch.cuda.max_memory_allocated`` on the fullest GPU), prices the same layouts again with the
search as it is now (on the meta device: no GPU needed) and prints predicted against measured.
Target: no layout predicted below its measured peak by more than 15% (a layout the search keeps
must fit), none above by more than 50% (a layout it refuses must not fit). Exits 1 on a miss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.search import plan_layout  # noqa: E402

LOW, HIGH = -0.15, 0.50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("--profile", default="h100")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    world = data["meta"]["world"]
    rows = [r for r in data["rows"] if "peak_gib" in r]
    failures = []
    print(f"{'model':24s} {'layout':44s} {'measured GiB':>12s} {'predicted':>9s} {'error':>7s}")
    for name, batch in sorted({(r["model"], r["batch"]) for r in rows}):
        modes = tuple(sorted({r["layout"].split()[-1] for r in rows if r["model"] == name}))
        result = plan_layout(f"timm:{name}", devices=world, batch=batch, device=args.profile, modes=modes,
                             mixed_precision="bf16", exact=10**6, timeline=False)
        predicted = {str(p.layout): p.memory_bytes / 2**30 for p in result.ranked}
        for r in (r for r in rows if r["model"] == name and r["batch"] == batch):
            if r["layout"] not in predicted:
                failures.append(f"{name} {r['layout']}: not ranked by the search now")
                continue
            error = predicted[r["layout"]] / r["peak_gib"] - 1
            print(f"{name:24s} {r['layout']:44s} {r['peak_gib']:12.1f} {predicted[r['layout']]:9.1f} {error:+7.1%}")
            if not LOW <= error <= HIGH:
                failures.append(f"{name} {r['layout']}: predicted {error:+.1%} off the measured peak")
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
