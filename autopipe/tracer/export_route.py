"""Route (b): ``torch.export`` for models fx cannot trace, normalised into the autopipe graph.

Leaf module calls are folded back from ATen ops into ``call_module`` nodes (see [Note: export
leaves] in export_leaves.py); guards go, in-place ops on activations become out-of-place.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ..graph import MODULE_KEY, keep_buffer_persistence, resolve_attr
from .export_leaves import fold_leaves, innermost_module, leaf_names, module_stack, outermost, within
from .fx_route import LeafSpec

__all__ = ["trace_export"]

_ASSERTS = {"_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_constrain_range",
            "sym_constrain_range_for_size", "_functional_assert_async", "_functional_assert_scalar"}
# ATen ops that follow a train flag -> the argument that is truthy in training.
_TRAIN_ARG = {
    **dict.fromkeys(("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "native_dropout"),
                    "train"),
    **dict.fromkeys(("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm", "rrelu"),
                    "training"),
    **dict.fromkeys(("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention"), "dropout_p"),
}


def _op(node: fx.Node) -> str | None:
    """The ATen op name of a call_function node (``add_`` for aten.add_.Tensor), else None."""
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if node.op == "call_function" and schema is not None else None


def _export(model: nn.Module, inputs: tuple, training: bool, keep: Iterable[str]) -> Any:
    modes = [(m, m.training) for m in model.modules()]  # a frozen submodule may sit in eval()
    try:
        model.train(training)
        return torch.export.export(model, inputs, strict=False, preserve_module_call_signature=tuple(sorted(keep)))
    except Exception as exc:
        exc.autopipe_module = _failing_module(exc, model)  # type: ignore[attr-defined]
        raise
    finally:
        for m, mode in modes:
            m.training = mode


def _failing_module(exc: BaseException, model: nn.Module) -> str | None:
    """The innermost module of ``model`` whose forward is on the traceback (for the error)."""
    names = {id(m): n for n, m in model.named_modules()}
    found, tb = None, exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def _mode_dependent(train: fx.Graph, evaluation: fx.Graph) -> set[str]:
    """Modules whose own exported ops (targets and constant arguments) differ between modes."""

    def ops(graph: fx.Graph) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in graph.nodes:
            if n.op == "call_function":
                args = fx.node.map_aggregate((n.args, n.kwargs), lambda a: "%" if isinstance(a, fx.Node) else repr(a))
                out.setdefault(innermost_module(n), []).append(f"{n.target}{args}")
        return out

    a, b = ops(train), ops(evaluation)
    eval_only = sorted(b.keys() - a.keys())  # nothing in the train graph to fold them into
    if eval_only:
        raise TraceError(f"export route: {', '.join(map(repr, eval_only))} compute nothing in train() but "
                         "something in eval(), so the train-mode graph cannot carry them; give exec_sequence")
    return {m for m in a.keys() | b.keys() if a.get(m) != b.get(m)}


def _sweep(graph: fx.Graph) -> None:
    """Drop export's guards and asserts, and unused values whose op has no effect."""
    for n in reversed(list(graph.nodes)):
        if n.users or n.op in ("placeholder", "output"):
            continue
        name = _op(n)
        if n.op == "get_attr" or n.target == "_guards_fn" or name in _ASSERTS or (name and not (
                n.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in n.target.tags)):
            graph.erase_node(n)


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return _op(node) is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def _out_of_place(graph: fx.Graph) -> None:
    """``add_(x, y)`` -> ``add(x, y)`` where ``x`` is an activation that no view aliases.

    Cut activations become autograd leaves in a stage, and in-place ops on such leaves fail.
    """
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        name = _op(n)
        first = n.target._schema.arguments[0].alias_info if name and n.target._schema.arguments else None
        if not (first is not None and first.is_write and name.endswith("_") and not name.endswith("__")):
            continue
        pure = getattr(getattr(torch.ops.aten, name[:-1], None), n.target._overloadname, None)
        x = n.args[0]
        # buffers (get_attr) are meant to be updated; a view's base, and views of x, must see the write
        if pure is None or not isinstance(x, fx.Node) or x.op == "get_attr" or _is_view(x) \
                or any(_is_view(u) and pos[u] < pos[n] for u in x.users):
            continue
        with graph.inserting_before(n):
            new = graph.call_function(pure, n.args, n.kwargs)
        new.meta, pos[new] = dict(n.meta), pos[n]
        for u in [u for u in x.users if pos[u] > pos[n]]:
            u.replace_input_with(x, new)
        n.replace_all_uses_with(new)
        graph.erase_node(n)


def _argument(node: fx.Node, name: str) -> tuple[bool, Any]:
    """(whether the op takes ``name``, its value in this call)."""
    for i, a in enumerate(node.target._schema.arguments):  # type: ignore[union-attr]
        if a.name == name:
            return True, node.kwargs.get(name, node.args[i] if i < len(node.args) else a.default_value)
    return False, None


def _train_flag(node: fx.Node) -> bool:
    arg = _TRAIN_ARG.get(_op(node) or "")
    if not arg:
        return False
    found, flag = _argument(node, arg)
    if found and flag and arg == "training":
        # Batch statistics with no running statistics to switch to (transformers' weight-
        # standardised convolutions normalise their weight so) are the same in both modes.
        stats = [_argument(node, n) for n in ("running_mean", "running_var")]
        return any(taken and value is not None for taken, value in stats)
    return bool(flag)


def _check_modes(graph: fx.Graph, changed: set[str], leaves: set[str], failed: dict[str, str]) -> None:
    """Raise if anything that behaves differently in train() and eval() is left outside a leaf."""
    for n in graph.nodes:
        owner = innermost_module(n)
        if _op(n) is None or not (_train_flag(n) or within(owner, changed)):  # getitems of a fold pass
            continue
        stack = module_stack(n)
        paths = [p for _, p, _ in stack if p]
        leaf = next((p for p in paths if p in leaves), None)
        enclosing = paths[: paths.index(leaf)] if leaf else paths
        where = f"module '{owner}' ({stack[-1][2]})" if owner else "the model's top level"
        why = f" Leaf '{leaf}' could not become one call: {failed[leaf]}." if leaf in failed else ""
        fix = f"leaf_modules=['{enclosing[-1]}'] (the whole module as one call), or " if enclosing else ""
        raise TraceError(f"export route: {n.target} in {where} behaves differently in train() and "
                         f"eval(), and one graph must serve both.{why} Fix: {fix}exec_sequence=[...].")


def _graph_module(model: nn.Module, graph: fx.Graph, exported: fx.GraphModule) -> fx.GraphModule:
    """``fx.GraphModule`` rooted at ``model``; tensors export made up become non-persistent buffers."""
    root = nn.Module()  # shares the model's children and tensors; the model itself is not touched
    for name, child in model.named_children():
        root.add_module(name, child)
    for name, p in model.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        root.register_buffer(name, b)
    for i, n in enumerate(n for n in graph.nodes if n.op == "get_attr" and resolve_attr(root, n.target) is None):
        value = resolve_attr(model, n.target)  # a plain tensor attribute, or a constant export lifted
        if value is None:
            value, n.target = resolve_attr(exported, n.target), f"_autopipe_constant_{i}"
        if isinstance(value, nn.Module):  # the body of a higher-order op (cond, flex attention's mask)
            root.add_module(n.target, value)
        else:
            root.register_buffer(n.target, value, persistent=False)
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__)
    gm.training = model.training  # not gm.train(): that would reset the shared leaves' own modes
    keep_buffer_persistence(gm, model)
    return gm


def trace_export(
    model: nn.Module, example_inputs: tuple, leaf_modules: Iterable[LeafSpec] = ()
) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    """Export ``model`` in train mode and normalise it into the autopipe graph.

    See [Note: the autopipe graph] in autopipe/graph.py and [Note: export leaves] in export_leaves.py.
    """
    leaves = leaf_names(model, leaf_modules)
    evaluation = _export(model, example_inputs, False, ()).module().graph
    try:
        ep = _export(model, example_inputs, True, leaves)
    except Exception:  # a leaf whose call signature export cannot keep: fold nothing, check below
        ep = _export(model, example_inputs, True, ())
    exported = ep.module()
    changed = _mode_dependent(exported.graph, evaluation)
    if "" in changed:
        raise TraceError(f"{type(model).__name__}.forward itself computes differently in train() and "
                         "eval(), so one graph cannot serve both; move that code into a submodule, or "
                         "give exec_sequence=[...]")
    if not all(within(m, leaves) for m in changed):
        leaves = outermost(leaves | changed)
        ep = _export(model, example_inputs, True, leaves)
        exported = ep.module()
    graph = fx.Graph()  # ours: no owning module, plain codegen (flat tuple out; ep keeps the structure)
    graph.output(graph.graph_copy(exported.graph, {}))
    _sweep(graph)
    failed = fold_leaves(graph, ep, leaves)
    _sweep(graph)
    _out_of_place(graph)
    _check_modes(graph, changed, leaves, failed)
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = tuple(out.args[0]) if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    if not all(isinstance(a, fx.Node) for a in flat):
        raise TraceError(f"{type(model).__name__} returns a constant among its outputs {flat}; "
                         "autopipe needs tensor outputs")
    out.args = (flat,)
    for n in graph.nodes:
        n.meta[MODULE_KEY] = "" if n.op in ("placeholder", "output") else innermost_module(n)
    return _graph_module(model, graph, exported), ep.call_spec.out_spec
