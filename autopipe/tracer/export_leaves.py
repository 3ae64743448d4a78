"""Leaf modules of the export route: which they are, and folding their ATen ops into calls.

See [Note: export leaves]; the route itself is in ``export_route.py``.
"""
from __future__ import annotations

import difflib
import operator
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import TraceError
from .fx_route import LeafSpec

if TYPE_CHECKING:
    from torch.export import ExportedProgram, ModuleCallSignature

__all__ = ["leaf_names", "fold_leaves", "module_stack", "innermost_module", "within", "outermost"]

# [Note: export leaves]
# torch.export bakes the mode into the graph: aten.dropout(x, p, True), batch_norm(training=True),
# drop-path rand chains. So every call of a leaf module is exported with its call signature kept
# (preserve_module_call_signature), and the ATen nodes of that call, found by
# meta["nn_module_stack"], are replaced by one call_module node with the very arguments and
# outputs the module saw. Leaves: non-container torch.nn modules, classes named like dropout or
# stochastic depth, the user's leaf_modules, and every module whose own exported ops differ
# between train() and eval() (we export both). The outermost leaf of a node wins. A call that
# cannot be folded cleanly keeps its ATen nodes (finer, still correct) unless it depends on the
# mode: then one graph cannot serve both modes, and we raise naming the module.

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_MODE_NAMES = ("Dropout", "DropPath", "StochasticDepth")


def module_stack(node: fx.Node) -> list[tuple[str, str, str]]:
    """(key, qualified name, class name) of each module call around ``node``, outermost first."""
    return [(k, path, cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1])
            for k, (path, cls) in (node.meta.get("nn_module_stack") or {}).items()]


def innermost_module(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = module_stack(node)
    return stack[-1][1] if stack else ""


def within(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def leaf_names(model: nn.Module, leaf_modules: Iterable[LeafSpec]) -> set[str]:
    """Qualified names of the outermost leaf modules (see [Note: export leaves])."""
    specs = list(leaf_modules)
    types = tuple(s for s in specs if isinstance(s, type))
    names = {s for s in specs if isinstance(s, str)}
    modules = dict(model.named_modules())
    unknown = sorted(names - modules.keys())
    if unknown:
        raise TraceError("leaf_modules names no submodule of the model: " + "; ".join(
            f"'{n}' (close matches: {', '.join(difflib.get_close_matches(n, list(modules), n=3)) or 'none'})"
            for n in unknown))
    for name, m in modules.items():
        cls = type(m)
        if name and not isinstance(m, _CONTAINERS) and cls is not nn.Module and (
                cls.__module__.startswith(("torch.nn.", "torch.ao.nn.")) or isinstance(m, types)
                or any(s in cls.__name__ for s in _MODE_NAMES)):
            names.add(name)
    return outermost(names)


def outermost(paths: Iterable[str]) -> set[str]:
    chosen: set[str] = set()
    for p in sorted(paths, key=lambda p: p.count(".")):
        if not within(p, chosen):
            chosen.add(p)
    return chosen


def _step(k: Any) -> tuple[Callable, Any] | None:
    if isinstance(k, pytree.SequenceKey):
        return operator.getitem, k.idx
    if isinstance(k, pytree.MappingKey):
        return operator.getitem, k.key
    if isinstance(k, pytree.GetAttrKey):
        return getattr, k.name
    return None


def _accessors(spec: pytree.TreeSpec) -> list[list[tuple[Callable, Any]]] | None:
    """For each leaf of a module's output ``spec``: the getitem/getattr steps that reach it."""
    if spec.is_leaf():
        return [[]]
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))
    steps = [[_step(k) for k in path] for path, _ in paths]
    return None if any(None in chain for chain in steps) else steps  # type: ignore[return-value]


def _fold(graph: fx.Graph, path: str, key: str, group: list[fx.Node], sig: ModuleCallSignature | None,
          resolve: Callable[[str], fx.Node | None], pos: dict[fx.Node, float]) -> str | None:
    """Replace one leaf call's ATen ``group`` by a call_module node; return why not, or None."""
    from torch.export.graph_signature import ConstantArgument, TensorArgument  # import autopipe stays light

    if sig is None:
        return "export recorded no call signature for it"
    members, flat = set(group), []
    for a in sig.inputs:
        if isinstance(a, ConstantArgument) or (isinstance(a, TensorArgument) and resolve(a.name)):
            flat.append(a.value if isinstance(a, ConstantArgument) else resolve(a.name))
        else:
            return f"its input {a} is neither a graph value nor a constant"
    outs = [resolve(a.name) if isinstance(a, TensorArgument) else None for a in sig.outputs]
    steps = _accessors(sig.out_spec)
    if steps is None or not any(outs) or any(o is not None and o not in members for o in outs):
        return "it returns values it does not compute"
    ins = {x for x in flat if isinstance(x, fx.Node)}
    for n in group:
        if n not in outs and any(u not in members for u in n.users):
            return f"its intermediate value '{n.name}' is used outside it"
        if any(a not in members and a not in ins and a.op != "get_attr" for a in n.all_input_nodes):
            return f"its node '{n.name}' reads a value that is not one of its inputs"
    anchor = max((o for o in outs if o is not None), key=pos.__getitem__)
    if any(pos[i] >= pos[anchor] for i in ins):
        return "its inputs are not all computed before its outputs"
    args, kwargs = pytree.tree_unflatten(flat, sig.in_spec)
    stack = group[0].meta.get("nn_module_stack") or {}
    with graph.inserting_after(anchor):  # where the call ended: random draws keep their order
        call = graph.call_module(path, tuple(args), dict(kwargs))
    keys = list(stack)
    call.meta["nn_module_stack"] = {k: stack[k] for k in keys[: keys.index(key) + 1]}
    pos[call] = pos[anchor] + 0.5
    for out, chain in zip(outs, steps):
        if out is None:
            continue
        value = call
        for fn, arg in chain:
            with graph.inserting_after(value):
                value = graph.call_function(fn, (value, arg))
            value.meta["nn_module_stack"], pos[value] = call.meta["nn_module_stack"], pos[anchor] + 0.5
        out.replace_all_uses_with(value)
        out.meta["autopipe_folded_into"] = value
    for n in sorted(group, key=pos.__getitem__, reverse=True):
        graph.erase_node(n)
    return None


def fold_leaves(graph: fx.Graph, ep: ExportedProgram, leaves: set[str]) -> dict[str, str]:
    """Fold every call of a leaf; return {leaf: why its ATen ops stayed}."""
    nodes = list(graph.nodes)
    pos = {n: float(i) for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}

    def resolve(name: str) -> fx.Node | None:  # a value a fold has replaced resolves to its new node
        n = by_name.get(name)
        while n is not None and "autopipe_folded_into" in n.meta:
            n = n.meta["autopipe_folded_into"]
        return n

    groups: dict[str, list[fx.Node]] = {}  # module-call key -> its nodes, in graph order
    path_of: dict[str, str] = {}
    for n in nodes:
        key, path = next(((k, p) for k, p, _ in module_stack(n) if p in leaves), (None, ""))
        if key is not None:
            groups.setdefault(key, []).append(n)
            path_of[key] = path
    signature_of: dict[str, ModuleCallSignature] = {}  # "blocks.0.drop@1" names a call; its outputs name its key
    for entry in ep.module_call_graph:
        path = entry.fqn.split("@")[0]
        if entry.signature is not None and path in leaves:
            for out in filter(None, (by_name.get(getattr(a, "name", "")) for a in entry.signature.outputs)):
                key = next((k for k, p, _ in module_stack(out) if p == path), None)
                if key is not None:
                    signature_of[key] = entry.signature
                    break
    failed: dict[str, str] = {}
    for key, group in groups.items():
        why = _fold(graph, path_of[key], key, group, signature_of.get(key), resolve, pos)
        if why is not None:
            failed.setdefault(path_of[key], why)
    for n in nodes:
        n.meta.pop("autopipe_folded_into", None)
    return failed
