"""Where a pipeline's NCCL kernels sit beside its stages' kernels: one step traced on every rank.

    torchrun --nproc-per-node 2 benchmarks/pipeline_trace_gpu.py --out DIR
    python benchmarks/pipeline_trace_gpu.py --summarise DIR      # anywhere, no GPU needed
    torchrun --nproc-per-node 2 benchmarks/pipeline_trace_gpu.py --smoke --out DIR   # CPU, gloo

The pipeline of pipeline_links_gpu.py (ViT-L/16, batch 256, pp=2, interleaved 1F1B with 4 chunks
and 4 micro-batches, bf16, CUDA graphs unless ``--eager``) trains ``--warmup`` steps, then one
step runs under ``torch.profiler``; each rank writes its trace (Chrome JSON, gzipped) to DIR.

``--dp N`` runs data parallelism over N of the ranks (pp = ranks / N; ``--chunks 1``: 1F1B), the
gradients all-reduced in ``pm.step`` as benchmarks/layout_choice_gpu.py does, so that a step's end
(the all-reduce, the gradient norm, the optimizer; deferred BatchNorm commits earlier, at the end
of ``train_step``) is one range, ``step_end``, whose host ops and GPU kernels the summary lists by
time.

The summary reads the traces' GPU kernels. Per rank: how long NCCL kernels were resident in the
step, on how many streams (each directed link has its own), and how much longer the stages'
kernels ran while an NCCL kernel was resident than while none was: every kernel name seen both
ways is priced at its median duration alone, and the kernels that ran beside NCCL are summed
against those prices. A stage slowed beside its links (the stage scale of the layout search) shows
as that ratio; whether it comes from kernels waiting for their peer or moving data shows in how
long the NCCL kernels stay resident against the bytes they move.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def trace(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    import autopipe
    from gpu_throughput import Env, adamw, batch, build_vit, loss_fn

    env = Env(args.smoke)
    B, m, chunks = (16, 4, 2) if args.smoke else (args.batch, args.microbatches, args.chunks)
    img = 32 if args.smoke else 224
    pp = env.world // args.dp
    torch.manual_seed(0)
    model = build_vit(args.model, args.smoke)
    pm = autopipe.parallelize(model, (torch.randn(B // args.dp // m, 3, img, img),), pp=pp,
                              microbatches=m, schedule="interleaved_1f1b" if chunks > 1 else "1f1b",
                              chunks=chunks, loss_fn=loss_fn, mixed_precision=None if args.smoke else "bf16",
                              device=env.device, cuda_graphs=env.cuda and not args.eager)
    pm.train()
    opt = adamw(pm.parameters(), env)
    x, y = batch(env, B // args.dp, img, 10 if args.smoke else 1000, seed=env.rank // pp)

    def step() -> None:
        with pm.no_sync():  # the dp all-reduce in step(), with the rest of the step's end
            pm.train_step(x, y)
        with record_function(STEP_END):
            pm.step(opt)
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    env.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    with profile(activities=activities) as prof:
        step()
        env.sync()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{env.rank}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)
    dist.barrier()  # every rank's trace written
    pm.close()
    dist.destroy_process_group()
    if env.rank == 0:
        print(summarise(args.out))


STEP_END = "step_end"
LONG_US = 300.0  # a point-to-point kernel resident longer than this waited for its peer (moving 26 MB takes <100 us)


def events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernels(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in evs if e.get("cat") == "kernel" and e.get("dur", 0) > 0]


def step_end(evs: list[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """What the ``step_end`` range holds: its host time, the host ops directly under it and the
    GPU kernels that ran from its start to the trace's end, each by name and total ms."""
    ranges = [e for e in evs if e.get("name") == STEP_END and e.get("cat") == "user_annotation"]
    if not ranges:
        return {}
    a = ranges[0]["ts"]
    b = a + ranges[0]["dur"]
    ops = sorted((e for e in evs if e.get("cat") == "cpu_op" and a <= e["ts"] and e["ts"] + e["dur"] <= b),
                 key=lambda e: (e["ts"], -e["dur"]))
    outer, reach = [], -1.0  # the ops no other op holds
    for e in ops:
        if e["ts"] >= reach:
            outer.append(e)
            reach = e["ts"] + e["dur"]
    ks = [k for k in kernels(evs) if k["ts"] >= a]

    def by_name(items: list[dict[str, Any]]) -> list[list[Any]]:
        total: dict[str, list[float]] = {}
        for e in items:
            t = total.setdefault(e["name"], [0, 0.0])
            t[0] += 1
            t[1] += e["dur"] / 1e3
        return [[n, c, round(ms, 3)] for n, (c, ms) in sorted(total.items(), key=lambda kv: -kv[1][1])[:top]]

    gpu_end = max((k["ts"] + k["dur"] for k in ks), default=b)
    return {"host_ms": (b - a) / 1e3, "to_gpu_end_ms": (max(b, gpu_end) - a) / 1e3, "host_ops": by_name(outer),
            "kernels": len(ks), "kernel_ms": sum(k["dur"] for k in ks) / 1e3, "top_kernels": by_name(ks)}


def overlap(ks: list[dict[str, Any]]) -> dict[str, Any]:
    """NCCL residency and the stages' kernels beside it, for one rank's kernels."""
    nccl = sorted((k["ts"], k["ts"] + k["dur"]) for k in ks if "nccl" in k["name"].lower())
    streams = {k.get("args", {}).get("stream") for k in ks if "nccl" in k["name"].lower()}
    merged: list[list[float]] = []
    for a, b in nccl:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def beside(a: float, b: float) -> bool:  # half the kernel or more under NCCL residency
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)
        return covered >= 0.5 * (b - a)

    alone: dict[str, list[float]] = {}
    with_nccl: list[tuple[str, float]] = []
    compute = [k for k in ks if "nccl" not in k["name"].lower()]
    for k in compute:
        if beside(k["ts"], k["ts"] + k["dur"]):
            with_nccl.append((k["name"], k["dur"]))
        else:
            alone.setdefault(k["name"], []).append(k["dur"])
    priced = [(d, statistics.median(alone[n])) for n, d in with_nccl if n in alone]
    links: dict[str, dict[str, float]] = {}
    for k in ks:  # each directed link's kernels run on a stream of their own
        if "nccl" in k["name"].lower() and "SendRecv" in k["name"]:
            link = links.setdefault(str(k.get("args", {}).get("stream")), {"kernels": 0, "ms": 0.0, "waits": 0,
                                                                           "waits_ms": 0.0})
            link["kernels"] += 1
            link["ms"] += k["dur"] / 1e3
            if k["dur"] > LONG_US:
                link["waits"] += 1
                link["waits_ms"] += k["dur"] / 1e3
    span = (max(k["ts"] + k["dur"] for k in ks) - min(k["ts"] for k in ks)) if ks else 0.0
    return {"step_ms": span / 1e3, "nccl_kernels": len(nccl), "nccl_streams": len(streams),
            "nccl_resident_ms": sum(b - a for a, b in merged) / 1e3,
            "compute_ms": sum(k["dur"] for k in compute) / 1e3,
            "compute_beside_nccl_ms": sum(d for _, d in with_nccl) / 1e3,
            "beside_over_alone": sum(d for d, _ in priced) / max(sum(p for _, p in priced), 1e-9),
            "priced_share": len(priced) / max(len(with_nccl), 1), "links": links}


def summarise(folder: str) -> str:
    lines = [f"{'rank':>4} {'step ms':>8} {'NCCL kernels':>12} {'streams':>7} {'resident ms':>11} "
             f"{'compute ms':>10} {'beside NCCL':>11} {'slower by':>9}"]
    rows = {}
    for path in sorted(glob.glob(os.path.join(folder, "rank*.json.gz"))):
        rank = int(os.path.basename(path)[4:].split(".")[0])
        evs = events(path)
        r = rows[rank] = overlap(kernels(evs))
        r["step_end"] = step_end(evs)
        lines.append(f"{rank:>4} {r['step_ms']:8.1f} {r['nccl_kernels']:12d} {r['nccl_streams']:7d} "
                     f"{r['nccl_resident_ms']:11.1f} {r['compute_ms']:10.1f} {r['compute_beside_nccl_ms']:11.1f} "
                     + (f"{r['beside_over_alone'] - 1:+9.1%}" if r["priced_share"] else f"{'-':>9}"))
        for stream, link in sorted(r["links"].items()):
            lines.append(f"     stream {stream}: {link['kernels']} send/receive kernels, {link['ms']:.1f} ms; "
                         f"{link['waits']} resident over {LONG_US:.0f} us, {link['waits_ms']:.1f} ms")
        end = r["step_end"]
        if end:
            lines.append(f"     step end: {end['host_ms']:.2f} ms on the host, {end['to_gpu_end_ms']:.2f} ms to the "
                         f"last kernel; {end['kernels']} kernels, {end['kernel_ms']:.2f} ms")
            for kind in ("host_ops", "top_kernels"):
                lines += [f"       {kind[:4]} {name[:70]:70} x{count:<5} {ms:8.3f} ms" for name, count, ms in end[kind]]
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="pipeline-trace")
    p.add_argument("--summarise", metavar="DIR", help="only summarise the traces in DIR")
    p.add_argument("--model", default="vit_large_patch16_224")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (pp = ranks / dp)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="eager stages (default: CUDA graphs)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU over gloo (a check of the script)")
    args = p.parse_args()
    if args.summarise:
        print(summarise(args.summarise))
    else:
        trace(args)


if __name__ == "__main__":
    main()
