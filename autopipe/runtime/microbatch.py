"""Splitting a batch into micro-batches along dim 0, and merging outputs back.

Every check raises :class:`InputError` with the numbers: batch size, m, the planned and given
shapes. Splits are views; nothing is copied.

[Note: batch splits]
``split="equal"`` (training's default) cuts a batch into m micro-batches of one size, any size
(the stage boundaries' shapes follow from it), and refuses a batch that m does not divide.
``split="uneven"`` cuts it as ``torch.tensor_split`` does: m micro-batches whose sizes differ
by at most one, the larger first; a batch of fewer than m samples runs as that many
micro-batches of one sample (fewer micro-batches for that step). Evaluation always splits
unevenly. A step over micro-batches of unequal sizes weighs each micro-batch's loss by its
share of the batch (n_i / N instead of 1 / m), which gives the gradient of the batch's mean
loss when ``loss_fn`` averages over samples, as the losses of torch.nn do by default.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from autopipe.errors import InputError

__all__ = ["SPLITS", "nearest_divisible", "batch_size", "microbatch_sizes", "split_inputs", "split_targets", "merge",
           "batch_loss"]

SPLITS = ("equal", "uneven")  # see [Note: batch splits]

# m: number of micro-batches


def nearest_divisible(batch: int, m: int) -> list[int]:
    """The batch sizes nearest to ``batch`` that split into ``m`` equal micro-batches."""
    below = batch // m * m
    return [below, below + m] if below > 0 else [m]


def _describe(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def batch_size(inputs: Sequence[Any]) -> int:
    """The batch size (dim 0) the inputs agree on; InputError listing every problem otherwise."""
    problems = []
    sizes = []
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            problems.append(f"input {i} is a {type(x).__name__}, not a tensor")
        elif x.dim() == 0:
            problems.append(f"input {i} is a 0-d tensor; inputs need a batch dimension (dim 0)")
        else:
            sizes.append((i, x.shape[0]))
    if not inputs:
        problems.append("no inputs were given")
    if len({n for _, n in sizes}) > 1:
        listed = ", ".join(f"input {i}: {n}" for i, n in sizes)
        problems.append(f"inputs disagree on the batch size (dim 0): {listed}")
    if problems:
        raise InputError("invalid pipeline inputs:\n" + "\n".join(f"  - {p}" for p in problems))
    return sizes[0][1]


def _check_divisible(batch: int, m: int, what: str) -> int:
    if batch % m == 0 and batch > 0:
        return batch // m
    sizes = " or ".join(map(str, nearest_divisible(batch, m)))
    raise InputError(
        f"{what} batch size {batch} does not split into {m} equal micro-batches "
        f"({batch} % {m} = {batch % m}); use a batch size of {sizes}, "
        f"or a number of micro-batches that divides {batch}"
    )


def microbatch_sizes(batch: int, m: int, split: str = "equal") -> list[int]:
    """The micro-batch sizes a batch of ``batch`` samples runs as; see [Note: batch splits]."""
    if split not in SPLITS:
        raise InputError(f"split={split!r}; use one of {', '.join(map(repr, SPLITS))}")
    if split == "equal" or batch <= 0:
        try:
            return [_check_divisible(batch, m, "input")] * m
        except InputError as exc:
            raise InputError(f"{exc}; or let such batches split unevenly: parallelize(..., "
                             "batch_split='uneven')") from None
    return [batch // m + (i < batch % m) for i in range(min(m, batch))]


def split_inputs(
    inputs: Sequence[torch.Tensor], m: int, specs: Sequence[Any] | None = None, *,
    sizes: Sequence[int] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """One tuple of views per micro-batch; checked against the planned ``specs``.

    ``specs`` (optional) lists a ``TensorSpec`` per input for one micro-batch, as planned.
    Without ``sizes`` the batch splits into ``m`` equal micro-batches of the planned shapes;
    with ``sizes`` (from :func:`microbatch_sizes`) into those, and only the dimensions after
    the batch dimension (and dtypes) are checked against ``specs``.
    """
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    batch = batch_size(inputs)
    free = sizes is not None  # the batch dimension follows the batch
    if sizes is None:
        sizes = [_check_divisible(batch, m, "input")] * m
    elif sum(sizes) != batch:
        raise InputError(f"micro-batch sizes {list(sizes)} do not add up to the batch size {batch}")
    if specs is not None:
        if len(specs) != len(inputs):
            raise InputError(f"the plan expects {len(specs)} model inputs, got {len(inputs)}")
        problems = []
        for i, (x, spec) in enumerate(zip(inputs, specs)):
            given = (sizes[0], *x.shape[1:])
            want = (sizes[0], *spec.shape[1:]) if free and spec.shape else tuple(spec.shape)
            if given != want or x.dtype != spec.dtype:
                problems.append(
                    f"input {i}: expected micro-batch {_describe(want, spec.dtype)}, "
                    f"given {_describe(given, x.dtype)} (batch {batch} in {len(sizes)} micro-batches)"
                )
        if problems:
            raise InputError(
                "inputs do not match the planned shapes (plan with an example micro-batch of "
                "the shapes you train with):\n" + "\n".join(f"  - {p}" for p in problems)
            )
    return list(zip(*(x.split(list(sizes)) for x in inputs)))


def split_targets(targets: Any, m: int, batch: int | None = None, *, sizes: Sequence[int] | None = None) -> list[Any]:
    """``m`` pytrees like ``targets`` (one per entry of ``sizes`` when given); tensor leaves
    split along dim 0 (equally, or into ``sizes``), other leaves shared.

    ``batch`` (the inputs' batch size) is checked against every tensor leaf when given.
    """
    m = len(sizes) if sizes is not None else m
    if targets is None:
        return [None] * m
    leaves, spec = pytree.tree_flatten(targets)
    parts: list[Any] = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            parts.append([leaf] * m)
            continue
        name = "targets" if len(leaves) == 1 else f"targets leaf {i}"
        if leaf.dim() == 0:
            raise InputError(f"{name} is a 0-d tensor; targets need a batch dimension (dim 0)")
        if batch is not None and leaf.shape[0] != batch:
            raise InputError(
                f"{name} has batch size {leaf.shape[0]} but the inputs have {batch}; "
                f"give one target row per input row"
            )
        if sizes is not None and leaf.shape[0] == sum(sizes):
            parts.append(leaf.split(list(sizes)))
        else:
            parts.append(leaf.split(_check_divisible(leaf.shape[0], m, name)))
    return [pytree.tree_unflatten([p[k] for p in parts], spec) for k in range(m)]


def merge(outputs: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Concatenates per-micro-batch output tuples along dim 0 (0-d outputs are stacked)."""
    return tuple(torch.cat(ts) if ts[0].dim() else torch.stack(ts) for ts in zip(*outputs))


def batch_loss(losses: dict[int, torch.Tensor], weights: Sequence[float] | None, device: torch.device) -> torch.Tensor:
    """The batch's loss (float32) from its micro-batches' ``losses``: their mean, or their sum
    weighted by ``weights`` (micro-batches of unequal sizes); an empty tensor without losses
    (a rank without the last stage, which receives it)."""
    if losses and weights is not None:
        return sum(weights[mb] * value.float() for mb, value in sorted(losses.items()))
    if losses:
        return torch.stack([loss for _, loss in sorted(losses.items())]).mean().float()
    return torch.empty((), dtype=torch.float32, device=device)
