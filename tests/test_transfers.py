"""A step's receives (runtime/transfers.py) land where the driver asks: in a CUDA-graph slot's
static tensors when posted ([Note: graph slots as boundaries]), or redirected there while a
shared-memory message is not yet copied out; those tensors never go back to the pool."""
from __future__ import annotations

import pytest
import torch

from autopipe.errors import ScheduleError
from autopipe.runtime.p2p import Handle, TensorSpec
from autopipe.runtime.program import PointToPoint
from autopipe.runtime.schedule import ActionKind
from autopipe.runtime.transfers import StepTransfers
from tests.test_host_links import _ends

SPEC = TensorSpec((4,), torch.float32)


class _SharedOnly:
    """The P2P of a pipeline whose every message goes through its shared-memory links."""

    def __init__(self, links) -> None:
        self.shared = links

    def post(self, transfers):
        return [Handle(self.shared.post(t.send, t.peer, t.tensors, t.what), t) for t in transfers]


def _pair():
    sender, receiver, monitor = _ends(slots=4, nbytes=1024)
    a = StepTransfers(_SharedOnly(sender), torch.device("cpu"), monitor, None)
    b = StepTransfers(_SharedOnly(receiver), torch.device("cpu"), monitor, None)
    for t in (a, b):  # stage 0 on rank 0 sends one tensor to stage 1 on rank 1, micro-batches 0 to 2
        t.start([None] * 3, [[[SPEC]]] * 3, {0: (0,), 1: ()})
    return a, b, (sender, receiver)


def _send(a: StepTransfers, mb: int, value: float) -> None:
    a.outbox[(0, mb)] = [torch.full((4,), value)]
    a.post([PointToPoint(ActionKind.SEND_ACT, 0, mb, 1, f"send {mb}")])


def test_receives_land_in_the_destination_or_are_redirected_and_only_pooled_buffers_return() -> None:
    a, b, links = _pair()
    static = [torch.zeros(4)]
    b.destination = lambda kind, s, mb, specs: static if mb == 0 and specs == [SPEC] else None
    for mb in range(3):
        b.post([PointToPoint(ActionKind.RECV_ACT, 1, mb, 0, f"receive {mb}")])
        _send(a, mb, float(mb + 1))
    assert b.received(ActionKind.RECV_ACT, 1, 0) is static and torch.equal(static[0], torch.full((4,), 1.0))
    b.release(ActionKind.RECV_ACT, 1, 0, static, live=())
    assert not b.pool._free  # the destination's tensors are not the pool's
    into = [torch.zeros(4)]
    got = b.received(ActionKind.RECV_ACT, 1, 1, into=into)  # not copied out yet: lands in ``into``
    assert got is into and torch.equal(into[0], torch.full((4,), 2.0))
    assert len(b.pool._free[("act", 1, None)]) == 1  # the pooled buffers it was bound for went back
    b.release(ActionKind.RECV_ACT, 1, 1, into, live=())
    assert len(b.pool._free[("act", 1, None)]) == 1
    pooled = b.received(ActionKind.RECV_ACT, 1, 2)
    assert pooled is not into and torch.equal(pooled[0], torch.full((4,), 3.0))
    b.release(ActionKind.RECV_ACT, 1, 2, pooled, live=())
    assert len(b.pool._free[("act", 1, None)]) == 2
    assert a.through_shared_memory(1) and not b.through_shared_memory(0)  # b sends nothing back
    a.fence(ActionKind.SEND_ACT, 0, 0)  # a shared-memory send: its copy is done, the wait returns
    with pytest.raises(ScheduleError, match=r"send of stage 0's outputs \(micro-batch 5\) must be posted"):
        a.fence(ActionKind.SEND_ACT, 0, 5)  # never posted: what it would read is about to be overwritten
    a.finish()
    for end in links:
        end.close()
