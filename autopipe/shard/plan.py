"""The shard plan: plain data saying how every node and parameter is split over ``tp`` ranks.

Made by :func:`plan_sharding` without processes or weights, applied by :func:`apply_sharding`,
printed by :meth:`ShardPlan.summary` and serialised by :meth:`ShardPlan.to_json`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "SCHEMA_VERSION",
    "NodeShard",
    "ParamShard",
    "CollectiveOp",
    "ShapeEdit",
    "ShardPlan",
    "collective_bytes",
]

SCHEMA_VERSION = 1

# A custom split: (full parameter, tp_rank, tp) -> this rank's shard.
SplitFn = Callable[[torch.Tensor, int, int], torch.Tensor]


@dataclass
class NodeShard:
    """How one node runs: ``column``, ``row``, ``replicated``, ``heads:12->6``, ``channel``,
    ``sharded-activation`` (an op on a sharded tensor), ``collective``..."""

    sharding: str
    rule: str  # the rule that chose it; "" where it follows from its inputs
    module: str


@dataclass
class ParamShard:
    """How one parameter or buffer (state_dict name) splits; ``dim`` is None when replicated.

    ``outer`` > 1 means the split dim holds ``outer`` stacked blocks (q, k, v) each split in
    ``tp``: see [Note: head-aware qkv slicing] in rules.py.
    """

    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    split: str  # "column" | "row" | "replicated" | "qkv" | "custom:<name>"
    dim: int | None
    outer: int = 1
    rule: str = ""
    dtype: str = "float32"

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def sharded(self) -> bool:
        return self.split != "replicated"


@dataclass
class CollectiveOp:
    """A collective node inserted after ``src``; ``users`` are the consumers rewired through it."""

    name: str
    kind: str  # a key of shard.collectives.COLLECTIVES: "copy_to_tp", "reduce_from_tp"...
    src: str
    users: tuple[str, ...]
    module: str
    shape: tuple[int, ...]  # of the full (gathered / reduced / copied) tensor, one micro-batch
    dtype: str
    fwd_bytes: int  # payload per rank, one micro-batch; a ring all-reduce moves 2 (tp-1)/tp of it
    bwd_bytes: int
    dim: int | None = None  # the dim gathered, scattered or split
    bias: str | None = None  # parameter added after the reduce (a row-parallel layer's bias)
    bias_trailing: int = 0  # output dims after the bias's: a conv's bias broadcasts as [C, 1, 1]


@dataclass
class ShapeEdit:
    """One size in a ``view``/``reshape``/``expand`` of a sharded tensor, made local.

    ``index`` is the position in the node's size list; ``new`` is an int, or ``"//tp"`` when
    the size is computed by another node (the rewrite divides it with a new node), or ``"*tp"``
    for a sequence-parallel region's local sample count used on a whole tensor.
    """

    node: str
    index: int
    old: int | str
    new: int | str


@dataclass
class ShardPlan:
    """Everything :func:`apply_sharding` needs, as plain data."""

    tp: int
    model: str
    route: str
    nodes: dict[str, NodeShard]
    params: dict[str, ParamShard]
    collectives: list[CollectiveOp]
    shape_edits: list[ShapeEdit]
    swaps: dict[str, str]  # node -> replacement leaf: "row", "mha", "tp_dropout"
    custom_splits: dict[str, SplitFn] = field(default_factory=dict, repr=False)  # not serialised
    sequence_parallel: bool = False
    # Replicated parameters applied to each rank's own samples (sequence parallelism): their
    # gradients are summed over the tp ranks, see reduce_sequence_parallel_grads.
    sequence_parallel_params: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    # -- queries ---------------------------------------------------------------------------
    def param_bytes(self) -> tuple[int, int]:
        """(bytes of all parameters and buffers, bytes one tp rank holds)."""
        full = sum(math.prod(p.shape) * p.itemsize for p in self.params.values())
        local = sum(math.prod(p.local_shape) * p.itemsize for p in self.params.values())
        return full, local

    def sharded_nodes(self) -> dict[str, NodeShard]:
        return {n: s for n, s in self.nodes.items() if s.sharding != "replicated"}

    # -- output ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("custom_splits")
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "ShardPlan":
        d = json.loads(text)
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"shard plan schema {d.get('schema_version')} is not {SCHEMA_VERSION}")
        return cls(
            tp=d["tp"], model=d["model"], route=d["route"],
            nodes={k: NodeShard(**v) for k, v in d["nodes"].items()},
            params={k: ParamShard(**{**v, "shape": tuple(v["shape"]), "local_shape": tuple(v["local_shape"])})
                    for k, v in d["params"].items()},
            collectives=[CollectiveOp(**{**c, "users": tuple(c["users"]), "shape": tuple(c["shape"])})
                         for c in d["collectives"]],
            shape_edits=[ShapeEdit(**e) for e in d["shape_edits"]],
            swaps=d["swaps"], sequence_parallel=d.get("sequence_parallel", False),
            sequence_parallel_params=list(d.get("sequence_parallel_params", [])),
        )

    def summary(self) -> str:
        """A short table of the sharded layers, then one of the collectives, then bytes per rank."""
        lines = [f"ShardPlan {self.model}: tp={self.tp}, route={self.route}"]
        layers = [(n, s.module, s.sharding, s.rule) for n, s in self.nodes.items()
                  if s.rule and not s.sharding.startswith("collective")]
        lines += _table(("node", "module", "sharding", "rule"), layers) if layers else ["(every node replicated)"]
        if self.collectives:
            lines += _table(("collective", "kind", "after", "fwd bytes", "bwd bytes"),
                            [(c.name, c.kind, c.src, str(c.fwd_bytes), str(c.bwd_bytes)) for c in self.collectives])
        fwd = sum(c.fwd_bytes for c in self.collectives)
        bwd = sum(c.bwd_bytes for c in self.collectives)
        full, local = self.param_bytes()
        lines.append(f"{len(self.collectives)} collectives: {fwd / 2**20:.2f} MiB forward, {bwd / 2**20:.2f} MiB "
                     f"backward per micro-batch; parameters {full / 2**20:.2f} MiB, {local / 2**20:.2f} MiB per tp rank")
        return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header)] + [fmt.format(*r) for r in rows]


def collective_bytes(plan: ShardPlan) -> dict[str, tuple[int, int]]:
    """Payload bytes of each collective node, ``{node: (forward, backward)}``, one micro-batch."""
    return {c.name: (c.fwd_bytes, c.bwd_bytes) for c in plan.collectives}
