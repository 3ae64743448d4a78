"""How much slower each stage runs inside the pipeline than alone.

[Note: stage scale]
The closed loop ([Note: closed loop] in closed_loop.py) times each stage alone on one device.
In a running pipeline the same stages run slower, and not alike. On 4 H200s (NVLink, NCCL,
CUDA graphs, 8 micro-batches of 32 images), channels-last ResNet-50, Swin-B and ViT-L/16 cut on
measured times: each stage's forward + backward inside the pipeline took 1.05-1.10x its time
alone for the first stage and 1.15-1.34x for the three others. NCCL's send and receive kernels
run beside the stage's own: with ``NCCL_MAX_P2P_NCHANNELS=1`` the excess about halved, and the
transfers slowed. So stages balanced alone to within 4% were 5-9% apart in the pipeline.

``stage_scale(events, plan)`` reads each stage's time in the pipeline from a recorded step
(the median forward plus the median backward over its micro-batches, on every rank that runs
it) and divides it by the stage's time alone (the closed loop's ``measured_time``, else the
modelled ``compute_time``). Given back for the next cut (``MeasureOptions(stage_scale=...)``,
or ``partition(stage_scale=...)``), the partitioner balances ``scale[i] x`` the stage's time
plus its transfers (``balance.solve_scaled``): the slowdown belongs to the stage's place in the
pipeline (its neighbours and its transfers), not to the nodes it holds. The closed loop then
compares the scaled times of the stages it times alone, and the plan reports the scaled times.
The factors of the next cut stay within 0.01-0.02 of those of the first.
``MeasureOptions(pipeline_steps=n)`` has ``parallelize`` do it all: it builds a stand-in
pipeline of a copy of the model, runs a warm-up and n recorded steps on the example micro-batch
with a loss of zero (the same kernels, zero gradients), reads the factors on rank 0, sends them
to every rank, restores the random generators, and cuts the model with them (api.py).

What it buys (docs/benchmarks.md, "4 GPUs"): the stages inside the pipeline within 1.02 of
their mean (from 1.05-1.09), and Swin-B's ranks within 3.4% of each other (from 11%); the
throughput moved by -3% to +4%, since at 8 micro-batches over 4 stages the fill, the drain and
the transfers weigh as much as the slowest stage.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from autopipe.errors import ConfigError
from autopipe.partition.plan import PartitionPlan
from autopipe.runtime.timeline import COMPUTE, Event

__all__ = ["stage_scale", "stage_seconds"]


def stage_seconds(events: Sequence[Event]) -> dict[int, float]:
    """Each stage's forward + backward seconds for one micro-batch in a recorded step: the
    median forward plus the median backward over its micro-batches and ranks."""
    spans: dict[tuple[int, str], list[float]] = {}
    for e in events:
        if e.action in COMPUTE:
            spans.setdefault((e.stage, e.action), []).append(e.end - e.start)
    stages = sorted({s for s, _ in spans})
    return {s: sum(statistics.median(spans[(s, a)]) for a in COMPUTE if (s, a) in spans) for s in stages}


def stage_scale(events: Sequence[Event], plan: PartitionPlan, *,
                scale: Sequence[float] | None = None) -> tuple[float, ...]:
    """Each stage's time in the pipeline over its time alone; see [Note: stage scale].
    ``events``: every rank's timeline events of a training step (``timeline.gather``); ``plan``
    the plan that ran; ``scale`` the factors it was cut with, if any (its stage times are
    scaled by them, and are divided back)."""
    inside = stage_seconds(events)
    missing = [i for i in range(plan.num_stages) if i not in inside]
    if missing:
        raise ConfigError(f"the timeline has no forward or backward of stage(s) {missing}; record a whole "
                          "training step on every rank (parallelize(record_timeline=True), then gather)")
    old = [1.0] * plan.num_stages if scale is None else [float(f) for f in scale]
    if len(old) != plan.num_stages:
        raise ConfigError(f"scale has {len(old)} factors for a plan of {plan.num_stages} stages")
    out = []
    for i, stage in enumerate(plan.stages):
        alone = stage.measured_time if stage.measured_time else stage.compute_time
        if not alone or alone <= 0:
            raise ConfigError(f"stage {i} has no time alone (measured or modelled) to compare with")
        out.append(inside[i] * old[i] / alone)
    return tuple(out)
