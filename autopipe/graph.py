"""The graph contract every tracing route produces and every later step reads.

[Note: the autopipe graph]
A traced model is an ``fx.GraphModule`` whose root is the original model, so every
``call_module`` and ``get_attr`` target is a qualified name of the original model
(``blocks.3.attn.qkv``, ``cls_token``) and parameters keep their state_dict names.

* Placeholders are the model's flattened positional example inputs, in order.
* The output node returns a flat tuple of tensors; the structure the unmodified model
  returns (a tuple, a dict, a transformers ``ModelOutput``) is kept as a pytree spec
  beside the graph (``TracedModel.out_spec``).
* Leaf modules (``nn.Linear``, ``nn.Conv2d``, norms, dropout, ``nn.MultiheadAttention``...)
  appear as ``call_module`` nodes; behaviour that differs between ``train()`` and
  ``eval()`` lives only inside such leaves, so one graph serves both modes.
* Every node carries ``node.meta["val"]``: a meta tensor for a tensor value, a pytree of
  them for several values, or the plain Python value (int, tuple, torch.Size...). The
  shapes are those of one micro-batch.
* Every node carries ``node.meta[MODULE_KEY]``: the qualified name of the innermost
  module of the original model that the node belongs to (``""`` for the root).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = [
    "MODULE_KEY",
    "value_of",
    "tensor_values",
    "tensor_bytes",
    "value_bytes",
    "is_tensor_node",
    "owning_module",
    "keep_buffer_persistence",
    "resolve_attr",
]

MODULE_KEY = "autopipe_module"


def value_of(node: fx.Node) -> Any:
    """The propagated value of ``node`` (meta tensor, pytree of them, or a Python value)."""
    return node.meta.get("val")


def tensor_values(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (possibly nested) value."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def value_bytes(value: Any) -> int:
    """Bytes of all tensors inside ``value``; 0 for non-tensor values."""
    return sum(tensor_bytes(t) for t in tensor_values(value))


def is_tensor_node(node: fx.Node) -> bool:
    return isinstance(value_of(node), torch.Tensor)


def owning_module(node: fx.Node) -> str:
    return node.meta.get(MODULE_KEY, "")


def keep_buffer_persistence(gm: fx.GraphModule, source: torch.nn.Module) -> None:
    """Make ``gm.state_dict()`` keys a subset of ``source``'s (the model, or the graph a stage
    or a rewrite was built from), so that non-persistent buffers stay out of checkpoints.

    ``fx.GraphModule`` registers every get_attr tensor it copies as a buffer, and torch 2.11
    makes it persistent even where the source's is not (timm's Swin ``attn_mask``); undo that.
    """
    persistent = {f"{m}.{b}".lstrip(".") for m, mod in source.named_modules(remove_duplicate=False)
                  for b in mod._buffers if b not in mod._non_persistent_buffers_set}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target not in persistent:
            owner_path, _, field = n.target.rpartition(".")
            owner = gm.get_submodule(owner_path)
            shared = owner is resolve_attr(source, owner_path)  # a module of the source itself: untouched
            if field in owner._buffers and not shared:
                owner.register_buffer(field, owner._buffers[field], persistent=False)


def resolve_attr(obj: Any, path: str) -> Any:
    """The attribute at dotted ``path`` below ``obj`` (``obj`` for ""), or None where one is missing."""
    for atom in path.split(".") if path else ():
        obj = getattr(obj, atom, None)
    return obj
