"""The files of a checkpoint: DCP's file writer and reader, with a CRC32 and a size per file.

[Note: checkpoint checksums]
A shard overwritten or cut short after its save would otherwise load as garbage (an overwritten
range is read back as other numbers, and training goes to NaN) or fail deep inside
``torch.load`` with an empty ``EOFError``. So every rank notes the files DCP wrote for it,
computes their sizes and CRC32s once they are complete, and rank 0 writes them into the
manifest with its own ``.metadata``. At load, rank 0 checks ``.metadata`` before reading it,
and every rank checks each file DCP is about to read for it, raising a CheckpointError naming
the file and what is wrong. A file is read once more for its CRC32 at save and at load (from
the page cache, mostly): a fraction of what writing or reading it costs.
"""
from __future__ import annotations

import os
import zlib
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ..errors import CheckpointError

__all__ = ["ChecksummedWriter", "VerifyingReader", "checksum", "verify"]

Checksums = dict[str, tuple[int, int]]  # file name in the checkpoint directory -> (bytes, CRC32)
_CHUNK = 16 * 1024 * 1024


def checksum(path: str) -> tuple[int, int]:
    """(size in bytes, CRC32) of the file at ``path``."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def verify(directory: str, name: str, expected: Checksums | None) -> None:
    """Raises CheckpointError unless ``directory/name`` has the size and CRC32 saved for it
    (``expected`` None: saved without checksums, nothing to check)."""
    if expected is None:
        return
    path = os.path.join(directory, name)
    if name not in expected:
        raise CheckpointError(f"checkpoint file {path!r} is not listed in the manifest of {directory!r}; "
                              "the directory was changed after the save. Load an intact checkpoint")
    want_size, want_crc = expected[name]
    try:
        size, crc = checksum(path)
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} cannot be read ({exc}); restore it, or load an "
                              "intact checkpoint") from None
    if size != want_size:
        raise CheckpointError(f"checkpoint file {path!r} is {size} bytes, but {want_size} were saved: it was "
                              f"{'truncated' if size < want_size else 'extended'} after the save. Restore it, "
                              "or load an intact checkpoint")
    if crc != want_crc:
        raise CheckpointError(f"checkpoint file {path!r} is corrupt: its CRC32 is {crc:#010x}, but "
                              f"{want_crc:#010x} was saved (its bytes changed after the save). Restore it, or "
                              "load an intact checkpoint")


class ChecksummedWriter(FileSystemWriter):
    """DCP's file writer, noting the files it wrote for this rank; see [Note: checkpoint checksums]."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.directory = path
        self.written: set[str] = set()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written.update(r.storage_data.relative_path for r in future.wait())
        return future

    def checksums(self) -> Checksums:
        """Sizes and CRC32s of the files written (call once the save finished)."""
        return {name: checksum(os.path.join(self.directory, name)) for name in sorted(self.written)}


class VerifyingReader(FileSystemReader):
    """DCP's file reader, checking each file against ``expected`` before it reads from it."""

    def __init__(self, path: str, expected: Checksums | None) -> None:
        super().__init__(path)
        self.directory = path
        self.expected = expected

    def read_data(self, plan: Any, planner: Any) -> Any:
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            verify(self.directory, name, self.expected)
        return super().read_data(plan, planner)
