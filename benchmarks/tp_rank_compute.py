"""The compute of one tensor-parallel rank, measured on ONE GPU with its collectives as identity.

autopipe tp=2 on two GPUs runs each rank's shard of the model plus the all-reduces between
shards. This times the shard alone (``apply_sharding(..., group=None)`` makes every collective
the identity) next to the whole model on the same batch, so the compute side of a tp step can
be told apart from its communication: a perfect split takes half the whole model's time.
With ``sequence_parallel`` the stand-in collectives keep rank 0's shapes (its slice of the
samples between sharded pairs, every sample inside them).

    python benchmarks/tp_rank_compute.py --tp 2 --batch 128 --out tp_rank.json
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import os
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.runtime.weight_casts import WeightCasts  # noqa: E402
from autopipe.shard import apply_sharding, plan_sharding  # noqa: E402
from autopipe.tracer import trace  # noqa: E402


def timed(step: Callable[[], None], warmup: int, steps: int, cuda: bool) -> float:
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, casts: WeightCasts | None,
                  graphed: bool) -> Callable[[], None]:
    dev = x.device.type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda", foreach=None if dev == "cuda" else True)

    def run(inp: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev, dtype=torch.bfloat16, cache_enabled=False):
            out = model(inp)
        return out[0] if isinstance(out, tuple) else out  # a traced graph returns its outputs flat

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return run(inp)

    fwd: Callable[[torch.Tensor], torch.Tensor] = run
    if graphed:
        fwd = torch.cuda.make_graphed_callables(Wrapped(), (x.clone(),))

    def step() -> None:
        if casts is not None:
            casts.refresh()
        loss = F.cross_entropy(fwd(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def main() -> None:
    import timm

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_large_patch16_224")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd model and shards")
    ap.add_argument("--only", default="", help="comma-separated substrings of configuration names to run")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        base = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=64,
                                 num_heads=4, num_classes=10)
        a.batch, a.steps, a.warmup, img, classes = 8, 2, 1, 32, 10
    else:
        base = timm.create_model(a.model)
        img, classes = 224, 1000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch, 3, img, img, generator=g).to(device)
    y = torch.randint(0, classes, (a.batch,), generator=g).to(device)

    rows: list[dict[str, Any]] = []

    def record(name: str, make: Callable[[], Callable[[], None]]) -> None:
        if a.only and not any(w in name for w in a.only.split(",")):
            return
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row: dict[str, Any] = {"config": name}
        try:
            s = timed(make(), a.warmup, a.steps, cuda)
            row |= {"step_ms": round(s * 1e3, 1), "samples_s": round(a.batch / s, 1)}
            if cuda:
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        except Exception as exc:  # noqa: BLE001 - keep the other rows
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    def whole(graphed: bool, compiled: bool = False) -> Callable[[], None]:
        model = copy.deepcopy(base).to(device).train()
        if compiled:
            model.compile(dynamic=False)
        return training_step(model, x, y, None, graphed)

    def shard(graphed: bool, sequence_parallel: bool = False, compiled: bool = False) -> Callable[[], None]:
        traced = trace(copy.deepcopy(base).train(), (x.cpu(),))
        plan = plan_sharding(traced, a.tp, sequence_parallel=sequence_parallel)
        sharded = apply_sharding(traced, plan, 0, group=None)
        gm = sharded.gm.to(device).train()
        casts = WeightCasts.install([gm], torch.bfloat16)
        if compiled:  # as parallelize(compile_stages=True) does: see [Note: compiled stages]
            gm.forward = torch.compile(gm.forward, dynamic=False)
        return training_step(gm, x, y, casts, graphed)

    record("whole model, eager", lambda: whole(False))
    record(f"tp={a.tp} rank 0 shard, eager", lambda: shard(False))
    record(f"tp={a.tp} rank 0 shard, seq. parallel", lambda: shard(False, sequence_parallel=True))
    if cuda:
        record("whole model, CUDA graph", lambda: whole(True))
        record(f"tp={a.tp} rank 0 shard, CUDA graph", lambda: shard(True))
    if a.compile:
        record("whole model, compiled", lambda: whole(False, compiled=True))
        record(f"tp={a.tp} rank 0 shard, compiled", lambda: shard(False, compiled=True))
        record(f"tp={a.tp} rank 0 shard, seq. parallel, compiled", lambda: shard(False, True, compiled=True))

    ref = next((r["step_ms"] for r in rows if r["config"] == "whole model, eager" and "step_ms" in r), None)
    print(f"\n{'configuration':36} {'step ms':>8} {'x whole/' + str(a.tp):>10} {'peak GiB':>9}")
    for r in rows:
        if "step_ms" not in r:
            print(f"{r['config']:36} {r.get('error', '')[:80]}")
            continue
        rel = r["step_ms"] / (ref / a.tp) if ref else float("nan")
        print(f"{r['config']:36} {r['step_ms']:>8.1f} {rel:>10.2f} {r.get('peak_gib', 0):>9.2f}")
    if a.out:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "model": a.model,
                "tp": a.tp, "batch": a.batch, "device": torch.cuda.get_device_name() if cuda else "cpu"}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
