"""Where a graph may be cut into stages, and what crosses each cut.

The node order is the graph's own (fx keeps nodes in execution order, placeholders first; the
output node is left out). ``allowed_cuts`` says where a boundary may fall, ``cut_dag`` what
every boundary would carry, and ``layer_groups``/``split_positions`` turn layers and module
names into positions of that order.
"""
from __future__ import annotations

import difflib
from typing import Mapping, Sequence

import networkx as nx
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import PartitionError
from ..graph import is_tensor_node, owning_module, resolve_attr, value_of
from ..tracer import TracedModel
from .cost import NodeCost
from .dag import LinearDag, linearize

__all__ = ["allowed_cuts", "cut_candidates", "cut_dag", "layer_of", "layer_groups", "split_positions"]


def _sent_bytes(node: fx.Node, nbytes: int, activation_dtype: torch.dtype | None) -> int:
    """Bytes of ``node``'s value on the wire: a floating tensor travels in ``activation_dtype``.

    Scaled from ``nbytes`` (the node's priced output, which a sharded costing may have cut)
    rather than recomputed from the traced value.
    """
    value = value_of(node)
    if activation_dtype is None or not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return nbytes
    return nbytes * activation_dtype.itemsize // value.element_size()


def layer_of(module_path: str, root: torch.nn.Module) -> str:
    """The top-level layer a module belongs to: ``blocks.3`` inside a ModuleList, else ``head``."""
    if not module_path:
        return ""
    parts = module_path.split(".")
    child = getattr(root, parts[0], None)
    if _is_layer_list(child) and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _is_layer_list(module: object) -> bool:
    # A GraphModule rebuilds the containers on a target's path as plain nn.Module, so a
    # ModuleList/Sequential of the original model is recognised by its indexed children too.
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        return True
    names = [name for name, _ in module.named_children()] if isinstance(module, torch.nn.Module) else []
    return bool(names) and all(name.isdigit() for name in names)


def layer_groups(nodes: Sequence[fx.Node], root: torch.nn.Module) -> list[int]:
    """Non-decreasing layer index of each node, for the equal-layers ("uniform") split."""
    groups: list[int] = []
    current, gid = None, -1
    for node in nodes:
        layer = layer_of(owning_module(node), root)
        if layer and layer != current:
            current, gid = layer, gid + 1
        groups.append(max(gid, 0))
    return groups


def allowed_cuts(nodes: Sequence[fx.Node], gm: fx.GraphModule) -> list[bool]:
    """Where a cut may fall: ``allowed[k]`` says whether stages may split after node k.

    Two users of one parameter stay in one stage.

    A parameter used by two stages would need its gradient summed across them; keeping its
    users together avoids that (vision models rarely share weights, so this costs nothing).
    """
    allowed = [True] * max(len(nodes) - 1, 0)
    users: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        owned: list[torch.Tensor] = []
        if node.op == "call_module":
            owned = list(gm.get_submodule(node.target).parameters())
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                t = resolve_attr(gm, arg.target)
                if isinstance(t, torch.Tensor):
                    owned.append(t)
        for t in owned:
            users.setdefault(id(t), []).append(i)
    for positions in users.values():
        for k in range(min(positions), max(positions)):
            allowed[k] = False
    position = {n: i for i, n in enumerate(nodes)}
    for i, node in enumerate(nodes):
        # Inputs all belong to stage 0, and a stage of inputs alone would do nothing.
        if node.op == "placeholder" and i < len(allowed):
            allowed[i] = False
        # A tuple of tensors cannot be sent: keep it with the nodes that unpack it.
        value = value_of(node)
        if not isinstance(value, torch.Tensor) and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value)):
            last = max((position[u] for u in node.users if u in position), default=i)
            for k in range(i, last):
                allowed[k] = False
    return allowed


def split_positions(names: Sequence[str], nodes: Sequence[fx.Node]) -> list[int]:
    """Cut positions (after index k) for explicit split points named by module."""
    modules = sorted({owning_module(n) for n in nodes if owning_module(n)})
    positions = []
    for name in names:
        first = next(
            (i for i, n in enumerate(nodes) if owning_module(n) == name or owning_module(n).startswith(name + ".")),
            None,
        )
        if first is None:
            close = difflib.get_close_matches(name, modules, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise PartitionError(f"split point {name!r} names no module of the traced graph{hint}")
        if first == 0:
            raise PartitionError(f"split point {name!r} is the first module: a stage before it would be empty")
        positions.append(first - 1)
    return positions


def cut_candidates(traced: TracedModel) -> list[bool]:
    """``allowed[k]``: whether a stage boundary may fall after position k of the node order."""
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    return allowed_cuts(nodes, traced.gm)


def cut_dag(traced: TracedModel, costs: Mapping[str, NodeCost], activation_dtype: torch.dtype | None) -> LinearDag:
    """The graph's node order as a linear DAG whose ``cut_bytes[k]`` are the bytes crossing a cut
    after position k (every live tensor, residuals included; floating ones in ``activation_dtype``)."""
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    output_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    graph = nx.DiGraph()
    for node in nodes:
        # get_attr and non-tensor values are never sent: the emitter copies or bakes them.
        sent = node.op != "get_attr" and is_tensor_node(node)
        nbytes = _sent_bytes(node, costs[node.name].out_bytes, activation_dtype) if sent else 0
        graph.add_node(node.name, cost=0.0, out_bytes=nbytes, mem=0.0, params=0)
    for node in nodes:
        for user in node.users:
            if user.op != "output":
                graph.add_edge(node.name, user.name)
    # Model outputs must reach the last stage: a sink after everything keeps them live.
    sink = "__output__"
    graph.add_node(sink, cost=0.0, out_bytes=0, mem=0.0, params=0)
    for leaf in output_node.all_input_nodes:
        graph.add_edge(leaf.name, sink)
    return linearize(graph, [n.name for n in nodes] + [sink])
