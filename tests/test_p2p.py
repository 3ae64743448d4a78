"""Boundary transfers: specs, buffer pooling, and real sends over a sub-group (rank translation).

One gloo world of 3 runs everything distributed: ranks 1 and 2 form the pipeline group, so
group rank 0 is global rank 1 and a wrong translation would hang or mix messages up.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autopipe.errors import ConfigError, InputError
from autopipe.runtime import PipelineDriver
from autopipe.runtime.p2p import (
    P2P, BufferPool, TensorSpec, Transfer, check_boundary, floating_indices, link_groups, ring_links,
)  # fmt: skip
from tests.distributed import run_distributed

__all__: list[str] = []

SPECS = [TensorSpec((2, 3), torch.float32), TensorSpec((2,), torch.int64), TensorSpec([4], torch.bfloat16)]


def test_spec_normalises_shape_and_prints() -> None:
    assert SPECS[2].shape == (4,) and hash(SPECS[2]) == hash(TensorSpec((4,), torch.bfloat16))
    assert str(SPECS[0]) == "(2, 3) float32"
    assert floating_indices(SPECS) == (0, 2)


def test_check_boundary_names_stage_and_shapes() -> None:
    good = [torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.bfloat16)]
    check_boundary(good, SPECS, 1, 0)
    with pytest.raises(InputError, match=r"stage 1 returned \[\(2, 3\) float32, \(2,\) int32, \(4,\) bfloat16\] "
                                         r"for micro-batch 5, but the plan says \[\(2, 3\) float32, \(2,\) int64"):
        check_boundary([good[0], good[1].int(), good[2]], SPECS, 1, 5)
    with pytest.raises(InputError, match="stage 0 returned"):
        check_boundary(good[:2], SPECS, 0, 0)


def test_ring_links_join_neighbours_both_ways() -> None:
    assert ring_links(1) == []
    assert ring_links(2) == [(0, 1), (1, 0)]
    assert ring_links(4) == [(0, 1), (0, 3), (1, 0), (1, 2), (2, 1), (2, 3), (3, 0), (3, 2)]


def test_buffers_are_reused_unless_aliased() -> None:
    pool = BufferPool("cpu")
    first = pool.acquire("act", SPECS)
    assert [tuple(b.shape) for b in first] == [(2, 3), (2,), (4,)] and first[1].dtype == torch.int64
    pool.release("act", first, live=[torch.zeros(1), None])
    assert pool.acquire("act", SPECS) is first
    assert pool.acquire("grad", SPECS) is not first  # pooled per key
    pool.release("act", first, live=[first[0][:1]])  # a view of the buffer is still in use
    assert pool.acquire("act", SPECS) is not first
    assert pool.zeros(SPECS[0]) is pool.zeros(TensorSpec((2, 3), torch.float32))


class Ignores(nn.Module):
    """Last stage using only its first input: autograd leaves the second one's grad None."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, h: torch.Tensor, unused: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.lin(h),)


class Splits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, 2 * h


def models() -> tuple[Splits, Ignores]:
    torch.manual_seed(0)
    return Splits(), Ignores()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def subgroup_worker(rank: int, world_size: int) -> Any:
    group = dist.new_group([1, 2])
    links = link_groups([[1, 2]])  # every process takes part, rank 0 too
    if rank == 0:
        assert links == {}
        return None
    me = dist.get_rank(group)
    # One group per direction, both of ranks 1 and 2: see [Note: transfer streams].
    assert sorted(links) == ring_links(2) and links[(0, 1)] is not links[(1, 0)]
    assert all(dist.get_process_group_ranks(g) == [1, 2] for g in links.values())
    p2p = P2P(group, links)
    assert p2p.link(True, 1 - me) is links[(me, 1 - me)] and p2p.link(False, 1 - me) is links[(1 - me, me)]
    with pytest.raises(ConfigError, match=r"pp_group has 2 of the 3 processes: build the pipelines' links"):
        PipelineDriver({me: nn.Identity()}, [[TensorSpec((3, 8), torch.float32)]], pp=2, chunks=1, pp_rank=me,
                       pp_group=group, schedule="1f1b", microbatches=2, loss_fn=mse, postprocess=lambda t: t,
                       device="cpu")
    assert p2p.global_rank(0) == 1 and p2p.global_rank(1) == 2
    # Both directions in one post, mixed dtypes: FIFO per direction, handles in order.
    mine = [torch.full(s.shape, 10.0 * rank + i).to(s.dtype) for i, s in enumerate(SPECS)]
    inbox = BufferPool("cpu").acquire("act", SPECS)
    send, recv = p2p.post([Transfer(True, mine, 1 - me, "send"), Transfer(False, inbox, 1 - me, "recv")])
    for w in send.works + recv.works:
        w.wait()
    got = [t.float().unique().tolist() for t in inbox]
    # A pipeline over the sub-group; stage 1 ignores a floating input, whose grad goes back as zeros.
    stage = models()[me]
    driver = PipelineDriver(
        {me: stage}, [[TensorSpec((3, 8), torch.float32)] * 2], pp=2, chunks=1, pp_rank=me, pp_group=group,
        schedule="1f1b", microbatches=2, loss_fn=mse, postprocess=lambda t: t[0], device="cpu", links=links,
    )
    x, y = data()
    loss = driver.train_step((x,), y)
    return got, loss.item(), {k: p.grad.clone() for k, p in stage.named_parameters()}


def test_transfers_and_pipeline_over_a_subgroup() -> None:
    _, r1, r2 = run_distributed(subgroup_worker, 3)
    assert r1[0] == [[20.0], [21.0], [22.0]] and r2[0] == [[10.0], [11.0], [12.0]]
    first, last = models()
    x, y = data()
    loss = sum(mse(last(*first(xm))[0], ym) / 2 for xm, ym in zip(x.split(3), y.split(3)))
    loss.backward()
    assert r1[1] == pytest.approx(loss.item(), rel=1e-6) and r2[1] == pytest.approx(loss.item(), rel=1e-6)
    for got, module in ((r1[2], first), (r2[2], last)):
        for name, p in module.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=1e-7)
