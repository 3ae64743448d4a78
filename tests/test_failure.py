"""No rank hangs when another fails: the failure is relayed through the store, or a deadline hits.

Unit tests drive FailureMonitor with stand-in works; the distributed ones make a real pipeline
rank raise or die mid-step and check that every other rank raises PipelineFailure promptly.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autopipe.errors import PipelineFailure
from autopipe.runtime import PipelineDriver
from autopipe.runtime.failure import FailureMonitor, failure_key
from tests.distributed import DistributedTestError, RankError, run_distributed
from tests.test_driver import Net, batch, boundary_specs, loss_fn, make_stages, postprocess

__all__: list[str] = []


class Work:
    """A stand-in for dist.Work: completes when ``done`` is set; ``wait()`` blocks like gloo's."""

    def __init__(self, done: bool = False, error: Exception | None = None) -> None:
        self.done = threading.Event()
        self.error = error
        if done:
            self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        if self.error is not None:  # like a gloo receive whose peer's socket closed
            raise self.error
        self.done.wait()
        return True


def monitors(n: int = 2, **kw: Any) -> list[FailureMonitor]:
    store = dist.HashStore()
    return [FailureMonitor(r, store, "autopipe/failure/test", **kw) for r in range(n)]


def test_record_is_seen_by_every_other_rank() -> None:
    a, b = monitors()
    a.record(ValueError("bad batch"))
    with pytest.raises(PipelineFailure, match=r"^pipeline rank 0 failed: ValueError: bad batch$"):
        b.check()


def test_first_failure_wins_and_relayed_failures_are_not_recorded() -> None:
    a, b, c, d = monitors(4)
    b.record(ValueError("root cause"))
    with pytest.raises(PipelineFailure) as relayed:
        a.check()
    a.record(relayed.value)  # what guard() does with it
    c.record(RuntimeError("a consequence"))
    with pytest.raises(PipelineFailure, match="pipeline rank 1 failed: ValueError: root cause"):
        d.check()


def test_guard_records_reraises_and_stays_failed() -> None:
    a, b = monitors()
    with pytest.raises(KeyError), a.guard():
        raise KeyError("stage 3")
    with pytest.raises(PipelineFailure, match="pipeline rank 0 failed: KeyError: 'stage 3'"):
        with a.guard():
            pass  # a failed pipeline refuses the next step
    with pytest.raises(PipelineFailure, match="pipeline rank 0 failed: KeyError"):
        b.check()


@pytest.mark.parametrize("threaded", [False, True])
def test_wait_raises_when_another_rank_failed(threaded: bool) -> None:
    a, b = monitors(threaded=threaded)
    threading.Timer(0.3, a.record, [ValueError("bad batch")]).start()
    start = time.perf_counter()
    with pytest.raises(PipelineFailure, match="pipeline rank 0 failed: ValueError: bad batch"):
        b.wait([Work()], "receive of stage 1's input (micro-batch 0) from pipeline rank 0")
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("threaded", [False, True])
def test_wait_times_out_naming_the_receive_and_peer(threaded: bool) -> None:
    (a,) = monitors(1, deadline=0.5, threaded=threaded)
    what = "receive of stage 2's input (micro-batch 3) from pipeline rank 1"
    with pytest.raises(PipelineFailure, match=r"stage 2's input \(micro-batch 3\) from pipeline rank 1 timed out after 0.5 s"):
        a.wait([Work()], what)


@pytest.mark.parametrize("threaded", [False, True])
def test_wait_returns_when_work_completes(threaded: bool) -> None:
    (a,) = monitors(1, threaded=threaded)
    work = Work()
    threading.Timer(0.05, work.done.set).start()
    a.wait([Work(done=True), work], "receive")
    pending = a.start([Work(done=True)])
    a.wait(pending, "send")
    assert pending.done()


def test_a_failed_work_becomes_a_pipeline_failure() -> None:
    (a,) = monitors(1, threaded=True, deadline=10)
    with pytest.raises(PipelineFailure, match="from pipeline rank 1 failed: Connection closed by peer"):
        a.wait([Work(error=RuntimeError("Connection closed by peer"))], "receive of x from pipeline rank 1")


# -- real pipelines --------------------------------------------------------------------------


class Faulty(nn.Module):
    """Wraps a stage; its ``fail_at``-th forward call raises (or kills the process)."""

    def __init__(self, stage: nn.Module, fail_at: int, die: bool) -> None:
        super().__init__()
        self.stage, self.fail_at, self.die, self.calls = stage, fail_at, die, 0

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls += 1
        if self.calls == self.fail_at:
            if self.die:
                os._exit(3)
            raise ValueError("bad batch")
        return self.stage(*args)


def failing_pipeline(rank: int, pp: int, chunks: int, schedule: str, culprit: int, die: bool,
                     deadline: float) -> float:
    torch.manual_seed(0)
    n, m = pp * chunks, 2 * pp
    stages: dict[int, nn.Module] = {s: st for s, st in enumerate(make_stages(Net(), n)) if s % pp == rank}
    if rank == culprit:  # first forward of step 2
        first = min(stages)
        stages[first] = Faulty(stages[first], fail_at=m + 1, die=die)
    driver = PipelineDriver(
        stages, boundary_specs(n), pp=pp, chunks=chunks, pp_rank=rank, pp_group=None, schedule=schedule,
        microbatches=m, loss_fn=loss_fn, postprocess=postprocess, device="cpu", deadline=deadline,
    )
    start = time.perf_counter()
    for step in range(3):
        x, ids, y = batch(step, m)
        start = time.perf_counter()
        driver.train_step((x, ids), {"y": y})
    return time.perf_counter() - start


@pytest.mark.parametrize("pp,chunks,schedule,culprit", [(4, 1, "1f1b", 1), (2, 2, "interleaved_1f1b", 1)])
def test_a_raising_rank_fails_every_rank(pp: int, chunks: int, schedule: str, culprit: int) -> None:
    start = time.perf_counter()
    results = run_distributed(failing_pipeline, pp, chunks, schedule, culprit, False, 60.0,
                              timeout=90, return_exceptions=True)
    # Relayed through the store, not by the 60 s deadline.
    assert time.perf_counter() - start < 30
    for rank, r in enumerate(results):
        assert isinstance(r, RankError), f"rank {rank} finished"
        if rank == culprit:
            assert (r.exc_type, r.message) == ("builtins.ValueError", "bad batch")
        else:
            assert r.exc_type == "autopipe.errors.PipelineFailure", str(r)
            assert r.message == f"pipeline rank {culprit} failed: ValueError: bad batch"


def test_a_dead_rank_fails_the_others_within_the_deadline() -> None:
    start = time.perf_counter()
    results = run_distributed(failing_pipeline, 4, 1, "1f1b", 2, True, 5.0, timeout=90, return_exceptions=True)
    assert time.perf_counter() - start < 45
    assert isinstance(results[2], RankError) and results[2].exitcode == 3
    for rank in (0, 1, 3):
        r = results[rank]
        assert isinstance(r, RankError) and r.exc_type == "autopipe.errors.PipelineFailure", str(r)


# -- the harness itself ----------------------------------------------------------------------


def raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("lost key")
    return rank * 10


def unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_harness_returns_values_and_reraises_rank_errors() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1 raised builtins.KeyError: 'lost key'[\s\S]*Traceback"):
        run_distributed(raise_on_rank_one, 2)
    values = run_distributed(raise_on_rank_one, 3, return_exceptions=True)
    assert values[0] == 0 and values[2] == 20 and isinstance(values[1], RankError)
    with pytest.raises(DistributedTestError, match=r"rank 0 raised .*(Pickl|pickle)"):
        run_distributed(unpicklable, 1, timeout=30)


def test_harness_kills_hung_ranks_at_the_timeout() -> None:
    start = time.perf_counter()
    with pytest.raises(DistributedTestError, match=r"timed out after 3 s; ranks \[0, 1\] never reported"):
        run_distributed(sleep_forever, 2, timeout=3)
    assert time.perf_counter() - start < 20


def test_failure_keys_differ_per_driver() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert failure_key(None) != failure_key(None)
    finally:
        dist.destroy_process_group()
