"""Shape propagation on fake tensors: fills ``node.meta["val"]`` without running real kernels.

Works for models on the meta device (planning a model too big for the machine) and for real
models alike: parameters are turned into fake tensors on the fly, so nothing is allocated.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ..graph import MODULE_KEY

__all__ = ["propagate_shapes", "to_meta"]


def to_meta(value: Any) -> Any:
    """Replace every tensor in ``value`` by a meta tensor of the same shape, stride and dtype."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
        return x

    return pytree.tree_map(convert, value)


class _Propagator(fx.Interpreter):
    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # A batch norm's output is its input's shape and dtype. Running it in fake mode reads
        # ``num_batches_tracked`` as a Python float where momentum is None, which torch 2.11's
        # fake tensors refuse (DataDependentOutputException); the shape needs no statistics.
        module = self.fetch_attr(target)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and args and isinstance(args[0], torch.Tensor):
            return torch.empty_like(args[0])
        return super().call_module(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:  # name the node: the raw error rarely does
            where = n.meta.get(MODULE_KEY) or "the model's top level"
            raise TraceError(
                f"shape propagation failed at node '{n.name}' ({n.op} {n.target}) in {where}: "
                f"{type(exc).__name__}: {exc}. Check that example_inputs are one micro-batch of the "
                f"shape the model expects."
            ) from exc
        n.meta["val"] = to_meta(result)
        return result


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Run ``gm`` on fake copies of ``example_inputs``, recording every node's value in its meta.

    Returns the (meta) output value.
    """
    # Fake mode runs ops on real tensors alone for real: a train-mode batch norm would bump the
    # model's num_batches_tracked. Buffers are swapped for copies while the graph runs.
    buffers = {f"gm.{n}": b.clone() for n, b in gm.named_buffers()}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_inputs = [
            mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs
        ]
        out = torch.func.functional_call(_Running(gm), buffers, tuple(fake_inputs))
    return to_meta(out)


class _Running(nn.Module):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any) -> Any:
        return _Propagator(self.gm).run(*args)
