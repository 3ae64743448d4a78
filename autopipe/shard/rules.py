"""Sharding rules: which nodes split how, as a registry users extend.

A rule matches nodes (by module type, by op target, by a glob on the module path, or by a
structural ``find``) and claims them with a style; the planner turns claims into a plan.
Priority: rules given to ``plan_sharding(rules=...)``, then registered ones (latest first),
then the built-ins of patterns.py. A node claimed once is not claimed again.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Mapping

import torch.fx as fx

from ..errors import ShardingError
from ..graph import MODULE_KEY
from . import ops
from .plan import SplitFn

__all__ = ["STYLES", "Split", "Claim", "ShardRule", "register_rule", "unregister_rule",
           "registered_rules", "column_parallel_head"]

# [Note: head-aware qkv slicing]
# A fused qkv projection (timm's ``attn.qkv``, the packed ``in_proj_weight`` of
# nn.MultiheadAttention) has 3 * heads * head_dim output rows ordered [3, heads, head_dim]:
# all q rows, then all k rows, then all v rows. A plain column split would give rank 0 the q
# and half of the k rows. Viewing the rows as [3, tp, heads/tp * head_dim] and keeping
# [:, rank] gives every rank the q, k and v rows of its own heads, so attention runs locally
# and the reshape to (B, N, 3, heads, head_dim) only needs heads -> heads/tp. The split is
# "qkv" (outer=3) in the plan; separate q/k/v Linears are plain column splits ([heads, head_dim]).

STYLES = ("column", "qkv", "row", "channel", "mha", "replicated")
AFTER_KINDS = ("reduce_from_tp", "gather_from_tp")
# How one parameter splits: "column" (dim 0), "row" (dim 1), "qkv" (dim 0, see the note),
# "replicated", or a callable (param, tp_rank, tp) -> shard (give it a ``merge(shards)``
# attribute so that gather_full_state_dict can rebuild the full tensor).
Split = str | SplitFn
SPLIT_NAMES = ("column", "row", "qkv", "replicated")

Matcher = type | tuple[type, ...] | str | Callable[..., Any] | None
Finder = Callable[[fx.Node, fx.GraphModule, Container[str]], "dict[str, Claim] | None"]  # (node, gm, claimed)


@dataclass(frozen=True)
class Claim:
    """A node's style as decided by ``rule``; ``after``: collectives inserted after the node."""

    style: str
    rule: str
    after: tuple[str, ...] = ()
    outer: int = 1
    heads: int | None = None
    layer: str = ""  # the layer named in errors (an attention module for heads)
    params: Mapping[str, Split] = field(default_factory=dict)


_DEFAULT_AFTER = {"row": ("reduce_from_tp",), "mha": ("reduce_from_tp",)}


@dataclass(frozen=True, eq=False)
class ShardRule:
    """A sharding rule. ``match``: a module type (or tuple), an op target (``torch.matmul``,
    ``torch.ops.aten.mm.default``) or a glob on the module path (``blocks.*.mlp.fc1``, also
    matched as a dotted suffix: ``mlp.fc2`` matches ``blocks.0.mlp.fc2``). ``style``: one of
    STYLES. ``params``: per-parameter split overrides (names relative to the module).
    ``collectives``: those inserted after the node (default: a reduce after row/mha); the f
    operator before a sharded region is always inserted. ``find``: a structural matcher
    claiming several nodes at once (the built-ins)."""

    name: str
    match: Matcher = None
    style: str = "replicated"
    params: Mapping[str, Split] = field(default_factory=dict)
    collectives: tuple[str, ...] | None = None
    find: Finder | None = None
    builtin: bool = False

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ShardingError(f"rule {self.name!r}: style {self.style!r} is not one of {', '.join(STYLES)}")
        if (self.match is None) == (self.find is None):
            raise ShardingError(f"rule {self.name!r}: give exactly one of match= or find=")
        for k, s in self.params.items():
            if isinstance(s, str) and s not in SPLIT_NAMES:
                raise ShardingError(f"rule {self.name!r}: split {s!r} of {k!r} is not one of "
                                    f"{', '.join(SPLIT_NAMES)} or a callable (param, tp_rank, tp) -> shard")
        after = self.after
        bad = [c for c in after if c not in AFTER_KINDS]
        if bad:
            raise ShardingError(f"rule {self.name!r}: unknown collectives {bad}; use {AFTER_KINDS}")
        if self.style in ("row", "mha") and "reduce_from_tp" not in after:
            raise ShardingError(f"rule {self.name!r}: a {self.style} layer's output is a partial sum "
                                "and needs collectives=('reduce_from_tp',)")
        if "gather_from_tp" in after and self.style not in ("column", "qkv"):
            raise ShardingError(f"rule {self.name!r}: 'gather_from_tp' follows column-parallel layers only")

    @property
    def after(self) -> tuple[str, ...]:
        return self.collectives if self.collectives is not None else _DEFAULT_AFTER.get(self.style, ())

    def claim(self) -> Claim:
        return Claim(self.style, self.name, self.after, 3 if self.style == "qkv" else 1, params=self.params)

    def matches(self, node: fx.Node, gm: fx.GraphModule) -> bool:
        if node.op not in ("call_module", "call_function", "call_method"):
            return False
        m = self.match
        if isinstance(m, str):
            path = node.meta.get(MODULE_KEY, "")
            if not path:
                return False
            if self.style == "replicated":  # a whole subtree may be kept replicated
                parts = path.split(".")
                return any(_glob(".".join(parts[:i]), m) for i in range(1, len(parts) + 1))
            if node.op == "call_module":
                return _glob(path, m)
            return bool(ops.param_inputs(node)) and _glob(path, m)
        if isinstance(m, (type, tuple)):
            return node.op == "call_module" and isinstance(ops.module_of(node, gm), m)
        target = node.target
        return target == m or getattr(target, "overloadpacket", None) == m


def _glob(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def column_parallel_head(match: str = "head") -> ShardRule:
    """The classifier column-parallel, its logits all-gathered (the default keeps it replicated)."""
    return ShardRule("column-parallel-head", match=match, style="column", collectives=("gather_from_tp",))


_USER: list[ShardRule] = []


def register_rule(rule: ShardRule) -> None:
    """Add ``rule`` for every later plan; it replaces a registered or built-in rule of its name."""
    unregister_rule(rule.name)
    _USER.append(rule)


def unregister_rule(name: str) -> None:
    _USER[:] = [r for r in _USER if r.name != name]


def registered_rules() -> list[ShardRule]:
    return list(_USER)
