"""The links between devices, as the layout search prices them, measured or taken from a profile.

[Note: link model]
Three transfers matter to a layout: a pipeline stage's activations and gradients to its
neighbour (point to point), the tensor-parallel collectives inside a stage, and the
data-parallel all-reduce of the gradients once per step. Each is priced as a latency per call
plus bytes over a bandwidth: point to point by ``p2p_latency`` and ``p2p_bandwidth``, the
collectives by ``collective_latency`` and ``collective_bandwidth``, the bus bandwidth in
NCCL's sense (an all-reduce of B bytes over n ranks moves 2 (n - 1) / n x B per rank).
``measure_links`` times both on the machine (a ping-pong between ranks 0 and 1, and
all-reduces over the group, at several sizes; latency and bandwidth are the line through
the times with the least relative error) and ``autopipe links`` writes the result for ``autopipe plan``. Without
a measurement the device profile's link figures stand in, marked as such.

[Note: collectives in a step]
An idle all-reduce says little of what a tensor-parallel collective costs inside a step.
On 2 gloo processes of one thread on a 2-core CPU, ViT's all-reduces of one micro-batch took
1.25 ms at 33 KB, 1.75 ms at 133 KB and 3.2 ms at 532 KB inside train_step (timed around each
call; ResNet-18's 1.5 ms at 34-137 KB), against 0.27 ms and about 1 GB/s idle: the ranks reach
each one at different times, and the processes that post and wait on it share the cores the
compute runs on. Where such figures were measured (``layout_choice_cpu.py`` fits them on a
model of its own), ``tp_latency`` and ``tp_bandwidth`` price the tensor-parallel collectives;
the data-parallel all-reduce of the gradients, a few large buckets, keeps the idle figures.

What a collective waits for is the other rank, which has drifted away during the compute before
it; a collective reached right after another finds the ranks together. Under sequence
parallelism each all-reduce becomes a reduce-scatter and, after the norms and residual adds of
1/tp of the tokens, an all-gather; backward, an all-gather follows a reduce-scatter the same way.
So of each sequence-parallel collective's two calls, one is reached after compute (the
in-step figures) and one right after another collective (the idle latency). On the 2-core CPU,
priced at the in-step figures both, ViT's tp=2 layouts with sequence parallelism came out
27-36% long at 2-8 micro-batches, while those without were within 12%
(results/2026-11-26-cpu-layout-choice-vit-before-follow.json); measured, sequence parallelism
added 28 ms to a 4-micro-batch step (64 more calls: 0.44 ms each, the idle all-reduce's 0.47).
That one step was the exception: over three later runs of every ViT layout
(results/2026-11-27-cpu-layout-choice-vit-*.json), sequence parallelism added more than priced to
every one of 24 pairs of layouts (the same micro-batches and checkpointing with it and without),
1.1-3.9x (median 1.9x; 141-166 ms measured at 8 micro-batches, 71-80 ms priced). A following call
still waits, if less. Where its latency was measured apart (``layout_choice_cpu.py`` fits it on
the sequence-parallel layouts of its own model), ``tp_follow_latency`` prices it.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from autopipe.errors import ConfigError
from autopipe.partition.device import DeviceProfile

__all__ = ["LinkModel", "measure_links"]


@dataclass(frozen=True)
class LinkModel:
    """Latencies (s) and bandwidths (B/s) of a machine's links; see [Note: link model]."""

    p2p_latency: float
    p2p_bandwidth: float
    collective_latency: float
    collective_bandwidth: float
    source: str = "device profile"  # "measured on ..." when measure_links made it
    # A tensor-parallel collective of one micro-batch as it costs inside a training step, where
    # that was measured apart (see [Note: collectives in a step]); None: as an idle all-reduce.
    tp_latency: float | None = None
    tp_bandwidth: float | None = None
    # A collective that follows another closely, inside a step, where that was measured apart;
    # None: as an idle all-reduce's latency.
    tp_follow_latency: float | None = None

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in asdict(self).items()
               if k != "source" and v is not None and not (v >= 0 and v < float("inf"))]
        bad += [f"{k}={getattr(self, k)!r}" for k in ("p2p_bandwidth", "collective_bandwidth", "tp_bandwidth")
                if getattr(self, k) is not None and not getattr(self, k) > 0]
        if bad:
            raise ConfigError(f"link model needs positive bandwidths and non-negative latencies, got {', '.join(bad)}")

    @classmethod
    def from_profile(cls, profile: DeviceProfile) -> LinkModel:
        return cls(profile.link_latency, profile.link_bandwidth, profile.link_latency, profile.link_bandwidth,
                   f"device profile {profile.name} (not measured)")

    def p2p(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` to a pipeline neighbour; 0 for nothing."""
        return 0.0 if nbytes <= 0 else self.p2p_latency + nbytes / self.p2p_bandwidth

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.collective_latency + 2 * (ranks - 1) / ranks * nbytes / self.collective_bandwidth

    def collectives(self, moved_bytes: Any, calls: Any, follow_calls: Any = 0) -> Any:
        """Seconds of tensor-parallel collectives moving ``moved_bytes`` per rank in all (numbers
        or arrays): ``calls`` reached after compute, at the in-step figures where there are some,
        and ``follow_calls`` that follow another collective closely, at ``tp_follow_latency``
        where it was measured, else the idle latency (see [Note: collectives in a step])."""
        latency = self.collective_latency if self.tp_latency is None else self.tp_latency
        bandwidth = self.collective_bandwidth if self.tp_bandwidth is None else self.tp_bandwidth
        follow = self.collective_latency if self.tp_follow_latency is None else self.tp_follow_latency
        return calls * latency + follow_calls * follow + moved_bytes / bandwidth

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump({"schema": 1, **asdict(self)}, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LinkModel:
        try:
            with open(path) as f:
                data = json.load(f)
            return cls(**{k: data[k] for k in ("p2p_latency", "p2p_bandwidth", "collective_latency",
                                                "collective_bandwidth", "source")},
                       **{k: data[k] for k in ("tp_latency", "tp_bandwidth", "tp_follow_latency")
                          if data.get(k) is not None})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read the link model {os.fspath(path)!r} ({type(exc).__name__}: {exc}); "
                              "measure it again with `torchrun --nproc-per-node N -m autopipe links --out FILE`") \
                from exc


def _fit(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(latency, bandwidth) of the line seconds = latency + bytes / bandwidth that fits the times
    with the least relative error: an unweighted fit is ruled by the largest transfers, and
    its intercept, what every small transfer (a tensor-parallel collective of one
    micro-batch) pays, can land far from the time of a small one (2.9 ms against 0.2 ms
    measured for gloo's all-reduce on 2 CPU processes)."""
    t = np.asarray(seconds, dtype=float)
    x = np.asarray(sizes, dtype=float)
    w = 1.0 / np.maximum(t, 1e-12)
    a = np.vstack([np.ones(len(x)), x]).T * w[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    # No transfer takes less than the latency: where the line (bent by a bandwidth that still
    # grows with size) crosses zero above the smallest transfer's time, the latency is that
    # time and the bandwidth is fitted to the rest (gloo's all-reduce on 2 CPU processes: 0.4
    # to 2.9 ms from one run to the next, unclipped).
    smallest = float(t[np.argmin(x)])
    if latency > smallest:
        latency = smallest
        rest = x > x.min()
        per_byte = float(np.sum(w[rest] ** 2 * (t[rest] - latency) * x[rest]) / np.sum((w[rest] * x[rest]) ** 2)) \
            if rest.any() else 0.0
    return max(float(latency), 0.0), 1.0 / max(float(per_byte), 1e-15)


def _timed(fn: Any, device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_links(device: torch.device | str, *, group: Any = None,
                  sizes: Sequence[int] = (1 << 12, 1 << 18, 1 << 22, 1 << 24, 1 << 25), reps: int = 10) -> LinkModel:
    """Time point-to-point transfers between ranks 0 and 1 and all-reduces over ``group``, at
    ``sizes`` bytes (up to a gradient bucket's: gloo's bandwidth still grows past 16 MB); every
    rank of the group calls it and gets the same model."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        raise ConfigError("measuring links needs two processes or more: launch with "
                          "`torchrun --nproc-per-node 2 -m autopipe links --out FILE`")
    device = torch.device(device)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    peer_of = {0: 1, 1: 0}
    p2p, ar = [], []
    for size in sizes:
        x = torch.zeros(size // 4, dtype=torch.float32, device=device)

        def ping_pong() -> None:
            if rank in peer_of:
                peer = dist.get_global_rank(group, peer_of[rank]) if group is not None else peer_of[rank]
                if rank == 0:
                    dist.send(x, peer, group=group)
                    dist.recv(x, peer, group=group)
                else:
                    dist.recv(x, peer, group=group)
                    dist.send(x, peer, group=group)

        p2p.append(_timed(ping_pong, device, reps) / 2)
        ar.append(_timed(lambda: dist.all_reduce(x, group=group), device, reps))
    # On the ranks' device: NCCL moves no CPU tensors.
    times = torch.tensor([p2p, ar], dtype=torch.float64, device=device)
    dist.broadcast(times, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    p2p, ar = times[0].tolist(), times[1].tolist()
    p2p_latency, p2p_bandwidth = _fit(sizes, p2p)
    moved = [2 * (world - 1) / world * s for s in sizes]
    coll_latency, coll_bandwidth = _fit(moved, ar)
    backend = dist.get_backend(group)
    return LinkModel(p2p_latency, p2p_bandwidth, coll_latency, coll_bandwidth,
                     f"measured on {world} ranks ({backend}, {device.type})")
