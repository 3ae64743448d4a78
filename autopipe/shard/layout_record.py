"""What layout propagation (layout.py) has found and decided so far, and the primitives its op
rules record with: every node's layout, the collectives to insert, the shape constants to make
local, the modules to swap and the parameters whose gradients are summed over tp.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..errors import ShardingError
from ..graph import MODULE_KEY, value_of, value_bytes
from . import ops
from .collectives import COLLECTIVES
from .plan import CollectiveOp, ShapeEdit
from .rules import Claim
from .value_layout import LOCAL, LOCAL_TOKENS, Partial, Sharded, dtype_of, shape_of

__all__ = ["LayoutRecord"]


class LayoutRecord:
    """The record of propagating layouts through ``gm`` from ``claims`` over ``tp`` ranks:
    ``lay`` maps each node to its layout; collectives, shape edits, swaps and partial
    parameters are what the rewrite will make of them."""

    def __init__(self, gm: fx.GraphModule, claims: dict[str, Claim], tp: int, sequence_parallel: bool = False):
        self.gm, self.claims, self.tp, self.sp = gm, claims, tp, sequence_parallel
        self.lay: dict[str, Any] = {}
        self.collectives: dict[str, CollectiveOp] = {}
        self.edits: list[ShapeEdit] = []
        self.swaps: dict[str, str] = {}
        self.visible: dict[str, str] = {}  # node -> the collective whose output its users see
        self.partial_params: dict[str, None] = {}  # used on this rank's samples only: grads summed over tp
        self._attrs: dict[str, list[str]] | None = None  # see attrs_behind

    def of(self, a: Any) -> Any:
        return self.lay.get(a.name) if isinstance(a, fx.Node) else None

    def fail(self, node: fx.Node, why: str) -> None:
        split = next((self.of(a) for a in node.all_input_nodes if isinstance(self.of(a), Sharded)), None)
        origin = split.origin if isinstance(split, Sharded) else ""
        where = node.meta.get(MODULE_KEY) or "the model's top level"
        fix = (f" Fix: keep '{origin}' replicated, e.g. parallelize(..., shard_rules=[ShardRule("
               f"'keep', match='{origin}', style='replicated')]) (plan_sharding(..., rules=[...]) when "
               "planning alone), or add a rule for this op." if origin else "")
        raise ShardingError(f"cannot shard node '{node.name}' ({node.op} {ops.op_name(node) if node.op != 'call_module' else node.target}) "
                            f"in {where}: {why}.{fix}")

    def add_collective(self, kind: str, src: fx.Node, users: list[fx.Node], module: str,
                       dim: int | None = None, bias: str | None = None, bias_trailing: int = 0) -> None:
        name = f"{kind}_{src.name}"
        if name in self.collectives:  # one f per replicated tensor feeding several sharded layers
            c = self.collectives[name]
            c.users = c.users + tuple(u.name for u in users if u.name not in c.users)
            return
        # Bytes of the whole tensor, moved forward and backward (summaries; the partitioner prices
        # the collective nodes of the rewritten graph itself). See [Note: collective table].
        fwd, bwd = COLLECTIVES[kind].payload(value_bytes(value_of(src)))
        # A reduced node's users see the reduction: a later collective on it takes that.
        after = self.visible.get(src.name, src.name)
        self.collectives[name] = CollectiveOp(name, kind, after, tuple(u.name for u in users), module,
                                              shape_of(src), dtype_of(src), fwd, bwd, dim, bias, bias_trailing)

    def reduce(self, node: fx.Node, partial: Partial) -> Any:
        """Sum partial ``node`` over the ranks; the layout its users see."""
        module = node.meta.get(MODULE_KEY, "")
        shape = shape_of(node)
        if self.sp and len(shape) >= 2 and shape[0] % self.tp == 0:  # see [Note: sequence parallelism] in layout.py
            self.add_collective("reduce_scatter_tp", node, list(node.users), module, dim=0, bias=partial.bias,
                                bias_trailing=partial.trailing)
            if partial.bias is not None:  # added after the scatter, to this rank's samples
                self.partial_params[partial.bias] = None
            self.visible[node.name] = f"reduce_scatter_tp_{node.name}"
            return Sharded(0, 1, module, tokens=True)
        self.add_collective("reduce_from_tp", node, list(node.users), module, bias=partial.bias,
                            bias_trailing=partial.trailing)
        self.visible[node.name] = f"reduce_from_tp_{node.name}"
        return None

    def edit_size(self, node: fx.Node, sizes: list[Any], j: int) -> None:
        size = sizes[j]
        if isinstance(size, fx.Node):
            if self.of(size) not in (LOCAL, LOCAL_TOKENS):
                self.edits.append(ShapeEdit(node.name, j, size.name, "//tp"))
        elif isinstance(size, int) and size != -1:
            if size % self.tp:
                self.fail(node, f"size {size} at position {j} is not divisible by tp={self.tp}")
            self.edits.append(ShapeEdit(node.name, j, size, size // self.tp))

    def global_samples(self, node: fx.Node, skip: int | None = None) -> None:
        """Sizes of ``node`` (a view/reshape/expand) that are a sequence-parallel region's local
        sample count, used on a tensor holding every sample: make them whole again."""
        sizes, _ = self.sizes_of(node)
        for j, size in enumerate(sizes):
            if j != skip and isinstance(size, fx.Node) and self.of(size) == LOCAL_TOKENS:
                self.edits.append(ShapeEdit(node.name, j, size.name, "*tp"))

    def sizes_of(self, node: fx.Node) -> tuple[list[Any], int]:
        """The size list of a view/reshape/expand and the arg position it starts at."""
        rest = list(node.args[1:])
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            return list(rest[0]), 1
        return rest, -1

    def attrs_behind(self, node: fx.Node) -> list[str]:
        """The get_attr targets ``node`` is computed from, if it is computed from them alone
        (a parameter, a reshape or cast of one); [] if an input of the model reaches it."""
        if self._attrs is None:  # one pass in graph order: inputs come first
            self._attrs = {}
            for n in self.gm.graph.nodes:
                if n.op == "get_attr":
                    self._attrs[n.name] = [n.target]
                elif n.op in ("call_function", "call_method") and n.all_input_nodes and all(
                        self._attrs.get(a.name) for a in n.all_input_nodes):
                    self._attrs[n.name] = [t for a in n.all_input_nodes for t in self._attrs[a.name]]
        return self._attrs.get(node.name, [])

    def tokens_in(self, node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if isinstance(self.of(a), Sharded) and self.of(a).tokens]

    def gather_tokens(self, node: fx.Node) -> None:
        """Give ``node`` every sample of its batch-split inputs (it runs replicated)."""
        for a in self.tokens_in(node):
            self.add_collective("gather_from_tp", a, [node], node.meta.get(MODULE_KEY, ""), dim=self.of(a).dim)
