"""The layouts a search weighs: every way to run a model on N devices, with why others cannot run.

# N: devices (world size); B: global batch; pp x tp x dp = N; m: micro-batches per replica;
# v: chunks per pipeline rank; b = B / dp / m: samples per micro-batch.

[Note: priced cuts]
The search cuts a layout's stages between whole nodes (predict.py) and prices each crossing by
the tensors that cross it. ``parallelize`` by default may cut an MLP into pieces of its hidden
units instead ([Note: MLP pieces]), wherever that balances the stages' compute better: the
boundaries move, and a boundary inside an MLP carries three tensors (the residual, the MLP's
input and the partial sum) where the search priced one or two. Each costs a pipeline rank its
host time twice per micro-batch (activation and gradient), and an interleaved schedule with
pp = 2 sends at every one of its 2v - 1 boundaries. ViT (depth 4, batch 16) pp2 m8 v2 on 2 CPU
cores: priced crossings of 2, 1 and 1 tensors, run with 3, 3 and 3, 80 more tensors a step at
about 225 us each end, about 18 ms a rank; the step measured 21 ms longer than predicted
(results/2026-11-26-cpu-layout-choice-vit-collectives-counted-3.json). So a layout is built with
``split_mlps=False``: it runs where it was priced.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterator

from autopipe.errors import ScheduleError
from autopipe.runtime.schedule import validate

__all__ = ["Layout", "divisors", "layouts"]

MAX_MICROBATCHES = 64


@dataclass(frozen=True, order=True)
class Layout:
    """One way to run: degrees, micro-batches, chunks, schedule and how the stages run."""

    pp: int
    tp: int
    dp: int
    microbatches: int
    chunks: int
    schedule: str
    sequence_parallel: bool
    recompute: bool  # activation checkpointing
    mode: str  # one of partition.device.EXECUTION_MODES

    def microbatch_size(self, batch: int) -> int:
        return batch // self.dp // self.microbatches

    def parallelize_kwargs(self) -> dict[str, Any]:
        """The ``parallelize`` arguments that run this layout as the search priced it (stage
        boundaries between whole nodes: see [Note: priced cuts])."""
        return dict(pp=self.pp, tp=self.tp, microbatches=self.microbatches, chunks=self.chunks,
                    schedule=self.schedule, sequence_parallel=self.sequence_parallel,
                    activation_checkpointing=self.recompute, cuda_graphs=self.mode.endswith("graphs"),
                    compile_stages=self.mode.startswith("compiled"), split_mlps=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        parts = [f"pp{self.pp} tp{self.tp} dp{self.dp}", f"m{self.microbatches}"]
        if self.chunks > 1:
            parts.append(f"v{self.chunks}")
        if self.pp > 1:
            parts.append(self.schedule)
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute:
            parts.append("ckpt")
        parts.append(self.mode)
        return " ".join(parts)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(devices: int, batch: int, *, modes: tuple[str, ...], chunk_options: tuple[int, ...] = (1, 2, 4),
            recompute_options: tuple[bool, ...] = (False, True),
            tp_options: tuple[int, ...] | None = None) -> Iterator[tuple[Layout | None, str, str]]:
    """Every candidate as ``(layout, "", "")``, and every impossible one as ``(None, its
    description, why)``: degrees that do not multiply to ``devices`` are not candidates at all,
    a batch that does not split, a schedule that cannot run, a mode that cannot hold the
    collectives are reasons."""
    for tp in divisors(devices):
        if tp_options is not None and tp not in tp_options:
            continue
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            if batch % dp:
                yield None, f"pp{pp} tp{tp} dp{dp}", f"batch {batch} does not split over dp={dp} replicas"
                continue
            per_replica = batch // dp
            for m in divisors(per_replica):
                if m > MAX_MICROBATCHES:
                    break
                for v in chunk_options if pp > 1 else (1,):
                    schedules = ("1f1b", "gpipe") if v == 1 and pp > 1 else \
                        ("interleaved_1f1b",) if v > 1 else ("1f1b",)
                    for schedule in schedules:
                        try:
                            validate(schedule, pp, m, v)
                        except ScheduleError as exc:
                            yield None, f"pp{pp} tp{tp} dp{dp} m{m} v{v} {schedule}", str(exc)
                            continue
                        for sp in (False, True) if tp > 1 else (False,):
                            if sp and (per_replica // m) % tp:
                                yield None, f"pp{pp} tp{tp} dp{dp} m{m} sp", (
                                    f"sequence parallelism splits a micro-batch of {per_replica // m} "
                                    f"samples over tp={tp} ranks, which does not divide it")
                                continue
                            for recompute in recompute_options:
                                for mode in modes:
                                    if tp > 1 and mode.endswith("graphs"):
                                        continue  # graphs cannot hold tp collectives: not a candidate
                                    yield Layout(pp, tp, dp, m, v, schedule, sp, recompute, mode), "", ""
