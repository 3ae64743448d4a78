"""Every kernel a traced graph launches, as arrays: what the layout search prices in one pass."""
from __future__ import annotations

import dataclasses

import numpy as np

from autopipe.partition.calibration import class_of, compute_class, launched
from autopipe.partition.cost import MATMUL_KINDS, NodeCost

__all__ = ["KernelTable"]


@dataclasses.dataclass
class KernelTable:
    """Every kernel the graph launches (a node, or each part of a composite one), as arrays:
    what ``DeviceProfile.node_time`` reads, so that every node is priced in one numpy pass."""

    node: np.ndarray  # int: the node it belongs to
    matmul: np.ndarray  # bool: on matmul units
    flops: tuple[np.ndarray, np.ndarray]  # forward, backward, at the reference size
    fixed_bytes: tuple[np.ndarray, np.ndarray]  # bytes that do not grow with the batch (weights)
    act_bytes: tuple[np.ndarray, np.ndarray]  # bytes that do
    fixed_class: list[str]  # calibration class when it does not depend on bytes, else ""
    prefix: list[str]  # else the class's part before the bytes bucket
    term: list[str]  # its vector-arithmetic term's class, or "" ([Note: depthwise arithmetic])
    shape: list[str]  # its exact shape where its rule names it ([Note: kernels off their class])

    @classmethod
    def of(cls, costs: list[NodeCost]) -> KernelTable:
        rows = []
        for i, cost in enumerate(costs):
            for k in launched(cost):
                weights = min(float(k.param_bytes), k.fwd_bytes)
                grads = min(2.0 * k.param_bytes, k.bwd_bytes)
                fwd_class = class_of(k)  # a class by shape is the same both ways; by bytes, bucketed per pass
                bytes_class = "/" in fwd_class and ("iB" in fwd_class.rsplit("/", 1)[1])
                rows.append((i, k.kind in MATMUL_KINDS, k.fwd_flops, k.bwd_flops, weights, grads,
                             k.fwd_bytes - weights, k.bwd_bytes - grads,
                             "" if bytes_class else fwd_class, fwd_class.rsplit("/", 1)[0] if bytes_class else "",
                             compute_class(k) or "", k.shape))
        cols = list(zip(*rows)) if rows else [[] for _ in range(12)]
        arr = [np.asarray(c, dtype=float) for c in cols[2:8]]
        return cls(np.asarray(cols[0], dtype=int), np.asarray(cols[1], dtype=bool), (arr[0], arr[1]),
                   (arr[2], arr[3]), (arr[4], arr[5]), list(cols[8]), list(cols[9]), list(cols[10]), list(cols[11]))
