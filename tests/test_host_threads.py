"""Host thread placement: a rank's thread and autograd's device thread share the rank's core
while CUDA stages run, and only then (autopipe/runtime/host_threads.py)."""
from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.runtime import host_threads
from autopipe.runtime.driver import PipelineDriver
from autopipe.runtime.host_threads import PIN_ENV, host_core, pinned_host_threads


@pytest.mark.parametrize("cores,rank,ranks,core", [
    (range(16), 0, 1, 15),  # one rank: the last core, core 0 left to the system
    (range(16), 0, 2, 7), (range(16), 1, 2, 15),  # one slice each
    ({2, 5, 9, 11}, 0, 2, 5), ({2, 5, 9, 11}, 1, 2, 11),  # the cores the process may use
    (range(3), 2, 3, 2),
    (range(4), 0, 8, None),  # fewer cores than ranks: no choice to make
    ({3}, 0, 1, None),  # one core: nothing to gain
])
def test_each_local_rank_gets_a_core_of_its_own(cores, rank, ranks, core) -> None:
    environ = {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(ranks)}
    assert host_core(set(cores), environ) == core


def test_nothing_is_pinned_for_cpu_stages() -> None:
    before = os.sched_getaffinity(0)
    with pinned_host_threads("cpu") as core:
        assert core is None
        assert os.sched_getaffinity(0) == before


def _affinity_in_thread() -> set[int]:
    seen: list[set[int]] = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    return seen[0]


def test_the_thread_is_pinned_inside_and_given_back_its_cores_after(monkeypatch) -> None:
    """Threads started inside (autograd's, on first use) share the core; threads started after
    (a data loader's workers) have the process's cores again."""
    monkeypatch.setattr(host_threads, "_enabled", lambda device: True)
    before = os.sched_getaffinity(0)
    with pinned_host_threads("cpu") as core:
        if len(before) < 2:  # a process of one core has nothing to choose
            assert core is None
            return
        assert core == max(before)
        assert os.sched_getaffinity(0) == {core}
        assert _affinity_in_thread() == {core}
    assert os.sched_getaffinity(0) == before
    assert _affinity_in_thread() == before


@pytest.mark.parametrize("setting,world,pinned", [
    (None, None, True), (None, "1", True), (None, "2", False),  # by default: a job of one process only
    ("auto", "4", False), ("1", "4", True), ("0", None, False), ("off", "1", False),
])
def test_a_job_of_one_process_pins_unless_told_otherwise(monkeypatch, setting, world, pinned) -> None:
    for name, value in ((PIN_ENV, setting), ("WORLD_SIZE", world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert host_threads._enabled(torch.device("cuda")) == (pinned and hasattr(os, "sched_setaffinity"))
    assert not host_threads._enabled(torch.device("cpu"))


def _record_forward_affinity(monkeypatch) -> list[set[int]]:
    seen: list[set[int]] = []
    forward = PipelineDriver._forward

    def recording(self, s: int, mb: int) -> None:
        seen.append(os.sched_getaffinity(0))
        forward(self, s, mb)

    monkeypatch.setattr(PipelineDriver, "_forward", recording)
    return seen


def _train_step(device: str) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    pm = autopipe.parallelize(model, (torch.randn(2, 16),), microbatches=2, chunks=2, schedule="gpipe",
                              loss_fn=F.cross_entropy, device=device)
    pm.train_step(torch.randn(4, 16, device=device), torch.randint(0, 4, (4,), device=device))


def test_a_cpu_pipeline_runs_on_the_process_cores(monkeypatch) -> None:
    seen = _record_forward_affinity(monkeypatch)
    before = os.sched_getaffinity(0)
    _train_step("cpu")
    assert seen and all(s == before for s in seen)


class _BackwardAffinity(torch.autograd.Function):
    seen: list[tuple[int, set[int]]] = []

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _BackwardAffinity.seen.append((threading.get_native_id(), os.sched_getaffinity(0)))
        return grad


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="autograd's device thread needs a GPU")
def test_a_gpu_pipeline_runs_its_schedule_on_the_rank_core(monkeypatch) -> None:
    monkeypatch.delenv(PIN_ENV, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = os.sched_getaffinity(0)
    core = host_core()
    seen = _record_forward_affinity(monkeypatch)
    _train_step("cuda")
    expected = before if core is None else {core}
    assert seen and all(s == expected for s in seen)
    assert os.sched_getaffinity(0) == before
    # Autograd's device thread, another thread than this one, runs the backward on the core too.
    _BackwardAffinity.seen.clear()
    with pinned_host_threads("cuda"):
        x = torch.ones(4, device="cuda", requires_grad=True)
        _BackwardAffinity.apply(x).sum().backward()
    (thread, affinity), = _BackwardAffinity.seen
    assert thread != threading.get_native_id()
    assert affinity == expected
