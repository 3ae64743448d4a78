"""A rank's stages and stage-boundary specs for each micro-batch size it has run.

[Note: other batch sizes]
The plan's boundary specs are for one micro-batch of the example's size. A step on another
micro-batch size asks ``variants(size)`` for this rank's stages and boundary specs at that
size (once; they are kept): every rank holds the whole batch and the whole graph, so each
derives every boundary shape itself, and receives are posted with the right shapes without
a shape message (what Colossal-AI's schedule exchanges when TENSOR_SHAPE is not given).
The stages of another size share the planned stages' parameters and modules; where a
route baked the size into the graph they are new graphs, else the planned ones (see
[Note: stage variants] in autopipe/stages/variants.py). A step may mix two sizes (an uneven split,
[Note: batch splits]) and run fewer micro-batches than planned (a batch smaller than m):
the driver compiles its programs per micro-batch count. CUDA graphs replay the planned
size only; other sizes run eagerly. Compiled stages compile once per size, warmed on every
rank before the step (see [Note: stage warm-up]). Without ``variants`` only the planned
size runs (other sizes fail the boundary check).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.runtime.p2p import TensorSpec

__all__ = ["Shapes", "BatchShapes"]

# A micro-batch size's stages ({stage index: module}) and boundary specs (one list per cut).
Shapes = tuple[dict[int, nn.Module], list[list[TensorSpec]]]


class BatchShapes:
    """The planned ``stages`` and ``boundary`` specs, and those ``variants(size)`` builds for
    other micro-batch sizes; ``input_specs`` are the model inputs' for one planned micro-batch."""

    def __init__(self, stages: dict[int, nn.Module], boundary: Sequence[Sequence[TensorSpec]],
                 input_specs: Sequence[TensorSpec] | None, variants: Callable[[int], Shapes] | None) -> None:
        if variants is not None and not (input_specs and input_specs[0].shape):
            raise ConfigError("variants= needs input_specs with a batch dimension (the planned micro-batch size)")
        self.planned: Shapes = (stages, [list(b) for b in boundary])
        self.input_specs = list(input_specs) if input_specs is not None else None
        self.variants = variants
        self.planned_size = input_specs[0].shape[0] if variants is not None else None
        self._other: dict[int, Shapes] = {}

    def key(self, size: int | None) -> int | None:
        """``size``, or None for the planned size (what buffer pools and warm-ups key on)."""
        return None if size == self.planned_size else size

    def of(self, size: int | None) -> Shapes:
        """The stages and boundary specs of micro-batches of ``size`` samples (None: planned)."""
        size = self.key(size)
        if size is None:
            return self.planned
        if size not in self._other:
            stages, specs = self.variants(size)
            mode = next(iter(self.planned[0].values())).training
            for module in stages.values():
                module.train(mode)
            self._other[size] = (stages, [list(b) for b in specs])
        return self._other[size]

    def stage_inputs(self, s: int, size: int | None = None) -> tuple[list[TensorSpec], list[bool]]:
        """Stage ``s``'s input specs for one micro-batch of ``size`` samples (None: planned),
        and which carry a gradient (received activations do, the model's inputs do not)."""
        if s == 0:
            specs = list(self.input_specs or [])
            if self.key(size) is not None:
                specs = [TensorSpec((size, *spec.shape[1:]), spec.dtype, spec.channels_last) for spec in specs]
        else:
            specs = self.of(size)[1][s - 1]
        return specs, [s > 0 and spec.dtype.is_floating_point for spec in specs]

    def train(self, mode: bool) -> None:
        """Train/eval mode for every size's stages."""
        for stages, _ in [self.planned, *self._other.values()]:
            for module in stages.values():
                module.train(mode)

    def built(self) -> dict[int, Shapes]:
        """The other sizes built so far."""
        return dict(self._other)
