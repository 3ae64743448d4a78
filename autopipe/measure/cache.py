"""Measured profiles on disk, so that a second run with the same graph does not time it again.

A profile is stored as JSON under a name hashed from its key (graph fingerprint, input
shapes, compute dtype, execution mode, activation checkpointing, device name, torch version)
and the segment count. The directory is ``$AUTOPIPE_CACHE_DIR`` or ``~/.cache/autopipe``.
A file that cannot be read is never overwritten or deleted: loading it raises a
ProfileError naming it, so nothing is lost behind the user's back.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

from autopipe.partition.measured import SCHEMA_VERSION, MeasuredCosts

__all__ = ["ProfileCache", "default_cache_dir"]


def default_cache_dir() -> str:
    return os.environ.get("AUTOPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "autopipe")


class ProfileCache:
    """A directory of measured profiles keyed by what they were measured for."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = os.fspath(directory) if directory is not None else default_cache_dir()

    def path(self, key: Mapping[str, Any], segments: int) -> str:
        digest = hashlib.sha256(json.dumps({**key, "segments": segments, "schema": SCHEMA_VERSION}, sort_keys=True).encode()).hexdigest()
        return os.path.join(self.directory, "profiles", f"{digest[:24]}.json")

    def load(self, key: Mapping[str, Any], segments: int) -> MeasuredCosts | None:
        """The cached profile for ``key``, None when there is none (ProfileError if unreadable)."""
        path = self.path(key, segments)
        if not os.path.exists(path):
            return None
        measured = MeasuredCosts.load(path)
        measured.check(dict(key), source=f"cached profile {path!r}")
        return measured

    def save(self, measured: MeasuredCosts, segments: int) -> str:
        path = self.path(measured.key(), segments)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        measured.save(path)
        return path
