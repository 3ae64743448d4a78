"""Loading the checkpoints checkpoint.py saves: into any pp x dp x tp layout of the same model,
checked against the model and the files' checksums first. See [Note: checkpoint layout] and
[Note: no rank left waiting] in checkpoint.py.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError
from ..stages.piece_state import PieceParam
from .checkpoint import (EXTRA, FORMAT, LATEST, MANIFEST, PREFIX, describe, latest_name, param_names, quiet,
                         state_entries)
from .checkpoint_files import VerifyingReader, verify
from .checkpoint_ranks import agree, checkpoint_group, from_rank0, world_of
from .state_map import StateEntry, load_local_state
from .zero import held_parameters

if TYPE_CHECKING:
    from .parallel_model import ParallelModel

__all__ = ["load_checkpoint"]


def _local(entry: StateEntry, t: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This tp rank's part of a full parameter-shaped tensor (inverse of :func:`_gathered`)."""
    if entry.split is None or tuple(t.shape) != tuple(entry.split.shape):
        return t
    return entry.cut(t, tp_rank).contiguous().clone()


def _index(stored: Any) -> dict[str, list[tuple[int, int, str]]]:
    """Full name -> [(dim, first index, stored name)] of the stored names (a whole tensor: 0, 0)."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for name in stored:
        piece = PieceParam.from_stored(name)
        out.setdefault(piece.full, []).append((piece.dim or 0, piece.start, name))
    return {k: sorted(v) for k, v in out.items()}


def _assemble(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """One tensor from its saved pieces in order (a 0-dim state, such as a step, is shared)."""
    if len(parts) == 1 or parts[0].dim() == 0:
        return parts[0]
    return torch.cat(parts, dim=dim)


def _stored_shape(parts: list[tuple[int, tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The full shape that saved pieces (dim, shape) make up; None when nothing was saved."""
    if not parts:
        return None
    dim, shape = parts[0]
    if len(parts) == 1:
        return tuple(shape)
    return tuple(sum(p[1][dim] for p in parts) if d == dim else size for d, size in enumerate(shape))


def _read(path: str) -> dict[str, Any]:
    """Rank 0: the committed directory, its manifest, tensor metadata and extra."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: the directory does not exist; pass the path "
                              "given to pm.save_checkpoint()")
    name = latest_name(path)
    if name is None:
        partial = sorted(e for e in os.listdir(path) if e.startswith(PREFIX))
        found = (f"it holds only unfinished saves ({', '.join(partial)}), which are never loaded"
                 if partial else "it has no 'latest' file")
        if os.path.exists(os.path.join(path, ".metadata")):
            found = "it is a plain torch.distributed.checkpoint directory, not one written by autopipe"
        raise CheckpointError(f"{path!r} holds no complete autopipe checkpoint: {found}. Pass the directory "
                              "given to pm.save_checkpoint(); a save that was interrupted leaves nothing to load")
    target = os.path.join(path, name)
    file = MANIFEST
    try:
        manifest = torch.load(os.path.join(target, MANIFEST), weights_only=True)
        file = ".metadata"
        verify(target, file, manifest.get("checksums"))
        metadata = dcp.FileSystemReader(target).read_metadata()
        file = EXTRA
        extra = torch.load(os.path.join(target, EXTRA), weights_only=True) if manifest["extra"] else None
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - becomes the message
        raise CheckpointError(f"checkpoint {target!r} (named by {path}/{LATEST}) cannot be read: its file "
                              f"{file!r} gives {describe(exc)}; it was changed or truncated after it was saved"
                              ) from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {target!r} has format {manifest.get('format')!r}; this autopipe "
                              f"reads format {FORMAT}. Load it with the autopipe version that saved it")
    tensors = {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    return {"dir": target, "manifest": manifest, "tensors": tensors, "extra": extra}


def _targets(pm: ParallelModel, optimizer: torch.optim.Optimizer | None,
             found: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Empty tensors for every key this rank loads, after checking that the checkpoint fits."""
    manifest, tensors, where = found["manifest"], found["tensors"], found["dir"]
    saved = f"saved from {manifest['model']} with " + ", ".join(f"{k}={v}" for k, v in manifest["layout"].items())
    out: dict[str, torch.Tensor] = {}
    missing, wrong = [], []
    model = _index(k[len("model."):] for k in tensors if k.startswith("model."))
    full_shapes, entries = pm.full_shapes, state_entries(pm)
    for s in sorted(pm.stages):
        for k in pm.stages[s].state_dict():
            k = entries[k].full
            want = full_shapes[k]
            parts = model.get(k, [])
            got = _stored_shape([(d, tensors[f"model.{name}"][0]) for d, _, name in parts])
            if got is None:
                missing.append(k)
            elif tuple(got) != want:
                wrong.append(f"{k}: {list(got)} in the checkpoint, {list(want)} in the model")
            else:
                for _, _, name in parts:
                    shape, dtype = tensors[f"model.{name}"]
                    out[f"model.{name}"] = torch.empty(shape, dtype=dtype)
    if missing or wrong:
        problems = ([f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}"] if missing else []) + wrong[:5]
        if len(wrong) > 5:
            problems.append(f"and {len(wrong) - 5} more tensors of other shapes")
        raise CheckpointError(f"checkpoint {where!r} ({saved}) does not fit this model:\n"
                              + "\n".join(f"  - {p}" for p in problems)
                              + "\nLoad it into the model it was saved from; to start from other weights "
                              "use pm.load_full_state_dict(state_dict)")
    if optimizer is None:
        return out
    states = manifest["optimizer"]
    if states is None:
        raise CheckpointError(f"checkpoint {where!r} holds no optimizer state (it was saved without "
                              "optimizer=); call load_checkpoint(path) without the optimizer and start it afresh")
    names = param_names(pm, optimizer)
    stored = _index(states)
    held = held_parameters(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = entries[names[id(p)]].full
            if held is not None and id(p) not in held:
                continue  # another dp rank's under ZeRO
            if name not in stored:
                raise CheckpointError(f"checkpoint {where!r} holds no optimizer state for parameter '{name}'; "
                                      "build the optimizer over the same parameters as when it was saved")
            for _, _, part in stored[name]:
                for k in states[part]["tensors"]:
                    shape, dtype = tensors[f"optim.{part}.{k}"]
                    out[f"optim.{part}.{k}"] = torch.empty(shape, dtype=dtype)
    return out


def _apply_optimizer(pm: ParallelModel, optimizer: torch.optim.Optimizer, states: dict[str, dict],
                     loaded: dict[str, torch.Tensor]) -> None:
    names, entries = param_names(pm, optimizer), state_entries(pm)
    stored = _index(states)
    mine = held_parameters(optimizer)  # under ZeRO the state dict holds this rank's states only
    sd: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for g in optimizer.param_groups:
        ids, hyper = [], None
        for p in g["params"]:
            name = names[id(p)]
            entry = entries[name]
            held, parts = entry.piece, stored[entry.full]
            saved = states[parts[0][2]]
            hyper = hyper if hyper is not None else saved["group"]
            st = dict(saved["values"])
            for k in saved["tensors"] if mine is None or id(p) in mine else ():
                t = _assemble([loaded[f"optim.{part}.{k}"] for _, _, part in parts], parts[0][0])
                st[k] = _local(entry, t if held is None else held.of(t).clone(), pm.tp_rank)
            if st and (mine is None or id(p) in mine):
                sd["state"][index] = st
            ids.append(index)
            index += 1
        sd["param_groups"].append({**(hyper or {}), "params": ids})
    optimizer.load_state_dict(sd)


def load_checkpoint(pm: ParallelModel, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Collective. Loads the checkpoint ``path/latest`` names; returns the ``extra`` it was saved with."""
    path = os.fspath(path)
    group = checkpoint_group(pm)
    found = from_rank0(group, lambda: _read(path))
    world = world_of()[1]
    error, state = None, {}
    try:
        state = _targets(pm, optimizer, found)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = describe(exc)
    agree(group, error)

    error = None
    try:
        reader = VerifyingReader(found["dir"], found["manifest"].get("checksums"))
        with quiet(world):
            dcp.load(state, storage_reader=reader, process_group=group, no_dist=world == 1)
    except (Exception, DCPException) as exc:  # noqa: BLE001 - agreed on below
        error = f"reading {found['dir']!r} failed: {describe(exc)}"
    agree(group, error)

    error = None
    try:
        model = _index(k[len("model."):] for k in state if k.startswith("model."))
        load_local_state(pm.stages, {full: _assemble([state[f"model.{name}"] for _, _, name in parts], parts[0][0])
                                     for full, parts in model.items()}, pm.shard_plan, pm.tp_rank, pm.plan.mlp_pieces)
        if optimizer is not None:
            _apply_optimizer(pm, optimizer, found["manifest"]["optimizer"], state)
        pm.training_state.load_scaler_state(found["manifest"]["loss_scaler"])
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = f"applying {found['dir']!r} failed: {describe(exc)}"
    agree(group, error)
    return found["extra"]
