"""Eager training steps with the host threads pinned to the rank's core, and without.

    python benchmarks/host_threads.py [--models resnet50,vit_base_patch16_224] [--microbatch 32]
        [--rounds 2] [--gpus 1] [--out results.json]

One process per measurement (so autograd's device thread starts unpinned each time), or one
torchrun world of ``--gpus`` ranks: ``parallelize`` with every stage local on one GPU (chunks=4,
8 micro-batches, GPipe), or ``pp=--gpus`` (1F1B, 8 micro-batches); eager, bf16 autocast,
channels-last, fused AdamW; the median of 10 steps after 3, with
``AUTOPIPE_PIN_THREADS=0`` and ``=1`` in turn, ``--rounds`` times each, alternating, so a slow
spell of the host does not fall on one setting only. See [Note: host thread placement] in
autopipe/runtime/host_threads.py. Prints samples/s per model and setting, and the gain.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def one_run(name: str, microbatch: int, steps: int = 10, warmup: int = 3) -> dict:
    """Train steps of ``timm:name`` in this process; samples/s and step times."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import autopipe
    from autopipe.models import default_input, load_model

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = load_model(f"timm:{name}", meta=False).cuda().to(memory_format=torch.channels_last)
    shape = default_input(model, microbatch).shape
    x = torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last)
    layout = dict(pp=world, schedule="1f1b") if world > 1 else dict(chunks=4, schedule="gpipe")
    pm = autopipe.parallelize(model, (x,), microbatches=8, loss_fn=F.cross_entropy, device="cuda",
                              mixed_precision="bf16", **layout)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True)
    batch = 8 * microbatch
    xs = torch.randn(batch, *shape[1:], device="cuda").contiguous(memory_format=torch.channels_last)
    ys = torch.randint(0, 1000, (batch,), device="cuda")
    times = []
    for _ in range(warmup + steps):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        pm.train_step(xs, ys)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    step = statistics.median(times[warmup:])
    if world > 1:
        dist.destroy_process_group()
    return {"model": name, "microbatch": microbatch, "gpus": world, "pinned": os.environ.get("AUTOPIPE_PIN_THREADS", "1") != "0",
            "step_ms": step * 1e3, "samples_per_s": batch / step, "steps_ms": [t * 1e3 for t in times[warmup:]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50,vit_base_patch16_224")
    parser.add_argument("--microbatch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=1, help="pipeline ranks (torchrun, one host)")
    parser.add_argument("--out")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: time this model, print JSON
    args = parser.parse_args(argv)
    if args.one:
        result = one_run(args.one, args.microbatch)
        if int(os.environ.get("RANK", 0)) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    import torch

    rows = []
    for name in args.models.split(","):
        for _ in range(args.rounds):
            for pin in ("0", "1"):
                env = dict(os.environ, AUTOPIPE_PIN_THREADS=pin)
                launch = [sys.executable] if args.gpus == 1 else \
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"]
                done = subprocess.run([*launch, os.path.abspath(__file__), "--one", name,
                                       "--microbatch", str(args.microbatch)],
                                      env=env, capture_output=True, text=True, cwd=ROOT)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                rows.append(json.loads(lines[-1][len("RESULT "):]))
                print(f"{name} pinned={pin == '1'}: {rows[-1]['samples_per_s']:.0f} samples/s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cores": len(os.sched_getaffinity(0)),
              "command": " ".join(["python", "benchmarks/host_threads.py", *sys.argv[1:]]),
              "date": datetime.date.today().isoformat(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'model':24} {'unpinned':>10} {'pinned':>10} {'gain':>7}   (samples/s, median over rounds)")
    for name in args.models.split(","):
        by = {p: statistics.median(r["samples_per_s"] for r in rows if r["model"] == name and r["pinned"] == p)
              for p in (False, True)}
        print(f"{name:24} {by[False]:10.0f} {by[True]:10.0f} {by[True] / by[False] - 1:+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
