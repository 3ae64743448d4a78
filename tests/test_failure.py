"""No rank hangs when another fails: the failure is relayed through the store, or a deadline hits.

Unit tests drive FailureMonitor with stand-in works; the distributed ones make a real pipeline,
tensor-parallel or data-parallel rank raise or die mid-step and check that every other rank
raises PipelineFailure promptly, naming the root cause; a job of plain processes checks how
failed processes exit.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.errors import InputError, PipelineFailure
from autopipe.runtime import PipelineDriver, host_links
from autopipe.failure.monitor import FailureMonitor, failure_key
from tests import failing_job as job
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
        return self.done.is_set() or self.error is not None

    def wait(self, timeout: Any = None) -> bool:
        if self.error is not None:  # like a gloo receive whose peer's socket closed
            raise self.error
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")  # as gloo's collectives say it
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


@pytest.mark.parametrize("host", [False, True])
def test_collective_waits_return_and_raise_the_recorded_failure(host: bool) -> None:
    a, b = monitors()
    work = Work()
    threading.Timer(0.05, work.done.set).start()
    b.wait_collective([Work(done=True), work], "all-reduce", host=host)
    threading.Timer(0.3, a.record, [ValueError("bad batch")]).start()
    start = time.perf_counter()
    with pytest.raises(PipelineFailure, match="pipeline rank 0 failed: ValueError: bad batch"):
        b.wait_collective([Work()], "tensor-parallel all-reduce", host=True)
    assert time.perf_counter() - start < 2.0


def test_a_failed_collective_is_typed_and_a_missing_peer_times_out() -> None:
    (a,) = monitors(1, deadline=0.5)
    with pytest.raises(PipelineFailure, match=r"^all-reduce over the tp ranks \[0, 1\] failed: Connection closed"):
        a.wait_collective([Work(error=RuntimeError("Connection closed by peer"))],
                          "all-reduce over the tp ranks [0, 1]", host=True)
    (b,) = monitors(1, deadline=0.5)
    with pytest.raises(PipelineFailure, match=r"^gradient all-reduce timed out after 0.5 s"):
        b.wait_collective([Work()], "gradient all-reduce", host=True)


def test_an_untyped_error_after_another_rank_failed_is_raised_as_that_failure() -> None:
    a, b = monitors()
    with pytest.raises(ValueError), a.guard():  # the root cause stays itself on its own rank
        raise ValueError("bad batch")
    with pytest.raises(PipelineFailure, match="pipeline rank 0 failed: ValueError: bad batch") as info, b.guard():
        raise RuntimeError("Connection closed by peer")  # what gloo says once rank 0 exits
    assert isinstance(info.value.__cause__, RuntimeError)
    _, d = monitors()
    with pytest.raises(InputError), d.guard():  # typed errors stay what they are
        raise InputError("bad shape")


def test_a_lost_peer_raised_where_a_transfer_is_posted_is_typed_and_recorded() -> None:
    """Gloo raises at isend/all_reduce time once a peer process has exited: no wait sees it."""
    a, b = monitors()
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
                        "[127.0.0.1]:58084")
    with pytest.raises(PipelineFailure, match=r"^a transfer or collective failed: Connection closed by peer "
                                              r"\[127.0.0.1\]:58084; a peer process may have died$") as info, a.guard():
        raise gloo
    assert info.value.__cause__ is gloo
    with pytest.raises(PipelineFailure, match="pipeline rank 0 failed: PipelineFailure: a transfer or collective"):
        b.check()  # recorded: the ranks waiting on this one are released
    (c,) = monitors(1)
    with pytest.raises(RuntimeError, match="^a user's own error$"), c.guard():
        raise RuntimeError("a user's own error")  # other untyped errors stay what they are


def test_arrive_waits_for_every_rank_and_names_those_that_did_not_come() -> None:
    store = dist.HashStore()
    a, b, c = (FailureMonitor(r, store, "autopipe/failure/arrive", size=3, deadline=1.0 if r < 2 else 30.0)
               for r in range(3))
    threads = [threading.Thread(target=m.arrive, args=("full_state_dict()",)) for m in (b, c)]
    for t in threads:
        t.start()
    a.arrive("full_state_dict()")  # returns once all three came
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    # The next call: rank 1 calls full_state_dict(), rank 2 save_checkpoint(), rank 0 nothing.
    errors: list[BaseException] = []

    def other() -> None:
        try:
            c.arrive("save_checkpoint()")
        except PipelineFailure as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    start = time.perf_counter()
    with pytest.raises(PipelineFailure, match=r"^full_state_dict\(\) is collective, and ranks 0, 2 did not call "
                                              r"it within 1 s \(rank 2 called save_checkpoint\(\) instead\)"):
        b.arrive("full_state_dict()")
    thread.join(timeout=10)
    # Rank 2 (a deadline of 30 s) learns of rank 1's failure at once.
    assert time.perf_counter() - start < 5
    assert [str(e).split(" (")[0] for e in errors] == [
        "pipeline rank 1 failed: PipelineFailure: full_state_dict() is collective, and ranks 0, 2 did not call it "
        "within 1 s"]

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


def failing_pipeline_shared(rank: int, pp: int, chunks: int, schedule: str, culprit: int, die: bool,
                            deadline: float) -> float:
    """failing_pipeline with its messages through shared memory ([Note: shared-memory links])."""
    os.environ["LOCAL_WORLD_SIZE"] = str(pp)  # one host, as torchrun says
    host_links.SHARED_LINKS = True
    return failing_pipeline(rank, pp, chunks, schedule, culprit, die, deadline)


def test_over_shared_memory_a_raising_rank_fails_every_rank_and_a_dead_one_times_out() -> None:
    start = time.perf_counter()
    raised = run_distributed(failing_pipeline_shared, 2, 2, "interleaved_1f1b", 1, False, 60.0,
                             timeout=90, return_exceptions=True)
    assert time.perf_counter() - start < 30  # relayed through the store, not by the 60 s deadline
    assert (raised[1].exc_type, raised[1].message) == ("builtins.ValueError", "bad batch")
    assert raised[0].exc_type == "autopipe.errors.PipelineFailure", str(raised[0])
    assert raised[0].message == "pipeline rank 1 failed: ValueError: bad batch"
    start = time.perf_counter()
    died = run_distributed(failing_pipeline_shared, 4, 1, "1f1b", 2, True, 5.0, timeout=90, return_exceptions=True)
    assert time.perf_counter() - start < 45
    assert isinstance(died[2], RankError) and died[2].exitcode == 3
    for rank in (0, 1, 3):  # waiting on the dead rank's counters, or on a rank that waits on it
        assert isinstance(died[rank], RankError) and died[rank].exc_type == "autopipe.errors.PipelineFailure", \
            str(died[rank])


# -- tensor- and data-parallel ranks, and how failed processes exit --------------------------


def failing_model(rank: int, world: int, pp: int, tp: int, culprit: int, die: bool, deadline: float) -> tuple:
    """parallelize()'s model, whose ``culprit`` fails in its second step; what each rank raised
    and how long after the start of its failing step."""
    torch.manual_seed(0)
    pm = autopipe.parallelize(job.mlp(), (torch.randn(2, job.IN),), pp=pp, tp=tp, microbatches=2,
                              loss_fn=F.cross_entropy, device="cpu", deadline=deadline)
    if rank == culprit:
        job.fail_at(pm, 3, die=die)  # the first forward of the second step (2 micro-batches a step)
    started = [0.0]
    try:
        job.train(pm, 3, lambda step: started.__setitem__(0, time.perf_counter()))
    except Exception as exc:  # noqa: BLE001 - returned for the test to look at
        return type(exc).__name__, str(exc), time.perf_counter() - started[0]
    return "finished", "", 0.0


@pytest.mark.parametrize("pp,tp,culprit,name", [
    (2, 2, 1, "rank 1 (pp 0, dp 0, tp 1)"),  # its tp peer sits in a tensor-parallel all-reduce
    (2, 1, 3, "rank 3 (pp 1, dp 1, tp 0)"),  # the other replica sits in the dp gradient all-reduce
])
def test_a_failing_tensor_or_data_parallel_rank_fails_every_rank(pp: int, tp: int, culprit: int, name: str) -> None:
    results = run_distributed(failing_model, 4, pp, tp, culprit, False, 60.0, timeout=150)
    for rank, (kind, message, took) in enumerate(results):
        if rank == culprit:
            assert (kind, message) == ("ValueError", "bad batch")
        else:
            assert (kind, message) == ("PipelineFailure", f"{name} failed: ValueError: bad batch"), rank
        assert took < 30, f"rank {rank} took {took:.1f} s: relayed through the store, not by the 60 s deadline"


def test_a_dead_tensor_parallel_rank_fails_the_others() -> None:
    results = run_distributed(failing_model, 4, 2, 2, 1, True, 60.0, timeout=150, return_exceptions=True)
    assert isinstance(results[1], RankError) and results[1].exitcode == 3
    for rank in (0, 2, 3):  # the first to lose its connection to rank 1 tells the others
        kind, message, took = results[rank]
        assert kind == "PipelineFailure" and re.search("Connection (closed|reset) by peer", message), message
        assert took < 30, f"rank {rank} took {took:.1f} s"


def test_failed_processes_exit_with_a_python_error_code() -> None:
    # Plain processes as torchrun starts them (the store held by the launcher, as its agent
    # does); see tests/failing_job.py for the race it sets up.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    root = Path(__file__).resolve().parent.parent
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.failing_job"], cwd=root, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=150)[1])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the failed job did not exit within 150 s")
    for rank, (p, err) in enumerate(zip(procs, errs)):
        assert "terminate called" not in err and p.returncode == 1, f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
    assert "ValueError: bad batch" in errs[1]
    assert "PipelineFailure: rank 1 (pp 1, dp 0, tp 0) failed: ValueError: bad batch" in errs[0]


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
    # The first run of a test process starts the fork server (torch and timm imported, tens of
    # seconds on a loaded machine); the clock is for the kill alone.
    assert run_distributed(raise_on_rank_one, 1) == [0]
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
