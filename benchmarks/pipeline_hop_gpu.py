"""How long a stage boundary takes to cross between two GPUs of one host: two ranks pass a
message back and forth, each after ~0.5 ms of GPU work, through the shared-memory links
(autopipe/runtime/host_links.py) and through NCCL, and the time of one hop (the copy and
every wait around it) is the round trip less the work, halved.

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_hop_gpu.py --out hop.json

The message is ``--tensors`` tensors of ViT-L/16's boundary at 64 images (64 x 197 x 1024 bf16,
25.8 MB each): 1 for a cut between blocks, 3 for a cut inside an MLP split across two stages
(the residual, the norm's output and the partial sum). Prints one row per transport and size.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.runtime.host_links import SharedLinks, message_bytes  # noqa: E402

SLEEP_CYCLES = 1_000_000  # ~0.5 ms of torch.cuda._sleep on an H100 or H200


def _work_ms() -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    a.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def hop_ms(send, recv, rank: int, work: float, iters: int) -> float:
    """The time of one hop: ``iters`` round trips less twice ``work``, halved."""
    for it in range(iters + 5):
        if it == 5:
            dist.barrier()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        if rank == 0:
            torch.cuda._sleep(SLEEP_CYCLES)
            send()
            recv()
        else:
            recv()
            torch.cuda._sleep(SLEEP_CYCLES)
            send()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    return (start.elapsed_time(end) / iters - 2 * work) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="1,3", help="tensors per message, comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    peer = 1 - rank
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    counts = [int(n) for n in args.tensors.split(",")]
    one = 64 * 197 * 1024
    sent = [torch.randn(one, device=device).to(torch.bfloat16) for _ in range(max(counts))]
    landed = [torch.empty_like(t) for t in sent]
    store = dist.distributed_c10d._get_default_store()

    def poll(done, what: str) -> None:
        while not done():
            pass

    links = SharedLinks.connect(device=device, store=store, key="autopipe/links/hop", rank=rank,
                                receives={peer: 8}, sends=[peer], slot_bytes=message_bytes(sent), poll=poll,
                                timeout=60.0)
    work = _work_ms()
    rows = []
    for n in counts:
        def shared_send(n=n) -> None:
            links.post(True, peer, sent[:n], "send")

        def shared_recv(n=n) -> None:
            (receipt,) = links.post(False, peer, landed[:n], "receive")
            poll(receipt.ready, "receive")
            receipt.wait()

        pending: list = []

        def nccl_send(n=n, pending=pending) -> None:
            for work in pending:  # the last round's sends, waited on the stream (the host goes on)
                work.wait()
            pending[:] = [dist.isend(t, peer) for t in sent[:n]]

        def nccl_recv(n=n) -> None:
            for w in [dist.irecv(t, peer) for t in landed[:n]]:
                w.wait()

        for name, send, recv in (("shared memory", shared_send, shared_recv), ("NCCL", nccl_send, nccl_recv)):
            ms = hop_ms(send, recv, rank, work, args.iters)
            for w in pending:
                w.wait()
            pending.clear()
            rows.append({"transport": name, "tensors": n, "mb": round(n * one * 2 / 1e6, 1), "hop_us": round(ms * 1e3, 1)})
            if rank == 0:
                print(f"{name:14s} {n} x 25.8 MB: hop {ms * 1e3:6.1f} us", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "date": datetime.date.today().isoformat(), "work_ms": round(work, 3),
                       "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    torch.cuda.synchronize()
    dist.barrier()
    links.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
