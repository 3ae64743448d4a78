"""The launch queue of an eager stage: a host that launches kernels ahead of the device.

See [Note: eager launch queue] in autopipe/measure/eager_host.py for the model: the host walks
the nodes and launches their kernels, the device runs each kernel once it is launched and the
one before it has finished, and a step's price is how far it moves the later of the two clocks.
Measured profiles replay their nodes' timed kernels through it; the analytic model of a table
fitted that way (``Calibration.launch_queue``) replays its own kernel prices: an op (a node, or a
part of a composite one) costs the host a time of its own and one per kernel it launches
(counted by its kind; ``Calibration.launch_host``), and a view a time of its own.

[Note: a stage starts idle]
One replay of the whole graph prices each node by how far it moves the later of the host's and
the device's clocks. Where GPU-bound layers come first, the device ends them milliseconds
behind the host, and the host-bound launches after them hide under that backlog: priced at
their device time. But a stage starts with an idle queue, whatever ran before it elsewhere. On
an H200, ResNet-50 at 128 images cut in 8 stages, eager: the nodes of the last stage (layer 4
and the head, host-bound) summed to 4.17 ms; the stage replayed alone from idle, 5.05 ms; timed,
5.05 ms (benchmarks/results/2026-11-29-h200-analytic-plans-eager-window-probe-p4b.json). With a
backlog of b at a stage's first node, the whole-graph sum falls short of the stage's replay by
min(b, replay - device time): not additive over the nodes. So the partitioner prices each stage
of a cut by its own replay (``stage_replays``) and cuts on those prices
([Note: cuts on stage replays] in replayed_cuts.py).

[Note: a replay's closed form]
A pass of launches (host seconds h_k, device seconds d_k) from an idle host and device ends at
max(H, D): the host's clock H = sum h, and the device's D = max over k of (H_k + sum_{j >= k} d_j),
H_k the host's clock once it has launched k (the device last waited for the host at some launch
k and ran from there without a gap). For the launches [p, q) of one pass, with exclusive prefix
sums Hx, Dx and G_k = Hx[k+1] - Dx[k]:
    replay(p, q) = max(Hx[q] - Hx[p], max_{p <= k < q} G_k - Hx[p] + Dx[q]),
a range maximum of one array, which a sparse table answers for every (p, q) at once.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from autopipe.partition.balance_problem import Windows
from autopipe.partition.cost import NodeCost

__all__ = ["Launch", "queue_steps", "queue_by_node", "analytic_launches", "pass_replays", "stage_replays"]

Launch = tuple[int, float, float]  # (node, host seconds, device seconds)


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


def queue_by_node(launches: Iterable[tuple[int, float, float]], nodes: int) -> np.ndarray:
    """The seconds each of ``nodes`` nodes adds to one pass through the launch queue:
    ``launches`` are (node, host seconds, device seconds) in launch order, a view's step with
    no device seconds."""
    owners: list[int] = []
    steps: list[tuple[float, float]] = []
    for node, host, device in launches:
        owners.append(node)
        steps.append((host, device))
    return np.bincount(np.array(owners, dtype=int), weights=queue_steps(steps), minlength=nodes)


def analytic_launches(costs: Sequence[NodeCost], kernel_time: Callable[[NodeCost, bool], float],
                      kernel_host: Callable[[NodeCost, bool], float],
                      view_host: tuple[float, float]) -> tuple[list[Launch], list[Launch]]:
    """The forward and the backward launches of ``costs`` (in graph order), each (node, host
    seconds, device seconds) in launch order: the forward runs the nodes in order and the
    backward in reverse (a composite's kernels too).

    ``kernel_time(cost, backward)``: the device seconds of one kernel (0: it launches nothing);
    ``kernel_host(cost, backward)``: what calling it costs the host. A node launches its
    ``parts`` (a composite module) or itself; a view launches nothing and costs the host
    ``view_host[d]`` (d: 0 forward, 1 backward); other nodes without work cost nothing."""
    out: list[list[Launch]] = []
    for d in (0, 1):
        launches: list[Launch] = []
        for i in (range(len(costs)) if d == 0 else range(len(costs) - 1, -1, -1)):
            c = costs[i]
            parts = c.parts or (c,)
            for part in parts if d == 0 else parts[::-1]:
                seconds = kernel_time(part, bool(d))
                if seconds > 0:
                    launches.append((i, kernel_host(part, bool(d)), seconds))
            if c.kind == "view" and view_host[d] > 0:
                launches.append((i, view_host[d], 0.0))
        out.append(launches)
    return out[0], out[1]


def stage_replays(launches: Sequence[Sequence[Launch]], starts: Sequence[int]) -> list[float]:
    """Each stage's seconds, forward and backward, as it runs: its own launches (of ``launches``,
    the passes ``analytic_launches`` gives) replayed from an idle host and device. Stage s holds
    the nodes from ``starts[s]`` to the next start ([Note: a stage starts idle])."""
    heads = np.asarray(starts, dtype=np.int64)
    ends = np.append(heads[1:], np.iinfo(np.int64).max)  # the last stage holds every node from its start
    return [float(t) for t in sum(pass_replays(p, heads, ends) for p in launches)]


def pass_replays(launches: Sequence[Launch], heads: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The replay from idle of the launches of nodes [heads, ends) (arrays of one shape) in one
    pass, in launch order: nodes ascending (a forward) or descending (a backward)
    ([Note: a replay's closed form])."""
    nodes = np.fromiter((n for n, _, _ in launches), dtype=np.int64, count=len(launches))
    backward = len(nodes) > 1 and nodes[0] > nodes[-1]
    host = np.fromiter((h for _, h, _ in launches), dtype=float, count=len(launches))
    device = np.fromiter((d for _, _, d in launches), dtype=float, count=len(launches))
    hx = np.concatenate(([0.0], np.cumsum(host)))
    dx = np.concatenate(([0.0], np.cumsum(device)))
    if backward:  # the launches of nodes >= b come first
        first, stop = (np.searchsorted(-nodes, -b, side="right") for b in (ends, heads))
    else:
        first, stop = (np.searchsorted(nodes, b, side="left") for b in (heads, ends))
    shape = first.shape
    first, stop = first.ravel(), stop.ravel()
    if len(launches) == 0:
        return np.zeros(shape)
    peak = Windows(first, stop - 1, len(launches)).reduce(hx[1:] - dx[:-1], np.maximum, -np.inf)
    replay = np.maximum(hx[stop] - hx[first], peak - hx[first] + dx[stop])
    return np.where(stop > first, replay, 0.0).reshape(shape)
