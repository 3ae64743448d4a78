"""The partition plan: plain data saying which nodes each pipeline stage runs and what it costs.

A plan prints itself as a table, serialises to JSON (with a schema version) and draws itself;
it needs no process group and no GPU, so it is made and checked anywhere.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .report import format_table

__all__ = ["SCHEMA_VERSION", "CutTensor", "StagePlan", "PartitionPlan"]

SCHEMA_VERSION = 2


@dataclass(frozen=True)
class CutTensor:
    """A tensor crossing a stage boundary (one micro-batch)."""

    name: str  # the producing node
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", "int64"...
    nbytes: int


@dataclass
class StagePlan:
    index: int
    pp_rank: int
    chunk: int
    nodes: list[str]
    modules: tuple[str, str]  # owning modules of the first and the last node with one
    params: int
    param_bytes: int
    flops: float  # forward + backward
    compute_time: float  # modelled seconds, forward + backward, one micro-batch
    comm_time: float  # modelled seconds moving its cut tensors (overlaps compute)
    cost: float  # max(compute, comm) + transfer latency: what the balancer minimises the max of
    activation_bytes: int  # saved for backward, one micro-batch
    memory_bytes: int  # params, grads, optimizer state, and activations of in-flight micro-batches
    inputs: list[CutTensor]
    outputs: list[CutTensor]
    cut_bytes: int  # bytes sent to the next stage, one micro-batch
    shardings: dict[str, str] = field(default_factory=dict)  # node -> sharding, when tp > 1
    analytic_time: float = 0.0  # the analytic model's compute seconds, whatever priced the plan
    measured_time: float | None = None  # the emitted stage timed alone on the device, when it was


@dataclass
class PartitionPlan:
    model: str
    route: str
    pp: int
    chunks: int
    tp: int
    microbatches: int
    microbatch_size: int
    balance: str
    device: str
    schedule: str
    stages: list[StagePlan]
    imbalance: float
    total_params: int
    schema: int = SCHEMA_VERSION
    # MLPs a stage boundary falls inside: fc1 -> {"fc2": name, "hidden": piece boundaries}
    # (see [Note: MLP pieces] in stages/mlp_pieces.py); empty when every cut is between nodes.
    mlp_pieces: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What priced the stages' compute: {"source": "analytic", "profile": ..., "mode": ...} or
    # {"source": "measured", "device": ..., "mode": ..., ...}; see [Note: measured costs].
    cost_source: dict[str, Any] = field(default_factory=dict)
    # How the closed loop went (measure/closed_loop.py): one entry per round of timing.
    refinement: list[dict[str, Any]] = field(default_factory=list)
    # The least max/mean of the stages' compute that any split between whole nodes reaches, by
    # the same node prices (balance.least_imbalance): where ``imbalance`` sits at it, one node
    # is too large a share of a stage and only fewer stages (or an MLP cut in pieces) balance
    # better. None for plans made before it was recorded.
    floor: float | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def measured_imbalance(self) -> float | None:
        """Largest over mean of the stages' measured times; None unless every stage was timed."""
        times = [s.measured_time for s in self.stages]
        if not times or any(t is None for t in times):
            return None
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {n: s.index for s in self.stages for n in s.nodes}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = self.schema
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PartitionPlan":
        stages = []
        for s in d["stages"]:
            s = dict(s)
            s["inputs"] = [CutTensor(c["name"], tuple(c["shape"]), c["dtype"], c["nbytes"]) for c in s["inputs"]]
            s["outputs"] = [CutTensor(c["name"], tuple(c["shape"]), c["dtype"], c["nbytes"]) for c in s["outputs"]]
            s["modules"] = tuple(s["modules"])
            stages.append(StagePlan(**s))
        rest = {k: v for k, v in d.items() if k != "stages"}
        return cls(stages=stages, **rest)

    def __str__(self) -> str:
        return format_table(self)
