"""Micro-batch splitting: equal views along dim 0, and InputErrors that carry the numbers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from autopipe.errors import InputError
from autopipe.runtime.microbatch import merge, nearest_divisible, split_inputs, split_targets
from autopipe.runtime.p2p import TensorSpec

__all__: list[str] = []


def test_split_gives_views_of_equal_size() -> None:
    x, ids = torch.randn(12, 5), torch.arange(12)
    mbs = split_inputs((x, ids), 4)
    assert len(mbs) == 4 and all(mx.shape == (3, 5) and mi.shape == (3,) for mx, mi in mbs)
    assert mbs[1][0].data_ptr() == x[3].data_ptr()  # no copy
    assert torch.equal(torch.cat([mi for _, mi in mbs]), ids)


@given(st.integers(1, 200), st.integers(1, 17))
def test_nearest_divisible_sizes_split(batch: int, m: int) -> None:
    sizes = nearest_divisible(batch, m)
    assert all(s % m == 0 and s > 0 for s in sizes)
    assert min(abs(s - batch) for s in sizes) < m


def test_not_divisible_names_batch_m_and_nearest_sizes() -> None:
    with pytest.raises(InputError, match=r"batch size 10 does not split into 4 equal micro-batches "
                                         r"\(10 % 4 = 2\); use a batch size of 8 or 12"):
        split_inputs((torch.zeros(10, 2),), 4)
    with pytest.raises(InputError, match=r"batch size 3 .* 4 equal micro-batches .* batch size of 4,"):
        split_inputs((torch.zeros(3, 2),), 4)


def test_shape_differing_from_plan_names_expected_and_given() -> None:
    specs = [TensorSpec((2, 16), torch.float32), TensorSpec((2,), torch.int64)]
    split_inputs((torch.zeros(8, 16), torch.zeros(8, dtype=torch.int64)), 4, specs)
    with pytest.raises(InputError, match=r"input 0: expected micro-batch \(2, 16\) float32, given \(2, 17\) float32 "
                                         r"\(batch 8 in 4 micro-batches\)"):
        split_inputs((torch.zeros(8, 17), torch.zeros(8, dtype=torch.int64)), 4, specs)
    with pytest.raises(InputError, match=r"input 1: expected micro-batch \(2,\) int64, given \(3,\) int64"):
        split_inputs((torch.zeros(12, 16), torch.zeros(12, dtype=torch.int64)), 4, specs)
    with pytest.raises(InputError, match="the plan expects 2 model inputs, got 1"):
        split_inputs((torch.zeros(8, 16),), 4, specs)


def test_inputs_must_agree_and_be_batched_tensors() -> None:
    with pytest.raises(InputError, match=r"disagree on the batch size \(dim 0\): input 0: 8, input 1: 6"):
        split_inputs((torch.zeros(8, 2), torch.zeros(6)), 2)
    with pytest.raises(InputError, match=r"input 1 is a list, not a tensor[\s\S]*input 2 is a 0-d tensor"):
        split_inputs((torch.zeros(8), [1, 2], torch.tensor(1.0)), 2)


def test_targets_pytree_split_and_checked_against_inputs() -> None:
    targets = {"y": torch.arange(6), "w": (torch.ones(6, 2), 0.5)}
    parts = split_targets(targets, 3, batch=6)
    assert [p["y"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert parts[2]["w"][0].shape == (2, 2) and parts[2]["w"][1] == 0.5
    assert split_targets(None, 2) == [None, None]
    with pytest.raises(InputError, match="targets has batch size 4 but the inputs have 6"):
        split_targets(torch.zeros(4), 2, batch=6)
    with pytest.raises(InputError, match="targets leaf 1 has batch size 5 but the inputs have 6"):
        split_targets([torch.zeros(6), torch.zeros(5)], 2, batch=6)


def test_merge_concatenates_and_stacks_scalars() -> None:
    outs = [(torch.full((2, 3), float(k)), torch.tensor(float(k))) for k in range(3)]
    cat, scalars = merge(outs)
    assert cat.shape == (6, 3) and scalars.tolist() == [0.0, 1.0, 2.0]
