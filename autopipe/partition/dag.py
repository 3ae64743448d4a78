"""A computation DAG laid out in one topological order, ready to be cut into stages.

``linearize`` turns a networkx graph and an order into arrays over positions, and knows for
every cut which values live across it; ``stage_io`` says what each stage of a split receives
and sends. No torch here: node names and numbers only.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import overload

import networkx as nx
import numpy as np

from autopipe.errors import PartitionError
from autopipe.partition.balance import check_starts

__all__ = ["LinearDag", "Crossing", "StageIO", "linearize", "stage_io"]

# n: number of nodes. Position p: index of a node in the order. Cut k (0 <= k <= n-2)
# lies after position k; a value crosses cut k iff produced at <= k and read at > k.

_SHOWN = 5  # offending edges or names listed in an error before "... and N more"


class Crossing(Sequence[tuple[str, ...]]):
    """``crossing[k]``: names produced at positions <= k and read at positions > k, in order.

    Built on demand from each node's last reader: the sets of a wide graph add up to
    O(n^2) names (an input read by every layer crosses every cut), while a split asks
    for S - 1 of them. One lookup costs O(k + size of the answer).
    """

    def __init__(self, order: tuple[str, ...], last_use: np.ndarray) -> None:
        self._order = order
        self._last_use = last_use

    def __len__(self) -> int:
        return max(len(self._order) - 1, 0)

    @overload
    def __getitem__(self, k: int) -> tuple[str, ...]: ...

    @overload
    def __getitem__(self, k: slice) -> list[tuple[str, ...]]: ...

    def __getitem__(self, k: int | slice) -> tuple[str, ...] | list[tuple[str, ...]]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = operator.index(k)
        cut = k + len(self) if k < 0 else k
        if not 0 <= cut < len(self):
            n = len(self._order)
            raise IndexError(f"cut {k} out of range: {n} nodes have cuts 0..{n - 2}")
        live = np.flatnonzero(self._last_use[: cut + 1] > cut)
        return tuple(self._order[p] for p in live)

    def __repr__(self) -> str:
        return f"Crossing({len(self)} cuts)"


@dataclass(frozen=True, eq=False)
class LinearDag:
    """A graph's nodes in one topological order, as arrays indexed by position."""

    order: tuple[str, ...]
    index: Mapping[str, int]  # name -> position
    cost: np.ndarray  # float64[n]: modelled seconds, forward + backward
    mem: np.ndarray  # float64[n]: params, grads, optimizer state and saved activations
    params: np.ndarray  # int64[n]: parameter count
    out_bytes: np.ndarray  # int64[n]: bytes of the value produced, 0 for non-tensors
    last_use: np.ndarray  # int64[n]: position of the last reader; own position if none
    cut_bytes: np.ndarray  # int64[n-1]: bytes crossing each cut
    crossing: Crossing

    def __len__(self) -> int:
        return len(self.order)


@dataclass(frozen=True)
class StageIO:
    """Nodes of one stage [start, stop) and the values it receives and sends.

    ``inputs`` holds every value crossing the cut before the stage, ``outputs`` every value
    crossing the cut after it: a value read two stages later passes through this one.
    """

    start: int
    stop: int
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    in_bytes: int
    out_bytes: int


def linearize(graph: nx.DiGraph, order: Sequence[str]) -> LinearDag:
    """Lay ``graph`` out in ``order``, which must be a topological order of all its nodes.

    Nodes carry ``cost``, ``out_bytes``, ``mem`` and ``params``; a missing one counts as 0.
    O(n + e): each cut's byte count comes from a difference array over last readers.
    """
    order = tuple(order)
    index = _check_order(graph, order)
    n = len(order)
    attrs = graph.nodes
    cost = np.array([attrs[v].get("cost", 0.0) for v in order], dtype=np.float64)
    mem = np.array([attrs[v].get("mem", 0.0) for v in order], dtype=np.float64)
    params = np.array([attrs[v].get("params", 0) for v in order], dtype=np.int64)
    out_bytes = np.array([attrs[v].get("out_bytes", 0) for v in order], dtype=np.int64)

    e = graph.number_of_edges()
    src = np.fromiter((index[u] for u, _ in graph.edges), dtype=np.int64, count=e)
    dst = np.fromiter((index[v] for _, v in graph.edges), dtype=np.int64, count=e)
    last_use = np.arange(n, dtype=np.int64)
    np.maximum.at(last_use, src, dst)

    # A value made at p and last read at u > p crosses cuts p..u-1.
    live = np.flatnonzero(last_use > np.arange(n))
    delta = np.zeros(n + 1, dtype=np.int64)
    delta[live] += out_bytes[live]
    np.subtract.at(delta, last_use[live], out_bytes[live])
    cut_bytes = np.cumsum(delta)[: max(n - 1, 0)]

    for array in (cost, mem, params, out_bytes, last_use, cut_bytes):
        array.setflags(write=False)
    return LinearDag(
        order=order,
        index=MappingProxyType(index),
        cost=cost,
        mem=mem,
        params=params,
        out_bytes=out_bytes,
        last_use=last_use,
        cut_bytes=cut_bytes,
        crossing=Crossing(order, last_use),
    )


def stage_io(dag: LinearDag, bounds: Sequence[int]) -> list[StageIO]:
    """What each stage of the split ``bounds`` (stage start positions) holds, receives, sends."""
    n = len(dag)
    check_starts(bounds, n)
    fences = [*(int(b) for b in bounds), n]
    stages = []
    for start, stop in zip(fences, fences[1:]):
        before, after = start - 1, stop - 1
        stages.append(
            StageIO(
                start=start,
                stop=stop,
                nodes=dag.order[start:stop],
                inputs=dag.crossing[before] if start > 0 else (),
                outputs=dag.crossing[after] if stop < n else (),
                in_bytes=int(dag.cut_bytes[before]) if start > 0 else 0,
                out_bytes=int(dag.cut_bytes[after]) if stop < n else 0,
            )
        )
    return stages


def _check_order(graph: nx.DiGraph, order: tuple[str, ...]) -> dict[str, int]:
    """Positions by name, after gathering every way ``order`` fails to be topological."""
    index: dict[str, int] = {}
    repeated = []
    for p, name in enumerate(order):
        if name in index:
            repeated.append(f"{name!r} at positions {index[name]} and {p}")
        else:
            index[name] = p
    problems = [f"repeated: {_listed(repeated)}"] if repeated else []
    unknown = [repr(v) for v in index if v not in graph]
    if unknown:
        problems.append(f"not in the graph: {_listed(unknown)}")
    missing = [repr(v) for v in graph if v not in index]
    if missing:
        problems.append(f"missing from the order: {_listed(missing)}")
    backward = [
        f"edge {u!r} -> {v!r} goes from position {index[u]} back to {index[v]}"
        for u, v in graph.edges
        if u in index and v in index and index[u] >= index[v]
    ]
    problems += backward[:_SHOWN]
    if len(backward) > _SHOWN:
        problems.append(f"... and {len(backward) - _SHOWN} more edges going backwards")
    if problems:
        head = (
            f"order of {len(order)} names is not a topological order of the graph's "
            f"{len(graph)} nodes"
        )
        raise PartitionError(head + ":\n" + "\n".join(f"  - {p}" for p in problems))
    return index


def _listed(items: list[str]) -> str:
    more = f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more
