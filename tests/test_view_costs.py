"""Views that copy: forward where the strides forbid a view, backward where autograd must
rebuild the input's shape ([Note: views that copy] in autopipe/partition/view_rules.py)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopipe.partition.cost import NodeCost, graph_costs
from autopipe.partition.view_rules import GRADIENT_COPY
from autopipe.tracer import trace

B, N, H, D = 2, 5, 2, 4
C = H * D
F32 = 4


class Attention(nn.Module):
    """timm's ViT attention, without its projections' biases' details."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        qkv = self.qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


def _by_op(gm, name: str) -> list[NodeCost]:
    costs = graph_costs(gm)
    return [costs[n.name] for n in gm.graph.nodes if str(n.target) == name or getattr(n.target, "__name__", "") == name]


def _backward_only(cost: NodeCost, nbytes: int) -> bool:
    return (cost.fwd_flops, cost.fwd_bytes, cost.bwd_bytes, cost.saved_bytes) == (0, 0, nbytes, 0)


def test_the_qkv_reshape_and_unbind_copy_in_backward_only():
    gm = trace(Attention(), (torch.randn(B, N, C),)).gm
    qkv_bytes = B * N * 3 * C * F32
    (reshape_qkv, merge_heads), (unbind,) = _by_op(gm, "reshape"), _by_op(gm, "unbind")
    # The gradient reaches the reshape through the permute: reshaping it back copies.
    assert _backward_only(reshape_qkv, 2 * qkv_bytes) and reshape_qkv.family == GRADIENT_COPY
    # unbind's backward stacks the three gradients into one tensor.
    assert _backward_only(unbind, 2 * qkv_bytes) and unbind.kind == "copy"
    # Fused attention writes tokens before heads: merging the heads after it is a view.
    assert merge_heads.kind == "view"


def test_a_reshape_the_strides_forbid_copies_forward_and_not_backward():
    class Net(nn.Module):
        def forward(self, x):
            return x.transpose(1, 2).reshape(2, 12) + x.reshape(2, 12)

    gm = trace(Net(), (torch.randn(2, 3, 4),)).gm
    copied, viewed = _by_op(gm, "reshape")
    assert (copied.kind, copied.fwd_bytes, copied.bwd_bytes) == ("copy", 2 * 24 * F32, 0)
    assert viewed.kind == "view"


def test_a_view_whose_permuted_gradient_views_back_is_free():
    # ViT's patch embedding: flatten(2).transpose(1, 2). Its gradient comes back transposed,
    # and splitting a dim (the flatten's backward) is a view whatever the strides; over
    # channels-last maps the forward is a view too.
    class Embed(nn.Module):
        def forward(self, x):
            return x.flatten(2).transpose(1, 2) * 2

    x = torch.randn(2, 8, 3, 3)
    for maps in (x, x.contiguous(memory_format=torch.channels_last)):
        (flatten,) = _by_op(trace(Embed(), (maps,)).gm, "flatten")
        assert flatten.kind == "view"


def test_slicing_writes_the_whole_input_in_backward_unless_it_takes_everything():
    class Net(nn.Module):
        def forward(self, x):
            return x[:, 0] * 2, x[:, :, :] * 3

    (cls_token, everything) = _by_op(trace(Net(), (torch.randn(2, 5, 8),)).gm, "getitem")
    assert _backward_only(cls_token, (2 * 5 * 8 + 2 * 2 * 8) * F32)
    assert everything.kind == "view"


def test_expand_sums_its_gradient_in_backward():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Parameter(torch.zeros(1, 1, 8))

        def forward(self, x):
            return torch.cat([self.token.expand(x.shape[0], -1, -1), x], dim=1)

    (expand,) = _by_op(trace(Net(), (torch.randn(4, 5, 8),)).gm, "expand")
    assert (expand.kind, expand.fwd_bytes, expand.fwd_flops) == ("reduction", 0, 0)
    assert expand.bwd_bytes == (4 * 8 + 8) * F32 and expand.bwd_flops == 4 * 8


def test_contiguous_and_clone_pass_their_gradient_through():
    class Net(nn.Module):
        def forward(self, x):
            return x.t().contiguous().clone()

    gm = trace(Net(), (torch.randn(3, 4),)).gm
    for name in ("contiguous", "clone"):
        (cost,) = _by_op(gm, name)
        assert (cost.kind, cost.fwd_bytes, cost.bwd_bytes) == ("copy", 2 * 12 * F32, 0), name
