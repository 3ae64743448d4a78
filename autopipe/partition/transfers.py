"""Seconds of what crosses a stage boundary or runs a tensor-parallel collective, by the
device profile's link; see [Note: communication in the stage cost].
"""
from __future__ import annotations

import torch.fx as fx

from ..shard.collectives import BY_FUNCTION
from .cost import NodeCost
from .device import DeviceProfile

__all__ = ["cut_seconds", "cut_latency_seconds", "boundary_copy_seconds", "tp_collective_seconds"]


# [Note: communication in the stage cost]
# The runtime posts sends without waiting and receives ahead of the compute that needs them
# (NCCL runs them on its own stream), so in the steady state of a schedule a stage's
# transfers overlap its compute. A stage [i, j) therefore takes
#     max(compute, comm) + latency
# - compute: its nodes' forward + backward seconds;
# - comm: seconds the link is busy with the bytes of its input cut and of its output cut.
#   Each cut moves its bytes twice, activations forward and their gradients back, but in
#   opposite directions, and links (NVLink, PCIe, InfiniBand, Ethernet) are full duplex:
#   a stage receives its inputs and its outputs' gradients (in + out bytes inbound) while it
#   sends its outputs and its inputs' gradients (as many outbound). So comm is
#   (in + out) / link_bandwidth: bytes / link_bandwidth per cut (``cut_seconds``);
# - latency: link_latency per transfer, so 2 per cut, which overlap does not hide
#   (``cut_latency_seconds``).
# The balancer (balance.solve_overlapped) minimises the largest such time exactly, so it
# avoids a cut at a huge activation only where that would make a stage link-bound; the plan's
# StagePlan.cost and imbalance come from balance.overlapped_stage_times, the same formula to
# the bit. Floating tensors are priced in activation_dtype when one is given.
# The largest stage time sets the pipeline's step time, so that is what is minimised. The
# plan's imbalance (largest over mean) is not: latencies and link-bound excess move the
# mean with the cuts, and a split with a slower largest stage can show a lower ratio.


def cut_seconds(nbytes: float, profile: DeviceProfile) -> float:
    """Link seconds a cut of ``nbytes`` adds to each stage beside it; see
    [Note: communication in the stage cost]."""
    return float(nbytes) / profile.link_bandwidth


def cut_latency_seconds(nbytes: float, profile: DeviceProfile) -> float:
    """Latency a cut adds to each stage beside it: two transfers (activations, gradients)."""
    return 2.0 * profile.link_latency if nbytes > 0 else 0.0


def boundary_copy_seconds(nbytes: float, profile: DeviceProfile) -> float:
    """Device seconds a cut of ``nbytes`` adds to each stage beside it by the copies its mode
    makes of them ([Note: boundary copies] in calibration.py); 0 without a calibration."""
    cal = profile.calibration
    mode = "graphs" if profile.mode.endswith("graphs") else "eager"  # replayed or not
    return float(nbytes) * cal.boundary.get(mode, 0.0) if cal is not None else 0.0


def tp_collective_seconds(node: fx.Node, cost: NodeCost, tp: int, profile: DeviceProfile) -> float:
    """Time of the collective a sharded graph's ``node`` runs over ``tp`` ranks, per micro-batch
    (forward + backward; see [Note: collective table] in shard/collectives.py); 0 for other nodes."""
    collective = BY_FUNCTION.get(node.target) if node.op == "call_function" else None
    if collective is None:
        return 0.0
    return profile.transfer_time(collective.moved_by_output(cost.out_bytes, tp))
