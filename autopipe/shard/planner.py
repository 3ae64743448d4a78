"""``plan_sharding()``: match the rules over a traced graph and return a :class:`ShardPlan`.

Pure planning: reads shapes from node meta and module attributes, so a model on the meta
device plans like a real one. Every misfit (heads, widths, splits) is reported at once.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..errors import ConfigError, ShardingError, positive_int
from ..graph import MODULE_KEY
from ..tracer import TracedModel
from . import ops
from .layout import propagate
from .value_layout import Sharded
from .plan import NodeShard, ParamShard, ShardPlan
from .patterns import ordered_rules
from .rules import Claim, ShardRule

__all__ = ["plan_sharding"]

# Split name -> (dim, outer). See [Note: head-aware qkv slicing] in rules.py for "qkv".
_SPLITS = {"column": (0, 1), "row": (1, 1), "qkv": (0, 3), "replicated": (None, 1)}


def _claim(gm: fx.GraphModule, rules: Sequence[ShardRule]) -> dict[str, Claim]:
    claims: dict[str, Claim] = {}
    for rule in rules:
        matched = 0
        for node in gm.graph.nodes:
            if rule.find is not None:
                found = rule.find(node, gm, claims.keys())
                if found and not any(n in claims for n in found):
                    claims.update(found)
            elif rule.matches(node, gm):
                matched += 1
                claims.setdefault(node.name, rule.claim())
        if isinstance(rule.match, str) and not rule.builtin and matched == 0:
            paths = sorted({n.target for n in gm.graph.nodes if n.op == "call_module"})
            warnings.warn(f"ShardRule {rule.name!r}: pattern {rule.match!r} matches no module of "
                          f"{type(gm).__name__} (leaf modules: {', '.join(paths[:6])}{', ...' if len(paths) > 6 else ''})",
                          stacklevel=3)
    return claims


def _tensors_of(node: fx.Node, gm: fx.GraphModule) -> dict[str, tuple[str, torch.Tensor]]:
    """``{name relative to the node's module: (state_dict name, tensor)}`` a claimed node owns."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        named = list(m.named_parameters()) + list(m.named_buffers())
        return {rel: (f"{node.target}.{rel}", t) for rel, t in named}
    out = {}
    for a in ops.param_inputs(node):
        owner, _, field = a.target.rpartition(".")
        t = getattr(gm.get_submodule(owner) if owner else gm, field)
        if isinstance(t, torch.Tensor):
            out[field] = (a.target, t)
    return out


def _default_split(style: str, rel: str, t: torch.Tensor) -> str:
    if style == "mha":
        return {"in_proj_weight": "qkv", "in_proj_bias": "qkv", "out_proj.weight": "row"}.get(rel, "replicated")
    if style == "channel":
        return "column" if t.dim() >= 1 and rel != "num_batches_tracked" else "replicated"
    if style in ("column", "qkv"):
        return style if style == "qkv" else "column"
    if style == "row":
        return "row" if rel == "weight" else "replicated"  # the bias is added after the reduce
    return "replicated"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _param_splits(gm: fx.GraphModule, claims: dict[str, Claim], tp: int,
                  custom: dict[str, Any]) -> tuple[dict[str, ParamShard], list[str], list[int]]:
    params: dict[str, ParamShard] = {}
    problems: list[str] = []
    constraints: list[int] = []
    by_name = {n.name: n for n in gm.graph.nodes}
    seen_heads: set[str] = set()
    for node_name, claim in claims.items():
        node = by_name[node_name]
        if claim.heads is not None and claim.layer not in seen_heads:
            seen_heads.add(claim.layer)
            constraints.append(claim.heads)
            if claim.heads % tp:
                problems.append(f"layer '{claim.layer}' has {claim.heads} heads, which tp={tp} does not divide "
                                f"(rule '{claim.rule}'); valid tp for it: {', '.join(map(str, _divisors(claim.heads)))}")
        for rel, (qual, t) in _tensors_of(node, gm).items():
            split = claim.params.get(rel, _default_split(claim.style, rel, t))
            where = f"rule '{claim.rule}': parameter '{qual}' {list(t.shape)}"
            if callable(split):
                try:
                    shards = [split(t.detach().to("meta"), r, tp) for r in range(tp)]
                    local = tuple(shards[0].shape)
                except Exception as exc:
                    problems.append(f"{where}: custom split {getattr(split, '__name__', split)!r} failed: {exc}")
                    continue
                if any(tuple(s.shape) != local for s in shards):
                    problems.append(f"{where}: custom split gives shards of different shapes")
                    continue
                shard = ParamShard(tuple(t.shape), local, f"custom:{getattr(split, '__name__', 'fn')}", None, 1,
                                   claim.rule, str(t.dtype).removeprefix("torch."))
                custom[qual] = split
            else:
                dim, outer = _SPLITS[split]
                if dim is not None:
                    if dim >= t.dim():
                        problems.append(f"{where}: split '{split}' needs dim {dim}, the parameter has {t.dim()}")
                        continue
                    constraints.append(t.shape[dim] // outer if t.shape[dim] % outer == 0 else 1)
                    if t.shape[dim] % (tp * outer):
                        problems.append(f"{where}: split '{split}' cuts dim {dim} ({t.shape[dim]}"
                                        f"{f' = {outer} x {t.shape[dim] // outer}' if outer > 1 else ''}) "
                                        f"into tp={tp} pieces, which does not divide it")
                        continue
                local = list(t.shape)
                if dim is not None:
                    local[dim] //= tp
                shard = ParamShard(tuple(t.shape), tuple(local), split, dim, outer, claim.rule,
                                   str(t.dtype).removeprefix("torch."))
            old = params.get(qual)
            if old is not None and (old.split, old.dim) != (shard.split, shard.dim):
                problems.append(f"parameter '{qual}' is split '{old.split}' by rule '{old.rule}' and "
                                f"'{shard.split}' by rule '{shard.rule}'; keep one (it is used by several nodes)")
            params[qual] = shard
    return params, problems, constraints


def _label(claim: Claim, tp: int) -> str:
    if claim.style in ("qkv", "mha") or (claim.style == "column" and claim.heads):
        return f"heads:{claim.heads}->{claim.heads // tp}" if claim.heads else claim.style
    if claim.style == "column" and "gather_from_tp" in claim.after:
        return "column+gather"
    return claim.style


def plan_sharding(traced: TracedModel, tp: int, rules: Sequence[ShardRule] | None = None, *,
                  sequence_parallel: bool = False) -> ShardPlan:
    """Plan Megatron 1-D tensor parallelism of ``traced`` over ``tp`` ranks.

    ``rules`` take priority over registered rules, which take priority over the built-ins.
    ``sequence_parallel`` splits the layers between sharded pairs (norms, residual adds) across
    the ranks by sample: see [Note: sequence parallelism] in layout.py.
    Raises :class:`ShardingError` naming every layer or parameter that cannot be split.
    """
    positive_int("tp", tp)
    gm = traced.gm
    samples = traced.input_shapes[0][0] if traced.input_shapes and traced.input_shapes[0] else None
    if sequence_parallel and tp > 1 and samples is not None and samples % tp:
        raise ConfigError(
            f"sequence_parallel=True splits each micro-batch's {samples} samples across tp={tp} ranks; "
            f"use a micro-batch size divisible by {tp}, or sequence_parallel=False")
    claims = _claim(gm, ordered_rules(rules or ())) if tp > 1 else {}
    styles: dict[str, set[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            styles.setdefault(n.target, set()).add(claims[n.name].style if n.name in claims else "replicated")
    problems = [f"module '{t}' is called by several nodes with different shardings ({', '.join(sorted(s))}); "
                "a module's parameters split one way" for t, s in styles.items() if len(s) > 1]
    custom: dict[str, Any] = {}
    params, more, constraints = _param_splits(gm, claims, tp, custom)
    problems += more
    if problems:
        g = math.gcd(*constraints) if constraints else 1
        raise ShardingError(
            f"cannot shard {type(gm).__name__} over tp={tp}:\n" + "\n".join(f"  - {p}" for p in problems)
            + f"\ntp values every sharded layer of this model accepts: {', '.join(map(str, _divisors(g)))}. "
            "Or keep a layer replicated: parallelize(..., shard_rules=[ShardRule('keep', match='<module path>', "
            "style='replicated')]) (plan_sharding(..., rules=[...]) when planning alone)"
        )
    every = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, t in every:
        params.setdefault(name, ParamShard(tuple(t.shape), tuple(t.shape), "replicated", None, 1, "",
                                           str(t.dtype).removeprefix("torch.")))
    result = propagate(gm, claims, tp, sequence_parallel)
    nodes: dict[str, NodeShard] = {}
    for node in gm.graph.nodes:
        claim, lay = claims.get(node.name), result.layouts.get(node.name)
        module = node.meta.get(MODULE_KEY, "")
        if claim is not None:
            nodes[node.name] = NodeShard(_label(claim, tp), claim.rule, module)
        elif isinstance(lay, Sharded) or (isinstance(lay, tuple) and any(isinstance(x, Sharded) for x in lay)):
            nodes[node.name] = NodeShard("sharded-activation", "", module)
        else:
            nodes[node.name] = NodeShard("replicated", "", module)
    for c in result.collectives:
        owner = c.users[0] if c.kind in ("copy_to_tp", "all_gather_tp") else c.src  # the sharded layer it serves
        nodes[c.name] = NodeShard(f"collective:{c.kind}", nodes[owner].rule, c.module)
    return ShardPlan(tp=tp, model=type(gm).__name__, route=traced.route, nodes=nodes, params=params,
                     collectives=result.collectives, shape_edits=result.edits, swaps=result.swaps,
                     custom_splits=custom, sequence_parallel=sequence_parallel,
                     sequence_parallel_params=result.partial_params)
