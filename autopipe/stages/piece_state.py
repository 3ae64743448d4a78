"""The state of MLP pieces (see [Note: MLP pieces] in mlp_pieces.py) under the model's own names.

A stage holding a piece of an MLP holds ``<module>_piece<i>`` tensors: rows or columns of the
model's. ``piece_params`` maps each piece's state_dict key to (full key, dim, start, stop),
``merge_pieces`` rebuilds full tensors from their pieces and ``take_piece`` cuts a piece out of a
full tensor; ``full_state_dict``, ``load_full_state_dict`` and checkpoints use them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import CheckpointError
from .piece_meta import SAMPLES

__all__ = ["Pieces", "PieceParam", "piece_module", "normalise", "piece_params", "merge_pieces", "take_piece",
           "NORM_ROWS"]

# fc1 -> {"fc2": name (None: a run, its pieces concatenated), "hidden": boundaries[, "norms": names]},
# or a pooling node -> {"samples": boundaries} (see piece_meta.py)
Pieces = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class PieceParam:
    """A piece's tensor as part of the model's: rows (dim 0) or columns (dim 1) [start, stop),
    or the whole tensor (dim None: fc2's bias, held by piece 0)."""

    full: str
    dim: int | None
    start: int
    stop: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full`` (a view); a 0-dim tensor, such as an optimizer step, is shared."""
        if self.dim is None or full.dim() == 0:
            return full
        return full.narrow(self.dim, self.start, self.stop - self.start)

    @property
    def stored(self) -> str:
        """The name checkpoints save this piece under: ``<full>[a:b]`` (rows), ``<full>[:,a:b]``
        (columns), or the full name for a whole tensor (see [Note: checkpoint layout])."""
        if self.dim is None:
            return self.full
        return f"{self.full}[{':,' if self.dim == 1 else ''}{self.start}:{self.stop}]"

    @classmethod
    def from_stored(cls, name: str) -> "PieceParam":
        """The piece a stored name (:attr:`stored`) stands for; a plain name is a whole tensor
        (dim None). Checkpoints saved from other layouts hold other pieces, so names are read back."""
        full, bracket, spec = name.rpartition("[")
        if not bracket or not spec.endswith("]"):
            return cls(name, None, 0, 0)
        dim, spec = (1, spec[2:-1]) if spec.startswith(":,") else (0, spec[:-1])
        start, colon, stop = spec.partition(":")
        if not (colon and start.isdigit() and stop.isdigit()):
            return cls(name, None, 0, 0)
        return cls(full, dim, int(start), int(stop))


def piece_module(module: str, i: int) -> str:
    """The qualified name of piece ``i`` of linear ``module``."""
    return f"{module}_piece{i}"


def normalise(pieces: Pieces) -> dict[str, dict[str, Any]]:
    """``pieces`` as plain sorted data, as plans store it."""
    out: dict[str, dict[str, Any]] = {}
    for m, p in sorted(pieces.items()):
        if SAMPLES in p:  # a pooling cut by sample
            out[m] = {SAMPLES: [int(b) for b in p[SAMPLES]]}
            continue
        out[m] = {"fc2": None if p["fc2"] is None else str(p["fc2"]), "hidden": [int(b) for b in p["hidden"]]}
        if p.get("norms"):
            out[m]["norms"] = [str(n) for n in p["norms"]]
    return out


NORM_ROWS = ("weight", "bias", "running_mean", "running_var")  # a BatchNorm's per-channel state


def piece_params(pieces: Pieces) -> dict[str, PieceParam]:
    """Each piece's state_dict key -> where it sits in the model's tensor."""
    out = {}
    for fc1, p in normalise(pieces).items():
        if SAMPLES in p:
            continue  # pooling holds no state
        bounds = p["hidden"]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            out[f"{piece_module(fc1, i)}.weight"] = PieceParam(f"{fc1}.weight", 0, a, b)
            out[f"{piece_module(fc1, i)}.bias"] = PieceParam(f"{fc1}.bias", 0, a, b)
            if p["fc2"] is not None:
                out[f"{piece_module(p['fc2'], i)}.weight"] = PieceParam(f"{p['fc2']}.weight", 1, a, b)
            for norm in p.get("norms", ()):  # every piece counts the batches; piece 0's is kept
                out.update({f"{piece_module(norm, i)}.{t}": PieceParam(f"{norm}.{t}", 0, a, b) for t in NORM_ROWS})
                out[f"{piece_module(norm, i)}.num_batches_tracked"] = PieceParam(f"{norm}.num_batches_tracked",
                                                                                  None, 0, 0)
        if p["fc2"] is not None:
            out[f"{piece_module(p['fc2'], 0)}.bias"] = PieceParam(f"{p['fc2']}.bias", None, 0, 0)
    return out


def merge_pieces(state: Mapping[str, torch.Tensor], pieces: Pieces) -> dict[str, torch.Tensor]:
    """``state`` with every complete set of pieces replaced by its full tensor."""
    keys = piece_params(pieces)
    out = {k: v for k, v in state.items() if k not in keys}
    groups: dict[str, list[tuple[int, str]]] = {}
    for key, pp in keys.items():
        groups.setdefault(pp.full, []).append((pp.start, key))
    for full, parts in groups.items():
        held = [key for _, key in parts if key in state]
        if not held:
            continue
        if len(held) != len(parts):
            lost = sorted({key for _, key in parts} - set(held))
            raise CheckpointError(f"'{full}' is cut into pieces across stages and {', '.join(lost)} is held "
                                  "by no stage; gather the state of every pipeline rank first")
        dim = keys[parts[0][1]].dim
        tensors = [state[key] for _, key in sorted(parts)]
        out[full] = tensors[0] if dim is None else torch.cat(tensors, dim=dim)
    return out


def take_piece(full_state: Mapping[str, torch.Tensor], key: str, pieces: Pieces) -> torch.Tensor:
    """The tensor for state_dict ``key`` from full tensors: a piece's slice, or the tensor itself."""
    pp = piece_params(pieces).get(key)
    return full_state[key] if pp is None else pp.of(full_state[pp.full])
