"""What the graph cut into pieces marks on its nodes, and the two kinds of piece specs.

A plan's pieces (``PartitionPlan.mlp_pieces``) name, per cut, where its pieces part:
- an MLP or convolution cut by hidden unit or channel (mlp_pieces.py): keyed by its first
  layer, ``{"fc2": name or None, "hidden": boundaries[, "norms": names]}``;
- a pooling cut by sample (sample_pieces.py): keyed by its node, ``{"samples": boundaries}``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["PIECES_META", "JOIN", "PIECE", "PIECE_OF", "SAMPLES", "bounds_of", "with_bounds"]

PIECES_META = "autopipe_mlp_pieces"  # on a split GraphModule: the pieces it was cut into
JOIN = "autopipe_pieces_join"  # on the nodes joining the pieces: adding partial sums, or concatenating
PIECE = "autopipe_piece"  # on a piece's nodes: (the spec's key, the piece's index)
PIECE_OF = "autopipe_piece_of"  # on a piece's nodes: (the unsplit node's name, its share of the work)
SAMPLES = "samples"  # a pooling cut by sample: the spec's boundaries, in samples of the planned micro-batch


def bounds_of(spec: Mapping[str, Any]) -> list[int]:
    """Where a spec's pieces part: hidden units, channels or samples."""
    return list(spec[SAMPLES] if SAMPLES in spec else spec["hidden"])


def with_bounds(spec: Mapping[str, Any], bounds: Sequence[int]) -> dict[str, Any]:
    """``spec`` with its pieces parting at ``bounds`` instead."""
    return {**spec, SAMPLES if SAMPLES in spec else "hidden": list(bounds)}
