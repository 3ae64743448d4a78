"""MLPs cut into pieces of their hidden units, so that a stage boundary can fall inside one.

[Note: MLP pieces]
At node granularity a boundary falls between nodes, so a model whose stages hold only a few
large matmuls cannot be balanced finer than its largest node: ViT-B/16 at pp=8 has 1.5 blocks
a stage, and its fc1 and fc2 are each about a tenth of one. An MLP ``fc2(act(fc1(x)))`` (any
chain of elementwise ops between the two linears) splits exactly by hidden unit, as Megatron's
tensor parallelism splits it: with the hidden units cut at ``0 = h_0 < h_1 < ... < h_k = H``,

    fc2(act(fc1(x))) = sum_i fc2_i(act(fc1_i(x)))

where ``fc1_i`` holds rows [h_i, h_i+1) of fc1's weight and bias and ``fc2_i`` columns
[h_i, h_i+1) of fc2's weight (``fc2_0`` adds fc2's bias). A pair of convolutions is an MLP over
channels in the same way (``conv2(relu(bn(conv1(x))))`` in a ResNet block, groups=1): the
hidden units are conv1's output channels, and a BatchNorm between them, which normalises each
channel on its own, is cut by channel too (its weight, bias and running statistics; the spec
names it under "norms"). ``cut_mlps`` rewrites a traced graph
that way: piece i is ``<fc1>_piece{i}`` -> the elementwise chain -> ``<fc2>_piece{i}``, and the
partial outputs are added. A stage boundary between two pieces carries the MLP's input and the
partial sum so far; the stages split the parameters between them (nothing is replicated, no
gradient is summed across stages), and only the additions of ``fc2``-sized partials are new
work. Cutting by output rows with a ``torch.cat`` instead would copy fc1's 4x wider output.
Where no second layer follows, a convolution and the per-channel ops after it (BatchNorm,
elementwise ops, pooling: a ResNet stem's conv -> bn -> relu -> maxpool) make a *run*, cut
the same way by output channel, its pieces joined by ``torch.cat`` on the channels ("fc2": None).

``plan_stages`` (piece_plan.py) tries it when a node-level plan is imbalanced (``split_mlps=True``,
balance="cost", tp=1): it cuts every large MLP into fine pieces, balances, and keeps pieces only
in the MLPs a boundary fell inside, one piece per stage (``PartitionPlan.mlp_pieces``: fc1 ->
{"fc2": name, "hidden": boundaries}); convolutions only with ``split_mlps="convolutions"``.
Stage emission applies the same rewrite, so the plan's node names are the graph's.

State keeps the model's names outside the stages (piece_state.py).
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Container, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import PartitionError
from ..graph import MODULE_KEY, keep_buffer_persistence, value_of
from ..memory_format import channels_last_dense
from ..shard import ops
from ..tracer import TracedModel
from . import sample_pieces
from .piece_meta import JOIN, PIECE, PIECE_OF, PIECES_META, SAMPLES, bounds_of, with_bounds
from .piece_state import NORM_ROWS, Pieces, normalise, piece_module

__all__ = ["Mlp", "find_mlps", "cut_mlps", "fine_hidden", "coarse_pieces", "pieces_for", "piece_seconds",
           "PIECES_META", "JOIN", "PIECE", "PIECE_OF"]

HIDDEN_ALIGN = 8  # piece boundaries are multiples of this many hidden units
MAX_PIECES = 8


LAYER_TYPES: tuple[type, ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# (output, input) width attributes of each layer type; a piece's module has its own widths
WIDTHS = {nn.Linear: ("out_features", "in_features"), nn.Conv1d: ("out_channels", "in_channels"),
          nn.Conv2d: ("out_channels", "in_channels"), nn.Conv3d: ("out_channels", "in_channels")}


@dataclass(frozen=True)
class Mlp:
    """Two layers of one type (nn.Linear, or nn.ConvNd with groups=1) joined by a chain of
    elementwise ops, and for convolutions BatchNorms and pooling (each the only user of the
    last); or a run: a convolution and such a chain with no second layer (``fc2`` None)."""

    fc1: fx.Node
    chain: tuple[fx.Node, ...]
    fc2: fx.Node | None
    norms: tuple[str, ...] = ()  # the chain's BatchNorm modules, cut by channel too
    align: ClassVar[int] = HIDDEN_ALIGN  # its pieces part on multiples of this many units

    @property
    def key(self) -> str:
        """Its name in ``PartitionPlan.mlp_pieces``: fc1's module."""
        return str(self.fc1.target)

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        """Its nodes in graph order."""
        return (self.fc1, *self.chain) + ((self.fc2,) if self.fc2 is not None else ())

    def spec(self, hidden: list[int]) -> dict[str, Any]:
        """The pieces spec (``PartitionPlan.mlp_pieces`` value) cutting this MLP at ``hidden``."""
        out: dict[str, Any] = {"fc2": self.fc2.target if self.fc2 is not None else None, "hidden": hidden}
        return {**out, "norms": list(self.norms)} if self.norms else out

    def hidden(self, gm: fx.GraphModule) -> int:
        """How many hidden units (fc1's outputs) it has."""
        return _width(gm.get_submodule(self.fc1.target), 0)


def _layer(node: fx.Node, gm: fx.GraphModule) -> nn.Module | None:
    """The layer ``node`` calls when it is one an MLP is made of (see :class:`Mlp`), else None."""
    if node.op != "call_module":
        return None
    m = gm.get_submodule(node.target)
    return m if type(m) in LAYER_TYPES and getattr(m, "groups", 1) == 1 else None


def _width(layer: nn.Module, which: int) -> int:
    """A layer's output (0) or input (1) width."""
    return getattr(layer, WIDTHS[type(layer)][which])


def _sole_tensor_input(node: fx.Node) -> fx.Node | None:
    inputs = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
    return inputs[0] if len(inputs) == 1 else None


def _is_channel_norm(node: fx.Node, gm: fx.GraphModule, width: int) -> bool:
    """A BatchNorm over ``width`` channels that holds no state in submodules (those would not be cut)."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    m = gm.get_submodule(node.target)
    return (isinstance(m, nn.modules.batchnorm._BatchNorm) and m.num_features == width
            and not any(True for c in m.children() for _ in c.state_dict()))


def _channel_op(node: fx.Node, source: fx.Node, gm: fx.GraphModule, conv: bool, width: int) -> bool:
    """Whether ``node`` acts on each of ``source``'s channels (units) alone: an elementwise op on
    that one tensor; after a convolution also a BatchNorm, or pooling (shapes as the input's
    but the spatial ones)."""
    out, inp = value_of(node), value_of(source)
    if not (isinstance(out, torch.Tensor) and _sole_tensor_input(node) is source):
        return False
    if ops.is_elementwise(node, gm) and not ops.is_samplewise(node, gm):
        return tuple(out.shape) == tuple(inp.shape)
    if not conv or node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    m = gm.get_submodule(node.target)
    if type(m) in sample_pieces.POOLS:
        return out.dim() == inp.dim() and tuple(out.shape[:2]) == tuple(inp.shape[:2])
    return _is_channel_norm(node, gm, width) and tuple(out.shape) == tuple(inp.shape)


def find_mlps(gm: fx.GraphModule) -> list[Mlp]:
    """Every fc1 -> chain -> fc2 that can be cut by hidden unit, and every run of a convolution
    and a chain that can be cut by channel.

    fc1 and fc2 are layers of one type (nn.Linear, or nn.ConvNd with groups=1), each its
    module's only call with one input; each node from fc1 up to fc2 has a single user, the
    next; the chain's ops act on each unit alone (``_channel_op``: elementwise ops, and after
    a convolution BatchNorms called once and pooling); fc2 reads fc1's width. A convolution
    whose chain reaches no such fc2 makes a run of itself and its chain. MLPs share no layer:
    in a stack (Linear, GELU, Linear, GELU, Linear) the first pair is one, the third linear
    alone is none.
    """
    calls: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    found = []
    taken: set[fx.Node] = set()  # the layers of the MLPs found so far
    for fc1 in gm.graph.nodes:
        first = _layer(fc1, gm)
        if first is None or calls[fc1.target] != 1 or len(fc1.args) != 1 or fc1.kwargs or fc1 in taken:
            continue
        hidden, conv = _width(first, 0), type(first) is not nn.Linear
        if hidden < 2 * HIDDEN_ALIGN:
            continue
        chain, node, fc2 = [], fc1, None
        while len(node.users) == 1:
            nxt = next(iter(node.users))
            second = _layer(nxt, gm)
            if second is not None:
                if (type(second) is type(first) and calls[nxt.target] == 1 and len(nxt.args) == 1
                        and not nxt.kwargs and nxt.args[0] is node and _width(second, 1) == hidden):
                    fc2 = nxt
                break
            if not _channel_op(nxt, node, gm, conv, hidden):
                break
            if _is_channel_norm(nxt, gm, hidden) and calls[nxt.target] != 1:
                break  # a norm called twice would be cut for one call only
            chain.append(nxt)
            node = nxt
        if fc2 is not None or conv:
            norms = tuple(c.target for c in chain if c.op == "call_module"
                          and isinstance(gm.get_submodule(c.target), nn.modules.batchnorm._BatchNorm))
            found.append(Mlp(fc1, tuple(chain), fc2, norms))
            taken.update(n for n in (fc1, fc2) if n is not None)
    return found


def fine_hidden(hidden: int, pieces: int, align: int = HIDDEN_ALIGN) -> list[int]:
    """Boundaries of about ``pieces`` equal pieces on multiples of ``align`` units."""
    pieces = max(1, min(pieces, MAX_PIECES, hidden // align))
    bounds = sorted({round(hidden * i / pieces / align) * align for i in range(pieces)} | {hidden})
    return bounds if len(bounds) > 2 else [0, hidden]


def pieces_for(seconds: float, hidden: int, granule: float, align: int = HIDDEN_ALIGN) -> int:
    """How many pieces make each about ``granule`` seconds (1 when the MLP is small already)."""
    if granule <= 0 or seconds <= 2 * granule:
        return 1
    return min(MAX_PIECES, math.ceil(seconds / granule), hidden // align)


def _piece(like: nn.Module, tensors: Mapping[str, torch.Tensor | None], **widths: int) -> nn.Module:
    """A copy of ``like`` holding copies of ``tensors`` (its own parameters and buffers, by
    name; None drops one) and the ``widths`` that go with them; nothing else is copied twice."""
    own = {id(t): t for t in (*like._parameters.values(), *like._buffers.values()) if t is not None}
    out = copy.deepcopy(like, own)  # its tensors are replaced below, not copied
    for name, t in tensors.items():
        if name in like._parameters:
            old = like._parameters[name]
            out._parameters[name] = (None if t is None or old is None
                                     else nn.Parameter(_copy(t, old), requires_grad=old.requires_grad))
        elif t is not None and like._buffers.get(name) is not None:
            out._buffers[name] = _copy(t, like._buffers[name])
    for attr, width in widths.items():
        setattr(out, attr, width)
    return out


def _copy(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, part of ``whole``, in ``whole``'s layout (a channels-last kernel stays one)."""
    last = whole.dim() == 4 and whole.is_contiguous(memory_format=torch.channels_last)
    return t.detach().clone(memory_format=torch.channels_last if last else torch.contiguous_format)


def _layer_piece(layer: nn.Module, a: int, b: int, rows: bool, bias: bool) -> nn.Module:
    """fc1's piece (``rows``: output units [a, b)) or fc2's (input units [a, b); ``bias``: it keeps the bias)."""
    out_attr, in_attr = WIDTHS[type(layer)]
    if rows:
        return _piece(layer, {"weight": layer.weight[a:b], "bias": None if layer.bias is None else layer.bias[a:b]},
                      **{out_attr: b - a})
    return _piece(layer, {"weight": layer.weight[:, a:b], "bias": layer.bias if bias else None}, **{in_attr: b - a})


def _norm_piece(norm: nn.Module, a: int, b: int) -> nn.Module:
    tensors = {t: getattr(norm, t)[a:b] for t in NORM_ROWS if getattr(norm, t, None) is not None}
    if getattr(norm, "num_batches_tracked", None) is not None:
        tensors["num_batches_tracked"] = norm.num_batches_tracked
    return _piece(norm, tensors, num_features=b - a)


def _with_width(value: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """A piece's traced value: ``value`` ``width`` wide in ``dim``, in its layout ([Note: boundary layout])."""
    shape = list(value.shape)
    shape[dim] = width
    layout = torch.channels_last if channels_last_dense(value) else torch.contiguous_format
    return torch.empty(shape, dtype=value.dtype, device="meta", memory_format=layout)


def _chain_piece(gm: fx.GraphModule, mlp: Mlp, i: int, a: int, b: int) -> fx.Node:
    """Piece ``i`` (hidden units [a, b)) of fc1 and the chain after it, inserted at the graph's
    insertion point; returns its last node."""
    fc1 = gm.get_submodule(mlp.fc1.target)
    dim = -1 if type(fc1) is nn.Linear else 1  # where a layer's units are in its output
    share = (b - a) / mlp.hidden(gm)
    first = piece_module(mlp.fc1.target, i)
    gm.add_submodule(first, _layer_piece(fc1, a, b, rows=True, bias=True))
    node = gm.graph.call_module(first, mlp.fc1.args)
    node.meta.update(mlp.fc1.meta)
    node.meta.update({"val": _with_width(value_of(mlp.fc1), b - a, dim), MODULE_KEY: first,
                      PIECE_OF: (mlp.fc1.name, share), PIECE: (mlp.fc1.target, i)})
    for op in mlp.chain:
        prev = node
        node = gm.graph.node_copy(op, lambda n: prev)  # noqa: B023 - called at once
        node.meta.update({"val": _with_width(value_of(op), b - a, dim), PIECE_OF: (op.name, share),
                          PIECE: (mlp.fc1.target, i)})
        if op.op == "call_module" and op.target in mlp.norms:
            node.target = piece_module(op.target, i)
            gm.add_submodule(node.target, _norm_piece(gm.get_submodule(op.target), a, b))
            node.meta[MODULE_KEY] = node.target
    return node


def _cut(gm: fx.GraphModule, mlp: Mlp, bounds: list[int]) -> None:
    """Replace ``mlp`` in ``gm`` by its pieces at ``bounds``, added up (a pair of layers) or
    concatenated (a run)."""
    graph, end = gm.graph, mlp.nodes[-1]
    pieces: list[fx.Node] = []
    with graph.inserting_before(end):
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            node = _chain_piece(gm, mlp, i, a, b)
            if mlp.fc2 is not None:  # fc2's columns [a, b): a partial sum of its output, added at once
                last = piece_module(mlp.fc2.target, i)
                gm.add_submodule(last, _layer_piece(gm.get_submodule(mlp.fc2.target), a, b, rows=False, bias=i == 0))
                node = graph.call_module(last, (node,))
                node.meta.update(mlp.fc2.meta)
                node.meta.update({MODULE_KEY: last, PIECE_OF: (mlp.fc2.name, (b - a) / bounds[-1]),
                                  PIECE: (mlp.fc1.target, i)})
                if pieces:  # a boundary between pieces carries one running sum
                    node = graph.call_function(operator.add, (pieces.pop(), node))
                    node.meta.update({**end.meta, JOIN: True})
            pieces.append(node)
        joined = pieces[0]
        if mlp.fc2 is None:
            joined = graph.call_function(torch.cat, (pieces,), {"dim": 1})
            joined.meta.update({**end.meta, JOIN: True})
    end.replace_all_uses_with(joined)
    for node in reversed(mlp.nodes):
        graph.erase_node(node)


def cut_mlps(traced: TracedModel, pieces: Pieces) -> TracedModel:
    """``traced`` with each MLP in ``pieces`` cut at its hidden boundaries; see [Note: MLP pieces].

    Returns ``traced`` itself when there is nothing to cut or it is cut this way already; the
    input graph and model are left alone otherwise.
    """
    wanted = normalise(pieces)
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
    for fc1_name, spec in wanted.items():
        if SAMPLES in spec:  # a pooling cut by sample: see [Note: sample pieces]
            sample_pieces.cut_pool(gm, fc1_name, spec[SAMPLES])
            continue
        mlp = mlps.get(fc1_name)
        if mlp is None or mlp.spec(spec["hidden"]) != spec:
            raise PartitionError(f"MLP pieces name {fc1_name!r} -> {spec['fc2']!r} (norms {spec.get('norms', [])}), "
                                 "which is not an MLP of this graph (two nn.Linear or nn.ConvNd calls joined by "
                                 "elementwise ops or BatchNorms, or a convolution and such ops); the plan was made "
                                 "for another model or trace")
        bounds, hidden = spec["hidden"], mlp.hidden(gm)
        if bounds[0] != 0 or bounds[-1] != hidden or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise PartitionError(f"hidden boundaries {bounds} do not cut {fc1_name!r} ({hidden} "
                                 "hidden units) into increasing pieces from 0")
        _cut(gm, mlp, bounds)
    gm.recompile()
    gm.delete_all_unused_submodules()
    gm.meta[PIECES_META] = wanted
    return TracedModel(gm, traced.route, traced.out_spec, traced.input_shapes, traced.input_dtypes,
                       dict(traced.attempts))


def coarse_pieces(fine: Pieces, stage_of: Mapping[str, int], gm: fx.GraphModule) -> dict[str, dict[str, Any]]:
    """The fine pieces merged to one piece per stage; MLPs that fell in one stage are dropped.

    ``stage_of`` maps the node names of ``gm``, the graph cut at ``fine``, to stages. A piece
    counts as in the stage of its last node (fc2's part, where its partial sum joins the rest).
    """
    ends: dict[tuple[str, int], int] = {}  # (fc1, piece) -> the stage of its last node
    starts: dict[tuple[str, int], int] = {}
    for n in gm.graph.nodes:
        if PIECE in n.meta:
            ends[n.meta[PIECE]] = stage_of[n.name]
            starts.setdefault(n.meta[PIECE], stage_of[n.name])
    out = {}
    for fc1, spec in normalise(fine).items():
        bounds = bounds_of(spec)
        stages = [ends[(fc1, i)] for i in range(len(bounds) - 1)]
        firsts = [starts[(fc1, i)] for i in range(len(bounds) - 1)]
        if len(set(stages) | set(firsts)) < 2:
            continue
        kept = [0] + [bounds[i] for i in range(1, len(stages)) if stages[i] != stages[i - 1]] + [bounds[-1]]
        if len(kept) > 2:
            out[fc1] = with_bounds(spec, kept)
    return out


def piece_seconds(split: TracedModel, seconds: Callable[[str], float], priced: Container[str]) -> dict[str, float]:
    """Seconds of the nodes of ``split`` (a graph cut into pieces) from those of the unsplit
    graph: a piece takes its share of its node's ``seconds``, the other nodes in ``priced``
    their own; the joins (partial sums, concatenations), which no unsplit node was, are left
    out (to be priced analytically)."""
    out = {}
    for node in split.gm.graph.nodes:
        if PIECE_OF in node.meta:
            whole, share = node.meta[PIECE_OF]
            out[node.name] = share * seconds(whole)
        elif node.name in priced and not node.meta.get(JOIN):
            out[node.name] = seconds(node.name)
    return out
