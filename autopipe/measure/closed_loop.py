"""The closed loop: time the stages a plan emits, and cut again while they are not balanced.

[Note: closed loop]
A profile prices each segment alone; a stage is many segments run together, and runs a
little differently: per-stage fixed costs (the first launch, autograd's start, the cast of
its outputs), host work hidden behind longer kernels in eager mode, kernels fused across
segment boundaries by torch.compile. So after cutting, every stage is timed as it will run
(timer.py) and, while the measured largest-over-mean exceeds ``target``, each node's seconds
are scaled by its stage's measured-over-planned ratio and the graph is cut again. The loop
keeps the plan whose slowest measured stage is fastest (the slowest stage sets a pipeline's
pace), records every round in ``plan.refinement`` and the kept plan's stage times in
``StagePlan.measured_time``, and stops after ``rounds`` re-cuts.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from autopipe.errors import ConfigError
from autopipe.partition.plan import PartitionPlan

__all__ = ["refine"]


def refine(plan: PartitionPlan, node_seconds: Mapping[str, float], *,
           measure: Callable[[PartitionPlan], Sequence[float]],
           replan: Callable[[dict[str, float]], PartitionPlan],
           target: float = 1.05, rounds: int = 3) -> PartitionPlan:
    """See [Note: closed loop]. ``measure(plan)`` gives each stage's measured seconds (forward
    + backward, one micro-batch); ``replan(seconds)`` cuts the graph again from per-node seconds."""
    if not target >= 1.0:
        raise ConfigError(f"balance target {target!r} must be a max/mean ratio >= 1.0, e.g. 1.05")
    if not isinstance(rounds, int) or rounds < 0:
        raise ConfigError(f"closed-loop rounds must be a non-negative integer, got {rounds!r}")
    seconds = dict(node_seconds)
    log: list[dict[str, object]] = []
    best = plan
    for r in range(rounds + 1):
        times = [float(t) for t in measure(plan)]
        for stage, t in zip(plan.stages, times):
            stage.measured_time = t
        ratio = plan.measured_imbalance or 1.0
        log.append({"round": r, "measured_max": max(times), "measured_imbalance": ratio,
                    "starts": [stage.nodes[0] for stage in plan.stages]})
        if r == 0 or max(times) < max(s.measured_time for s in best.stages):
            best = plan
        if ratio <= target or r == rounds:
            break
        for stage, t in zip(plan.stages, times):
            planned = sum(seconds.get(n, 0.0) for n in stage.nodes)
            if planned > 0 and t > 0:
                for n in stage.nodes:
                    if n in seconds:
                        seconds[n] *= t / planned
        plan = replan(seconds)
    best.refinement = log
    return best
