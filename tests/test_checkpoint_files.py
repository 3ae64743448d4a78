"""Checkpoint files damaged after their save are named at load (checksums), and a rank that dies
in the middle of a save makes every other rank raise CheckpointError within the deadline,
leaving the previous checkpoint as the one that loads.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import autopipe
from autopipe.training.checkpoint_files import checksum
from autopipe.errors import CheckpointError
from tests import failing_job as job
from tests.distributed import RankError, run_distributed

__all__: list[str] = []


def _pm(seed: int = 0, **kwargs) -> autopipe.ParallelModel:
    torch.manual_seed(seed)
    args = dict(microbatches=2, loss_fn=F.cross_entropy, device="cpu")
    return autopipe.parallelize(job.mlp(), (torch.randn(2, job.IN),), **{**args, **kwargs})


def _saved(tmp_path) -> tuple[str, list[str]]:
    """A saved single-process checkpoint: its directory and its shard files."""
    pm = _pm()
    opt = torch.optim.AdamW(pm.parameters())
    job.train(pm, 1)
    target = pm.save_checkpoint(tmp_path, opt)
    return target, sorted(f for f in os.listdir(target) if f.endswith(".distcp"))


def _load(tmp_path) -> None:
    pm = _pm(seed=1)
    pm.load_checkpoint(tmp_path, torch.optim.AdamW(pm.parameters()))


def test_an_intact_checkpoint_lists_every_file_with_its_size_and_crc(tmp_path) -> None:
    target, shards = _saved(tmp_path)
    manifest = torch.load(os.path.join(target, "manifest.pt"), weights_only=True)
    assert set(manifest["checksums"]) == {".metadata", *shards}
    assert all(manifest["checksums"][f] == checksum(os.path.join(target, f)) for f in manifest["checksums"])
    _load(tmp_path)


def test_overwritten_bytes_in_a_shard_are_named_at_load(tmp_path) -> None:
    target, shards = _saved(tmp_path)
    path = os.path.join(target, shards[0])
    with open(path, "r+b") as f:  # 4000 bytes in the middle: the size stays, the contents change
        f.seek(os.path.getsize(path) // 2 - 2000)
        f.write(os.urandom(4000))
    with pytest.raises(CheckpointError, match=rf"checkpoint file '{path}' is corrupt: its CRC32 is 0x[0-9a-f]{{8}}, "
                                              r"but 0x[0-9a-f]{8} was saved"):
        _load(tmp_path)


def test_a_truncated_shard_or_metadata_is_named_with_its_sizes(tmp_path) -> None:
    target, shards = _saved(tmp_path)
    path = os.path.join(target, shards[0])
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    with pytest.raises(CheckpointError, match=rf"checkpoint file '{path}' is {size - 100} bytes, but {size} were "
                                              "saved: it was truncated after the save"):
        _load(tmp_path)
    metadata = os.path.join(target, ".metadata")
    os.truncate(metadata, 10)
    with pytest.raises(CheckpointError, match=rf"checkpoint file '{metadata}' is 10 bytes, .* truncated"):
        _load(tmp_path)
    os.truncate(os.path.join(target, "manifest.pt"), 50)
    with pytest.raises(CheckpointError, match=r"cannot be read: its file 'manifest.pt' gives \w+"):
        _load(tmp_path)


def _killed_during_save(rank: int, world: int, root: str, victim: int) -> tuple:
    pm = _pm(pp=2, tp=2, deadline=5)
    opt = torch.optim.AdamW(pm.parameters())
    job.train(pm, 1)
    pm.save_checkpoint(root, opt)
    kept = pm.full_state_dict()
    job.train(pm, 1)
    write = dcp.FileSystemWriter.write_data

    def die_while_writing(self, *args, **kwargs):
        if rank == victim:
            os._exit(9)
        return write(self, *args, **kwargs)

    dcp.FileSystemWriter.write_data = die_while_writing
    start = time.perf_counter()
    try:
        pm.save_checkpoint(root, opt)
    except Exception as exc:  # noqa: BLE001 - returned for the test to look at
        return type(exc).__name__, str(exc), time.perf_counter() - start, kept
    return "returned", "", time.perf_counter() - start, kept


@pytest.mark.parametrize("victim", [0, 2])
def test_a_rank_killed_during_a_save_makes_every_rank_raise_and_keeps_the_last_checkpoint(tmp_path, victim) -> None:
    results = run_distributed(_killed_during_save, 4, str(tmp_path), victim, timeout=150, return_exceptions=True)
    assert isinstance(results[victim], RankError) and results[victim].exitcode == 9
    survivors = [r for r in range(4) if r != victim]
    for rank in survivors:
        kind, message, took, _ = results[rank]
        assert kind == "CheckpointError" and "lost contact with the other ranks" in message, (rank, kind, message)
        assert took < 30, f"rank {rank} took {took:.1f} s (deadline 5 s)"
    kept = results[survivors[0]][3]
    pm = _pm(seed=1)
    pm.load_checkpoint(tmp_path)  # the checkpoint saved before, in another layout
    for name, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, kept[name], rtol=0, atol=0, msg=name)
