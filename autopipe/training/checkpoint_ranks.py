"""How the ranks of a checkpoint save or load agree: each rank's outcome gathered, rank 0's
result handed to all, over a gloo group whose timeout is the model's deadline; see [Note: no
rank left waiting] in checkpoint.py.
"""
from __future__ import annotations

import datetime
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from ..errors import CheckpointError
from ..failure.monitor import DEFAULT_DEADLINE, active, brief

if TYPE_CHECKING:
    from .parallel_model import ParallelModel

__all__ = ["world_of", "checkpoint_group", "agree", "from_rank0"]

_GROUPS: weakref.WeakKeyDictionary[Any, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def world_of() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checkpoint_group(pm: ParallelModel) -> dist.ProcessGroup | None:
    """The gloo group ``pm``'s checkpoints coordinate over (None for one process); created at
    its first save or load, which every rank calls, with the deadline of the monitor running."""
    if world_of()[1] == 1:
        return None
    if pm not in _GROUPS:
        monitor = active()
        deadline = monitor.deadline if monitor is not None else DEFAULT_DEADLINE
        _GROUPS[pm] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=deadline))
    return _GROUPS[pm]


def release_checkpoint_group(pm: ParallelModel) -> dist.ProcessGroup | None:
    """Forgets ``pm``'s checkpoint group and returns it (None if it has none), to be destroyed."""
    return _GROUPS.pop(pm, None)


def _exchange(fn: Callable[[], Any], what: str) -> Any:
    """``fn()``, a collective; a rank that dies or stops answering makes it a CheckpointError."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a peer's connection closed, or the group timed out
        monitor = active()
        cause = monitor.cause(exc) if monitor is not None else exc
        if cause is not exc:  # another rank's recorded failure says why
            error = CheckpointError(f"lost contact with the other ranks while {what}: {cause}")
        else:
            deadline = monitor.deadline if monitor is not None else DEFAULT_DEADLINE
            error = CheckpointError(
                f"lost contact with the other ranks while {what} ({type(exc).__name__}: {brief(exc)}); a rank "
                f"may have died (see its log) or stopped calling the checkpoint (the deadline is {deadline:g} s)")
        if monitor is not None:
            monitor.record(error)  # the job cannot go on: its later steps refuse at once
        raise error from exc


def agree(group: dist.ProcessGroup | None, error: str | None, payload: Any = None) -> list[Any]:
    """Every rank's ``payload``; raises one CheckpointError on every rank if any rank had an error."""
    rank, world = world_of()
    entries: list[Any] = [(error, payload)]
    if world > 1:
        entries = [None] * world
        _exchange(lambda: dist.all_gather_object(entries, (error, payload), group=group),
                  "agreeing on each rank's outcome")
    failed = [(r, e) for r, (e, _) in enumerate(entries) if e is not None]
    if failed:
        r, e = failed[0]
        raise CheckpointError(e if world == 1 else f"rank {r}: {e}")
    return [p for _, p in entries]


def from_rank0(group: dist.ProcessGroup | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0 and handed to every rank; its failure is raised on every rank."""
    rank, world = world_of()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box = [(None, fn())]
        except CheckpointError as exc:
            box = [(str(exc), None)]
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            box = [(f"{type(exc).__name__}: {exc}", None)]
    if world > 1:
        _exchange(lambda: dist.broadcast_object_list(box, src=0, group=group), "waiting for rank 0")
    error, value = box[0]
    if error is not None:
        raise CheckpointError(error)
    return value
