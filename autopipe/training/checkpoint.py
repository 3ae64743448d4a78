"""Sharded, atomic training checkpoints of a ParallelModel and its optimizer, written with
torch.distributed.checkpoint (DCP).

[Note: checkpoint layout]
``save_checkpoint(pm, path)`` treats ``path`` as a directory:

    path/latest          the name of the last complete checkpoint (replaced with os.replace)
    path/ckpt-<id>/      one DCP checkpoint (.metadata, __<rank>_0.distcp), plus
                         manifest.pt (layout, loss scale, optimizer hyperparameters) and
                         extra.pt (the caller's ``extra``), both written by rank 0

Keys are the unmodified model's names with full shapes: ``model.<name>`` and, per parameter,
``optim.<name>.<state>`` (exp_avg, momentum_buffer, step...). Tensor-parallel shards are
gathered over tp, and only tp rank 0 of dp replica 0 of each pipeline rank writes its stages,
so the files are split over pp ranks and nothing is written twice. Under ZeRO (zero.py) each
dp replica's tp rank 0 writes the optimizer state of the parameters its replica holds, under
the same keys, and a load reads into each rank only the state of the parameters it holds. Because the keys do not
depend on the layout, a checkpoint loads into any pp x dp x tp layout of the same model.
An MLP cut across stages (plan.mlp_pieces) is saved as its pieces, ``model.<name>[a:b]``
(rows a to b) or ``model.<name>[:,a:b]`` (columns), and ``optim.<name>[a:b].<state>``, written
by the ranks holding them; loads rebuild the full tensor from whatever pieces were saved and
cut what this layout holds. BatchNorm running statistics are saved as committed: saves happen
between steps, when deferred statistics (runtime/batchnorm.py) are folded in and their per-step
sums, non-persistent buffers, are zero; so a resumed run continues as the uninterrupted one.

A save writes a fresh ``ckpt-<id>`` directory, the ranks agree that every write succeeded,
and only then rank 0 points ``latest`` at it and deletes the older directories. A save that
fails on any rank raises CheckpointError on every rank and leaves ``latest`` as it was; a
process killed mid-save leaves an unreferenced directory that loads ignore and the next
successful save deletes. Every rank must see ``path`` on one shared filesystem (as DCP needs).

[Note: no rank left waiting]
Every step that can fail on one rank alone (argument checks, building the state, writing,
reading, applying) is followed by one all_gather_object of each rank's error, so all ranks
raise the same CheckpointError together instead of leaving peers in a collective. DCP's own
save/load propagate a failure of any rank to all of them. A rank that dies cannot answer,
so these collectives and DCP's run over a gloo group of their own whose timeout is the
model's ``deadline`` (created by every rank at its first save or load): a survivor's
collective fails at the latest after ``deadline`` seconds, and it raises CheckpointError
("lost contact with the other ranks while ..."), naming the failure another rank recorded
where there is one; the error is recorded too, so the model refuses further steps. Files are
checked against checksums at load; see [Note: checkpoint checksums] in checkpoint_files.py.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from .checkpoint_files import ChecksummedWriter, checksum
from .checkpoint_ranks import agree, checkpoint_group, from_rank0, world_of
from ..errors import CheckpointError
from .state_map import StateEntry, local_full_state, stage_map
from .zero import held_parameters, local_optimizer

if TYPE_CHECKING:
    from .parallel_model import ParallelModel

__all__ = ["save_checkpoint", "FORMAT", "LATEST", "PREFIX", "MANIFEST", "EXTRA", "quiet", "describe", "param_names",
           "state_entries", "latest_name"]

FORMAT = 1
LATEST = "latest"
POINTER_TMP = ".latest.tmp-"
PREFIX = "ckpt-"
MANIFEST = "manifest.pt"
EXTRA = "extra.pt"


@contextlib.contextmanager
def quiet(world: int) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is what is meant."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def describe(exc: BaseException) -> str:
    if isinstance(exc, DCPException):  # a BaseException: one entry per failed rank
        return "; ".join(f"rank {r}: {describe(e)}" for r, (e, _) in sorted(exc.failures.items()))
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (no message; a file may be truncated)"


# ----------------------------------------------------------------------------- state
def param_names(pm: ParallelModel, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """``id(param) -> name`` for the optimizer's parameters, all of which must be ``pm``'s."""
    names = {id(p): n for n, p in pm.named_parameters()}
    foreign = sum(id(p) not in names for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise CheckpointError(
            f"the optimizer holds {foreign} parameter(s) that are not this rank's stage parameters; "
            "build it from pm.parameters() (not the original model's) before saving or loading"
        )
    return names


def state_entries(pm: ParallelModel) -> dict[str, StateEntry]:
    """The state map of this rank's stages; see autopipe/training/state_map.py."""
    return stage_map(pm.stages, pm.shard_plan, pm.plan.mlp_pieces)


def _gathered(entry: StateEntry, t: torch.Tensor, like: tuple[int, ...], group: Any) -> torch.Tensor:
    """The full tensor of a tensor shaped ``like`` the parameter (collective over tp where it is
    split); any other (a step count) as it is."""
    if entry.split is None or tuple(t.shape) != like:
        return t.detach().cpu()
    return entry.gather(t, group, f"all-gather of the optimizer state of '{entry.key}' over the tp ranks").cpu()


def _optimizer_state(pm: ParallelModel, optimizer: torch.optim.Optimizer,
                     names: dict[int, str]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Tensors keyed ``optim.<name>.<state>`` (full shapes), and per parameter its group's
    hyperparameters, non-tensor state and tensor state keys: of every parameter, or under
    ZeRO of those this rank holds (the same on every tp rank). Collective over tp."""
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, dict] = {}
    held, states = held_parameters(optimizer), local_optimizer(optimizer).state
    mapped = state_entries(pm)
    entries = [(names[id(p)], p, g) for g in optimizer.param_groups for p in g["params"]
               if held is None or id(p) in held]
    for name, p, group in sorted(entries, key=lambda e: e[0]):  # same order on every tp rank
        state = states.get(p, {})
        keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
        stored = mapped[name].stored
        info[stored] = {
            "group": {k: v for k, v in group.items() if k != "params"},
            "values": {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)},
            "tensors": keys,
        }
        for k in keys:
            tensors[f"optim.{stored}.{k}"] = _gathered(mapped[name], state[k], tuple(p.shape), pm.mesh.tp_group)
    return tensors, info


def _serialise_extra(extra: Any) -> bytes | None:
    if extra is None:
        return None
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - becomes the message
        raise CheckpointError(
            f"extra (a {type(extra).__name__}) cannot be stored as plain data ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); pass dicts, lists, numbers, strings and "
            "tensors, e.g. extra={'step': step, 'scheduler': scheduler.state_dict()}"
        ) from None
    return buf.getvalue()


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def latest_name(path: str) -> str | None:
    try:
        with open(os.path.join(path, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


# ----------------------------------------------------------------------------- save
def _rank_state(pm: ParallelModel, optimizer: torch.optim.Optimizer | None,
                names: dict[int, str] | None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """What this rank writes (tp rank 0 only) and its optimizer's per-parameter info; collective over tp."""
    model, optim, info = {}, {}, {}
    if pm.dp_rank == 0:
        entries = state_entries(pm)
        model = {f"model.{entries[k].stored}": v
                 for k, v in local_full_state(pm.stages, pm.shard_plan, pm.mesh.tp_group).items()}
    if optimizer is not None and (pm.dp_rank == 0 or held_parameters(optimizer) is not None):
        optim, info = _optimizer_state(pm, optimizer, names)
    if pm.tp_rank == 0:
        return {**model, **optim}, info
    return {}, {}


def _commit(path: str, name: str, manifest: dict[str, Any], extra_bytes: bytes | None) -> None:
    """Rank 0: write the manifest and extra into ``path/name``, point ``latest`` at it, and
    delete the older checkpoints."""
    target, pointer = os.path.join(path, name), os.path.join(path, f"{POINTER_TMP}{name}")
    buf = io.BytesIO()
    torch.save(manifest, buf)
    _write_file(os.path.join(target, MANIFEST), buf.getvalue())
    if extra_bytes is not None:
        _write_file(os.path.join(target, EXTRA), extra_bytes)
    _fsync_dir(target)
    _write_file(pointer, name.encode())
    os.replace(pointer, os.path.join(path, LATEST))
    _fsync_dir(path)
    for entry in os.listdir(path):  # older checkpoints and what saves that died left
        if entry.startswith(PREFIX) and entry != name:
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
        elif entry.startswith(POINTER_TMP):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, entry))


def save_checkpoint(pm: ParallelModel, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: Any = None) -> str:
    """Collective. See [Note: checkpoint layout]; returns the directory that ``latest`` names."""
    path = os.fspath(path)
    rank, world = world_of()
    group = checkpoint_group(pm)
    # 1. Local checks, and rank 0 names the new directory.
    error, names, extra_bytes = None, None, None
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(f"checkpoint path {path!r} is a file; pass a directory path "
                                  "(it is created if missing)")
        names = param_names(pm, optimizer) if optimizer is not None else None
        if rank == 0:
            extra_bytes = _serialise_extra(extra)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = describe(exc)
    proposals = agree(group, error, (f"{PREFIX}{uuid.uuid4().hex[:12]}", path))
    paths = sorted({p for _, p in proposals})
    if len(paths) > 1:
        raise CheckpointError(f"the ranks passed different checkpoint paths ({', '.join(map(repr, paths[:4]))}); "
                              "every rank must pass the same path, on a filesystem they all share")
    name = proposals[0][0]
    target = os.path.join(path, name)
    pointer = os.path.join(path, f"{POINTER_TMP}{name}")
    previous = latest_name(path)

    def fail(stage: str, exc: CheckpointError) -> CheckpointError:
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(pointer)
        kept = f"'{previous}' is still the latest checkpoint" if previous else "no checkpoint was committed"
        return CheckpointError(f"saving checkpoint {path!r} failed while {stage}: {exc}. Nothing in {path!r} "
                               f"changed ({kept}); fix the cause and save again")

    # 2. Build this rank's state: dp replica 0 gathers its tp shards, tp rank 0 writes them.
    error, state, info = None, {}, {}
    try:
        os.makedirs(target, exist_ok=True)
        state, info = _rank_state(pm, optimizer, names)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = describe(exc)
    try:
        infos = agree(group, error, info)
    except CheckpointError as exc:
        raise fail("preparing the state", exc) from None

    # 3. Write (DCP raises on every rank if any rank's write failed), then sum up the files.
    error, sums = None, {}
    try:
        writer = ChecksummedWriter(target)
        with quiet(world):
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=world == 1)
        sums = writer.checksums()
        if rank == 0:
            sums[".metadata"] = checksum(os.path.join(target, ".metadata"))
    except (Exception, DCPException) as exc:  # noqa: BLE001 - agreed on below
        error = describe(exc)
    try:
        checksums = {k: v for part in agree(group, error, sums) for k, v in part.items()}
    except CheckpointError as exc:
        raise fail("writing the shards", exc) from None

    # 4. Rank 0 completes the directory and commits it.
    manifest = {
        "format": FORMAT,
        "model": pm.model_name,
        "layout": {"pp": pm.plan.pp, "tp": pm.mesh.dims.tp, "dp": pm.dp_size, "chunks": pm.plan.chunks},
        "optimizer": {k: v for part in infos for k, v in part.items()} if optimizer is not None else None,
        "loss_scaler": pm.training_state.scaler_state(),
        "extra": extra_bytes is not None,
        "checksums": checksums,  # see [Note: checkpoint checksums]
    }
    try:
        from_rank0(group, lambda: _commit(path, name, manifest, extra_bytes))  # raises before os.replace or not at all
    except CheckpointError as exc:
        raise fail("committing", exc) from None
    return target
