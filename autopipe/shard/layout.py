"""Layout propagation: which dim of every activation is split, and what that costs the graph.

Walks the graph once in execution order from the claims (column, row, ...) and decides,
as plain data, every collective to insert and every shape constant to make local.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..errors import ShardingError
from ..graph import MODULE_KEY, value_of, value_bytes
from . import ops
from .plan import CollectiveOp, ShapeEdit
from .rules import Claim

__all__ = []


@dataclass(frozen=True)
class Sharded:
    dim: int
    outer: int = 1
    origin: str = field(default="", compare=False)  # the sharded layer it comes from (for errors)


@dataclass(frozen=True)
class Partial:
    bias: str | None = None


@dataclass(frozen=True)
class LocalShape:
    dim: int  # the entry of a shape tuple that is local at run time


LOCAL = "local"  # an int that is a local size at run time


@dataclass
class Result:
    layouts: dict[str, Any]
    collectives: list[CollectiveOp]
    edits: list[ShapeEdit]
    swaps: dict[str, str]


def _ndim(node: fx.Node) -> int:
    v = value_of(node)
    return v.dim() if isinstance(v, torch.Tensor) else 0


def _shape(node: Any) -> tuple[int, ...]:
    v = value_of(node) if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _dtype(node: fx.Node) -> str:
    v = value_of(node)
    return str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else ""


class _Propagator:
    def __init__(self, gm: fx.GraphModule, claims: dict[str, Claim], tp: int):
        self.gm, self.claims, self.tp = gm, claims, tp
        self.lay: dict[str, Any] = {}
        self.collectives: dict[str, CollectiveOp] = {}
        self.edits: list[ShapeEdit] = []
        self.swaps: dict[str, str] = {}

    # -- helpers -----------------------------------------------------------------------------
    def of(self, a: Any) -> Any:
        return self.lay.get(a.name) if isinstance(a, fx.Node) else None

    def fail(self, node: fx.Node, why: str) -> None:
        split = next((self.of(a) for a in node.all_input_nodes if isinstance(self.of(a), Sharded)), None)
        origin = split.origin if isinstance(split, Sharded) else ""
        where = node.meta.get(MODULE_KEY) or "the model's top level"
        fix = (f" Fix: keep '{origin}' replicated, e.g. plan_sharding(..., rules=[ShardRule("
               f"'keep', match='{origin}', style='replicated')]), or add a rule for this op." if origin else "")
        raise ShardingError(f"cannot shard node '{node.name}' ({node.op} {ops.op_name(node) if node.op != 'call_module' else node.target}) "
                            f"in {where}: {why}.{fix}")

    def add_collective(self, kind: str, src: fx.Node, users: list[fx.Node], module: str,
                       dim: int | None = None, bias: str | None = None) -> None:
        name = f"{kind}_{src.name}"
        if name in self.collectives:  # one f per replicated tensor feeding several sharded layers
            c = self.collectives[name]
            c.users = c.users + tuple(u.name for u in users if u.name not in c.users)
            return
        nbytes = value_bytes(value_of(src))
        fwd, bwd = (0, nbytes) if kind == "copy_to_tp" else (nbytes, 0)
        self.collectives[name] = CollectiveOp(name, kind, src.name, tuple(u.name for u in users), module,
                                              _shape(src), _dtype(src), fwd, bwd, dim, bias)

    def reduce(self, node: fx.Node, partial: Partial) -> None:
        self.add_collective("reduce_from_tp", node, list(node.users), node.meta.get(MODULE_KEY, ""), bias=partial.bias)
        self.lay[node.name] = None

    def edit_size(self, node: fx.Node, sizes: list[Any], j: int) -> None:
        size = sizes[j]
        if isinstance(size, fx.Node):
            if self.of(size) != LOCAL:
                self.edits.append(ShapeEdit(node.name, j, size.name, "//tp"))
        elif isinstance(size, int) and size != -1:
            if size % self.tp:
                self.fail(node, f"size {size} at position {j} is not divisible by tp={self.tp}")
            self.edits.append(ShapeEdit(node.name, j, size, size // self.tp))

    # -- anchors -----------------------------------------------------------------------------
    def anchor(self, node: fx.Node, claim: Claim) -> Any:
        tensors = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor) and a.op != "get_attr"]
        ins = [self.of(a) for a in tensors]
        style, module = claim.style, node.meta.get(MODULE_KEY, "")
        if style in ("column", "qkv", "mha"):
            for a, lay in zip(tensors, ins):
                if lay is not None:
                    self.fail(node, f"this {style}-parallel layer gets the already split '{a.name}'")
                self.add_collective("copy_to_tp", a, [node], module)
            if style == "mha":
                self.swaps[node.name] = "mha"
                return (Partial(f"{node.target}.out_proj.bias"), None)
            dim = 1 if ops.is_conv(node, self.gm) else _ndim(node) - 1
            if "gather_from_tp" in claim.after:
                self.add_collective("gather_from_tp", node, list(node.users), module, dim=dim)
                return None
            return Sharded(dim, claim.outer, module)
        if style == "row":
            dim = 1 if ops.is_conv(node, self.gm) else _ndim(tensors[0]) - 1
            if ins != [Sharded(dim, 1)]:
                self.fail(node, f"a row-parallel layer needs its input split on dim {dim}, got {ins}")
            if node.op != "call_module" or type(ops.module_of(node, self.gm)) not in _ROW_TYPES:
                self.fail(node, "row-parallel layers must be nn.Linear or nn.Conv1d/2d/3d leaves")
            self.swaps[node.name] = "row"
            has_bias = getattr(ops.module_of(node, self.gm), "bias", None) is not None
            self.reduce(node, Partial(f"{node.target}.bias" if has_bias else None))
            return None
        if style == "channel":
            if not ins or not isinstance(ins[0], Sharded) or ins[0].dim != 1 or ins[0].outer != 1:
                self.fail(node, f"a channel-sharded layer needs its input split on dim 1, got {ins}")
            return ins[0]
        if any(lay is not None for lay in ins):
            self.fail(node, "a replicated layer gets a split activation")
        return None

    # -- ops on split activations ------------------------------------------------------------
    def pointwise(self, node: fx.Node) -> Any:
        n_out = _ndim(node)
        split: Sharded | None = None
        for a in node.all_input_nodes:
            lay = self.of(a)
            if isinstance(lay, Sharded):
                s = Sharded(lay.dim + n_out - _ndim(a), lay.outer, lay.origin)
                if split is not None and split != s:
                    self.fail(node, f"its inputs are split on different dims ({split}, {s})")
                split = s
            elif lay is not None and lay != LOCAL:
                self.fail(node, f"input '{a.name}' has layout {lay}")
        assert split is not None
        for a in node.all_input_nodes:
            if self.of(a) is None and isinstance(value_of(a), torch.Tensor):
                shape = _shape(a)
                k = split.dim - (n_out - len(shape))
                if 0 <= k < len(shape) and shape[k] != 1:
                    self.fail(node, f"the replicated operand '{a.name}' {list(shape)} spans the split dim {split.dim}")
        return split

    def sizes_of(self, node: fx.Node) -> tuple[list[Any], int]:
        """The size list of a view/reshape/expand and the arg position it starts at."""
        rest = list(node.args[1:])
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            return list(rest[0]), 1
        return rest, -1

    def reshape(self, node: fx.Node, s: Sharded, explicit: bool) -> Sharded:
        # See [Note: locating the split dim across a reshape] in ops.py.
        src, out = _shape(node.args[0]), _shape(node)
        found = ops.locate_split(src, out, s.dim, s.outer, self.tp)
        if found is None:
            self.fail(node, f"the split dim {s.dim} of {list(src)} (outer {s.outer}) has no dim of "
                            f"{list(out)} that divides by tp={self.tp}")
        j, outer = found  # type: ignore[misc]
        if explicit:
            self.edit_size(node, self.sizes_of(node)[0], j)
        return Sharded(j, outer, s.origin)

    def split_op(self, node: fx.Node, name: str, s: Sharded) -> Any:
        n = _ndim(node.args[0])
        default_dim = 0
        d = _norm(ops.arg(node, 1 if name == "unbind" else 2, "dim", default_dim), n)
        count = len(value_of(node)) if isinstance(value_of(node), (tuple, list)) else 0
        if name == "unbind":
            if d == s.dim:
                self.fail(node, "it unbinds the split dim")
            return tuple(Sharded(s.dim - (d < s.dim), s.outer, s.origin) for _ in range(count))
        if d != s.dim:
            return tuple(s for _ in range(count))
        if count != s.outer:
            self.fail(node, f"it cuts the split dim into {count} pieces, not the {s.outer} blocks it holds")
        if name != "chunk":  # split sizes are sizes of the split dim: make them local
            sizes = node.args[1]
            for j in range(len(sizes) if isinstance(sizes, (list, tuple)) else 1):
                self.edit_size(node, list(sizes) if isinstance(sizes, (list, tuple)) else [sizes], j)
        return tuple(Sharded(s.dim, 1, s.origin) for _ in range(count))

    def getitem(self, node: fx.Node, base: Any, index: Any) -> Any:
        if isinstance(base, tuple):
            return base[index] if isinstance(index, int) else None
        if isinstance(base, LocalShape):
            return LOCAL if isinstance(index, int) and index == base.dim else None
        if not isinstance(base, Sharded):
            return None
        dim = ops.indexed_dim(index, _ndim(node.args[0]), base.dim)
        if dim is None:
            self.fail(node, "it indexes the split dim")
        return Sharded(dim, base.outer, base.origin)  # type: ignore[arg-type]

    def op(self, node: fx.Node) -> Any:
        gm, name = self.gm, ops.op_name(node) if node.op != "call_module" else ""
        first = node.args[0] if node.args else None
        s = self.of(first)
        if node.op == "call_module":
            m = ops.module_of(node, gm)
            if ops.is_elementwise(node, gm):
                if ops.is_dropout(node, gm) and isinstance(self.pointwise(node), Sharded):
                    self.swaps[node.name] = "tp_dropout"
                return self.pointwise(node)
            if isinstance(m, torch.nn.LayerNorm) and isinstance(s, Sharded):
                if s.dim >= _ndim(node) - len(m.normalized_shape):
                    self.fail(node, "it normalises over the split dim")
                return s
            if ops.is_linear(node, gm) or ops.is_conv(node, gm):
                self.fail(node, f"this replicated {type(m).__name__} gets a split activation; make it row-parallel, "
                                f"e.g. ShardRule('row', match='{node.target}', style='row')")
            self.fail(node, f"{type(m).__name__} is not known to keep a split activation")
        if name == "getitem":
            return self.getitem(node, s, node.args[1])
        if name in ops.SIZE_QUERIES:
            if not isinstance(s, Sharded):
                return None
            if name == "getattr":
                return LocalShape(s.dim) if node.args[1] == "shape" else None
            d = ops.arg(node, 1, "dim")
            if name == "dim":
                return None
            return LocalShape(s.dim) if d is None else (LOCAL if _norm(d, _ndim(first)) == s.dim else None)
        if name in ops.DROPOUT_FUNCTIONS or ops.is_elementwise(node, gm):
            out = self.pointwise(node)
            if name in ops.DROPOUT_FUNCTIONS:
                self.swaps[node.name] = "tp_dropout"
            return out
        if not isinstance(s, Sharded):
            self.fail(node, f"its inputs have layouts {[self.of(a) for a in node.all_input_nodes]}")
        n = _ndim(first)
        if name in ops.RESHAPES:
            return self.reshape(node, s, explicit=True)
        if name in ops.SHAPE_ONLY:
            return self.reshape(node, s, explicit=False)
        if name == "expand":
            sizes, _ = self.sizes_of(node)
            j = s.dim + len(sizes) - n
            self.edit_size(node, sizes, j)
            return Sharded(j, s.outer, s.origin)
        if name in ops.PERMUTES:
            if name == "permute":
                dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
                return Sharded([_norm(d, n) for d in dims].index(s.dim), s.outer, s.origin)
            a, b = (1, 0) if name == "t" else (_norm(node.args[1], n), _norm(node.args[2], n))
            return Sharded(b if s.dim == a else a if s.dim == b else s.dim, s.outer, s.origin)
        if name in ops.SPLITS:
            return self.split_op(node, name, s)
        if name in ops.SOFTMAX:
            if _norm(ops.arg(node, 1, "dim"), n) == s.dim:
                self.fail(node, "it takes a softmax over the split dim")
            return s
        if name in ops.SDPA:
            qkv = [self.of(a) for a in node.args[:3]]
            if any(not isinstance(x, Sharded) or x.dim != n - 3 or x.outer != 1 for x in qkv):
                self.fail(node, f"attention needs q, k and v split on the heads dim {n - 3}, got {qkv}")
            return self.pointwise(node)
        if name in ops.MATMUL:
            if s.dim >= n - 2:
                self.fail(node, "it contracts or indexes over the split dim")
            return self.pointwise(node)
        if name in ops.LAYER_NORMS:
            shape = ops.arg(node, 1, "normalized_shape")
            if s.dim >= n - len(shape):
                self.fail(node, "it normalises over the split dim")
            return s if name == "layer_norm" else (s, None, None)
        self.fail(node, f"autopipe does not know how '{name}' treats a split dim")

    def run(self) -> Result:
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                bad = [a.name for a in node.all_input_nodes if self.of(a) is not None]
                if bad:
                    self.fail(node, f"model outputs {bad} are split; end the sharded region with a row-parallel "
                                    "layer or gather it (column_parallel_head())")
                continue
            claim = self.claims.get(node.name)
            if claim is not None:
                out = self.anchor(node, claim)
            elif all(self.of(a) in (None, LOCAL) for a in node.all_input_nodes):
                out = None
            else:
                out = self.op(node)
            if isinstance(out, Partial):
                self.reduce(node, out)
                out = None
            self.lay[node.name] = out
        return Result(self.lay, list(self.collectives.values()), self.edits, self.swaps)


_ROW_TYPES = (torch.nn.Linear, torch.nn.modules.linear.NonDynamicallyQuantizableLinear, *ops.CONV_TYPES)


def propagate(gm: fx.GraphModule, claims: dict[str, Claim], tp: int) -> Result:
    """Layouts of every node under ``claims``, with the collectives and shape edits they need."""
    return _Propagator(gm, claims, tp).run()
