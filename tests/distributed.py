"""Runs a function on ``world_size`` fresh processes over gloo and returns what each rank returned.

Import it as ``from tests.distributed import run_distributed`` (``tests`` is a package).
A rank that raises or dies fails the test with its rank and traceback; a global timeout kills
every child, so a hung collective fails the test instead of hanging CI.

The ranks run on the CPU on any machine: ``parallelize`` picks the CPU by default under a gloo
process group (a GPU machine included), and tests that need CUDA's answers without a GPU use
:func:`cuda_present`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "DistributedTestError", "run_distributed", "cuda_present"]


@dataclasses.dataclass(frozen=True)
class RankError:
    """What a rank left instead of a result: an exception it raised, or its death."""

    rank: int
    exc_type: str  # qualified class name, or "" when the process died
    message: str
    traceback: str = ""
    exitcode: int | None = None

    def __str__(self) -> str:
        if self.exitcode is not None and not self.exc_type:
            return f"rank {self.rank} died with exit code {self.exitcode}"
        return f"rank {self.rank} raised {self.exc_type}: {self.message}\n{self.traceback}"


class DistributedTestError(AssertionError):
    """One or more ranks failed, or the run timed out (an AssertionError, so pytest shows it plainly)."""


def _worker(
    rank: int,
    world_size: int,
    init_method: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
    release: Any,
) -> None:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one compute thread each
    # A rank still running shortly before the run's timeout prints where it is (every thread's
    # stack, to stderr, which pytest shows with the failure): a hang names its line.
    faulthandler.dump_traceback_later(max(timeout - 10.0, 1.0), exit=False)
    # The ranks are CPU processes on any machine, a GPU workstation included: what they ask
    # torch about CUDA must get a CPU-only machine's answer (as the tests' conftest does).
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args, **kwargs)
        # Pickled here, by value: an unpicklable result fails this rank with its traceback
        # (the queue's feeder thread would only print it), and tensors need no shared memory.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        results.put((rank, False, pickle.dumps(RankError(rank, kind, str(exc), traceback.format_exc()))))
    faulthandler.cancel_dump_traceback_later()
    results.close()
    results.join_thread()
    # Exit only once every rank has reported: a rank leaving early would close sockets that
    # peers still read from. os._exit skips the process-group destructors, which can block on
    # receives that a failure left pending.
    release.wait(timeout)
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    return_exceptions: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes.

    ``fn`` and its arguments must be picklable (a module-level function). Returns each rank's
    return value (copied with pickle; tensors arrive detached from any graph), in rank order. A rank that raises or dies raises :class:`DistributedTestError`
    with its traceback, unless ``return_exceptions`` is true: then its entry is a
    :class:`RankError`. Past ``timeout`` seconds every child is killed and the error names the
    ranks that had not reported.
    """
    ctx = mp.get_context("forkserver")
    # The server imports torch once per test session; each rank is then a cheap fork of it.
    # timm too: tracing imports it (and torchvision) for its own rules, ~15 s per process on
    # a loaded 2-core machine. Modules that are not installed are skipped.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "timm"])
    results = ctx.Queue()
    release = ctx.Event()
    with tempfile.TemporaryDirectory(prefix="autopipe-dist-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, init_method, timeout, fn, args, kwargs, results, release),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, payload = results.get(timeout=0.1)
                    outcome[rank] = (ok, pickle.loads(payload))
                except queue.Empty:
                    pass
                for rank, p in enumerate(procs):
                    # A death is only final once the queue had time to deliver its last words.
                    if rank not in outcome and p.exitcode is not None and results.empty():
                        time.sleep(0.2)
                        if results.empty():
                            outcome[rank] = (False, RankError(rank, "", "", "", p.exitcode))
        finally:
            release.set()
            # Ranks that reported exit at once; the others are hung (or this is a timeout).
            grace = time.monotonic() + 5
            for rank, p in enumerate(procs):
                if rank in outcome:
                    p.join(timeout=max(0.0, grace - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        raise DistributedTestError(
            f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) timed out "
            f"after {timeout:.0f} s; ranks {missing} never reported and were killed"
        )
    values = [outcome[r][1] for r in range(world_size)]
    failed = [v for ok, v in (outcome[r] for r in range(world_size)) if not ok]
    if failed and not return_exceptions:
        raise DistributedTestError("\n".join(str(f) for f in failed))
    return values


@contextlib.contextmanager
def cuda_present() -> Iterator[None]:
    """Inside, torch says one GPU is there (nothing runs on it): what code that only asks
    sees on a GPU machine, so such behaviour is tested on CPU-only machines too."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=1):
        yield
