"""The launch queue of an eager stage: a host that launches kernels ahead of the device.

See [Note: eager launch queue] in autopipe/measure/eager_host.py for the model: the host walks
the nodes and launches their kernels, the device runs each kernel once it is launched and the
one before it has finished, and a step's price is how far it moves the later of the two clocks.
Measured profiles replay their nodes' timed kernels through it; the analytic model of a table
fitted that way (``Calibration.launch_queue``) replays its own kernel prices.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from autopipe.partition.cost import NodeCost

__all__ = ["queue_steps", "analytic_queue_times"]


def queue_steps(steps: Iterable[tuple[float, float]]) -> list[float]:
    """For each (host seconds, device seconds) step in launch order, from an idle host and device,
    how far it moves the later of their clocks. The prices add up to the whole replay."""
    host = device = clock = 0.0
    out = []
    for host_seconds, device_seconds in steps:
        host += host_seconds
        if device_seconds > 0:
            device = max(device, host) + device_seconds
        later = max(host, device)
        out.append(later - clock)
        clock = later
    return out


def analytic_queue_times(costs: Sequence[NodeCost], kernel_time: Callable[[NodeCost, bool], float],
                         host: tuple[float, float],
                         view_host: tuple[float, float]) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each node of ``costs`` (in graph order) when the forward runs
    them in order and the backward in reverse (a composite's kernels too), as one eager stage
    through the launch queue.

    ``kernel_time(cost, backward)``: the device seconds of one kernel (0: it launches nothing). A
    node launches its ``parts`` (a composite module) or itself, each kernel costing the host
    ``host[d]`` (d: 0 forward, 1 backward); a view launches nothing and costs the host
    ``view_host[d]``; other nodes without work cost nothing."""
    out = [[0.0, 0.0] for _ in costs]
    for d in (0, 1):
        order = range(len(costs)) if d == 0 else range(len(costs) - 1, -1, -1)
        owners: list[int] = []
        steps: list[tuple[float, float]] = []
        for i in order:
            c = costs[i]
            parts = c.parts or (c,)
            for part in parts if d == 0 else parts[::-1]:
                seconds = kernel_time(part, bool(d))
                if seconds > 0:
                    owners.append(i)
                    steps.append((host[d], seconds))
            if c.kind == "view" and view_host[d] > 0:
                owners.append(i)
                steps.append((view_host[d], 0.0))
        for i, step in zip(owners, queue_steps(steps)):
            out[i][d] += step
    return [(f, b) for f, b in out]
