"""A rank's program: the steps the pipeline driver runs for one schedule and number of
micro-batches, in posting order (see [Note: transfer streams] in streams.py). Plain data,
compiled once per (schedule, micro-batches) and checked without processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from autopipe.runtime.schedule import ActionKind, all_rank_actions, rank_actions
from autopipe.runtime.streams import posting_order, send_delays, stream_deadlock

__all__ = ["Compute", "PointToPoint", "Transfers", "Step", "SENDS", "compile_program"]

SENDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
_LABELS = {  # how errors name a transfer; completed with "pipeline rank <peer>"
    ActionKind.SEND_ACT: "send of stage {s}'s output (micro-batch {mb}) to",
    ActionKind.RECV_ACT: "receive of stage {s}'s input (micro-batch {mb}) from",
    ActionKind.SEND_GRAD: "send of the gradient of stage {s}'s input (micro-batch {mb}) to",
    ActionKind.RECV_GRAD: "receive of the gradient of stage {s}'s output (micro-batch {mb}) from",
}


@dataclass(frozen=True)
class Compute:
    """Run stage ``stage``'s forward (or backward) on micro-batch ``microbatch``."""

    forward: bool
    stage: int
    microbatch: int


@dataclass(frozen=True)
class PointToPoint:
    """One send or receive with pipeline rank ``peer``; ``what`` names it in errors."""

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int
    what: str

    @property
    def send(self) -> bool:
        return self.kind in SENDS


@dataclass(frozen=True)
class Transfers:
    """The sends and receives between two computes, posted together."""

    transfers: tuple[PointToPoint, ...]


Step = Union[Compute, Transfers]


def compile_program(schedule: str, pp: int, microbatches: int, chunks: int, pp_rank: int,
                    lead: int = 1, delay_sends: bool = False) -> list[Step]:
    """The steps of pipeline rank ``pp_rank`` for ``schedule`` (validated by the caller), each
    receive posted ``lead`` computes ahead of its consumer (see [Note: receive lead]) and, with
    ``delay_sends``, each send as late as the schedule allows (see [Note: send timing]; posted
    at once wherever the delays would let a rank's streams deadlock)."""
    steps: list[Step] = []
    batch: list[PointToPoint] = []
    actions = rank_actions(schedule, pp, microbatches, chunks, pp_rank)
    delays = None
    if delay_sends and pp > 1:
        every = all_rank_actions(schedule, pp, microbatches, chunks)
        per_rank = send_delays(every, pp, chunks)
        if not stream_deadlock([posting_order(a, lead, d) for a, d in zip(every, per_rank)], pp):
            delays = per_rank[pp_rank]
    for a in posting_order(actions, lead, delays):
        s, mb = a.stage, a.microbatch
        if a.kind is ActionKind.FORWARD or a.kind is ActionKind.BACKWARD:
            if batch:
                steps.append(Transfers(tuple(batch)))
                batch = []
            steps.append(Compute(a.kind is ActionKind.FORWARD, s, mb))
            continue
        peer = (s + 1 if a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD) else s - 1) % pp
        batch.append(PointToPoint(a.kind, s, mb, peer, _LABELS[a.kind].format(s=s, mb=mb) + f" pipeline rank {peer}"))
    if batch:
        steps.append(Transfers(tuple(batch)))
    return steps
