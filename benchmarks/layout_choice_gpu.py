"""Is the layout search right on GPUs? Its top layouts, and the pure ones, predicted and measured.

    torchrun --standalone --nproc-per-node 2 benchmarks/layout_choice_gpu.py \\
        --models vit_large_patch16_224:256,vit_huge_patch14_224:128 --out results.json
    torchrun --standalone --nproc-per-node 1 benchmarks/layout_choice_gpu.py \\
        --models vit_large_patch16_224:256,resnet50:256 --out results1.json
    torchrun --standalone --nproc-per-node 2 benchmarks/layout_choice_gpu.py --smoke   # CPU, gloo, tiny

For each timm model and global batch (``name:batch``), on the GPUs of this torchrun world:
1. the links are measured (``measure_links``, with 2 GPUs or more);
2. rank 0 searches (``plan_layout``: the calibrated analytic model of ``--profile`` (the GPU's own by
   default), the measured
   links, 90% of the GPU's memory as the budget, the execution modes of ``--modes``) and every
   rank gets its ranking, as ``parallelize(pp="auto")`` does;
3. measured: the search's top ``--top`` layouts, and on several GPUs the best pp-only, tp-only and
   dp-only layouts, and on one GPU the best of each execution mode, micro-batch count and
   checkpointing choice that the top did not cover (``--extra`` of them), each built with
   ``parallelize(**layout.parallelize_kwargs(), mixed_precision="bf16")`` on fresh random weights,
   trained with AdamW (torch's default, multi-tensor on CUDA) through ``pm.step``; a step is timed
   between two synchronisations, the slowest rank's time, median of ``--steps`` after
   ``--warmup`` (CUDA graphs are captured and stages compiled in the warm-up). CUDA events split
   each step into the pipeline (``train_step``) and the rest (the dp all-reduce, the norm and the
   optimizer's step, in ``pm.step``), each predicted apart. Each row keeps every rank's allocated
   memory after the build and between steps (parameters, gradients, optimizer state, pools),
   and what its allocator holds after the last step (``memory_gib``: ``reserved``; a CUDA graph's
   replays write into its private pool unseen by the allocated counts), beside the fullest
   rank's peak allocated since the build.
Targets (issues: automatic layout; several-GPU checks): every measured layout's predicted step
time within 15% of its measured one, and the chosen layout (the search's first) within 5% of the
best measured. Results are written after every layout; the table is printed last; exits 1 on a
miss.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import autopipe  # noqa: E402
from _ranks import finish, init_ranks, log, peak_gib, record_row  # noqa: E402
from autopipe.planning import default_profile  # noqa: E402
from autopipe.search import measure_links, plan_layout  # noqa: E402
from autopipe.search.layouts import Layout  # noqa: E402

MAX_ERROR, MAX_REGRET = 0.15, 0.05


def build(name: str, smoke: bool) -> nn.Module:
    import timm

    if smoke:
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=4, embed_dim=128,
                                 num_heads=4, num_classes=10)
    return timm.create_model(name)


def select(ranked: list, devices: int, top: int, extra: int) -> list:
    """The predictions to measure: the top ones, then the pure layouts (several devices) or the
    best of each choice the top left out (one device)."""
    chosen = list(ranked[:top])

    def add(p: Any) -> None:
        if p is not None and all(p is not c for c in chosen):
            chosen.append(p)

    if devices > 1:
        for degree in ("pp", "tp", "dp"):
            add(next((p for p in ranked if getattr(p.layout, degree) == devices), None))
    else:
        keys = (lambda l: l.mode, lambda l: l.recompute, lambda l: l.microbatches)
        added = 0
        for key in keys:
            seen = {key(p.layout) for p in chosen}
            for p in ranked:
                if added < extra and key(p.layout) not in seen:
                    seen.add(key(p.layout))
                    add(p)
                    added += 1
    return chosen


def _mark(cuda: bool) -> Any:
    """A point on the timeline: a CUDA event on the stream, or the host clock (a CPU's ops are
    done when they return)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def rank_gib(device: torch.device, reserved: bool = False) -> list[float]:
    """Every rank's allocated memory now (``reserved``: what its caching allocator holds, CUDA
    graphs' private pools included), GiB."""
    if device.type != "cuda":
        return [0.0] * dist.get_world_size()
    now = torch.cuda.memory_reserved(device) if reserved else torch.cuda.memory_allocated(device)
    every = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor([now / 2**30], dtype=torch.float64, device=device))
    return [round(float(t), 3) for t in every]


def time_layout(model: nn.Module, layout: Layout, layout_prediction: float, batch: int, args: argparse.Namespace,
                device: torch.device) -> dict[str, Any]:
    """The measured step of ``layout``, and its prediction's error."""
    size = layout.microbatch_size(batch)
    img, classes = (32, 10) if args.smoke else (224, 1000)
    begin = time.perf_counter()
    pm = autopipe.parallelize(model, (torch.randn(size, 3, img, img),), loss_fn=F.cross_entropy, device=device,
                              mixed_precision=None if args.smoke else "bf16", profile=None if args.smoke else
                              args.profile or None, **layout.parallelize_kwargs())
    build_s = time.perf_counter() - begin
    memory = {"built": rank_gib(device)}
    pm.train()
    per = batch // layout.dp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(per, 3, img, img, generator=g).to(device)
    y = torch.randint(0, classes, (per,), generator=g).to(device)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times, phases = [], []
    cuda = device.type == "cuda"
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        marks = [_mark(cuda)]
        # The dp all-reduce runs in step() (it would at the end of train_step otherwise), so the
        # GPU timeline splits into the pipeline and the rest the prediction prices apart.
        with pm.no_sync():
            pm.train_step(x, y)
        marks.append(_mark(cuda))
        pm.step(opt)
        marks.append(_mark(cuda))
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        split = [_seconds(a, b) for a, b in zip(marks, marks[1:])]
        seconds = torch.tensor([time.perf_counter() - t0] + split, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(float(seconds[0]))
            phases.append([float(v) for v in seconds[1:]])
        if i == 0:
            first = float(seconds[0])
        if i == args.warmup - 1:  # the state a step starts from
            memory["between_steps"] = rank_gib(device)
    memory["reserved"] = rank_gib(device, reserved=True)
    del opt
    pm.close()
    median = statistics.median(times)
    return {"measured": median, "spread": (max(times) - min(times)) / median, "times": times,
            "pipeline_measured": statistics.median(p[0] for p in phases),
            "rest_measured": statistics.median(p[1] for p in phases),
            "build_s": build_s, "first_step_s": first, "peak_gib": peak_gib(device), "memory_gib": memory,
            "error": layout_prediction / median - 1}


def run_model(name: str, batch: int, args: argparse.Namespace, device: torch.device, links: Any,
              rows: list[dict], save: Any) -> None:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = build(name, args.smoke)
    memory = torch.cuda.get_device_properties(device).total_memory * 0.9 if device.type == "cuda" else None
    modes = tuple(args.modes.split(",")) if not args.smoke else ("eager",)
    img = 32 if args.smoke else 224
    result = [None]
    if dist.get_rank() == 0:
        profile = "cpu" if args.smoke else default_profile(args.profile or None, device)
        result[0] = plan_layout(model, devices=world, batch=batch, device=profile,
                                memory=memory, links=links, example_inputs=(torch.randn(1, 3, img, img),),
                                mixed_precision=None if args.smoke else "bf16", modes=modes, exact=10**6,
                                timeline=False)
    dist.broadcast_object_list(result, src=0)
    search = result[0]
    picks = select(search.ranked, world, args.top, args.extra)
    log(f"{name} batch {batch} on {world}: {len(search.ranked)} layouts ranked in {search.seconds:.1f} s "
        f"({search.costs}; links {search.links}); measuring {len(picks)}")
    for p in picks:
        position = next(i for i, q in enumerate(search.ranked) if q is p)
        row: dict[str, Any] = {"model": name, "batch": batch, "layout": str(p.layout), "rank": position,
                               "predicted": p.step_seconds, "predicted_gib": p.memory_bytes / 2**30,
                               "bubble": p.bubble, "parts": p.parts}
        record_row(rows, row, lambda p=p: time_layout(copy.deepcopy(model), p.layout, p.step_seconds, batch, args,
                                                      device), device, save)
        if "measured" in row:
            rest = sum(v for k, v in row["parts"].items() if k != "pipeline")
            log(f"  #{row['rank']:<3d} {row['layout']:48s} predicted {row['predicted'] * 1e3:8.1f} ms  measured "
                f"{row['measured'] * 1e3:8.1f} ms  {row['error']:+6.1%}  {row['peak_gib']:5.1f} GiB "
                f"(predicted {row['predicted_gib']:5.1f}); pipeline {row['parts']['pipeline'] * 1e3:.1f} / "
                f"{row['pipeline_measured'] * 1e3:.1f} ms, rest {rest * 1e3:.1f} / {row['rest_measured'] * 1e3:.1f} ms")
        else:
            log(f"  #{row['rank']:<3d} {row['layout']:48s} failed: {row['failure'][:120]}")
    rows.append({"model": name, "batch": batch, "chosen": str(search.best.layout), "search_seconds": search.seconds,
                 "costs": search.costs, "links": search.links, "ranked": len(search.ranked)})
    save()


def summarise(rows: list[dict]) -> list[str]:
    failures = []
    for name, batch in sorted({(r["model"], r["batch"]) for r in rows}):
        runs = [r for r in rows if r["model"] == name and r["batch"] == batch and "measured" in r]
        chosen = next((r["chosen"] for r in rows if r["model"] == name and r["batch"] == batch and "chosen" in r), None)
        if not runs or chosen is None:
            failures.append(f"{name}: nothing measured")
            continue
        best = min(runs, key=lambda r: r["measured"])
        pick = next((r for r in runs if r["layout"] == chosen), None)
        within = sum(abs(r["error"]) <= MAX_ERROR for r in runs)
        print(f"{name} batch {batch}: {len(runs)} layouts measured, {within} predicted within {MAX_ERROR:.0%} "
              f"(median error {statistics.median(r['error'] for r in runs):+.1%}); best measured {best['layout']} "
              f"{best['measured'] * 1e3:.1f} ms")
        if pick is None:
            failures.append(f"{name}: the chosen layout {chosen} failed")
        else:
            regret = pick["measured"] / best["measured"] - 1
            print(f"  chosen {chosen}: {pick['measured'] * 1e3:.1f} ms ({regret:+.1%} against the best measured)")
            if regret > MAX_REGRET:
                failures.append(f"{name}: the chosen layout is {regret:.1%} slower than the best measured")
        failures += [f"{name} {r['layout']}: predicted {r['error']:+.1%} off" for r in runs if abs(r["error"]) > MAX_ERROR]
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit_large_patch16_224:256,vit_huge_patch14_224:128",
                        help="comma-separated timm_name:global_batch")
    parser.add_argument("--modes", default="eager,graphs,compiled,compiled+graphs")
    parser.add_argument("--profile", default="", help="the device profile the search prices with (default: "
                        "the GPU's own, as parallelize picks it)")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--extra", type=int, default=3, help="one GPU: further layouts of choices the top left out")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--smoke", action="store_true", help="tiny ViT on CPU over gloo (a check of the script)")
    args = parser.parse_args(argv)
    device = init_ranks(args.smoke)
    cuda = device.type == "cuda"
    links = measure_links(device) if dist.get_world_size() > 1 else None
    rows: list[dict] = []
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": dist.get_world_size(),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "command": " ".join(sys.argv),
            "links": links.__dict__ if links is not None else None}

    def save() -> None:
        if dist.get_rank() == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)

    for spec in args.models.split(","):
        name, _, batch = spec.partition(":")
        run_model(name, int(batch or 64), args, device, links, rows, save)
    return finish(summarise(rows) if dist.get_rank() == 0 else [], device)


if __name__ == "__main__":
    raise SystemExit(main())
