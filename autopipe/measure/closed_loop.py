"""The closed loop: time the stages a plan emits, and cut again while they are not balanced.

[Note: closed loop]
A profile prices each node by what it did in its segment; a stage is many nodes run together,
and runs a little differently: per-stage fixed costs (the first launch, autograd's start, the
cast of its outputs), host work hidden behind longer kernels in eager mode, kernels fused
across node boundaries by torch.compile. So after cutting, every stage is timed as it will run
(timer.py), and while the measured largest-over-mean exceeds ``target`` the graph is cut again
from corrected costs:
- the profile's segments (groups of consecutive nodes, [Note: segments] in profile.py) each get
  a correction factor g, and stages a shared fixed time c: every stage timed so far, in every
  round, is one equation ``sum over groups of g[k] x planned[stage, k] + c = measured[stage]``;
- g and c are the non-negative least-squares solution on relative error, pulled towards
  g = 1 (the profile) so that groups no timing has told apart stay as profiled;
- node seconds are the profiled ones times their group's factor, and the graph is cut again.
Each round adds equations, so corrections sharpen instead of chasing the last round's noise.
The loop keeps the plan whose slowest measured stage is fastest (the slowest stage sets a
pipeline's pace), records every round in ``plan.refinement`` and the kept plan's stage times
in ``StagePlan.measured_time``, and stops after ``rounds`` re-cuts.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from autopipe.errors import ConfigError
from autopipe.partition.plan import PartitionPlan

__all__ = ["refine", "PRIOR"]

PRIOR = 0.2  # pull of each group's factor towards 1, against equations of weight 1


def refine(plan: PartitionPlan, *, groups: int,
           planned: Callable[[PartitionPlan], list[dict[int, float]]],
           measure: Callable[[PartitionPlan], Sequence[float]],
           replan: Callable[[list[float]], PartitionPlan],
           target: float = 1.05, rounds: int = 3) -> PartitionPlan:
    """See [Note: closed loop]. ``planned(plan)`` gives, per stage, the profiled seconds of its
    nodes by group; ``measure(plan)`` each stage's measured seconds (forward + backward, one
    micro-batch); ``replan(factors)`` cuts the graph again with each group's seconds scaled."""
    if not target >= 1.0:
        raise ConfigError(f"balance target {target!r} must be a max/mean ratio >= 1.0, e.g. 1.05")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise ConfigError(f"closed-loop rounds must be a non-negative integer, got {rounds!r}")
    rows: list[np.ndarray] = []
    times: list[float] = []
    log: list[dict[str, object]] = []
    best = plan
    for r in range(rounds + 1):
        measured = [float(t) for t in measure(plan)]
        for stage, t in zip(plan.stages, measured):
            stage.measured_time = t
        ratio = plan.measured_imbalance or 1.0
        log.append({"round": r, "measured_max": max(measured), "measured_imbalance": ratio,
                    "stage_starts": [stage.nodes[0] for stage in plan.stages]})
        if r == 0 or max(measured) < max(s.measured_time for s in best.stages):
            best = plan
        if ratio <= target or r == rounds:
            break
        for by_group, t in zip(planned(plan), measured):
            row = np.zeros(groups + 1)
            for k, seconds in by_group.items():
                row[k] = seconds
            row[-1] = 1.0  # the stage's fixed time
            rows.append(row)
            times.append(t)
        factors = _solve(np.array(rows), np.array(times), groups)
        log[-1]["factors"] = [round(f, 4) for f in factors]
        plan = replan(factors)
    best.refinement = log
    return best


def _solve(a: np.ndarray, t: np.ndarray, groups: int) -> list[float]:
    """Group factors g >= 0 and a fixed time c >= 0 minimising relative error, g pulled to 1."""
    from scipy.optimize import nnls

    keep = t > 0
    w = 1.0 / t[keep]
    aw, tw = a[keep] * w[:, None], t[keep] * w
    prior = np.zeros((groups, groups + 1))
    prior[:, :groups] = np.eye(groups) * PRIOR
    sol, _ = nnls(np.vstack([aw, prior]), np.concatenate([tw, np.full(groups, PRIOR)]), maxiter=20 * (groups + 1))
    return [float(g) if g > 0 else 1.0 for g in sol[:groups]]
