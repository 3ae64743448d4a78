"""What layout propagation (layout.py) records of a value: split on a dim (:class:`Sharded`),
a partial sum awaiting its all-reduce (:class:`Partial`), a shape holding a local size
(:class:`LocalShape`), and the propagation's :class:`Result`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..graph import value_of
from .plan import CollectiveOp, ShapeEdit

__all__ = ["Sharded", "Partial", "LocalShape", "LOCAL", "LOCAL_TOKENS", "Result", "ndim_of", "shape_of", "norm_dim",
           "dtype_of"]


@dataclass(frozen=True)
class Sharded:
    dim: int
    outer: int = 1
    origin: str = field(default="", compare=False)  # the sharded layer it comes from (for errors)
    tokens: bool = False  # split across samples in a sequence-parallel region, features whole

    def moved(self, dim: int, outer: int | None = None) -> "Sharded":
        """The same split, found at ``dim`` of another tensor."""
        return Sharded(dim, self.outer if outer is None else outer, self.origin, self.tokens)


@dataclass(frozen=True)
class Partial:
    bias: str | None = None
    trailing: int = 0  # dims after the bias's (a conv's channels are followed by its spatial dims)


@dataclass(frozen=True)
class LocalShape:
    dim: int  # the entry of a shape tuple that is local at run time
    tokens: bool = False


LOCAL = "local"  # an int that is a local size at run time
LOCAL_TOKENS = "local-tokens"  # the local number of samples of a sequence-parallel region


@dataclass
class Result:
    layouts: dict[str, Any]
    collectives: list[CollectiveOp]
    edits: list[ShapeEdit]
    swaps: dict[str, str]
    partial_params: list[str] = field(default_factory=list)  # see [Note: sequence parallelism]


def ndim_of(node: fx.Node) -> int:
    v = value_of(node)
    return v.dim() if isinstance(v, torch.Tensor) else 0


def shape_of(node: Any) -> tuple[int, ...]:
    v = value_of(node) if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def dtype_of(node: fx.Node) -> str:
    v = value_of(node)
    return str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else ""
