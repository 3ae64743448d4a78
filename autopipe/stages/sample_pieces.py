"""Pooling cut by sample, so that a stage boundary can fall inside one.

[Note: sample pieces]
Pooling computes each sample of its input alone, so it splits exactly along the batch: with
the micro-batch's samples cut at ``0 = s_0 < s_1 < ... < s_k = B``,

    pool(x) = cat_i pool(x[s_i : s_i+1])        (on dim 0)

``cut_pool`` rewrites a traced graph that way: ``split_samples`` of the input (``torch.split`` by
sample, at sizes read from the input, so the graph serves any micro-batch size), then
each part pooled (a copy of the pooling node; the module holds no state, so each stage that
pools calls its own copy of it), then ``torch.cat`` of the results (a JOIN). A boundary
between pieces i and i + 1 carries the samples pooled so far and the input's samples still to
pool, no more than a cut before the pooling would. The values are the unsplit graph's to the
bit, and so are the gradients: the split's backward concatenates its parts' gradients.

Why: a ResNet's stem ends in a max-pool over its largest map. On an H200 under CUDA graphs at
128 images, ResNet-50's conv1 -> bn1 -> act1 took 3.0 ms and the max-pool 1.2 ms more, with a
mean stage of 3.95 ms in 8 stages: the first stage either stopped short of the pool (3.0 ms)
or ran over the mean by 7% with it, and no plan cut between nodes reached 1.05 (docs/
benchmarks.md, "One GPU: convolutions cut by channel"). The same stem cut by channel
(mlp_pieces.py) ran at 1.4x its share: a channel slice of a channels-last map is strided, and
the narrower convolutions are slower per channel. A slice of samples is contiguous in either
layout, and a pooling of part of the batch, memory-bound, costs about its share of the whole.

The spec (``PartitionPlan.mlp_pieces``, keyed by the pooling node's name) is ``{"samples":
boundaries}`` in samples of the planned micro-batch. A micro-batch of another size (a step's
uneven last one: [Note: stage variants]) is cut at the same fractions of its own batch, each
piece keeping a sample where there are enough.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import PartitionError
from ..graph import value_of
from ..memory_format import channels_last_dense
from ..partition.rule_tables import FUNCTION_NAMES
from .piece_meta import JOIN, PIECE, PIECE_OF, SAMPLES

__all__ = ["Pool", "POOLS", "find_pools", "cut_pool", "scaled_bounds", "split_samples"]

POOLS: tuple[type, ...] = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


@dataclass(frozen=True)
class Pool:
    """A pooling node that can be cut by sample: an ``nn.MaxPoolNd`` or ``nn.AvgPoolNd`` called
    with its input alone, returning one tensor with the input's batch."""

    node: fx.Node
    align: ClassVar[int] = 1  # any sample may part the pieces

    @property
    def key(self) -> str:
        """Its name in ``PartitionPlan.mlp_pieces``: the node's."""
        return self.node.name

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return (self.node,)

    def spec(self, bounds: list[int]) -> dict[str, Any]:
        """The pieces spec cutting it at sample ``bounds``."""
        return {SAMPLES: list(bounds)}

    def hidden(self, gm: fx.GraphModule) -> int:
        """How many units it is cut from: the samples of its micro-batch."""
        return int(value_of(self.node).shape[0])


def _is_pool(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return False
    if type(gm.get_submodule(node.target)) not in POOLS:
        return False
    x, y = value_of(node.args[0]), value_of(node)
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() >= 3
            and y.shape[0] == x.shape[0] >= 2)


def find_pools(gm: fx.GraphModule) -> list[Pool]:
    """Every pooling node of ``gm`` that can be cut by sample (see :class:`Pool`)."""
    return [Pool(n) for n in gm.graph.nodes if _is_pool(n, gm)]


def scaled_bounds(bounds: list[int], batch: int) -> list[int]:
    """``bounds`` (samples of a micro-batch of ``bounds[-1]``) at the same fractions of ``batch``,
    each piece keeping a sample where ``batch`` has enough."""
    planned, k = bounds[-1], len(bounds) - 1
    if batch == planned:
        return list(bounds)
    out = [0]
    for i, b in enumerate(bounds[1:-1], 1):
        least = out[-1] + (1 if batch >= k else 0)
        out.append(min(max(round(b * batch / planned), least), batch - (k - i if batch >= k else 0)))
    return out + [batch]


def split_samples(x: torch.Tensor, bounds: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``x`` cut along its batch (dim 0) at ``bounds``, samples of a micro-batch of ``bounds[-1]``
    scaled to ``x``'s: the graph stays generic in the batch size, as stage variants for other
    sizes need ([Note: stage variants])."""
    at = scaled_bounds(list(bounds), int(x.shape[0]))
    return torch.split(x, [b - a for a, b in zip(at, at[1:])], dim=0)


FUNCTION_NAMES[split_samples] = "split"  # priced as torch.split is


def _like(value: torch.Tensor, samples: int) -> torch.Tensor:
    """A piece's traced value: ``value`` with ``samples`` samples, in its layout."""
    layout = torch.channels_last if channels_last_dense(value) else torch.contiguous_format
    return torch.empty((samples, *value.shape[1:]), dtype=value.dtype, device="meta", memory_format=layout)


def cut_pool(gm: fx.GraphModule, name: str, bounds: list[int]) -> None:
    """Replace pooling node ``name`` of ``gm`` by its pieces at sample ``bounds`` (of the planned
    micro-batch; scaled to ``gm``'s), concatenated; see [Note: sample pieces]."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    if node is None or not _is_pool(node, gm):
        raise PartitionError(f"pieces name {name!r} as a pooling cut by sample, which is not a pooling node of "
                             "this graph (an nn.MaxPoolNd or nn.AvgPoolNd called with its input alone); the "
                             "plan was made for another model or trace")
    if bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise PartitionError(f"sample boundaries {bounds} do not cut {name!r} into increasing pieces from 0")
    x, out = value_of(node.args[0]), value_of(node)
    sizes = [int(part.shape[0]) for part in split_samples(x, tuple(bounds))]  # on the traced (meta) value
    graph = gm.graph
    with graph.inserting_before(node):
        split = graph.call_function(split_samples, (node.args[0], tuple(bounds)))
        split.meta.update({**node.meta, "val": tuple(_like(x, s) for s in sizes)})
        parts = []
        for i, s in enumerate(sizes):
            part = graph.call_function(operator.getitem, (split, i))
            part.meta.update({**node.meta, "val": _like(x, s)})
            parts.append(part)
        pooled = []
        for i, (part, s) in enumerate(zip(parts, sizes)):
            piece = graph.node_copy(node, lambda _: part)  # noqa: B023 - called at once
            piece.meta.update({"val": _like(out, s), PIECE_OF: (node.name, s / max(x.shape[0], 1)), PIECE: (name, i)})
            pooled.append(piece)
        joined = graph.call_function(torch.cat, (pooled,), {"dim": 0})
        joined.meta.update({**node.meta, JOIN: True})
    node.replace_all_uses_with(joined)
    graph.erase_node(node)
