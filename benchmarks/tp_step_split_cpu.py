"""Where a tensor-parallel step's time goes on 2 CPU processes: inside its collectives, and outside.

    python benchmarks/tp_step_split_cpu.py --models vit,fan --microbatches 1,4,16 --out split.json

Two gloo processes of one thread each, the models of ``layout_choice_cpu.py`` (its small ViT
and ResNet-18, and ``Fan``, the model its in-step collective figures are fitted on), at its
batch of 16. For each model and micro-batch count, ``pp=1 tp=2`` is built with ``parallelize``
and trained for ``--steps`` steps after 2 warm-up ones; every tensor-parallel all-reduce is timed
where it is called (the clone of its input, the call, the wait: on gloo, sequence parallelism's
reduce-scatters are all-reduces too, its all-gathers are not counted). Per step, each rank's
median:
- the train step, and the AdamW step after it;
- the time inside the all-reduces, their count and their bytes per call;
- the rest of the train step: the compute, and what the collectives cost outside their calls
  (autograd functions, copies).

The search prices a tp=2 step as (compute and optimizer, from the profile) + calls x latency +
bytes / bandwidth, with the latency and bandwidth fitted on Fan's steps
([Note: collectives in a step] in autopipe/search/links.py). This splits what such a step takes
into those parts, measured, so that a model's price and Fan's can be compared part by part
(``collective_terms`` in layout_choice_cpu.py's results hold the priced parts).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _model_and_batch(name: str, batch: int, size: int) -> tuple[Any, tuple, tuple, Any]:
    import layout_choice_cpu as bench

    g = torch.Generator().manual_seed(1)
    if name == "fan":
        x = torch.randn(batch, 64, 256, generator=g)
        return bench.Fan(), (torch.randn(size, 64, 256),), (x, torch.randint(0, 10, (batch, 64), generator=g)), \
            bench._fan_loss
    x = torch.randn(batch, 3, 32, 32, generator=g)
    return bench.build(name), (torch.randn(size, 3, 32, 32),), (x, torch.randint(0, 10, (batch,), generator=g)), \
        F.cross_entropy


class _CallTimer:
    """Times every tensor-parallel all-reduce where it is called (patched in for the run)."""

    def __init__(self) -> None:
        import autopipe.shard.collectives as collectives

        self.module, self.original = collectives, collectives._all_reduce
        self.seconds, self.calls, self.bytes = 0.0, 0, 0
        collectives._all_reduce = self

    def __call__(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        begin = time.perf_counter()
        out = self.original(x, group)
        self.seconds += time.perf_counter() - begin
        self.calls += 1
        self.bytes += x.numel() * x.element_size()
        return out

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0


def _split(name: str, m: int, args: argparse.Namespace, timer: _CallTimer) -> dict[str, Any]:
    """One model at ``m`` micro-batches, tp=2: each part of a step, this rank's medians."""
    import autopipe
    import layout_choice_cpu as bench

    torch.manual_seed(0)
    model, example, batch, loss = _model_and_batch(name, args.batch, args.batch // m)
    pm = autopipe.parallelize(model, example, loss_fn=loss, device="cpu", costs="analytic",
                              measure=bench._as_priced(), pp=1, tp=2, microbatches=m,
                              sequence_parallel=args.sequence_parallel, split_mlps=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    steps = []
    for i in range(2 + args.steps):
        dist.barrier()
        timer.reset()
        begin = time.perf_counter()
        pm.train_step(*batch)
        train = time.perf_counter() - begin
        begin = time.perf_counter()
        pm.step(opt)
        opt.zero_grad(set_to_none=False)
        if i >= 2:
            steps.append((train, time.perf_counter() - begin, timer.seconds, timer.calls, timer.bytes))
    pm.close()
    train, optimizer, inside = (statistics.median(s[k] for s in steps) for k in range(3))
    calls, moved = steps[-1][3], steps[-1][4]
    return {"model": name, "microbatches": m, "rank": dist.get_rank(), "train_step": train,
            "optimizer_step": optimizer, "in_all_reduce": inside, "outside": train - inside, "calls": calls,
            "bytes_per_call": moved / max(calls, 1), "per_call": inside / max(calls, 1)}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    timer = _CallTimer()
    rows = []
    try:
        for name in args.models.split(","):
            for m in (int(v) for v in args.microbatches.split(",")):
                row = _split(name, m, args, timer)
                rows.append(row)
                print(f"rank {rank} {name:6s} m{m:<3d} step {row['train_step'] * 1e3:7.1f} ms (+ AdamW "
                      f"{row['optimizer_step'] * 1e3:4.1f}): in {row['calls']} all-reduces "
                      f"{row['in_all_reduce'] * 1e3:6.1f} ms ({row['per_call'] * 1e3:.2f} ms a call of "
                      f"{row['bytes_per_call'] / 1e3:.0f} KB), outside {row['outside'] * 1e3:6.1f} ms", flush=True)
    finally:
        timer.module._all_reduce = timer.original
    gathered = [None, None]
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out.put([r for ranks in gathered for r in ranks])
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit,fan", help="vit, resnet and/or fan")
    parser.add_argument("--microbatches", default="1,4,16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    bad = [n for n in args.models.split(",") if n not in ("vit", "resnet", "fan")]
    if bad:
        parser.error(f"unknown model(s) {bad}: choose among vit, resnet, fan")
    counts = [int(v) for v in args.microbatches.split(",")]
    if "resnet" in args.models.split(",") and args.batch // max(counts) < 2:
        parser.error(f"ResNet-18's batch norms need 2 samples a micro-batch or more: at --batch {args.batch}, "
                     f"--microbatches {max(counts)} gives {args.batch // max(counts)}; use {args.batch // 2} or fewer")
    import layout_choice_cpu as bench

    rows = bench.run_two_ranks(worker, args)
    if rows is None:
        print("FAIL a worker died; see its traceback above")
        return 1
    if args.out:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "command": " ".join(sys.argv),
                "machine": f"{os.cpu_count()} cores, 2 gloo processes of one thread"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
