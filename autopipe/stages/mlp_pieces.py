"""MLPs cut into pieces of their hidden units, so that a stage boundary can fall inside one.

[Note: MLP pieces]
At node granularity a boundary falls between nodes, so a model whose stages hold only a few
large matmuls cannot be balanced finer than its largest node: ViT-B/16 at pp=8 has 1.5 blocks
a stage, and its fc1 and fc2 are each about a tenth of one. An MLP ``fc2(act(fc1(x)))`` (any
chain of elementwise ops between the two linears) splits exactly by hidden unit, as Megatron's
tensor parallelism splits it: with the hidden units cut at ``0 = h_0 < h_1 < ... < h_k = H``,

    fc2(act(fc1(x))) = sum_i fc2_i(act(fc1_i(x)))

where ``fc1_i`` holds rows [h_i, h_i+1) of fc1's weight and bias and ``fc2_i`` columns
[h_i, h_i+1) of fc2's weight (``fc2_0`` adds fc2's bias). ``cut_mlps`` rewrites a traced graph
that way: piece i is ``<fc1>_piece{i}`` -> the elementwise chain -> ``<fc2>_piece{i}``, and the
partial outputs are added. A stage boundary between two pieces carries the MLP's input and the
partial sum so far; the stages split the parameters between them (nothing is replicated, no
gradient is summed across stages), and only the additions of ``fc2``-sized partials are new
work. Cutting by output rows with a ``torch.cat`` instead would copy fc1's 4x wider output.

``plan_stages`` (piece_plan.py) tries it when a node-level plan is imbalanced (``split_mlps=True``,
balance="cost", tp=1): it cuts every large MLP into fine pieces, balances, and keeps pieces only
in the MLPs a boundary fell inside, one piece per stage (``PartitionPlan.mlp_pieces``: fc1 ->
{"fc2": name, "hidden": boundaries}). Stage emission applies the same rewrite, so the plan's node
names are the graph's.

State keeps the model's names outside the stages: ``piece_params`` maps each piece's state_dict
key to (full key, dim, start, stop), ``merge_pieces`` rebuilds full tensors from their pieces and
``take_piece`` cuts a piece out of a full tensor (``full_state_dict``, ``load_full_state_dict``
and checkpoints use them).
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Container, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import CheckpointError, PartitionError
from ..graph import MODULE_KEY, keep_buffer_persistence, value_of
from ..shard import ops
from ..tracer import TracedModel

__all__ = ["Mlp", "PieceParam", "find_mlps", "cut_mlps", "fine_hidden", "coarse_pieces", "pieces_for", "piece_seconds",
           "piece_params", "merge_pieces", "take_piece", "PIECES_META", "PARTIAL_SUM", "PIECE_OF"]

Pieces = Mapping[str, Mapping[str, Any]]  # fc1 -> {"fc2": name, "hidden": boundaries}

PIECES_META = "autopipe_mlp_pieces"  # on a split GraphModule: the pieces it was cut into
PARTIAL_SUM = "autopipe_partial_sum"  # on the nodes adding the pieces' partial outputs
PIECE_OF = "autopipe_piece_of"  # on a piece's nodes: (the unsplit node's name, its share of the work)
HIDDEN_ALIGN = 8  # piece boundaries are multiples of this many hidden units
MAX_PIECES = 8


@dataclass(frozen=True)
class Mlp:
    """Two nn.Linear calls joined by a chain of elementwise ops (each the only user of the last)."""

    fc1: fx.Node
    chain: tuple[fx.Node, ...]
    fc2: fx.Node


@dataclass(frozen=True)
class PieceParam:
    """A piece's tensor as part of the model's: rows (dim 0) or columns (dim 1) [start, stop),
    or the whole tensor (dim None: fc2's bias, held by piece 0)."""

    full: str
    dim: int | None
    start: int
    stop: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full`` (a view); a 0-dim tensor, such as an optimizer step, is shared."""
        if self.dim is None or full.dim() == 0:
            return full
        return full.narrow(self.dim, self.start, self.stop - self.start)

    @property
    def stored(self) -> str:
        """The name checkpoints save this piece under: ``<full>[a:b]`` (rows), ``<full>[:,a:b]``
        (columns), or the full name for a whole tensor (see [Note: checkpoint layout])."""
        if self.dim is None:
            return self.full
        return f"{self.full}[{':,' if self.dim == 1 else ''}{self.start}:{self.stop}]"

    @classmethod
    def from_stored(cls, name: str) -> "PieceParam":
        """The piece a stored name (:attr:`stored`) stands for; a plain name is a whole tensor
        (dim None). Checkpoints saved from other layouts hold other pieces, so names are read back."""
        full, bracket, spec = name.rpartition("[")
        if not bracket or not spec.endswith("]"):
            return cls(name, None, 0, 0)
        dim, spec = (1, spec[2:-1]) if spec.startswith(":,") else (0, spec[:-1])
        start, colon, stop = spec.partition(":")
        if not (colon and start.isdigit() and stop.isdigit()):
            return cls(name, None, 0, 0)
        return cls(full, dim, int(start), int(stop))


def piece_module(module: str, i: int) -> str:
    """The qualified name of piece ``i`` of linear ``module``."""
    return f"{module}_piece{i}"


def _normalise(pieces: Pieces) -> dict[str, dict[str, Any]]:
    return {m: {"fc2": str(p["fc2"]), "hidden": [int(b) for b in p["hidden"]]} for m, p in sorted(pieces.items())}


def piece_params(pieces: Pieces) -> dict[str, PieceParam]:
    """Each piece's state_dict key -> where it sits in the model's tensor."""
    out = {}
    for fc1, p in _normalise(pieces).items():
        bounds = p["hidden"]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            out[f"{piece_module(fc1, i)}.weight"] = PieceParam(f"{fc1}.weight", 0, a, b)
            out[f"{piece_module(fc1, i)}.bias"] = PieceParam(f"{fc1}.bias", 0, a, b)
            out[f"{piece_module(p['fc2'], i)}.weight"] = PieceParam(f"{p['fc2']}.weight", 1, a, b)
        out[f"{piece_module(p['fc2'], 0)}.bias"] = PieceParam(f"{p['fc2']}.bias", None, 0, 0)
    return out


def merge_pieces(state: Mapping[str, torch.Tensor], pieces: Pieces) -> dict[str, torch.Tensor]:
    """``state`` with every complete set of pieces replaced by its full tensor."""
    keys = piece_params(pieces)
    out = {k: v for k, v in state.items() if k not in keys}
    groups: dict[str, list[tuple[int, str]]] = {}
    for key, pp in keys.items():
        groups.setdefault(pp.full, []).append((pp.start, key))
    for full, parts in groups.items():
        held = [key for _, key in parts if key in state]
        if not held:
            continue
        if len(held) != len(parts):
            lost = sorted({key for _, key in parts} - set(held))
            raise CheckpointError(f"'{full}' is cut into pieces across stages and {', '.join(lost)} is held "
                                  "by no stage; gather the state of every pipeline rank first")
        dim = keys[parts[0][1]].dim
        tensors = [state[key] for _, key in sorted(parts)]
        out[full] = tensors[0] if dim is None else torch.cat(tensors, dim=dim)
    return out


def take_piece(full_state: Mapping[str, torch.Tensor], key: str, pieces: Pieces) -> torch.Tensor:
    """The tensor for state_dict ``key`` from full tensors: a piece's slice, or the tensor itself."""
    pp = piece_params(pieces).get(key)
    return full_state[key] if pp is None else pp.of(full_state[pp.full])


def _is_linear(node: fx.Node, gm: fx.GraphModule) -> bool:
    return node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.Linear


def _sole_tensor_input(node: fx.Node) -> fx.Node | None:
    inputs = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
    return inputs[0] if len(inputs) == 1 else None


def find_mlps(gm: fx.GraphModule) -> list[Mlp]:
    """Every fc1 -> elementwise chain -> fc2 that can be cut by hidden unit.

    Each linear is its module's only call with one input; each node from fc1 up to fc2 has a
    single user, the next; the chain's ops are elementwise on that one tensor (activations,
    dropout, arithmetic with constants); fc2 reads fc1's width. MLPs share no linear: in a
    stack (Linear, GELU, Linear, GELU, Linear) the first pair is one, the third linear alone
    is none.
    """
    calls: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    found = []
    taken: set[fx.Node] = set()  # the linears of the MLPs found so far
    for fc1 in gm.graph.nodes:
        if not _is_linear(fc1, gm) or calls[fc1.target] != 1 or len(fc1.args) != 1 or fc1.kwargs or fc1 in taken:
            continue
        chain, node = [], fc1
        while len(node.users) == 1:
            nxt = next(iter(node.users))
            if _is_linear(nxt, gm):
                hidden = gm.get_submodule(fc1.target).out_features
                ok = (calls[nxt.target] == 1 and len(nxt.args) == 1 and not nxt.kwargs and nxt.args[0] is node
                      and gm.get_submodule(nxt.target).in_features == hidden and hidden >= 2 * HIDDEN_ALIGN)
                if ok:
                    found.append(Mlp(fc1, tuple(chain), nxt))
                    taken.update((fc1, nxt))
                break
            out = value_of(nxt)
            if not (ops.is_elementwise(nxt, gm) and not ops.is_samplewise(nxt, gm) and _sole_tensor_input(nxt) is node
                    and isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(value_of(node).shape)):
                break
            chain.append(nxt)
            node = nxt
    return found


def fine_hidden(hidden: int, pieces: int) -> list[int]:
    """Boundaries of about ``pieces`` equal pieces on multiples of HIDDEN_ALIGN units."""
    pieces = max(1, min(pieces, MAX_PIECES, hidden // HIDDEN_ALIGN))
    bounds = sorted({round(hidden * i / pieces / HIDDEN_ALIGN) * HIDDEN_ALIGN for i in range(pieces)} | {hidden})
    return bounds if len(bounds) > 2 else [0, hidden]


def pieces_for(seconds: float, hidden: int, granule: float) -> int:
    """How many pieces make each about ``granule`` seconds (1 when the MLP is small already)."""
    if granule <= 0 or seconds <= 2 * granule:
        return 1
    return min(MAX_PIECES, math.ceil(seconds / granule), hidden // HIDDEN_ALIGN)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Linear) -> nn.Linear:
    """An nn.Linear holding copies of ``weight`` and ``bias`` (made on the meta device, not initialised)."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    out.weight = nn.Parameter(weight.detach().clone(), requires_grad=like.weight.requires_grad)
    if bias is not None:
        out.bias = nn.Parameter(bias.detach().clone(), requires_grad=like.bias.requires_grad)
    out.train(like.training)
    return out


def _with_width(value: torch.Tensor, width: int) -> torch.Tensor:
    return torch.empty((*value.shape[:-1], width), dtype=value.dtype, device="meta")


def cut_mlps(traced: TracedModel, pieces: Pieces) -> TracedModel:
    """``traced`` with each MLP in ``pieces`` cut at its hidden boundaries; see [Note: MLP pieces].

    Returns ``traced`` itself when there is nothing to cut or it is cut this way already; the
    input graph and model are left alone otherwise.
    """
    wanted = _normalise(pieces)
    done = traced.gm.meta.get(PIECES_META, {})
    if done == wanted:
        return traced
    if done:
        raise PartitionError(f"this graph is already cut into MLP pieces at {sorted(done)}; "
                             "cut the traced model as it came from trace() instead")
    if not wanted:
        return traced
    gm = fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph), class_name=type(traced.gm).__name__)
    keep_buffer_persistence(gm, traced.gm)
    gm.meta.update(traced.gm.meta)
    mlps = {m.fc1.target: m for m in find_mlps(gm)}
    graph = gm.graph
    for fc1_name, spec in wanted.items():
        mlp = mlps.get(fc1_name)
        if mlp is None or mlp.fc2.target != spec["fc2"]:
            raise PartitionError(f"MLP pieces name {fc1_name!r} -> {spec['fc2']!r}, which is not an MLP of this "
                                 "graph (two nn.Linear calls joined by elementwise ops); the plan was made "
                                 "for another model or trace")
        fc1, fc2 = gm.get_submodule(fc1_name), gm.get_submodule(spec["fc2"])
        bounds = spec["hidden"]
        if bounds[0] != 0 or bounds[-1] != fc1.out_features or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise PartitionError(f"hidden boundaries {bounds} do not cut {fc1_name!r} ({fc1.out_features} "
                                 "hidden units) into increasing pieces from 0")
        total = None
        with graph.inserting_before(mlp.fc2):
            for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
                first = piece_module(fc1_name, i)
                gm.add_submodule(first, _linear(fc1.weight[a:b], None if fc1.bias is None else fc1.bias[a:b], fc1))
                last = piece_module(spec["fc2"], i)
                gm.add_submodule(last, _linear(fc2.weight[:, a:b], fc2.bias if i == 0 else None, fc2))
                share = (b - a) / fc1.out_features
                node = graph.call_module(first, mlp.fc1.args)
                node.meta.update(mlp.fc1.meta)
                node.meta.update({"val": _with_width(value_of(mlp.fc1), b - a), MODULE_KEY: first,
                                  PIECE_OF: (mlp.fc1.name, share)})
                for op in mlp.chain:
                    prev = node
                    node = graph.node_copy(op, lambda n: prev)  # noqa: B023 - called at once
                    node.meta.update({"val": _with_width(value_of(op), b - a), PIECE_OF: (op.name, share)})
                partial = graph.call_module(last, (node,))
                partial.meta.update(mlp.fc2.meta)
                partial.meta.update({MODULE_KEY: last, PIECE_OF: (mlp.fc2.name, share)})
                if total is not None:
                    partial = graph.call_function(operator.add, (total, partial))
                    partial.meta.update(mlp.fc2.meta)
                    partial.meta[PARTIAL_SUM] = True
                total = partial
        mlp.fc2.replace_all_uses_with(total)
        for node in (mlp.fc2, *reversed(mlp.chain), mlp.fc1):
            graph.erase_node(node)
    gm.recompile()
    gm.delete_all_unused_submodules()
    gm.meta[PIECES_META] = wanted
    return TracedModel(gm, traced.route, traced.out_spec, traced.input_shapes, traced.input_dtypes,
                       dict(traced.attempts))


def coarse_pieces(fine: Pieces, stage_of: Mapping[str, int], gm: fx.GraphModule) -> dict[str, dict[str, Any]]:
    """The fine pieces merged to one piece per stage; MLPs that fell in one stage are dropped.

    ``stage_of`` maps the node names of ``gm``, the graph cut at ``fine``, to stages. A piece
    counts as in the stage of its fc2 part, where its partial sum joins the rest.
    """
    node_of = {n.target: n.name for n in gm.graph.nodes if n.op == "call_module"}
    out = {}
    for fc1, spec in _normalise(fine).items():
        bounds = spec["hidden"]
        stages = [stage_of[node_of[piece_module(spec["fc2"], i)]] for i in range(len(bounds) - 1)]
        firsts = [stage_of[node_of[piece_module(fc1, i)]] for i in range(len(bounds) - 1)]
        if len(set(stages) | set(firsts)) < 2:
            continue
        kept = [0] + [bounds[i] for i in range(1, len(stages)) if stages[i] != stages[i - 1]] + [bounds[-1]]
        if len(kept) > 2:
            out[fc1] = {"fc2": spec["fc2"], "hidden": kept}
    return out


def piece_seconds(split: TracedModel, seconds: Callable[[str], float], priced: Container[str]) -> dict[str, float]:
    """Seconds of the nodes of ``split`` (a graph cut into pieces) from those of the unsplit
    graph: a piece takes its share of its node's ``seconds``, the other nodes in ``priced``
    their own; the partial sums, which no unsplit node was, are left out (to be priced
    analytically)."""
    out = {}
    for node in split.gm.graph.nodes:
        if PIECE_OF in node.meta:
            whole, share = node.meta[PIECE_OF]
            out[node.name] = share * seconds(whole)
        elif node.name in priced and not node.meta.get(PARTIAL_SUM):
            out[node.name] = seconds(node.name)
    return out
