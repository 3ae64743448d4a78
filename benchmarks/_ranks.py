"""What the torchrun benchmarks share: one process group, and rows that every rank records alike."""
from __future__ import annotations

import datetime
import gc
import faulthandler
import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["init_ranks", "log", "max_over_ranks", "record_row", "peak_gib", "finish"]


def init_ranks(smoke: bool) -> torch.device:
    """NCCL and this rank's GPU, or gloo and the CPU (one thread) for a smoke run or no GPU."""
    cuda = torch.cuda.is_available() and not smoke
    every = os.environ.get("BENCH_TRACEBACKS_EVERY")  # seconds: every thread's stack, again and again (a stall)
    if every:
        faulthandler.dump_traceback_later(float(every), repeat=True)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    return torch.device("cpu")


def log(*args: Any) -> None:
    """Print on rank 0 only (torchrun's RANK; before the process group exists too)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, flush=True)


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of every rank's ``value`` (collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def peak_gib(device: torch.device) -> float:
    """The fullest rank's peak allocated memory since the last reset (GiB; 0 on the CPU)."""
    return max_over_ranks(torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0, device)


def record_row(rows: list[dict], row: dict[str, Any], fn: Callable[[], dict], device: torch.device,
               save: Callable[[], None]) -> None:
    """Runs ``fn`` into ``row`` with peak memory reset before it; a failure is kept in the row
    (and its traceback printed) so that the other rows still run. Every rank must fail alike: a
    rank left alone in a collective cannot go on, so a failure on some ranks only stops the run."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    failed = 0.0
    try:
        row.update(fn())
    except Exception as exc:  # noqa: BLE001 - one row failing must not lose the others
        row["failure"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"[rank {dist.get_rank()}] {row} failed:\n{traceback.format_exc()}", flush=True)
        failed = 1.0
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flags = torch.tensor([failed, -failed], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    rows.append(row)
    save()
    if flags[0] and not -flags[1]:
        raise RuntimeError(f"{row} failed on some ranks only; stopping")


def finish(failures: list[str], device: torch.device) -> int:
    """Print this rank's ``failures`` (rank 0 has them), end the process group, and return the
    exit code every rank agrees on: 1 if any rank failed."""
    for line in failures:
        print("FAIL", line)
    failed = max_over_ranks(float(bool(failures)), device)
    dist.destroy_process_group()
    return 1 if failed else 0
