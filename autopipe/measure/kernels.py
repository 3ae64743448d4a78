"""Each node's own device time, forward and backward, read from the profiler's kernel records.

[Note: node times from kernels]
Timing a small piece of a graph alone with events measures the host more than the device:
launching one kernel through Python, autograd and a graph replay takes 100-300 us on an H100
host, longer than most kernels of a 32-image micro-batch take on the GPU. So node times come
from ``torch.profiler`` instead, which records every kernel's own duration (CUPTI) whatever
the host does around it:
- the stage runs under an ``fx.Interpreter`` that opens a ``record_function`` range per node,
  so every forward kernel falls under the node that launched it;
- the forward ops inside a node's range carry autograd sequence numbers, and the backward
  functions autograd evaluates carry the same numbers, so every backward kernel is traced
  back to its node too. An op records the number the next autograd node will get whether or
  not it makes one (``nn.Dropout(0.0)`` returns its input and makes none), so the number
  belongs to the last op that recorded it: the one that made the node;
- what no node claims (gradient accumulation into ``.grad``, the engine's own kernels) is
  returned as ``unattributed`` and spread by the caller.
The host time of each node (its range, its backward functions) and the kernels it launched are
read the same way; an eager stage prices them through its launch queue ([Note: eager launch
queue] in eager_host.py). On a CPU the op's own time is both. With activation checkpointing a node's forward runs again in the backward, so its
forward time is added to its backward time.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["NodeTimes", "node_times"]

_PREFIX = "autopipe:node:"
_BACKWARD = "autograd::engine::evaluate_function:"


@dataclass(frozen=True)
class NodeTimes:
    """Seconds per node and direction (median over repetitions); see [Note: node times from kernels]."""

    device: dict[str, tuple[float, float]]  # node -> (forward, backward) kernel seconds
    host: dict[str, tuple[float, float]]  # node -> (forward, backward) host seconds
    kernels: dict[str, tuple[int, int]]  # node -> kernels launched (forward, backward)
    unattributed: tuple[float, float]  # device seconds no node claims (forward, backward)


class _Ranges(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("call_module", "call_function", "call_method"):
            with record_function(_PREFIX + n.name):
                return super().run_node(n)
        return super().run_node(n)


def _launched(e: Any) -> list[float]:
    """Durations (us) of the device work launched under ``e``: kernels, copies and fills. A range's
    own GPU annotation (its span on the device, gaps included) is not work and is left out."""
    own = [k.duration for k in getattr(e, "kernels", ())
           if k.name != e.name and not k.name.startswith((_PREFIX, "autograd::"))]
    for c in e.cpu_children:
        own += _launched(c)
    return own


def _one_pass(stage: fx.GraphModule, inputs: Sequence[torch.Tensor], seeds: list[torch.Tensor] | None,
              device: torch.device, dtype: torch.dtype | None) -> tuple[dict, list[torch.Tensor]]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    interp = _Ranges(stage)
    with profile(activities=activities) as prof:
        if dtype is not None:
            with torch.autocast(device.type, dtype=dtype, cache_enabled=False):
                outs = interp.run(*inputs)
        else:
            outs = interp.run(*inputs)
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if seeds is None:
            seeds = [torch.randn_like(o) for o in outs]
        if outs:
            torch.autograd.backward(outs, seeds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _parse(prof.events(), cuda=device.type == "cuda"), seeds


def _parse(events: Any, *, cuda: bool) -> dict[str, Any]:
    owner: dict[int, str] = {}
    fwd: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # device us, host us, kernels
    bwd: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    claims: list[tuple[float, int, str]] = []
    # Not the device-side annotations; in the order the ops began, so that of the ops recording one
    # autograd sequence number the last is the one that made the node (see the Note).
    events = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    for e in events:
        if e.name.startswith(_PREFIX):
            name = e.name[len(_PREFIX):]
            work = _launched(e) if cuda else [e.cpu_time_total]
            cell = fwd[name]
            cell[0] += sum(work)
            cell[1] += e.cpu_time_total
            cell[2] += len(work)
            stack = list(e.cpu_children)
            while stack:
                c = stack.pop()
                if c.sequence_nr >= 0:
                    claims.append((c.time_range.start, c.sequence_nr, name))
                stack.extend(c.cpu_children)
    for _, seq, name in sorted(claims, key=lambda c: c[0]):
        owner[seq] = name
    lost = [0.0, 0.0]
    for e in events:
        if not e.name.startswith(_BACKWARD):
            continue
        work = _launched(e) if cuda else [e.cpu_time_total]
        name = owner.get(e.sequence_nr)
        if name is None:
            lost[1] += sum(work)
            continue
        cell = bwd[name]
        cell[0] += sum(work)
        cell[1] += e.cpu_time_total
        cell[2] += len(work)
    return {"fwd": dict(fwd), "bwd": dict(bwd), "lost": lost}


def node_times(stage: fx.GraphModule, inputs: Sequence[torch.Tensor], grads: Sequence[bool],
               device: torch.device, dtype: torch.dtype | None, *, reps: int = 3,
               recompute: bool = False) -> NodeTimes:
    """Profile ``stage`` (prepared for ``device``: weights there, weight casts installed)
    forward and backward ``reps`` times after one warm-up pass; see [Note: node times from kernels]."""
    xs = [x.detach().requires_grad_(g) for x, g in zip(inputs, grads)]
    _, seeds = _one_pass(stage, xs, None, device, dtype)  # warm-up: allocator, autotuning
    passes = [_one_pass(stage, xs, seeds, device, dtype)[0] for _ in range(max(reps, 1))]
    for p in stage.parameters():
        p.grad = None
    names = sorted({n for p in passes for d in ("fwd", "bwd") for n in p[d]})

    def median(direction: str, name: str, field: int) -> float:
        return statistics.median(p[direction].get(name, [0.0, 0.0, 0])[field] for p in passes)

    device_s, host_s, counts = {}, {}, {}
    for n in names:
        f_dev, b_dev = median("fwd", n, 0) * 1e-6, median("bwd", n, 0) * 1e-6
        f_host, b_host = median("fwd", n, 1) * 1e-6, median("bwd", n, 1) * 1e-6
        if recompute:  # the forward runs again inside the backward
            b_dev, b_host = b_dev + f_dev, b_host + f_host
        device_s[n], host_s[n] = (f_dev, b_dev), (f_host, b_host)
        counts[n] = (int(median("fwd", n, 2)), int(median("bwd", n, 2)))
        if recompute:
            counts[n] = (counts[n][0], counts[n][0] + counts[n][1])
    lost = tuple(statistics.median(p["lost"][i] for p in passes) * 1e-6 for i in range(2))
    return NodeTimes(device_s, host_s, counts, lost)  # type: ignore[arg-type]

