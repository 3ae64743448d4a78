"""Where a pipeline step's time goes on 2 CPU processes: 1F1B against interleaved 1F1B.

    python benchmarks/interleaved_step_cpu.py --out results.json [--layouts 16:1,16:2,8:1,8:2]

The small ViT of layout_choice_cpu.py, pp=2, batch 16, two gloo processes of one thread each.
Each layout ``M:V`` (M micro-batches, V chunks; V=1 is 1F1B) is built with ``parallelize``,
stepped 6 times with its timeline recorded, and the step of median wall time among the last 4
is read, per rank:
- ``compute``: its forwards and backwards (the timeline's F and B spans);
- ``waits``: the time spent waiting for a receive (RECV_ACT, RECV_GRAD);
- ``posts``: the time spent posting transfers (``StepTransfers.post``: gloo's isend/irecv, the
  packing of what is sent, the hand-over to the thread that waits on a send), in all and by how
  many transfers were already in flight (posted, not yet delivered or received) at the post;
- ``other``: the rest of the step (the driver's own work, the loss's broadcast).
The layout search prices a transfer's host time at one fitted figure per tensor
(``transfer_overhead``); this shows what a post costs as the schedule runs it.
"""
from __future__ import annotations

import argparse
import collections
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from layout_choice_cpu import build, run_two_ranks  # noqa: E402

STEPS, WARMUP = 6, 2


def _step_parts(pm: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, posts: list) -> dict[str, Any]:
    """One timed step of ``pm``: its wall time and where it went on this rank."""
    pm.timeline.clear()
    posts.clear()
    dist.barrier()
    begin = time.perf_counter()
    pm.train_step(x, y)
    wall = time.perf_counter() - begin
    pm.step(opt)
    opt.zero_grad(set_to_none=False)
    spans = collections.defaultdict(float)
    for e in pm.timeline.events():
        spans["compute" if e.action in ("F", "B") else "waits"] += e.end - e.start
    by_flight = collections.defaultdict(list)
    for in_flight, seconds in posts:
        by_flight[min(in_flight, 4)].append(seconds)
    post_total = sum(s for _, s in posts)
    return {"wall": wall, "compute": spans["compute"], "waits": spans["waits"], "posts": post_total,
            "post_count": len(posts), "other": wall - spans["compute"] - spans["waits"] - post_total,
            "post_by_in_flight": {str(k): [len(v), statistics.median(v)] for k, v in sorted(by_flight.items())}}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import autopipe
    from autopipe.runtime import transfers

    posts: list[tuple[int, float]] = []
    post = transfers.StepTransfers.post

    def timed_post(self: Any, batch: Any) -> None:
        in_flight = len(self._sends) + len(self._recv)
        begin = time.perf_counter()
        post(self, batch)
        posts.append((in_flight, time.perf_counter() - begin))

    transfers.StepTransfers.post = timed_post
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    rows = []
    for spec in args.layouts.split(","):
        m, v = (int(s) for s in spec.split(":"))
        torch.manual_seed(0)
        pm = autopipe.parallelize(build("vit"), (torch.randn(args.batch // m, 3, 32, 32),), loss_fn=F.cross_entropy,
                                  device="cpu", pp=2, microbatches=m, chunks=v, record_timeline=True,
                                  schedule="1f1b" if v == 1 else "interleaved_1f1b")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        steps = [_step_parts(pm, opt, x, y, posts) for _ in range(STEPS)][WARMUP:]
        mine = sorted(steps, key=lambda s: s["wall"])[len(steps) // 2]
        both: list[Any] = [None] * world
        dist.all_gather_object(both, mine)
        rows.append({"layout": f"pp2 m{m} " + ("1f1b" if v == 1 else f"v{v} interleaved_1f1b"), "ranks": both})
        pm.close()
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="8:1,8:2,8:4,16:1,16:2,16:4")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = run_two_ranks(worker, args)
    if rows is None:
        print("FAIL a worker died; see its traceback above")
        return 1
    for row in rows:
        for r, p in enumerate(row["ranks"]):
            flights = " ".join(f"{k}:{n}x{s * 1e3:.2f}" for k, (n, s) in p["post_by_in_flight"].items())
            print(f"{row['layout']:28s} rank {r}  step {p['wall'] * 1e3:6.1f} ms  compute {p['compute'] * 1e3:6.1f}  "
                  f"waits {p['waits'] * 1e3:5.1f}  posts {p['posts'] * 1e3:5.1f} ({p['post_count']})  "
                  f"other {p['other'] * 1e3:5.1f}  post ms by transfers in flight {flights}")
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "machine": "2 CPU cores, 2 gloo processes of one thread",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
