"""A small tensor-parallel model, a stage forward that fails on cue, and a job built from them.

The job (``python -m tests.failing_job``, with torchrun's environment variables, 2 processes)
trains pp=2 and rank 1 raises in its stage's forward at the second step: test_failure.py runs
it as plain processes, not under the harness, to see how failed processes exit. Rank 0 is
then left with a thread blocked in a receive from rank 1. To make the race of [Note: exit after
a failure] certain, rank 1 leaves 2 s after failing and rank 0's interpreter takes 5 s to tear
down (a slow ``__del__``, as large programs have), so that the receive fails while rank 0 is
finalizing, which aborted the process before that Note's exit hook.
"""
from __future__ import annotations

import atexit
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopipe

IN, HIDDEN, OUT = 16, 64, 4


def mlp() -> nn.Module:
    """Two MLP pairs (each sharded column then row over tp), enough for pp=2."""
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, IN),
                         nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))


def batch(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g)


def fail_at(pm: autopipe.ParallelModel, call: int, *, die: bool = False) -> None:
    """Makes the ``call``-th forward of this rank's first stage raise ValueError("bad batch")
    (or, with ``die``, end the process with exit code 3, as a crash would)."""
    stage = pm.stages[min(pm.stages)]
    inner, calls = stage.forward, [0]

    def forward(*args: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == call:
            if die:
                os._exit(3)
            raise ValueError("bad batch")
        return inner(*args)

    stage.forward = forward


def train(pm: autopipe.ParallelModel, steps: int, on_step: Callable[[int], None] = lambda step: None) -> None:
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x, y = batch(4 * pm.dp_size)
    rows = slice(4 * pm.dp_rank, 4 * (pm.dp_rank + 1))
    for step in range(steps):
        on_step(step)
        opt.zero_grad()
        pm.train_step(x[rows], y[rows])
        pm.step(opt)


class _SlowTeardown:
    def __del__(self) -> None:
        time.sleep(5)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    pm = autopipe.parallelize(mlp(), (torch.randn(2, IN),), pp=2, microbatches=2, loss_fn=F.cross_entropy,
                              device="cpu", deadline=60)
    if dist.get_rank() == 1:
        fail_at(pm, 3)  # the first micro-batch of the second step
        atexit.register(time.sleep, 2)
    else:
        globals()["teardown"] = _SlowTeardown()
    train(pm, 3)


if __name__ == "__main__":
    main()
