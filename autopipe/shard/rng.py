"""Random streams for tensor parallelism: one per tp rank for sharded activations.

[Note: dropout under tensor parallelism]
A replicated activation is the same tensor on every tp rank, so its dropout mask must be the
same too: the default generator serves it, seeded identically on all tp ranks by the caller.
A sharded activation holds different features on each rank; drawing its mask from that same
generator would give every rank the same mask for different features (correlated dropout),
so dropout leaves in sharded regions draw from a generator of their own, seeded
``seed + 2718 + tp_rank`` (Megatron's model-parallel RNG tracker uses the same offset).
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from .collectives import fx_leaf

__all__ = ["TP_SEED_OFFSET", "manual_seed_tp", "tp_generator", "tp_dropout"]

TP_SEED_OFFSET = 2718

_base_seed: int | None = None
_generators: dict[tuple[str, int], torch.Generator] = {}


def manual_seed_tp(seed: int) -> None:
    """Seed the sharded-region streams; rank ``r`` then draws from ``seed + 2718 + r``.

    Without this call the base seed is ``torch.initial_seed()`` at first use, which agrees
    across tp ranks whenever the caller seeded them alike (as it must for replicated dropout).
    """
    global _base_seed
    _base_seed = int(seed)
    _generators.clear()


def tp_generator(device: torch.device, tp_rank: int) -> torch.Generator:
    """The generator of tp rank ``tp_rank`` on ``device`` (created and seeded on first use)."""
    global _base_seed
    if _base_seed is None:
        _base_seed = torch.initial_seed()
    key = (str(device), tp_rank)
    gen = _generators.get(key)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(_base_seed + TP_SEED_OFFSET + tp_rank)
        _generators[key] = gen
    return gen


@fx_leaf
def tp_dropout(x: torch.Tensor, p: float, training: bool, tp_rank: int) -> torch.Tensor:
    """Dropout whose mask comes from this tp rank's stream. See [Note: dropout under tensor parallelism]."""
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    if x.device.type == "meta" or is_fake(x):  # shape propagation: no mask to draw
        return torch.empty_like(x)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=tp_generator(x.device, tp_rank))
    return x * keep / (1.0 - p)
