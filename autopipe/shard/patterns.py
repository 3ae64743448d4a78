"""The built-in rules: structural patterns (attention, MLP pairs, conv pairs, classifier).

Each ``find`` looks at one node and, when the pattern around it fits, claims every node of
the pattern at once; the planner applies a claim only if none of its nodes is taken.
"""
from __future__ import annotations

import warnings
from typing import Callable, Container, Sequence

import torch.fx as fx
import torch.nn as nn

from ..graph import value_of
from . import ops
from .rules import Claim, ShardRule, registered_rules

__all__ = ["BUILTINS", "ordered_rules"]


def _heads(module: nn.Module) -> int | None:
    for attr in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            return v
    cfg = getattr(module, "config", None)
    return getattr(cfg, "num_attention_heads", None) if cfg is not None else None


def _graph_heads(node: fx.Node, fused: bool) -> int | None:
    """Heads read off the reshape that follows a projection: (B, N, [3,] heads, head_dim)."""
    src = value_of(node)
    for u in node.users:
        out = value_of(u)
        if u.op in ("call_method", "call_function") and ops.op_name(u) in ops.RESHAPES and hasattr(out, "shape"):
            rest = tuple(out.shape)[src.dim() - 1:]
            if fused and len(rest) == 3 and rest[0] == 3:
                return rest[1]
            if not fused and len(rest) == 2:
                return rest[0]
    return None


def _layer_heads(node: fx.Node, gm: fx.GraphModule, fused: bool) -> int | None:
    # Non-leaf modules of a traced GraphModule are bare: the graph is the reliable witness.
    layer = _parent(node.target)
    found = _heads(gm.get_submodule(layer)) if layer else None
    return found if found is not None else _graph_heads(node, fused)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _forward_to_linears(starts: Sequence[fx.Node], gm: fx.GraphModule, limit: int = 200) -> list[fx.Node] | None:
    """The Linear nodes first reached going forward from ``starts`` (None if output is reached)."""
    seen, found, stack = set(starts), [], [u for s in starts for u in s.users]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output" or len(seen) > limit:
            return None
        if ops.is_linear(n, gm):
            found.append(n)
            continue
        stack.extend(n.users)
    return found


def _walk_back(end: fx.Node, gm: fx.GraphModule, is_source: Callable[[fx.Node], bool],
               passes: Callable[[fx.Node], bool]) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """Sources and in-between nodes feeding ``end``'s first input through ``passes`` ops only.

    None when something else feeds the region (a residual, a parameter) or a region value
    escapes it: then splitting the region would leak a sharded activation.
    """
    sources: list[fx.Node] = []
    region: list[fx.Node] = []
    stack = [end.args[0]] if end.args and isinstance(end.args[0], fx.Node) else []
    while stack:
        n = stack.pop()
        if n in sources or n in region:
            continue
        if is_source(n):
            sources.append(n)
        elif passes(n):
            region.append(n)
            stack.extend(n.all_input_nodes)
        else:
            return None
    inside = set(sources) | set(region) | {end}
    if not sources or any(u not in inside for n in sources + region for u in n.users):
        return None
    return sources, region


def _find_mha(node: fx.Node, gm: fx.GraphModule, claimed: Container[str]) -> dict[str, Claim] | None:
    m = ops.module_of(node, gm)
    if not isinstance(m, nn.MultiheadAttention):
        return None
    if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
        warnings.warn(f"nn.MultiheadAttention '{node.target}' uses kdim/vdim, bias_k or add_zero_attn; "
                      "kept replicated", stacklevel=3)
        return None
    return {node.name: Claim("mha", "attention-mha", ("reduce_from_tp",), 3, m.num_heads, node.target)}


def _find_fused_qkv(node: fx.Node, gm: fx.GraphModule, claimed: Container[str]) -> dict[str, Claim] | None:
    if not ops.is_linear(node, gm) or node.target.rpartition(".")[2] not in ("qkv", "qkv_proj", "Wqkv"):
        return None
    outs = _forward_to_linears([node], gm)
    if not outs or len(outs) != 1 or ops.module_of(node, gm).out_features % 3:
        return None
    layer = _parent(node.target)
    heads = _layer_heads(node, gm, fused=True)
    return {node.name: Claim("qkv", "attention-qkv-fused", (), 3, heads, layer),
            outs[0].name: Claim("row", "attention-qkv-fused", ("reduce_from_tp",), layer=layer)}


_Q, _K, _V = ("query", "q_proj", "q", "to_q", "wq"), ("key", "k_proj", "k", "to_k", "wk"), ("value", "v_proj", "v", "to_v", "wv")


def _find_separate_qkv(node: fx.Node, gm: fx.GraphModule, claimed: Container[str]) -> dict[str, Claim] | None:
    leaf = node.target.rpartition(".")[2] if node.op == "call_module" else ""
    if not ops.is_linear(node, gm) or leaf not in _Q or not node.args:
        return None
    layer = _parent(node.target)
    siblings = {u.target.rpartition(".")[2]: u for u in node.args[0].users
                if ops.is_linear(u, gm) and _parent(u.target) == layer}
    k = next((siblings[n] for n in _K if n in siblings), None)
    v = next((siblings[n] for n in _V if n in siblings), None)
    if k is None or v is None:
        return None
    outs = _forward_to_linears([node, k, v], gm)
    if not outs or len(outs) != 1:
        return None
    heads = _layer_heads(node, gm, fused=False)
    col = Claim("column", "attention-qkv-separate", (), 1, heads, layer)
    return {node.name: col, k.name: col, v.name: col,
            outs[0].name: Claim("row", "attention-qkv-separate", ("reduce_from_tp",), layer=layer)}


def _find_mlp_pair(node: fx.Node, gm: fx.GraphModule, claimed: Container[str]) -> dict[str, Claim] | None:
    if not ops.is_linear(node, gm):
        return None
    found = _walk_back(node, gm, lambda n: ops.is_linear(n, gm) and n.name not in claimed,
                       lambda n: ops.is_elementwise(n, gm))
    if found is None:
        return None
    claims = {s.name: Claim("column", "mlp-pair") for s in found[0]}
    claims[node.name] = Claim("row", "mlp-pair", ("reduce_from_tp",))
    return claims


def _find_conv_pair(node: fx.Node, gm: fx.GraphModule, claimed: Container[str]) -> dict[str, Claim] | None:
    if node.op != "call_module" or not ops.is_conv(node, gm):
        return None
    found = _walk_back(node, gm, lambda n: ops.is_conv(n, gm) and n.name not in claimed,
                       lambda n: ops.is_elementwise(n, gm) or ops.is_batchnorm(n, gm))
    if found is None:
        return None
    claims = {s.name: Claim("column", "conv-pair") for s in found[0]}
    claims.update({n.name: Claim("channel", "conv-pair") for n in found[1] if ops.is_batchnorm(n, gm)})
    claims[node.name] = Claim("row", "conv-pair", ("reduce_from_tp",))
    return claims


def _find_classifier(node: fx.Node, gm: fx.GraphModule, claimed: Container[str]) -> dict[str, Claim] | None:
    if ops.is_linear(node, gm) and any(u.op == "output" for u in node.users):
        return {node.name: Claim("replicated", "classifier")}
    return None


BUILTINS: list[ShardRule] = [
    ShardRule("attention-mha", find=_find_mha, style="mha", builtin=True),
    ShardRule("attention-qkv-fused", find=_find_fused_qkv, style="qkv", builtin=True),
    ShardRule("attention-qkv-separate", find=_find_separate_qkv, style="column", builtin=True),
    ShardRule("mlp-pair", find=_find_mlp_pair, style="column", builtin=True),
    ShardRule("conv-pair", find=_find_conv_pair, style="column", builtin=True),
    ShardRule("classifier", find=_find_classifier, style="replicated", builtin=True),
]


def ordered_rules(per_call: Sequence[ShardRule] = ()) -> list[ShardRule]:
    """Every rule in priority order: per-call, registered (latest first), built-ins."""
    chosen = list(per_call) + list(reversed(registered_rules()))
    names = {r.name for r in chosen}
    return chosen + [r for r in BUILTINS if r.name not in names]
