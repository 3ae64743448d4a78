"""A traced graph's costs at any micro-batch size, as arrays: what the layout search prices with.

[Note: costs at another batch]
Tracing a large model takes seconds, and a search weighs many micro-batch sizes, so the graph
is traced once, at a reference size, and every node's cost is scaled to the others: FLOPs,
activation bytes, saved and output bytes grow with the batch, a node's parameter bytes do
not (``scaled``). The kernel classes of a calibration never depend on the batch (see
[Note: calibrated roofline]), except through bytes, which are scaled first. A measured
profile prices the nodes at its own size, and other sizes by the analytic ratio of the two.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from autopipe.graph import owning_module
from autopipe.partition.cost import NodeCost, graph_costs, training_state_bytes
from autopipe.partition.device import DeviceProfile
from autopipe.partition.measured import MeasuredCosts
from autopipe.partition.partitioner import cut_candidates, cut_dag, tp_collective_seconds
from autopipe.tracer import TracedModel

__all__ = ["GraphCosts", "scaled"]


def scaled(cost: NodeCost, ratio: float) -> NodeCost:
    """``cost`` at ``ratio`` times its batch; see [Note: costs at another batch]."""
    if ratio == 1.0:
        return cost
    if cost.parts:
        parts = tuple(scaled(p, ratio) for p in cost.parts)
        return dataclasses.replace(
            cost, parts=parts, fwd_flops=sum(p.fwd_flops for p in parts), bwd_flops=sum(p.bwd_flops for p in parts),
            fwd_bytes=sum(p.fwd_bytes for p in parts), bwd_bytes=sum(p.bwd_bytes for p in parts),
            saved_bytes=int(cost.saved_bytes * ratio), out_bytes=int(cost.out_bytes * ratio))
    weights = min(float(cost.param_bytes), cost.fwd_bytes)
    grads = min(2.0 * cost.param_bytes, cost.bwd_bytes)  # weights read, their gradients written
    return dataclasses.replace(
        cost, fwd_flops=cost.fwd_flops * ratio, bwd_flops=cost.bwd_flops * ratio,
        fwd_bytes=weights + (cost.fwd_bytes - weights) * ratio, bwd_bytes=grads + (cost.bwd_bytes - grads) * ratio,
        saved_bytes=int(cost.saved_bytes * ratio), out_bytes=int(cost.out_bytes * ratio))


class GraphCosts:
    """One traced (and possibly tp-sharded) graph, priced per node at any micro-batch size.

    Arrays follow the graph's node order (placeholders first, the output node left out).
    """

    def __init__(self, traced: TracedModel, reference_size: int, *, tp: int = 1,
                 measured: Mapping[int, MeasuredCosts] | None = None) -> None:
        self.traced, self.reference_size, self.tp = traced, reference_size, tp
        nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
        self.order = [n.name for n in nodes]
        all_costs = graph_costs(traced.gm)
        self.costs = [all_costs[n] for n in self.order]
        self.allowed = np.array(cut_candidates(traced), dtype=bool)
        by_name = dict(zip(self.order, self.costs))
        dag = cut_dag(traced, by_name, None)
        self.cut_bytes_ref = np.asarray(dag.cut_bytes[: len(self.order) - 1], dtype=float)  # traced dtype
        self.param_bytes = np.array([c.param_bytes for c in self.costs], dtype=float)
        self.param_count = np.array([c.param_count for c in self.costs], dtype=float)
        self.saved_ref = np.array([c.saved_bytes for c in self.costs], dtype=float)
        self.state_bytes = np.array([training_state_bytes(c.param_bytes) if c.param_count else 0
                                     for c in self.costs], dtype=float)
        self.collective_nodes = [i for i, n in enumerate(nodes) if tp_collective_seconds(n, self.costs[i], max(tp, 2),
                                                                                         _UNIT_LINK) > 0]
        self._nodes = nodes
        self.measured = dict(measured or {})
        self.modules = [owning_module(n) for n in nodes]
        self._times: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def node_times(self, size: int, profile: DeviceProfile) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of every node at ``size`` samples per micro-batch."""
        key = (size, profile.name, profile.mode, id(profile.calibration), profile.matmul_flops, profile.mem_bandwidth)
        if key not in self._times:
            self._times[key] = self._node_times(size, profile)
        return self._times[key]

    def _node_times(self, size: int, profile: DeviceProfile) -> tuple[np.ndarray, np.ndarray]:
        ratio = size / self.reference_size
        fwd = np.empty(len(self.costs))
        bwd = np.empty(len(self.costs))
        for i, c in enumerate(self.costs):
            s = scaled(c, ratio)
            fwd[i], bwd[i] = profile.node_time(s), profile.node_time(s, backward=True)
        measured = self._measured_for(size)
        if measured is not None:
            fwd, bwd = self._from_measured(measured, size, profile, fwd, bwd)
        return fwd, bwd

    def _measured_for(self, size: int) -> MeasuredCosts | None:
        if size in self.measured:
            return self.measured[size]
        return self.measured[min(self.measured, key=lambda s: abs(s - size))] if self.measured else None

    def _from_measured(self, measured: MeasuredCosts, size: int, profile: DeviceProfile,
                       fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Measured node times, split into forward and backward as measured (or as modelled),
        scaled by the model's ratio when the profile was made at another size."""
        own = measured.input_shapes[0][0] if measured.input_shapes and measured.input_shapes[0] else size
        base_f, base_b = (fwd, bwd) if own == size else self.node_times(own, profile)
        out_f, out_b = fwd.copy(), bwd.copy()
        for i, name in enumerate(self.order):
            seconds = measured.node_seconds.get(name)
            if seconds is None:
                continue
            detail = measured.node_detail.get(name)
            share = detail[0] / (detail[0] + detail[1]) if detail and detail[0] + detail[1] > 0 else \
                base_f[i] / (base_f[i] + base_b[i]) if base_f[i] + base_b[i] > 0 else 0.5
            ratio = (fwd[i] + bwd[i]) / (base_f[i] + base_b[i]) if base_f[i] + base_b[i] > 0 else size / own
            out_f[i], out_b[i] = seconds * share * ratio, seconds * (1 - share) * ratio
        return out_f, out_b

    def collective_bytes(self, size: int) -> np.ndarray:
        """Per node, bytes its tensor-parallel collective moves per micro-batch (0 elsewhere), as
        ``tp_collective_seconds`` counts them, at ``size`` samples."""
        out = np.zeros(len(self.costs))
        ratio = size / self.reference_size
        for i in self.collective_nodes:
            out[i] = tp_collective_seconds(self._nodes[i], self.costs[i], self.tp, _UNIT_LINK) * ratio
        return out


# A link of 1 B/s and no latency: tp_collective_seconds then returns bytes moved.
_UNIT_LINK = DeviceProfile("unit", 1.0, 1.0, 1.0, 1.0, 0.0, 0.0)
