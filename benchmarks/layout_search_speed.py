"""How fast the layout search answers: ViT-H/14 for 64 GPUs, ViT-L/16 for 8 (h100 profile).

    python benchmarks/layout_search_speed.py [--out results.json]

Each case is planned the way ``autopipe plan`` plans it: the model built on the meta device,
traced once, every layout weighed; timed from the model's spec to the ranked result, in a
warm process (the libraries imported once before). Targets (issue: automatic layout): ViT-H/14
on 64 GPUs in <= 10 s, the search over every layout of 8 GPUs in <= 5 s, on a 2-core CPU.
Exits 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.search import plan_layout  # noqa: E402

CASES = [("timm:vit_huge_patch14_224", 64, 1024, 10.0), ("timm:vit_large_patch16_224", 8, 256, 5.0)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import timm  # noqa: F401 - imported before the clock starts, as in a warm process

    rows, failed = [], False
    for spec, gpus, batch, target in CASES:
        begin = time.perf_counter()
        result = plan_layout(spec, devices=gpus, batch=batch, device="h100", memory=80 * 2**30, timeline=False)
        seconds = time.perf_counter() - begin
        ok = seconds <= target
        failed |= not ok
        rows.append({"model": spec, "gpus": gpus, "batch": batch, "seconds": seconds, "search_seconds": result.seconds,
                     "layouts": result.estimated, "chosen": str(result.best.layout), "target": target})
        print(f"{spec} on {gpus} GPUs, batch {batch}: {seconds:.2f} s in all ({result.seconds:.2f} s searching "
              f"{result.estimated} layouts), chosen {result.best.layout}  {'ok' if ok else f'FAIL > {target} s'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": "2-core CPU", "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
