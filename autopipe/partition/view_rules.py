"""Pricing rules for views: ops that return their input under another shape. They launch no
kernel forward, except where the strides forbid it, and several copy in backward; see
[Note: views that copy].
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autopipe.graph import tensor_bytes, tensor_values, value_of

from .op_rules import Op, Work

__all__ = ["GRADIENT_COPY", "PERMUTES", "reshape", "split", "index", "expand", "getitem"]

# [Note: views that copy]
# A view returns its input under another shape, but some views copy all the same:
# - reshape, view and flatten of a tensor whose strides do not allow the new shape (a permuted
#   one) copy forward, as ``reshape`` does (Swin's window merge). Their backward reshapes a
#   contiguous gradient: a view.
# - a view that a permute or transpose reads gets its gradient permuted, and reshaping that
#   gradient back is a copy (ViT's qkv reshape before its permute: 46 us a block at 32 images
#   on an H100, forward free).
# - unbind, split and chunk: backward stacks the pieces' gradients into one tensor (ViT's
#   unbind of q, k, v: 59 us a block).
# - select and slicing: backward writes zeros over the whole input and the gradient into the
#   slice (ViT's class token).
# - expand: backward sums the gradient over the broadcast dims.
# A copy made in backward only is priced by ``Work(fwd_free=True, bwd_bytes=...)``, of the
# kernel family GRADIENT_COPY: mostly strided, slower per byte than a forward copy, and fitted
# apart from it. Which views copy is read from the meta values' strides, as the GPU lays them.
GRADIENT_COPY = "grad"
PERMUTES = frozenset({"permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims"})


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target).rstrip("_")
    if node.op == "call_function":
        return str(getattr(node.target, "__name__", node.target)).split(".", 1)[0].rstrip("_")
    return ""


def _source(op: Op) -> torch.Tensor | None:
    tensors = op.activations or op.weights
    return tensors[0] if tensors else None


def _gradient_copy(nbytes: float) -> Work:
    return Work("copy", fwd_free=True, bwd_bytes=float(nbytes), family=GRADIENT_COPY)


def reshape(op: Op) -> Work:
    """view, reshape, flatten and their kin: a copy forward when the strides forbid a view, a
    copy backward when a permute reads the result."""
    x, out = _source(op), op.out_tensor
    if x is None:
        return Work("view")
    try:
        x.view(out.shape)
    except (RuntimeError, ValueError):  # the strides forbid a view: reshape copies
        return Work("copy", bwd_bytes=0.0)
    if op.differentiable and any(_name(u) in PERMUTES and not _views_back(value_of(u), out, x.shape)
                                   for u in op.node.users):
        return _gradient_copy(2 * tensor_bytes(out))
    return Work("view")


def _views_back(permuted: Any, out: torch.Tensor, shape: torch.Size) -> bool:
    """Whether the gradient of ``out`` that arrives through ``permuted`` (a permutation of its
    dims, its own gradient contiguous) can be viewed in ``shape``."""
    if not isinstance(permuted, torch.Tensor) or permuted.dim() != out.dim():
        return True
    dims = {(n, s): i for i, (n, s) in enumerate(zip(out.shape, out.stride()))}
    contiguous = torch.empty(permuted.shape, device="meta").stride()
    strides = list(out.stride())
    for n, s, c in zip(permuted.shape, permuted.stride(), contiguous):
        if (n, s) in dims:
            strides[dims[(n, s)]] = c
    try:
        torch.empty_strided(tuple(out.shape), tuple(strides), device="meta").view(shape)
    except (RuntimeError, ValueError):
        return False
    return True


def split(op: Op) -> Work:
    """unbind, split, chunk: backward stacks the pieces' gradients into the input's shape."""
    x = _source(op)
    if x is None or not op.differentiable:
        return Work("view")
    return _gradient_copy(2 * tensor_bytes(x))


def index(op: Op) -> Work:
    """select, slice, narrow: backward fills the input's shape with zeros and the slice. A
    slice of everything (Swin's crop of a padding it did not add) is the input."""
    x = _source(op)
    if x is None or not op.differentiable or x.numel() == op.out_tensor.numel():
        return Work("view")
    return _gradient_copy(tensor_bytes(x) + 2 * tensor_bytes(op.out_tensor))


def expand(op: Op) -> Work:
    """expand: backward sums the gradient over the broadcast dims."""
    x, out = _source(op), op.out_tensor
    if x is None or not op.differentiable or x.numel() == out.numel():
        return Work("view")
    return Work("reduction", float(out.numel()), fwd_free=True,
                bwd_bytes=float(tensor_bytes(out) + tensor_bytes(x)))


def getitem(op: Op) -> Work:
    """``x[i]``: slicing a tensor is a view (whose backward copies); indexing with a tensor
    gathers into a new tensor, and its backward scatter-adds (sorting the indices first on a
    GPU), a fixed cost of its own (0.4 ms for Swin's relative position bias on an H100), hence
    a family apart. An item of a tuple or list is the item."""
    if any(True for _ in tensor_values(op.arg(1, "idx"))):
        return Work("copy", family="gather")
    return index(op) if isinstance(op.arg(0, "self"), torch.Tensor) else Work("view")
