"""Measured costs: profile a graph on its device, plan from the profile, check the plan by timing it.

The layer above partition/, emit and runtime/: it runs stages on the device. ``measured_plan``
is what ``parallelize(costs="measured")`` and ``autopipe profile`` call; see
[Note: measured costs] (partition/measured.py), [Note: stage timing] (timer.py),
[Note: segments] (profile.py) and [Note: closed loop] (closed_loop.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopipe.errors import ProfileError
from autopipe.partition.measured import MeasuredCosts
from autopipe.partition.partitioner import partition
from autopipe.partition.plan import PartitionPlan
from autopipe.tracer import TracedModel

from .cache import ProfileCache, default_cache_dir
from .closed_loop import refine
from .profile import DEFAULT_SEGMENTS, _rank_world, _share, profile_graph, profile_key, segment_starts
from .timer import RunSetup, StageTiming, device_name, time_stages

__all__ = ["MeasureOptions", "measured_plan", "profile_graph", "time_stages", "time_plan", "RunSetup",
           "StageTiming", "ProfileCache", "refine", "segment_starts", "profile_key", "device_name",
           "default_cache_dir", "DEFAULT_SEGMENTS"]


@dataclass(frozen=True)
class MeasureOptions:
    """How to measure: segments of the profile (None: DEFAULT_SEGMENTS for the mode), repetitions
    per timing, the closed loop's max/mean target and re-cuts, and the cache directory (None:
    ``default_cache_dir()``; ``cache=False`` times again every time)."""

    segments: int | None = None
    reps: int = 10
    warmup: int = 2
    target: float = 1.05
    rounds: int = 3
    cache: bool = True
    cache_dir: str | None = None


def time_plan(traced: TracedModel, plan: PartitionPlan, setup: RunSetup, group: Any = None) -> list[float]:
    """Every stage's measured forward+backward seconds, ranks sharing the work (collective when
    torch.distributed is initialised)."""
    rank, world = _rank_world(group)
    mine = [i for i in range(plan.num_stages) if i % world == rank]
    timings = _share(lambda: time_stages(traced, plan, setup, mine), group, world)
    return [timings[i].seconds for i in range(plan.num_stages)]


def measured_plan(traced: TracedModel, setup: RunSetup, partition_args: dict[str, Any], *,
                  options: MeasureOptions = MeasureOptions(), measured: MeasuredCosts | None = None,
                  closed_loop: bool = True, group: Any = None) -> PartitionPlan:
    """Profile ``traced`` as ``setup`` runs it (or take ``measured``), cut it with
    ``partition(traced, **partition_args)`` on the measured costs, then time the stages and cut
    again while they are unbalanced. Collective when torch.distributed is initialised."""
    if measured is None:
        cache = ProfileCache(options.cache_dir) if options.cache else None
        measured = profile_graph(traced, dataclasses.replace(setup, reps=options.reps, warmup=options.warmup),
                                 segments=options.segments, cache=cache, group=group)
    else:
        key = profile_key(traced, setup)
        key.pop("torch_version")  # a profile given by hand may come from another torch
        measured.check(key, source="the given profile")
    plan = partition(traced, measured=measured, **partition_args)
    if not closed_loop:
        return plan
    timing = dataclasses.replace(setup, reps=options.reps, warmup=options.warmup)
    return refine(
        plan, measured.node_seconds, target=options.target, rounds=options.rounds,
        measure=lambda p: time_plan(traced, p, timing, group),
        replan=lambda seconds: partition(traced, measured=dataclasses.replace(measured, node_seconds=seconds),
                                         **partition_args))
