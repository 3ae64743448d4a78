"""Ordinary mistakes that used to hang every rank now raise typed errors on every rank, fast:
ranks passing parallelize() different arguments, a rank that never calls it, and a collective
API (full_state_dict) called on one rank only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.training.agreement import _differences, describe
from tests import failing_job as job
from tests.distributed import run_distributed

__all__: list[str] = []


def _outcome(fn, *args, **kwargs) -> tuple[str, str, float]:
    """(exception type, message, seconds) of ``fn(*args, **kwargs)``; ("returned", "", s) if none."""
    start = time.perf_counter()
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - returned for the test to look at
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return "returned", "", time.perf_counter() - start


def _parallelize(**kwargs) -> autopipe.ParallelModel:
    torch.manual_seed(0)
    args = dict(pp=2, microbatches=2, loss_fn=F.cross_entropy, device="cpu", deadline=30)
    return autopipe.parallelize(job.mlp(), (torch.randn(2, job.IN),), **{**args, **kwargs})


# ----------------------------------------------------------------------------- descriptions
@dataclass
class Rule:
    name: str
    match: object


def test_descriptions_are_the_same_in_every_process_and_name_what_differs() -> None:
    # No object addresses: two processes describe equal arguments alike.
    assert describe(F.cross_entropy) == "torch.nn.functional.cross_entropy"
    assert describe(nn.Linear) == "torch.nn.modules.linear.Linear"
    assert describe((torch.zeros(2, 3, dtype=torch.float16),)) == "[tensor(2, 3) float16]"
    assert describe([Rule("keep", nn.GELU)]) == "[Rule(name='keep', match=torch.nn.modules.activation.GELU)]"
    assert describe(lambda x: x).endswith("<lambda>") and " at 0x" not in describe(object())
    a, b = describe(job.mlp()), describe(job.mlp())
    assert a == b and a.startswith("Sequential (8 tensors, shapes ")
    assert describe(nn.Linear(3, 4)) != describe(nn.Linear(3, 5))


def test_differences_name_each_argument_and_the_ranks_behind_each_value() -> None:
    same = {"pp": "2", "tp": "1"}
    assert _differences([same, same], "parallelize()") == ("", "")
    kind, message = _differences([same, {"pp": "4", "tp": "1"}, same, same], "parallelize()")
    assert kind == "config"
    assert "  - pp: 2 on ranks 0, 2, 3; 4 on rank 1\n" in message
    assert "tp" not in message.split("\n", 1)[1]


# ----------------------------------------------------------------------------- processes
def _mismatched(rank: int, world: int) -> tuple[str, str, float]:
    odd = dict(pp=4, microbatches=4) if rank == 1 else {}
    return _outcome(_parallelize, **odd)


def test_ranks_with_different_arguments_all_raise_a_config_error_naming_them() -> None:
    results = run_distributed(_mismatched, 4, timeout=120)
    for rank, (kind, message, took) in enumerate(results):
        assert kind == "ConfigError", (rank, kind, message)
        assert message.startswith("the ranks called parallelize() with different arguments")
        assert "  - pp: 2 on ranks 0, 2, 3; 4 on rank 1\n  - microbatches: 2 on ranks 0, 2, 3; 4 on rank 1\n" \
            in message, message
        assert took < 20, f"rank {rank} took {took:.1f} s"
    assert len({m for _, m, _ in results}) == 1  # the same message on every rank


def _absent(rank: int, world: int) -> tuple[str, str, float]:
    if rank == 1:  # never calls parallelize()
        return "returned", "", 0.0
    return _outcome(_parallelize, deadline=2)


def test_a_rank_that_never_calls_parallelize_is_named_within_the_deadline() -> None:
    kind, message, took = run_distributed(_absent, 2, timeout=60)[0]
    assert (kind, message.split(";")[0]) == ("PipelineFailure", "rank 1 did not call parallelize() within 2 s")
    assert took < 15


def _state_on_rank_zero_only(rank: int, world: int) -> tuple[str, str, float]:
    pm = _parallelize(deadline=3 if rank == 0 else 30)  # rank 1 learns of it from rank 0, not its own deadline
    if rank == 0:
        return _outcome(pm.full_state_dict)
    return _outcome(job.train, pm, 1)  # waits for rank 0's activations instead


def test_full_state_dict_on_one_rank_raises_on_every_rank_within_the_deadline() -> None:
    results = run_distributed(_state_on_rank_zero_only, 2, timeout=90)
    (kind0, message0, took0), (kind1, message1, took1) = results
    assert kind0 == "PipelineFailure" and message0.startswith(
        "full_state_dict() is collective, and rank 1 did not call it within 3 s; call it on every rank"), message0
    assert kind1 == "PipelineFailure" and message1.startswith(
        "rank 0 (pp 0, dp 0, tp 0) failed: PipelineFailure: full_state_dict() is collective"), message1
    assert took0 < 15 and took1 < 15
