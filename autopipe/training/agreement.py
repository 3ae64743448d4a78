"""Every rank passes ``parallelize`` the same arguments: checked once, over the store, with a deadline.

[Note: argument agreement]
Ranks given different plan-shaping arguments (pp on one rank, 2 * pp on another; another
micro-batch count or schedule) would build different meshes and plans and then wait for one
another in collectives that never match. So ``parallelize`` first writes each rank's arguments,
described as plain strings, into the store torch.distributed already shares. Rank 0 waits for
every rank's (``store.wait``, server-side: no polling), compares them and writes one verdict,
which every rank reads and raises alike: a ConfigError naming each argument that differs and
the ranks behind each value, or a PipelineFailure naming the ranks that did not call
``parallelize`` within the deadline. It is one round trip per rank and no collective: a rank
that never comes cannot hang the others past the deadline.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from collections import Counter
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.distributed_c10d import _get_default_store

from ..errors import ConfigError, PipelineFailure

__all__ = ["agree", "describe"]

_calls: Counter[str] = Counter()
_WIDTH = 100  # characters of a value shown in messages


def describe(value: Any) -> str:
    """A description of ``value`` that is the same in every process for equal values (no
    addresses): names for functions and types, shapes for tensors, a digest for modules."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, nn.Module):
        shapes = [(k, tuple(v.shape), str(v.dtype)) for k, v in value.state_dict().items()]
        digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]
        return f"{type(value).__qualname__} ({len(shapes)} tensors, shapes {digest})"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        fields = ", ".join(f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def agree(arguments: Mapping[str, Any], *, deadline: float, what: str = "parallelize()") -> None:
    """Raises on every rank unless every rank of the world passed equal ``arguments`` to its
    n-th call of ``what``; see [Note: argument agreement]. Nothing to do for one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world, store = dist.get_rank(), dist.get_world_size(), _get_default_store()
    _calls[what] += 1
    base = f"autopipe/arguments/{what}/{_calls[what]}"
    store.set(f"{base}/{rank}", json.dumps({k: describe(v) for k, v in arguments.items()}))
    timeout = datetime.timedelta(seconds=deadline)
    if rank == 0:
        keys = [f"{base}/{r}" for r in range(world)]
        try:
            store.wait(keys, timeout)
        except Exception:  # noqa: BLE001 - a timeout: some ranks did not come
            missing = [r for r in range(world) if not store.check([keys[r]])]
            verdict = ("absent", _absent(missing, what, deadline))
        else:
            verdict = _differences([json.loads(v) for v in store.multi_get(keys)], what)
            for key in keys[1:]:  # read once, here (the others wait for rank 0's own)
                store.delete_key(key)
        store.set(f"{base}/verdict", json.dumps(verdict))
    else:
        try:  # rank 0 waits ``deadline`` from its own arrival for the others
            store.wait([f"{base}/0"], timeout)
            store.wait([f"{base}/verdict"], timeout + datetime.timedelta(seconds=10))
        except Exception:  # noqa: BLE001 - a timeout
            raise PipelineFailure(_absent([0], what, deadline)) from None
    kind, message = json.loads(store.get(f"{base}/verdict"))
    if kind == "config":
        raise ConfigError(message)
    if kind == "absent":
        raise PipelineFailure(message)


def _absent(missing: list[int], what: str, deadline: float) -> str:
    ranks = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
    return (f"rank{'s' if len(missing) > 1 else ''} {ranks} did not call {what} within {deadline:g} s; "
            f"every rank must call it (raise deadline= if a rank is this slow to get there)")


def _differences(described: list[dict[str, str]], what: str) -> tuple[str, str]:
    """("", "") when every rank passed the same; else ("config", the ConfigError's message)."""
    lines = []
    for name in described[0]:
        values: dict[str, list[int]] = {}
        for rank, d in enumerate(described):
            values.setdefault(d.get(name, "<missing>"), []).append(rank)
        if len(values) > 1:
            shown = "; ".join(f"{_short(v)} on rank{'s' if len(r) > 1 else ''} {_ranks(r)}" for v, r in values.items())
            lines.append(f"  - {name}: {shown}")
    if not lines:
        return "", ""
    return "config", (f"the ranks called {what} with different arguments, which would build different plans "
                      "and hang in collectives that never match:\n" + "\n".join(lines)
                      + "\nPass the same values on every rank")


def _short(value: str) -> str:
    return value if len(value) <= _WIDTH else value[: _WIDTH - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
