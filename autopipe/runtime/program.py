"""A rank's program: the steps the pipeline driver runs for one schedule and number of
micro-batches, in posting order (see [Note: transfer streams] in streams.py). Plain data,
compiled once per (schedule, micro-batches) and checked without processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from autopipe.runtime.schedule import ActionKind, all_rank_actions, rank_actions
from autopipe.runtime.streams import posting_order, send_delays, stream_deadlock

__all__ = ["Compute", "PointToPoint", "Transfers", "Step", "SENDS", "compile_program", "messages_ahead"]

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


def messages_ahead(programs: list[list[Step]]) -> dict[tuple[int, int], int]:
    """Per directed link (sending pipeline rank, receiving one), the most messages its sender can
    have posted that the receiver has not yet taken, however fast or slow each rank runs:
    ``programs[r]`` is rank r's program for one step. A message is taken when its consumer's
    compute starts. Each rank runs its program in order, a compute waits for its inputs'
    sends to be posted, and sends never wait. Message k on a link is posted after every event
    it depends on; of the link's messages, at least those whose consumers are among them are
    taken by then, and any other may still be waiting, so k minus their number is the bound.
    A ring of that many slots per link lets every send wait for its slot's previous message
    without two ranks waiting on each other (see [Note: shared-memory links] in host_links.py).
    Raises ValueError if the programs cannot all run to their end (a receive without a send)."""
    pp = len(programs)
    sent: dict[tuple, int] = {}  # (link, kind, stage, mb) -> the event (rank, index) posting it
    consumer: dict[tuple, tuple[int, int]] = {}  # (link, kind, stage, mb) -> (rank, index) of its compute
    events: list[list[tuple]] = [[] for _ in range(pp)]  # per rank: ("c", waits) or ("s", key)
    order: dict[tuple[int, int], int] = {}
    for r, program in enumerate(programs):
        waiting: dict[tuple, tuple] = {}  # (kind of compute, stage, mb) -> receive keys it consumes
        for step in program:
            if isinstance(step, Compute):
                keys = waiting.pop((step.forward, step.stage, step.microbatch), ())
                for key in keys:
                    consumer[key] = (r, len(events[r]))
                events[r].append(("c", keys))
                continue
            for t in step.transfers:
                link = (r, t.peer) if t.send else (t.peer, r)
                forward = t.kind in (ActionKind.SEND_ACT, ActionKind.RECV_ACT)
                # Keyed by the consumer: the stage after an activation's sender, before a gradient's.
                stage = t.stage + (1 if forward else -1) if t.send else t.stage
                key = (link, forward, stage, t.microbatch)
                if t.send:
                    order[link] = order.get(link, 0) + 1
                    sent[key] = (r, len(events[r]))
                    events[r].append(("s", key, order[link]))
                else:
                    waiting[(forward, t.stage, t.microbatch)] = waiting.get((forward, t.stage, t.microbatch), ()) + (key,)
    # The latest event of each rank that every event depends on, in a run where nothing waits
    # longer than it must: ranks advance round-robin while their next event's inputs are posted.
    ancestors: dict[tuple[int, int], list[int]] = {}
    at, progress = [0] * pp, True
    while progress:
        progress = False
        for r in range(pp):
            while at[r] < len(events[r]):
                event = events[r][at[r]]
                known = list(ancestors[(r, at[r] - 1)]) if at[r] else [-1] * pp
                inputs = [sent.get(key) for key in event[1]] if event[0] == "c" else []
                if any(i is None or i[1] >= at[i[0]] for i in inputs):
                    break  # a send it waits for is not posted yet
                for i in inputs:
                    known = [max(a, b) for a, b in zip(known, ancestors[i])]
                known[r] = at[r]
                ancestors[(r, at[r])] = known
                at[r] += 1
                progress = True
    if any(at[r] < len(events[r]) for r in range(pp)):
        stuck = [f"rank {r} at event {at[r]}" for r in range(pp) if at[r] < len(events[r])]
        raise ValueError(f"the programs cannot run to their end: {', '.join(stuck)}")
    ahead: dict[tuple[int, int], int] = {}
    taken: dict[tuple[int, int], list[int]] = {}  # link -> consumer indices (on the receiver), in message order
    for key, (r, i) in sorted(sent.items(), key=lambda kv: events[kv[1][0]][kv[1][1]][2]):
        taken.setdefault(key[0], []).append(consumer[key][1])
    for r in range(pp):
        for i, event in enumerate(events[r]):
            if event[0] != "s":
                continue
            link, k = event[1][0], event[2]
            seen = ancestors[(r, i)][link[1]]
            ahead[link] = max(ahead.get(link, 0), k - sum(c <= seen for c in taken[link]))
    return ahead
