"""Shared-memory links (runtime/host_links.py): what a slot holds, which messages they carry,
the ring's slots from the schedule, and the ring itself between two ends of one process."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from autopipe.errors import ConfigError, PipelineFailure
from autopipe.failure.monitor import FailureMonitor
from autopipe.runtime import host_links
from autopipe.runtime.host_links import ALIGN, SharedLinks, message_bytes, ring_slots, shared_links, slot_bytes
from autopipe.runtime.p2p import TensorSpec


def test_a_message_takes_each_tensor_aligned_and_a_slot_the_largest_boundary() -> None:
    assert message_bytes([torch.zeros(3, dtype=torch.int8), torch.zeros(2, 100)]) == ALIGN + 4 * ALIGN
    boundaries = [[TensorSpec((2, 100), torch.float32)], [TensorSpec((3,), torch.int8), TensorSpec((64,), torch.bfloat16)]]
    assert slot_bytes(boundaries) == 4 * ALIGN
    assert slot_bytes([]) == ALIGN


def test_shared_links_are_on_between_gpus_of_one_host_unless_switched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_links, "SHARED_LINKS", None)
    assert shared_links(cuda=True, one_host=True) and not shared_links(cuda=False, one_host=True)
    assert not shared_links(cuda=True, one_host=False)
    monkeypatch.setattr(host_links, "SHARED_LINKS", True)
    assert shared_links(cuda=False, one_host=True) and not shared_links(cuda=False, one_host=False)
    monkeypatch.setattr(host_links, "SHARED_LINKS", False)
    assert not shared_links(cuda=True, one_host=True)


def test_ring_slots_cover_every_program_and_fewer_micro_batches() -> None:
    # Interleaved 1F1B, pp=2, 4 chunks, 4 micro-batches: 28 messages a step on each link, 4 ahead at most.
    assert ring_slots("interleaved_1f1b", 2, 4, 4) == {(0, 1): 4, (1, 0): 4}
    # GPipe sends every micro-batch before any comes back; evaluation is GPipe's forward.
    assert ring_slots("1f1b", 2, 6, 1) == {(0, 1): 6, (1, 0): 2}
    assert ring_slots("1f1b", 2, 6, 1, fewer=False) == {(0, 1): 6, (1, 0): 2}


def _ends(slots: int, nbytes: int, deadline: float = 30.0) -> tuple[SharedLinks, SharedLinks, FailureMonitor]:
    """Both ends of one link (rank 0 sends to rank 1), connected in two threads over one store."""
    store = dist.HashStore()
    monitor = FailureMonitor(0, store, "autopipe/failure/test", size=2, deadline=deadline)
    got: dict[int, SharedLinks] = {}

    def connect(rank: int) -> None:
        got[rank] = SharedLinks.connect(device=torch.device("cpu"), store=store, key="autopipe/links/test", rank=rank,
                                        receives={0: slots} if rank else {}, sends=[] if rank else [1],
                                        slot_bytes=nbytes, poll=monitor.poll, timeout=deadline)

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return got[0], got[1], monitor


def test_messages_cross_the_ring_in_order_and_reuse_its_slots() -> None:
    sender, receiver, monitor = _ends(slots=2, nbytes=message_bytes([torch.zeros(4), torch.zeros(3, dtype=torch.int64)]))
    assert sender.carries(True, 1, [torch.zeros(4)]) and receiver.carries(False, 0, [torch.zeros(4)])
    assert not sender.carries(True, 1, [torch.zeros(200)])  # larger than a slot: the backend's link takes it
    assert not sender.carries(True, 2, [torch.zeros(4)]) and not receiver.carries(True, 0, [torch.zeros(4)])
    for n in range(5):  # more messages than slots: each reuses the slot of the one two back
        x, ids = torch.full((4,), float(n)), torch.arange(3) + n
        (sent,) = sender.post(True, 1, [x, ids], "send")
        assert sent.ready() and sent.is_completed()
        out = [torch.empty(4), torch.empty(3, dtype=torch.int64)]
        (receipt,) = receiver.post(False, 0, out, "receive")
        assert receipt.ready() and not receipt.is_completed()
        monitor.wait([receipt], "receive")
        assert receipt.is_completed() and torch.equal(out[0], x) and torch.equal(out[1], ids)
    # A third message while the first two wait: its slot is the first's, which is not copied out.
    for n in range(2):
        sender.post(True, 1, [torch.zeros(4), torch.zeros(3, dtype=torch.int64)], "send")
    monitor.deadline = 0.5
    with pytest.raises(PipelineFailure, match=r"send \(a free slot\) timed out after 0.5 s"):
        sender.post(True, 1, [torch.zeros(4), torch.zeros(3, dtype=torch.int64)], "send")
    sender.close()
    receiver.close()


def test_a_receive_not_yet_copied_out_lands_where_it_is_redirected() -> None:
    """A CUDA graph's slot taken at the forward: the message goes straight into its inputs."""
    sender, receiver, monitor = _ends(slots=2, nbytes=message_bytes([torch.zeros(4)]))
    pooled, static = [torch.zeros(4)], [torch.zeros(4)]
    (receipt,) = receiver.post(False, 0, pooled, "receive")
    sender.post(True, 1, [torch.arange(4.0)], "send")
    assert receipt.redirect(static)
    monitor.wait([receipt], "receive")
    assert torch.equal(static[0], torch.arange(4.0)) and torch.equal(pooled[0], torch.zeros(4))
    assert not receipt.redirect(pooled)  # copied out already
    sender.close()
    receiver.close()


def test_a_slot_of_no_bytes_is_refused() -> None:
    with pytest.raises(ConfigError, match="slot_bytes must be positive, got 0"):
        SharedLinks.connect(device=torch.device("cpu"), store=dist.HashStore(), key="k", rank=0, receives={},
                            sends=[], slot_bytes=0, poll=lambda done, what: None, timeout=1.0)


@pytest.mark.parametrize("end", ["_open_ring", "_make_ring"])
def test_a_ring_either_end_cannot_set_up_leaves_the_link_to_the_backend(monkeypatch: pytest.MonkeyPatch,
                                                                        end: str) -> None:
    """Both ends drop the link alike: GPUs without peer access refuse the receiver's memory, and
    memory that cannot be shared refuses its handle."""
    def refuse(*args: object) -> None:
        raise RuntimeError("peer access is not supported between these devices")

    monkeypatch.setattr(SharedLinks, end, refuse)
    with pytest.warns(RuntimeWarning, match=r"from pipeline rank 0 to 1 could not be set up \(RuntimeError: peer "
                                            r"access .*\); its messages go over the backend's link"):
        sender, receiver, _ = _ends(slots=2, nbytes=ALIGN)
    assert not sender.carries(True, 1, [torch.zeros(4)]) and not receiver.carries(False, 0, [torch.zeros(4)])
    sender.close()
    receiver.close()
