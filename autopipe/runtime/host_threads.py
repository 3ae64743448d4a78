"""Where a rank's host threads run while its stages do.

[Note: host thread placement]
A stage in eager mode is host work as much as device work: the rank's thread dispatches every
op and launches its kernels, and each backward pass is run by autograd's device thread (one
per device and process, started by the first backward on that device) while the rank's thread
waits for it. At 32 images per micro-batch a ResNet-50 stage launches faster than an H200 runs
it only just, so its time is its host threads' time, and that depends on where the scheduler
puts them. On the 16-core H200 host, one plan of ResNet-50 in 8 stages timed five times in a
row: unpinned, the stages took 2.8-9.2 ms and each moved 1.1-1.9x between timings; pinned to
one core, 2.4-4.3 ms, six of eight moving 1.05-1.15x. A hand-over between threads on one core
is quick; between cores it waits for the other core to wake, on a virtual machine for its
hypervisor too.

So while a rank runs its CUDA stages, and while the timer times them (measure/timer.py), its
thread and autograd's device thread share one core:
- the core is the rank's own among the cores the process may use: local rank i of n (torchrun's
  LOCAL_RANK, LOCAL_WORLD_SIZE) takes the last core of the i-th of n equal slices, so ranks of
  one host do not share, and core 0, which takes most interrupts, is left to the system;
- the rank's thread is pinned on entering a step and given back its cores on leaving it, so
  what the user starts between steps (data-loader workers are forked from this thread and
  inherit its cores) keeps the process's cores;
- autograd's device thread is pinned once, from inside a backward pass (nothing else reaches
  it), and stays pinned: it runs only backward passes;
- nothing is pinned for CPU stages (their intra-op threads need the cores), where the process
  may use only one core anyway, or off Linux.

Where the job is one process (every stage on one GPU), this is the default. Where it is
several ranks, it is not: on 2 H200s (32 cores), a 2-stage eager pipeline of ViT-B/16 at 8
micro-batches of 32 ran at 1860 samples/s pinned against 2248 unpinned (ResNet-50: 2019 against
1915; results/2026-11-26-h200x2-host-threads-pp2.json), while in one process pinning gave
ResNet-50, ViT-B/16 and Swin-B 42-63% more (results/2026-11-26-h200-host-threads.json). Why is
not measured: in a pipeline the rank's thread also drives NCCL's point-to-point calls, and any
helper thread those start would share its core. ``AUTOPIPE_PIN_THREADS=1`` pins in every
process, ``=0`` in none.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

import torch

__all__ = ["host_core", "pinned_host_threads", "PIN_ENV"]

PIN_ENV = "AUTOPIPE_PIN_THREADS"

_device_threads: set[tuple[str, int]] = set()  # (device, core) whose autograd thread is pinned


def host_core(cores: set[int] | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """The core this rank's host threads run on (see [Note: host thread placement]), or None
    where there is no choice to make: fewer cores than local ranks, or one core in all."""
    environ = os.environ if environ is None else environ
    if cores is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        cores = os.sched_getaffinity(0)
    ordered = sorted(cores)
    rank = int(environ.get("LOCAL_RANK", 0) or 0)
    ranks = int(environ.get("LOCAL_WORLD_SIZE", 1) or 1)
    if len(ordered) < 2 or len(ordered) < ranks or not 0 <= rank < ranks:
        return None
    return ordered[(rank + 1) * len(ordered) // ranks - 1]


def _enabled(device: torch.device) -> bool:
    """Whether to pin for stages on ``device``; see [Note: host thread placement]."""
    if device.type != "cuda" or not hasattr(os, "sched_setaffinity"):
        return False
    setting = os.environ.get(PIN_ENV, "auto").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    return int(os.environ.get("WORLD_SIZE", "1") or 1) == 1  # "auto": a job of one process


@contextlib.contextmanager
def pinned_host_threads(device: torch.device | str) -> Iterator[int | None]:
    """Runs the block with this thread, and ``device``'s autograd thread, on this rank's core;
    yields the core (None where nothing is pinned). See [Note: host thread placement]."""
    device = torch.device(device)
    core = host_core() if _enabled(device) else None
    if core is None:
        yield None
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        _pin_device_thread(device, core)
        yield core
    finally:
        os.sched_setaffinity(0, before)


class _PinOnBackward(torch.autograd.Function):
    """Identity whose backward pins the thread that runs it: autograd's thread for ``x``'s device."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, core: int) -> torch.Tensor:  # type: ignore[override]
        ctx.core = core  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        os.sched_setaffinity(0, {ctx.core})  # type: ignore[attr-defined]
        return grad, None


def _pin_device_thread(device: torch.device, core: int) -> None:
    if device.index is not None:
        index = device.index
    else:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    key = (f"{device.type}:{index}", core)
    if key in _device_threads or torch.is_inference_mode_enabled():
        return
    with torch.enable_grad():
        x = torch.zeros(1, device=torch.device(device.type, index), requires_grad=True)
        _PinOnBackward.apply(x, core).sum().backward()
    _device_threads.add(key)
