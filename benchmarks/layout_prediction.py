"""The layout search's predictions, made again now, against what a GPU run measured.

    python benchmarks/layout_prediction.py benchmarks/results/2026-11-25-h100x2-layout-choice.json

Reads the rows of a ``layout_choice_gpu.py`` result (each layout's measured step time and
memory: what the fullest GPU's allocator held, ``torch.cuda.memory_reserved``, where the run
recorded it, else its ``torch.cuda.max_memory_allocated``, which misses CUDA graphs' pools),
prices the same layouts again
with the search and cost model of this checkout (with the links the run measured, if any; no
GPU needed) and prints predicted against measured beside the run's own prediction. So a change
of the cost model is judged on measurements already made.

Targets: step time within 15% (issue: auto-parallel); memory no more than 15% below the
measured peak (a layout the search keeps must fit) and no more than 50% above (a layout it
refuses must not fit). Exits 1 on a miss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.partition.device import gpu_profile_name  # noqa: E402
from autopipe.search import plan_layout  # noqa: E402
from autopipe.search.links import LinkModel  # noqa: E402

TIME = 0.15
LOW, HIGH = -0.15, 0.50


def measured_gib(row: dict) -> float:
    """The memory a row measured: the fullest rank's reserved, else the peak allocated."""
    reserved = row.get("memory_gib", {}).get("reserved")
    return max(reserved) if reserved else row["peak_gib"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("--profile", default="",
                        help="the device profile to price with (default: the one of the GPU the run was made on)")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    world = data["meta"]["world"]
    profile = args.profile or gpu_profile_name(str(data["meta"].get("device", "")))
    links = LinkModel(**data["meta"]["links"]) if data["meta"].get("links") else None
    rows = [r for r in data["rows"] if "measured" in r]
    failures, out = [], []
    print(f"{'model':22s} {'layout':36s} {'measured ms':>11s} {'then':>7s} {'now':>7s} {'error':>7s}   "
          f"{'GiB':>5s} {'now':>5s} {'error':>7s}")
    for name, batch in sorted({(r["model"], r["batch"]) for r in rows}):
        modes = tuple(sorted({r["layout"].split()[-1] for r in rows if r["model"] == name}))
        result = plan_layout(f"timm:{name}", devices=world, batch=batch, device=profile, modes=modes,
                             links=links, mixed_precision="bf16", exact=10**6, timeline=False)
        ranked = {str(p.layout): p for p in result.ranked}
        for r in (r for r in rows if r["model"] == name and r["batch"] == batch):
            p = ranked.get(r["layout"])
            if p is None:
                failures.append(f"{name} {r['layout']}: not ranked by the search now")
                continue
            time_error = p.step_seconds / r["measured"] - 1
            held = measured_gib(r)
            memory_error = p.memory_bytes / 2**30 / held - 1
            split = ""
            if "pipeline_measured" in r:  # the run split its steps (CUDA events): pipeline, then the rest
                rest = p.step_seconds - p.parts["pipeline"]
                split = (f"   pipeline {p.parts['pipeline'] * 1e3:6.1f} / {r['pipeline_measured'] * 1e3:6.1f}"
                         f"   rest {rest * 1e3:5.1f} / {r['rest_measured'] * 1e3:5.1f}")
            print(f"{name[:22]:22s} {r['layout']:36s} {r['measured'] * 1e3:11.1f} {r['predicted'] * 1e3:7.1f} "
                  f"{p.step_seconds * 1e3:7.1f} {time_error:+7.1%}   {held:5.1f} "
                  f"{p.memory_bytes / 2**30:5.1f} {memory_error:+7.1%}{split}")
            out.append({"model": name, "batch": batch, "layout": r["layout"], "measured": r["measured"],
                        "predicted_then": r["predicted"], "predicted": p.step_seconds, "error": time_error,
                        "peak_gib": r["peak_gib"], "measured_gib": held, "predicted_gib": p.memory_bytes / 2**30,
                        "memory_error": memory_error})
            if abs(time_error) > TIME:
                failures.append(f"{name} {r['layout']}: step time predicted {time_error:+.1%} off")
            if not LOW <= memory_error <= HIGH:
                failures.append(f"{name} {r['layout']}: memory predicted {memory_error:+.1%} off the measured peak")
        chosen = str(result.best.layout)
        measured = {r["layout"]: r["measured"] for r in rows if r["model"] == name and r["batch"] == batch}
        if chosen in measured:
            regret = measured[chosen] / min(measured.values()) - 1
            print(f"  {name}: the search now chooses {chosen}, {regret:+.1%} against the best measured")
        else:
            print(f"  {name}: the search now chooses {chosen}, which the run did not measure")
    within = sum(abs(r["error"]) <= TIME for r in out)
    print(f"{within} of {len(out)} step times within {TIME:.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"source": args.results, "profile": profile, "rows": out}, f, indent=1)
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
