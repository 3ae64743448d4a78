"""Seconds of what crosses a stage boundary or runs a tensor-parallel collective, by the
device profile's link; see [Note: communication in the stage cost].
"""
from __future__ import annotations

import torch.fx as fx

from ..shard import collectives as c
from .cost import NodeCost
from .device import DeviceProfile

__all__ = ["cut_seconds", "cut_latency_seconds", "tp_collective_seconds"]


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


def tp_collective_seconds(node: fx.Node, cost: NodeCost, tp: int, profile: DeviceProfile) -> float:
    """Time of the collective a sharded graph's ``node`` runs over ``tp`` ranks, per micro-batch
    (forward + backward): ring all-reduce moves 2 (tp - 1) / tp of the tensor per rank (f in
    backward, g in forward), all-gather and reduce-scatter (tp - 1) / tp of the whole tensor.
    0 for other nodes."""
    # Ring collectives: reduce-scatter and all-gather each move (tp - 1) / tp of the whole tensor.
    whole_moves = {c.copy_to_tp: 2 * (tp - 1) / tp, c.reduce_from_tp: 2 * (tp - 1) / tp,
                   c.gather_from_tp: (tp - 1) / tp,
                   c.all_gather_tp: 2 * (tp - 1) / tp,  # all-gather forward, reduce-scatter backward
                   c.reduce_scatter_tp: 2 * (tp - 1),  # its output is 1/tp of the whole: both ways
                   c.split_to_tp: tp - 1}  # all-gather backward, of a whole tp times its output
    if node.op != "call_function" or node.target not in whole_moves:
        return 0.0
    return profile.transfer_time(whole_moves[node.target] * cost.out_bytes)
