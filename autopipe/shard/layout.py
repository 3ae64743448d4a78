"""Layout propagation: which dim of every activation is split, and what that costs the graph.

Walks the graph once in execution order from the claims (column, row, ...) and decides,
as plain data, every collective to insert and every shape constant to make local. The op
rules are here; what they record, and the primitives they record with, in layout_record.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from ..errors import ShardingError
from ..graph import MODULE_KEY, value_of
from . import ops
from .layout_record import LayoutRecord
from .rules import Claim
from .value_layout import LOCAL, LOCAL_TOKENS, LocalShape, Partial, Result, Sharded, ndim_of, norm_dim, shape_of

__all__ = []


# [Note: sequence parallelism]
# Between a row-parallel layer and the next column-parallel one, plain tensor parallelism runs
# the same work on every rank: the all-reduced activation is whole everywhere, so norms,
# residual adds, casts and dropout are computed tp times (ViT-L at tp=2: a rank computes 1.30x
# half the model, benchmarks/tp_rank_compute.py). With sequence_parallel=True (Megatron's
# sequence parallelism) those regions are split across the ranks by sample (dim 0: the batch,
# which a micro-batch keeps divisible by tp; ViT's 197 tokens are not), marked Sharded(tokens=True):
# - a row-parallel output is reduce-scattered along dim 0 instead of all-reduced;
# - a column-parallel input from such a region is all-gathered (its backward reduce-scatters:
#   each rank holds a partial gradient of the whole input) instead of passed through f;
# - a replicated tensor meeting a split one (the residual stream entering the first block)
#   keeps this rank's slice (split_to_tp; backward all-gathers);
# - ops that need every sample (BatchNorm, reductions over the batch, an active dropout, whose
#   one-process mask covers every sample, and ops not known here) and the model's outputs
#   all-gather first (gather_from_tp) and run replicated, so unknown ops cost speed, not
#   correctness;
# - a local sample count read from a split tensor's shape and used to shape a whole one is
#   multiplied back (ShapeEdit "*tp"); other arithmetic on it is refused with a ShardingError;
# - parameters applied to each rank's samples (norm weights, row-parallel biases, layer
#   scales) get partial gradients: the plan lists them (sequence_parallel_params) and
#   training/gradients.py's reduce_sequence_parallel_grads sums them over tp after backward.
# Communication per layer pair is the same as the all-reduce's (reduce-scatter + all-gather),
# and activation memory of the split regions drops by tp. Row outputs whose dim 0 does not
# divide by tp keep the all-reduce.


class _Propagator(LayoutRecord):
    """The op rules of layout propagation; :meth:`run` applies them in graph order."""

    # -- helpers -----------------------------------------------------------------------------
    def drops(self, node: fx.Node) -> bool:
        """Whether a dropout or stochastic-depth node may zero anything (p > 0)."""
        if node.op == "call_module":
            m = ops.module_of(node, self.gm)
            p = getattr(m, "p", getattr(m, "drop_prob", 1.0))
            return bool(m.training) and p != 0
        return ops.arg(node, 1, "p", 0.5) != 0 and ops.arg(node, 2, "training", True) is not False

    # -- anchors -----------------------------------------------------------------------------
    def anchor(self, node: fx.Node, claim: Claim) -> Any:
        tensors = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor) and a.op != "get_attr"]
        ins = [self.of(a) for a in tensors]
        style, module = claim.style, node.meta.get(MODULE_KEY, "")
        if style in ("column", "qkv", "mha"):
            for a, lay in zip(tensors, ins):
                if isinstance(lay, Sharded) and lay.tokens:  # the whole batch enters the sharded layer
                    self.add_collective("all_gather_tp", a, [node], module, dim=lay.dim)
                    continue
                if lay is not None:
                    self.fail(node, f"this {style}-parallel layer gets the already split '{a.name}'")
                self.add_collective("copy_to_tp", a, [node], module)
            if style == "mha":
                self.swaps[node.name] = "mha"
                return (Partial(f"{node.target}.out_proj.bias"), None)
            dim = 1 if ops.is_conv(node, self.gm) else ndim_of(node) - 1
            if "gather_from_tp" in claim.after:
                self.add_collective("gather_from_tp", node, list(node.users), module, dim=dim)
                return None
            return Sharded(dim, claim.outer, module)
        if style == "row":
            dim = 1 if ops.is_conv(node, self.gm) else ndim_of(tensors[0]) - 1
            if ins != [Sharded(dim, 1)]:
                self.fail(node, f"a row-parallel layer needs its input split on dim {dim}, got {ins}")
            if node.op != "call_module" or type(ops.module_of(node, self.gm)) not in _ROW_TYPES:
                self.fail(node, "row-parallel layers must be nn.Linear or nn.Conv1d/2d/3d leaves")
            self.swaps[node.name] = "row"
            has_bias = getattr(ops.module_of(node, self.gm), "bias", None) is not None
            trailing = ndim_of(node) - 2 if ops.is_conv(node, self.gm) else 0
            return self.reduce(node, Partial(f"{node.target}.bias" if has_bias else None, trailing))
        if style == "channel":
            if not ins or not isinstance(ins[0], Sharded) or ins[0].dim != 1 or ins[0].outer != 1:
                self.fail(node, f"a channel-sharded layer needs its input split on dim 1, got {ins}")
            return ins[0]
        if self.sp and all(lay is None or (isinstance(lay, Sharded) and lay.tokens) for lay in ins):
            self.gather_tokens(node)  # a layer kept whole (a head) runs on every sample
            return None
        if any(lay is not None for lay in ins):
            self.fail(node, "a replicated layer gets a split activation")
        return None

    # -- ops on split activations ------------------------------------------------------------
    def pointwise(self, node: fx.Node) -> Any:
        n_out = ndim_of(node)
        split: Sharded | None = None
        for a in node.all_input_nodes:
            lay = self.of(a)
            if isinstance(lay, Sharded):
                s = lay.moved(lay.dim + n_out - ndim_of(a))
                if split is not None and split != s:
                    self.fail(node, f"its inputs are split on different dims ({split}, {s})")
                split = s
            elif lay is not None and lay != LOCAL:
                self.fail(node, f"input '{a.name}' has layout {lay}")
        assert split is not None
        for a in node.all_input_nodes:
            if self.of(a) is None and isinstance(value_of(a), torch.Tensor):
                shape = shape_of(a)
                k = split.dim - (n_out - len(shape))
                if 0 <= k < len(shape) and shape[k] != 1:
                    if split.tokens or split.outer == 1:
                        # A replicated tensor meets a split one (the residual stream entering a batch-split
                        # region, a position bias over the heads): this rank's slice; its gradient,
                        # all-gathered, is the sum of every rank's share.
                        self.add_collective("split_to_tp", a, [node], node.meta.get(MODULE_KEY, ""), dim=k)
                        continue
                    self.fail(node, f"the replicated operand '{a.name}' {list(shape)} spans the split dim {split.dim}")
        return split

    def reshape(self, node: fx.Node, s: Sharded, explicit: bool) -> Sharded:
        # See [Note: locating the split dim across a reshape] in ops.py.
        src, out = shape_of(node.args[0]), shape_of(node)
        found = ops.locate_split(src, out, s.dim, s.outer, self.tp)
        if found is None:
            self.fail(node, f"the split dim {s.dim} of {list(src)} (outer {s.outer}) has no dim of "
                            f"{list(out)} that divides by tp={self.tp}")
        j, outer = found  # type: ignore[misc]
        sizes = self.sizes_of(node)[0]
        whole = self.of(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], fx.Node) else None
        if isinstance(whole, LocalShape):  # reshape(y.shape) of a y split alike: already this rank's sizes
            if (whole.dim, whole.tokens) != (j, s.tokens):
                self.fail(node, f"it takes the shape of a tensor split on dim {whole.dim}, not {j}")
            return s.moved(j, outer)
        if explicit:
            self.edit_size(node, sizes, j)
            self.global_samples(node, skip=j if s.tokens else None)
        return s.moved(j, outer)

    def split_op(self, node: fx.Node, name: str, s: Sharded) -> Any:
        n = ndim_of(node.args[0])
        default_dim = 0
        d = norm_dim(ops.arg(node, 1 if name == "unbind" else 2, "dim", default_dim), n)
        count = len(value_of(node)) if isinstance(value_of(node), (tuple, list)) else 0
        if name == "unbind":
            if d == s.dim:
                self.fail(node, "it unbinds the split dim")
            return tuple(s.moved(s.dim - (d < s.dim)) for _ in range(count))
        if d != s.dim:
            return tuple(s for _ in range(count))
        if count != s.outer:
            self.fail(node, f"it cuts the split dim into {count} pieces, not the {s.outer} blocks it holds")
        if name != "chunk":  # split sizes are sizes of the split dim: make them local
            sizes = node.args[1]
            for j in range(len(sizes) if isinstance(sizes, (list, tuple)) else 1):
                self.edit_size(node, list(sizes) if isinstance(sizes, (list, tuple)) else [sizes], j)
        return tuple(s.moved(s.dim, 1) for _ in range(count))

    def join(self, node: fx.Node, name: str) -> Sharded:
        """``cat``/``stack`` of tensors split alike (EVA's rotary embedding stacks the halves of
        each head's q and k, and joins the class token's back on): the split moves with a new dim,
        and no join may run along it."""
        parts = list(node.args[0]) if node.args else list(node.kwargs.get("tensors", ()))
        lays = [self.of(a) for a in parts]
        if not lays or any(lay != lays[0] for lay in lays) or not isinstance(lays[0], Sharded):
            self.fail(node, f"it joins tensors of layouts {lays}; only tensors split alike join")
        s, n = lays[0], ndim_of(parts[0])
        d = norm_dim(ops.arg(node, 1, "dim", 0), n + (name == "stack"))
        if name == "stack":
            return s.moved(s.dim + (d <= s.dim))
        if d == s.dim:
            self.fail(node, "it joins along the split dim")
        return s

    def getitem(self, node: fx.Node, base: Any, index: Any) -> Any:
        if isinstance(base, tuple):
            return base[index] if isinstance(index, int) else None
        if isinstance(base, LocalShape):
            if base.tokens and not isinstance(index, int):  # a slice of sizes holding the local count
                raise ShardingError(
                    f"cannot shard node '{node.name}' in {node.meta.get(MODULE_KEY) or 'the top level'}: it "
                    "slices a shape holding the number of samples of a sequence-parallel region; use "
                    "sequence_parallel=False")
            if not (isinstance(index, int) and index == base.dim):
                return None
            return LOCAL_TOKENS if base.tokens else LOCAL
        if not isinstance(base, Sharded):
            return None
        dim = ops.indexed_dim(index, ndim_of(node.args[0]), base.dim)
        if dim is None:
            self.fail(node, "it indexes the split dim")
        return base.moved(dim)  # type: ignore[arg-type]

    def module_op(self, node: fx.Node, s: Any) -> Any:
        """The layout out of a leaf module whose input has layout ``s``."""
        gm, m = self.gm, ops.module_of(node, self.gm)
        if isinstance(s, Sharded) and s.tokens:
            # Per-sample layers keep a split across samples; masks drawn per rank would not be
            # the one-process masks, so an active dropout gathers first (see run()).
            if (ops.is_dropout(node, gm) or ops.is_samplewise(node, gm)) and self.drops(node):
                self.fail(node, "dropout draws masks over every sample")
            if ops.is_elementwise(node, gm):
                return self.pointwise(node)
            if (ops.is_linear(node, gm) and s.dim < ndim_of(node) - 1) or (ops.is_conv(node, gm) and s.dim == 0):
                return s
        if ops.is_elementwise(node, gm):
            if ops.is_dropout(node, gm) and isinstance(self.pointwise(node), Sharded):
                self.swaps[node.name] = "tp_dropout"
            return self.pointwise(node)
        if isinstance(m, (torch.nn.Softmax, torch.nn.LogSoftmax)) and isinstance(s, Sharded):
            if m.dim is None or norm_dim(m.dim, ndim_of(node)) == s.dim:
                self.fail(node, "it takes a softmax over the split dim")
            return s
        if isinstance(m, torch.nn.LayerNorm) and isinstance(s, Sharded):
            if s.dim >= ndim_of(node) - len(m.normalized_shape):
                self.fail(node, "it normalises over the split dim")
            return s
        if ops.is_linear(node, gm) or ops.is_conv(node, gm):
            self.fail(node, f"this replicated {type(m).__name__} gets a split activation; make it row-parallel, "
                            f"e.g. ShardRule('row', match='{node.target}', style='row')")
        self.fail(node, f"{type(m).__name__} is not known to keep a split activation")

    def size_query(self, node: fx.Node, name: str, s: Any, first: Any) -> Any:
        """What ``x.shape``, ``x.size(d)`` or ``x.dim()`` of a value with layout ``s`` holds."""
        if not isinstance(s, Sharded):
            return None
        if name == "getattr":
            return LocalShape(s.dim, s.tokens) if node.args[1] == "shape" else None
        d = ops.arg(node, 1, "dim")
        if name == "dim":
            return None
        if d is None:
            return LocalShape(s.dim, s.tokens)
        return (LOCAL_TOKENS if s.tokens else LOCAL) if norm_dim(d, ndim_of(first)) == s.dim else None

    def op(self, node: fx.Node) -> Any:
        gm, name = self.gm, ops.op_name(node) if node.op != "call_module" else ""
        first = node.args[0] if node.args else None
        s = self.of(first)
        if node.op == "call_module":
            return self.module_op(node, s)
        if name == "getitem":
            return self.getitem(node, s, node.args[1])
        if name in ops.SIZE_QUERIES:
            return self.size_query(node, name, s, first)
        if name in ops.DROPOUT_FUNCTIONS and isinstance(s, Sharded) and s.tokens and self.drops(node):
            self.fail(node, "dropout draws masks over every sample")
        if name in ops.DROPOUT_FUNCTIONS or ops.is_elementwise(node, gm):
            out = self.pointwise(node)
            if name in ops.DROPOUT_FUNCTIONS:
                self.swaps[node.name] = "tp_dropout"
            return out
        if name not in ops.RESHAPES | {"expand"} and any(self.of(a) == LOCAL_TOKENS for a in node.all_input_nodes):
            raise ShardingError(
                f"cannot shard node '{node.name}' ({name}) in {node.meta.get(MODULE_KEY) or 'the top level'}: it "
                "computes with the number of samples of a sequence-parallel region, which differs between its "
                "ranks and the whole batch; use sequence_parallel=False")
        if name in ops.JOINS:
            return self.join(node, name)
        if s is None and name in ops.RESHAPES | {"expand"}:  # a whole tensor shaped by a local count
            self.global_samples(node)
            return None
        if not isinstance(s, Sharded):
            self.fail(node, f"its inputs have layouts {[self.of(a) for a in node.all_input_nodes]}")
        n = ndim_of(first)
        if name in ops.RESHAPES:
            return self.reshape(node, s, explicit=True)
        if name in ops.SHAPE_ONLY:
            return self.reshape(node, s, explicit=False)
        if name == "expand":
            sizes, _ = self.sizes_of(node)
            j = s.dim + len(sizes) - n
            self.edit_size(node, sizes, j)
            self.global_samples(node, skip=j if s.tokens else None)
            return s.moved(j)
        if name in ops.PERMUTES:
            if name == "permute":
                dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
                return s.moved([norm_dim(d, n) for d in dims].index(s.dim))
            a, b = (1, 0) if name == "t" else (norm_dim(node.args[1], n), norm_dim(node.args[2], n))
            return s.moved(b if s.dim == a else a if s.dim == b else s.dim)
        if name in ops.SPLITS:
            return self.split_op(node, name, s)
        if name in ops.SOFTMAX:
            if norm_dim(ops.arg(node, 1, "dim"), n) == s.dim:
                self.fail(node, "it takes a softmax over the split dim")
            return s
        if name == "normalize":  # F.normalize(x, p, dim=1): SwinV2's cosine attention, over each head
            if norm_dim(ops.arg(node, 2, "dim", 1), n) == s.dim:
                self.fail(node, "it normalises over the split dim")
            return s
        if name in ops.SDPA:
            qkv = [self.of(a) for a in node.args[:3]]
            if all(isinstance(x, Sharded) and x.tokens and x.dim < n - 2 for x in qkv):
                return self.pointwise(node)
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

    def op_or_gather(self, node: fx.Node) -> Any:
        """``op``; in a sequence-parallel region an op that cannot keep the split across samples
        (a reduction over them, BatchNorm, an active dropout, an unknown op) gets them all."""
        if not self.tokens_in(node) or any(isinstance(self.of(a), Sharded) and not self.of(a).tokens
                                           for a in node.all_input_nodes):
            return self.op(node)
        edits, swaps = len(self.edits), dict(self.swaps)
        collectives = {k: dataclasses.replace(c) for k, c in self.collectives.items()}  # users grow in place
        try:
            out = self.op(node)
        except ShardingError:
            del self.edits[edits:]
            self.collectives, self.swaps = collectives, swaps
            self.gather_tokens(node)
            return None
        self.note_partial_params(node)
        return out

    def note_partial_params(self, node: fx.Node) -> None:
        """Parameters ``node`` applies to this rank's samples only (a norm's weight, a layer scale,
        also through a reshape of it)."""
        names = []
        if node.op == "call_module":
            names = [f"{node.target}.{k}" for k, _ in ops.module_of(node, self.gm).named_parameters()]
        for a in node.all_input_nodes:
            split = self.collectives.get(f"split_to_tp_{a.name}")
            if self.of(a) is None and not (split is not None and node.name in split.users):
                names += self.attrs_behind(a)
        for name in names:
            try:
                self.gm.get_parameter(name)
            except AttributeError:  # a buffer or a constant: no gradient
                continue
            self.partial_params[name] = None

    def run(self) -> Result:
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                self.gather_tokens(node)
                bad = [a.name for a in node.all_input_nodes if self.of(a) is not None and not
                       (isinstance(self.of(a), Sharded) and self.of(a).tokens)]
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
                out = self.op_or_gather(node)
            if isinstance(out, Partial):
                out = self.reduce(node, out)
            self.lay[node.name] = out
        return Result(self.lay, list(self.collectives.values()), self.edits, self.swaps, list(self.partial_params))


_ROW_TYPES = (torch.nn.Linear, torch.nn.modules.linear.NonDynamicallyQuantizableLinear, *ops.CONV_TYPES)


def propagate(gm: fx.GraphModule, claims: dict[str, Claim], tp: int, sequence_parallel: bool = False) -> Result:
    """Layouts of every node under ``claims``, with the collectives and shape edits they need."""
    return _Propagator(gm, claims, tp, sequence_parallel).run()
