"""How evenly autopipe's "cost" balance splits vision models, against the usual splits.

Planned as users on GPUs plan: each model built on the meta device, 32 images per micro-batch,
activations crossing stages in bf16 (``activation_dtype=torch.bfloat16``, as under bf16
autocast), the h100 device profile. For each model and pp x chunks stages:

- autopipe: its imbalance, max/mean modelled stage time, where a stage takes
  max(compute, comm) + latency (see [Note: communication in the stage cost]);
- bound: the best imbalance any node-level cut can reach given the model's node costs
  (cuts between the traced graph's nodes: no MLP cut into pieces),
  i.e. the exact optimum of the same balancer given a free link (no transfer time, no
  latency), where stage time is compute alone and the mean is fixed;
- the equal-layers, by-parameters and best block-level splits, measured as the reference
  anchors were (top-level blocks, max/mean forward FLOPs).

Targets: autopipe imbalance <= 1.05 for every model and pp in {2, 4, 8}, chunks 1 and 2 "where
the graph has enough nodes", and ViT-H/14 planned for pp=8 (trace + partition) in <= 5 s.
"The graph has enough nodes" for a stage count means: its node-level bound (above) is <= 1.05.
A case above 1.05 is then either

- granularity-limited: its bound is above 1.05 too, so no node-level cut reaches the target
  even without communication (not counted as a failure), or
- a failure: some cut reaches 1.05 on compute alone, but autopipe's plan does not.

Exits 1 on any failure or when planning ViT-H/14 takes longer than 5 s. Failures are printed
with their stages: compute, transfer and latency per stage and the bytes at each cut, next to
the free-link plan's cuts priced on the real link.

    python benchmarks/balance_quality.py [--models resnet50,vit_base_patch16_224] [--out PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from autopipe.graph import owning_module
from autopipe.models import default_input, load_model
from autopipe.partition import balance as balancer
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import get_profile
from autopipe.partition.partitioner import partition
from autopipe.partition.transfers import cut_latency_seconds, cut_seconds
from autopipe.stages import plan_stages
from autopipe.tracer import trace

MODELS = {
    "resnet50": "ResNet-50",
    "resnet152": "ResNet-152",
    "vit_base_patch16_224": "ViT-B/16",
    "vit_large_patch16_224": "ViT-L/16",
    "vit_huge_patch14_224": "ViT-H/14",
    "swin_base_patch4_window7_224": "Swin-B",
    "convnext_base": "ConvNeXt-B",
}
PPS = (2, 4, 8)
CHUNKS = (1, 2)
MICROBATCH = 32
ACTIVATION_DTYPE = torch.bfloat16
DEVICE = "h100"
MAX_IMBALANCE = 1.05
MAX_PLAN_SECONDS = 5.0
# Block-level, forward-FLOP imbalance of (equal layers, by parameters, best block cut), chunks=1.
ANCHORS: dict[tuple[str, int], tuple[float, float, float]] = {
    ("resnet50", 4): (1.37, 2.99, 1.13),
    ("resnet50", 8): (1.58, 3.55, 1.16),
    ("vit_base_patch16_224", 8): (1.32, 1.32, 1.32),
    ("swin_base_patch4_window7_224", 4): (1.30, 1.86, 1.05),
    ("convnext_base", 8): (1.30, 2.32, 1.08),
}
FREE_LINK = dataclasses.replace(get_profile(DEVICE), name=f"{DEVICE}-free-link", link_bandwidth=float("inf"),
                                link_latency=0.0)
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "balance_quality.json")


def _flop_imbalance(flops: np.ndarray, starts: Sequence[int]) -> float:
    return balancer.imbalance(balancer.stage_costs(flops, starts))


def _block_starts(block_values: np.ndarray, firsts: list[int], n_stages: int) -> list[int]:
    """Node starts of the min-max split of whole blocks by ``block_values``."""
    return [firsts[b] for b in balancer.solve(block_values, n_stages)]


def repeated_blocks(model: nn.Module) -> set[str]:
    """Qualified names of repeated blocks: elements of a Sequential/ModuleList of 2+ modules of
    one class from outside torch.nn (ResNet bottlenecks, ViT blocks, Swin/ConvNeXt stage blocks)."""
    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Sequential, nn.ModuleList)) and len(mod) > 1:
            kinds = {type(child) for child in mod}
            if len(kinds) == 1 and not next(iter(kinds)).__module__.startswith("torch.nn"):
                out.update(f"{name}.{i}" if name else str(i) for i in range(len(mod)))
    return out


def block_keys(nodes: Sequence[fx.Node], model: nn.Module, flops: np.ndarray) -> list[str]:
    """The block of each node: its deepest repeated block, else its top-level child.

    Top-level children that do no forward FLOPs (Identity, dropout) and root-level glue
    join the block before them, so that "equal layers" counts only layers that work.
    """
    blocks = repeated_blocks(model)
    keys: list[str | None] = []
    for node in nodes:
        parts = owning_module(node).split(".")
        prefixes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
        keys.append(next((p for p in prefixes if p in blocks), parts[0] or None))
    work: dict[str | None, float] = {}
    for key, f in zip(keys, flops):
        work[key] = work.get(key, 0.0) + float(f)
    working = [k for k in keys if k is not None and work[k] > 0]
    previous = working[0] if working else "(model)"
    out = []
    for key in keys:
        if key is not None and work[key] > 0:
            previous = key
        out.append(previous)
    return out


def block_baselines(traced: Any, model: nn.Module, n_stages: int) -> dict[str, float | None]:
    """Forward-FLOP imbalance of the three block-level splits; None where blocks < stages."""
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    costs = graph_costs(traced.gm)
    flops = np.array([costs[n.name].fwd_flops for n in nodes])
    params = np.array([costs[n.name].param_count for n in nodes], dtype=np.float64)
    keys = block_keys(nodes, model, flops)
    firsts = [i for i in range(len(keys)) if i == 0 or keys[i] != keys[i - 1]]
    if len(firsts) < n_stages:
        return {"uniform": None, "params": None, "best_block": None, "blocks": len(firsts)}
    groups = list(np.cumsum([i in set(firsts) for i in range(len(keys))]) - 1)
    bounds = firsts + [len(nodes)]
    block_flops = np.array([flops[a:b].sum() for a, b in zip(bounds, bounds[1:])])
    block_params = np.array([params[a:b].sum() for a, b in zip(bounds, bounds[1:])])
    return {
        "uniform": _flop_imbalance(flops, balancer.solve_uniform(groups, n_stages)),
        "params": _flop_imbalance(flops, _block_starts(block_params, firsts, n_stages)),
        "best_block": _flop_imbalance(flops, _block_starts(block_flops, firsts, n_stages)),
        "blocks": len(firsts),
    }


def _plan_flop_imbalance(plan: Any) -> float:
    flops = [s.flops for s in plan.stages]  # fwd+bwd; bwd/fwd is per-kind, close to fwd shape
    return balancer.imbalance(flops)


def stage_rows(plan: Any, profile: Any) -> list[dict[str, float]]:
    """Each stage of ``plan`` timed on ``profile``'s link from its cut bytes (seconds, bytes).

    The formula of [Note: communication in the stage cost], so a plan made for a free link
    can be priced on the real one.
    """
    out = []
    for s, stage in enumerate(plan.stages):
        received = plan.stages[s - 1].cut_bytes if s > 0 else 0
        sides = [b for b in (received, stage.cut_bytes if s + 1 < len(plan.stages) else 0) if b > 0]
        comm = sum(cut_seconds(b, profile) for b in sides)
        latency = sum(cut_latency_seconds(b, profile) for b in sides)
        out.append({"compute": stage.compute_time, "comm": comm, "latency": latency,
                    "cost": max(stage.compute_time, comm) + latency, "in_bytes": received,
                    "out_bytes": stage.cut_bytes if s + 1 < len(plan.stages) else 0})
    return out


def status(imbalance: float, bound: float) -> str:
    if imbalance <= MAX_IMBALANCE:
        return "ok"
    return "granularity-limited" if bound > MAX_IMBALANCE else "FAIL"


def run(models: Sequence[str]) -> dict[str, Any]:
    rows = []
    link = get_profile(DEVICE)
    for name in models:
        model = load_model(f"timm:{name}")
        traced = trace(model, (default_input(model, MICROBATCH),))
        for pp in PPS:
            for chunks in CHUNKS:
                schedule = "1f1b" if chunks == 1 else "interleaved_1f1b"
                common = dict(microbatches=2 * pp * chunks, schedule=schedule, activation_dtype=ACTIVATION_DTYPE)
                plan = plan_stages(traced, pp, chunks, model_name=name, device=DEVICE, **common)
                # The same exact balancer with a free link: the best node-level cut on compute alone.
                free = partition(traced, pp, chunks, device=FREE_LINK, **common)
                base = block_baselines(traced, model, pp * chunks)
                stages = stage_rows(plan, link)
                free_on_link = stage_rows(free, link)
                rows.append({
                    "model": name, "pp": pp, "chunks": chunks, "stages": pp * chunks,
                    "nodes": sum(len(s.nodes) for s in plan.stages),
                    "autopipe": plan.imbalance,
                    "bound": free.imbalance,
                    "status": status(plan.imbalance, free.imbalance),
                    "autopipe_flops": _plan_flop_imbalance(plan),
                    "link_bound": sum(s.comm_time > s.compute_time for s in plan.stages),
                    # The link's price on the bottleneck: autopipe's largest stage over the free-link one's.
                    "link_cost": max(s.cost for s in plan.stages) / max(s.cost for s in free.stages),
                    "free_on_link": balancer.imbalance([s["cost"] for s in free_on_link]),
                    "stage_detail": stages,
                    "free_detail": free_on_link,
                    **base,
                    "anchor": ANCHORS.get((name, pp)) if chunks == 1 else None,
                })
    return {"rows": rows}


def plan_time(name: str = "vit_huge_patch14_224", pp: int = 8, repeats: int = 3) -> dict[str, Any]:
    """Wall clock of trace + partition, the model built beforehand, in a warm process.

    The best of ``repeats`` is what the target judges: on a shared machine the others measure
    the neighbours too. All runs are recorded.
    """
    model = load_model(f"timm:{name}")
    x = default_input(model, MICROBATCH)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_stages(trace(model, (x,)), pp, 1, microbatches=2 * pp, device=DEVICE,
                  activation_dtype=ACTIVATION_DTYPE)
        times.append(time.perf_counter() - start)
    return {"model": name, "pp": pp, "seconds": times, "best": min(times), "worst": max(times)}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


_LEGEND = """\
autopipe     max/mean modelled stage time, max(compute, comm) + latency, node-level cuts
bound        the best imbalance any node-level cut reaches on compute alone (free link, exact)
status       ok: autopipe <= {limit}; granularity-limited: bound > {limit} too, so the graph has
             too few nodes for this many stages; FAIL: bound <= {limit} < autopipe
link +       autopipe's largest stage time over the free-link plan's largest (the link's price)
free@link    the free-link plan's cuts priced on the real link: max/mean
link-bound   stages of autopipe's plan whose transfers outlast their compute
its FLOPs    max/mean fwd+bwd FLOPs of autopipe's stages
uniform, params, best block: max/mean forward FLOPs of block-level splits, as the anchors were measured"""


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = ["model", "pp", "v", "nodes", "autopipe", "bound", "status", "link +", "free@link",
            "link-bound", "its FLOPs", "uniform", "params", "best block", "anchor u/p/b"]
    lines = [head]
    for r in rows:
        anchor = "/".join(f"{a:.2f}" for a in r["anchor"]) if r["anchor"] else ""
        lines.append([
            MODELS.get(r["model"], r["model"]), str(r["pp"]), str(r["chunks"]), str(r["nodes"]),
            _fmt(r["autopipe"]), _fmt(r["bound"]), r["status"], f"{r['link_cost'] - 1:+.1%}",
            _fmt(r["free_on_link"]), str(r["link_bound"]), _fmt(r["autopipe_flops"]), _fmt(r["uniform"]),
            _fmt(r["params"]), _fmt(r["best_block"]), anchor,
        ])
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_detail(row: dict[str, Any]) -> str:
    """A case's stages, autopipe's and the free-link plan's on the real link (ms, MB)."""
    lines = [f"{MODELS.get(row['model'], row['model'])} pp={row['pp']} chunks={row['chunks']}: imbalance "
             f"{row['autopipe']:.3f}, bound {row['bound']:.3f} ({row['status']})",
             "  stage  | autopipe: compute  comm  latency  cost  out MB | free-link cuts on the link: "
             "compute  comm  latency  cost  out MB"]
    largest = [max(s["cost"] for s in row[k]) * 1e3 for k in ("stage_detail", "free_detail")]
    lines.insert(1, f"  largest stage: autopipe {largest[0]:.3f} ms (the least any cut reaches on this link), "
                    f"free-link cuts {largest[1]:.3f} ms at imbalance {row['free_on_link']:.3f}")
    for s, (a, f) in enumerate(zip(row["stage_detail"], row["free_detail"])):
        cells = [f"{a['compute'] * 1e3:7.3f} {a['comm'] * 1e3:5.3f} {a['latency'] * 1e3:8.3f} "
                 f"{a['cost'] * 1e3:5.3f} {a['out_bytes'] / 1e6:7.1f}" for a in (a, f)]
        lines.append(f"  {s:5d}  | {cells[0]:>48} | {cells[1]:>60}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated timm names")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]

    result = run(models)
    timing = plan_time()
    rows = result["rows"]
    worst = max(rows, key=lambda r: r["autopipe"])
    failing = [r for r in rows if r["status"] == "FAIL"]
    limited = [r for r in rows if r["status"] == "granularity-limited"]
    failures = [f"{r['model']} pp={r['pp']} chunks={r['chunks']}: imbalance {r['autopipe']:.3f} > "
                f"{MAX_IMBALANCE}, though a node-level cut reaches {r['bound']:.3f} on compute alone"
                for r in failing]
    if timing["best"] > MAX_PLAN_SECONDS:
        failures.append(f"ViT-H/14 pp=8 planning took {timing['best']:.2f} s > {MAX_PLAN_SECONDS} s")

    link = get_profile(DEVICE)
    print(f"{MICROBATCH} images per micro-batch (traced fp32 on meta, activations cross stages in "
          f"{str(ACTIVATION_DTYPE).removeprefix('torch.')}), device profile {DEVICE} (link "
          f"{link.link_bandwidth / 1e9:.0f} GB/s, {link.link_latency * 1e6:.0f} us), microbatches = 2 x stages")
    print(_LEGEND.format(limit=MAX_IMBALANCE), end="\n\n")
    print(format_rows(rows))
    print(f"\nworst autopipe imbalance: {worst['autopipe']:.3f} ({worst['model']} pp={worst['pp']} "
          f"chunks={worst['chunks']})")
    print(f"ViT-H/14 pp=8 planning (trace + partition): best {timing['best']:.2f} s, "
          f"runs {', '.join(f'{t:.2f}' for t in timing['seconds'])} s")
    if limited:
        print("granularity-limited (the graph has too few nodes for this many stages; not failures):")
        for r in limited:
            print(f"  - {r['model']} pp={r['pp']} chunks={r['chunks']}: imbalance {r['autopipe']:.3f}, "
                  f"bound {r['bound']:.3f}")
    for r in failing:
        print("\n" + format_detail(r))
    print("\nPASS" if not failures else "\nFAIL:\n" + "\n".join(f"  - {f}" for f in failures))

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({
            "schema": 2, "microbatch": MICROBATCH, "device": DEVICE,
            "activation_dtype": str(ACTIVATION_DTYPE).removeprefix("torch."),
            "link": {"bandwidth": link.link_bandwidth, "latency": link.link_latency},
            "targets": {"max_imbalance": MAX_IMBALANCE, "max_plan_seconds": MAX_PLAN_SECONDS},
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "rows": result["rows"], "plan_time": timing, "failures": failures,
        }, f, indent=2)
    print(f"results written to {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
