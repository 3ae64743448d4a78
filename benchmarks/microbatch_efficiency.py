"""Where a pipeline rank's time goes, measured on ONE GPU: micro-batching, casts, autopipe's runtime.

A pipeline rank computes its share of the model one micro-batch at a time. Before blaming the
schedule (bubble) or the links, this measures on one GPU, whole model, the same global batch:

* ``eager m=1``: one step on the whole batch (what the one-GPU baseline measures);
* ``eager m=M``: M micro-batches with gradient accumulation, autocast entered per micro-batch
  (as each pipeline stage does): the price of the micro-batch size alone;
* ``eager m=M, one autocast``: the same inside one autocast region, so each weight is cast to
  bf16 once per step instead of once per micro-batch;
* ``autopipe pp=1 m=M``: autopipe's runtime on one GPU (tracing, emitted stage, schedule,
  gradient accumulation), eager and with CUDA graphs.

Then one profiled step of a few of them: the GPU's summed kernel time over the wall time
(how much of the step the GPU is computing at all) and the kernels that take longest.

    python benchmarks/microbatch_efficiency.py --out results.json         # one GPU
    python benchmarks/microbatch_efficiency.py --smoke                     # CPU, tiny model
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopipe  # noqa: E402


def build(name: str, smoke: bool) -> nn.Module:
    import timm

    if smoke:
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=64,
                                 num_heads=4, num_classes=10)
    return timm.create_model(name)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.img, self.classes = (32, 10) if args.smoke else (224, 1000)
        torch.manual_seed(0)
        self.base = build(args.model, args.smoke)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(args.batch, 3, self.img, self.img, generator=g).to(self.device)
        self.y = torch.randint(0, self.classes, (args.batch,), generator=g).to(self.device)
        self.rows: list[dict[str, Any]] = []

    # --- helpers
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(list(params), lr=1e-4, fused=self.cuda, foreach=None if self.cuda else True)

    def timed(self, step: Callable[[], None]) -> float:
        for _ in range(self.args.warmup):
            step()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(self.args.steps):
            step()
        self.sync()
        return (time.perf_counter() - t0) / self.args.steps

    def record(self, name: str, make: Callable[[], Callable[[], None]], profile: bool = False) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row: dict[str, Any] = {"config": name}
        try:
            step = make()
            seconds = self.timed(step)
            row |= {"samples_s": round(self.args.batch / seconds, 1), "step_ms": round(seconds * 1e3, 1)}
            if self.cuda:
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if profile:
                row |= self.profiled(step)
        except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        self.rows.append(row)
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        self.save()

    def profiled(self, step: Callable[[], None]) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.sync()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            step()
            self.sync()
            wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6  # us -> s
        by_name: dict[str, float] = {}
        for e in kernels:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
        cpu = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
        return {"profiled_wall_ms": round(wall * 1e3, 1), "kernel_ms": round(busy * 1e3, 1),
                "kernels": len(kernels), "gpu_busy": round(busy / wall, 3) if wall else None,
                "top_kernels_ms": [(n[:90], round(t, 2)) for n, t in top],
                "top_cpu_ms": [(a.key[:90], a.count, round(a.self_cpu_time_total / 1e3, 2)) for a in cpu]}

    def save(self) -> None:
        if self.args.out:
            meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if self.cuda else "cpu", "model": self.args.model,
                    "batch": self.args.batch, "command": " ".join(sys.argv)}
            with open(self.args.out, "w") as f:
                json.dump({"meta": meta, "results": self.rows}, f, indent=1)

    # --- configurations
    def eager(self, m: int, *, one_autocast: bool = False, compiled: bool = False) -> Callable[[], None]:
        model = copy.deepcopy(self.base).to(self.device).train()
        opt = self.optimizer(model.parameters())
        if compiled:
            model.compile(dynamic=False)
        xs, ys = self.x.chunk(m), self.y.chunk(m)
        dev = self.device.type

        def micro(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = loss_fn(model(x), y) / m
            loss.backward()

        def step() -> None:
            region = torch.autocast(dev, dtype=torch.bfloat16) if one_autocast else contextlib.nullcontext()
            with region:
                for x, y in zip(xs, ys):
                    micro(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def autopipe(self, m: int, *, graphs: bool, compiled: bool = False) -> Callable[[], None]:
        model = copy.deepcopy(self.base)
        pm = autopipe.parallelize(model, (self.x[: self.args.batch // m].cpu(),), pp=1, microbatches=m,
                                  loss_fn=loss_fn, mixed_precision="bf16", device=self.device,
                                  profile="h200" if self.cuda else None, cuda_graphs=graphs and self.cuda,
                                  compile_stages=compiled)
        pm.train()
        opt = self.optimizer(pm.parameters())

        def step() -> None:
            pm.train_step(self.x, self.y)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step


def check_bf16(bench: Bench, m: int, compiled: bool = False) -> dict[str, Any]:
    """autopipe pp=1 (bf16, CUDA graphs where available) against eager autocast with the same
    micro-batches, 3 SGD steps: losses and parameters agree to bf16 precision."""
    from autopipe.runtime import weight_casts

    ref = copy.deepcopy(bench.base).to(bench.device).train()
    model = copy.deepcopy(bench.base)
    n = min(bench.args.batch, 8 * m)
    x, y = bench.x[:n], bench.y[:n]
    pm = autopipe.parallelize(model, (x[: n // m].cpu(),), pp=1, microbatches=m, loss_fn=loss_fn,
                              mixed_precision="bf16", device=bench.device, cuda_graphs=bench.cuda,
                              compile_stages=compiled)
    pm.train()
    opt, opt_ref = torch.optim.SGD(pm.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    worst_loss = 0.0
    for _ in range(3):
        loss = float(pm.train_step(x, y))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            with torch.autocast(bench.device.type, dtype=torch.bfloat16):
                part = loss_fn(ref(xs), ys) / m
            part.backward()
            ref_loss += float(part.detach())
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        worst_loss = max(worst_loss, abs(loss - ref_loss) / abs(ref_loss))
    pairs = [(p.detach().float(), q.detach().float()) for p, q in zip(pm.parameters(), ref.parameters())]
    worst_param = (sum(float((p - q).square().sum()) for p, q in pairs)
                   / sum(float(q.square().sum()) for _, q in pairs)) ** 0.5
    return {"loss_rel_err": worst_loss, "param_rel_err": worst_param,
            "fp32_gemm": bool(weight_casts._mm_out_dtype), "ok": worst_loss < 1e-2 and worst_param < 1e-2}


def table(rows: list[dict[str, Any]]) -> str:
    ref = next((r["samples_s"] for r in rows if r["config"] == "eager m=1" and "samples_s" in r), None)
    lines = [f"{'configuration':<34} {'samples/s':>10} {'vs m=1':>7} {'step ms':>8} {'peak GiB':>9} {'GPU busy':>9}"]
    for r in rows:
        if "loss_rel_err" in r:
            lines.append(f"{r['config']:<34} loss rel err {r['loss_rel_err']:.1e}, params {r['param_rel_err']:.1e}, "
                         f"fp32-output GEMM {r['fp32_gemm']}: {'ok' if r['ok'] else 'FAIL'}")
            continue
        if "error" in r:
            lines.append(f"{r['config']:<34} {r['error'][:60]}")
            continue
        rel = f"{r['samples_s'] / ref:.3f}" if ref else "-"
        busy = f"{r['gpu_busy']:.3f}" if r.get("gpu_busy") is not None else "-"
        lines.append(f"{r['config']:<34} {r['samples_s']:>10.1f} {rel:>7} {r['step_ms']:>8.1f} "
                     f"{r.get('peak_gib', 0):>9.2f} {busy:>9}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_large_patch16_224")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", default="4,8", help="comma-separated micro-batch counts")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, batch 16")
    ap.add_argument("--compile", action="store_true",
                    help="also time torch.compile: the whole model (m=1) and autopipe's compiled stages")
    ap.add_argument("--only", default="", help="comma-separated substrings of configuration names to run")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps, args.warmup = 16, 2, 1
    if torch.cuda.is_available() and not args.smoke:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    bench = Bench(args)
    ms = [int(v) for v in args.microbatches.split(",")]
    wanted = [w for w in args.only.split(",") if w]

    def run(name: str, make: Callable[[], Callable[[], None]], profile: bool = False) -> None:
        if not wanted or any(w in name for w in wanted):
            bench.record(name, make, profile)

    for compiled in (False, True) if args.compile else (False,):
        name = f"check bf16 autopipe pp=1 m={ms[-1]}{' compiled' if compiled else ''} vs autocast"
        if not wanted or any(w in name for w in wanted):
            row = {"config": name} | check_bf16(bench, ms[-1], compiled)
            print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            bench.rows.append(row)
    run("eager m=1", lambda: bench.eager(1), profile=True)
    if args.compile:
        run("eager m=1 compiled", lambda: bench.eager(1, compiled=True), profile=True)
    for m in ms:
        run(f"eager m={m}", lambda m=m: bench.eager(m), profile=m == ms[-1])
        run(f"eager m={m}, one autocast", lambda m=m: bench.eager(m, one_autocast=True))
        run(f"autopipe pp=1 m={m}", lambda m=m: bench.autopipe(m, graphs=False), profile=m == ms[-1])
        if args.compile:
            run(f"autopipe pp=1 m={m} compiled", lambda m=m: bench.autopipe(m, graphs=False, compiled=True))
        if bench.cuda:
            run(f"autopipe pp=1 m={m} graphs", lambda m=m: bench.autopipe(m, graphs=True), profile=m == ms[-1])
            if args.compile:
                run(f"autopipe pp=1 m={m} graphs compiled",
                    lambda m=m: bench.autopipe(m, graphs=True, compiled=True), profile=m == ms[-1])
    for r in bench.rows:
        if "top_kernels_ms" in r:
            print(f"\n{r['config']}: wall {r['profiled_wall_ms']} ms, kernels {r['kernel_ms']} ms "
                  f"({r['kernels']} launches, GPU busy {r['gpu_busy']})")
            for name, t in r["top_kernels_ms"]:
                print(f"    {t:>8.2f} ms  {name}")
            print("  host (self CPU time):")
            for name, count, t in r["top_cpu_ms"]:
                print(f"    {t:>8.2f} ms  {count:>6}x  {name}")
    print()
    print(table(bench.rows))


if __name__ == "__main__":
    main()
