"""A pipeline step in seconds: every rank's action list replayed with stage and link times.

[Note: timed replay]
The schedules' own action lists (runtime/schedule.py) are replayed with real durations:
- a forward of stage s takes ``forward[s]``, a backward ``backward[s]`` (seconds, one
  micro-batch), plus ``action_overhead`` of host work per compute (the driver's own Python);
- a send is posted when its compute ends and takes its link's latency plus its bytes over the
  link's bandwidth; each directed link carries one transfer at a time (one stream per link,
  [Note: transfer streams]), so a send waits for the previous one on its link;
- a receive waits until its message has arrived; compute and transfers overlap;
- posting a send or a receive and handing it to the backend takes the rank's own time
  (``host_act[s]``, ``host_grad[s]``: the host is the device on CPUs, where gloo's transfers
  and the threads that wait on them share the cores with the compute).
The makespan is the time the last rank finishes; a rank's idle fraction of it is its bubble.
Every (rank, action, start, end) is kept, so the chosen layout's timeline can be drawn.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

from autopipe.errors import ScheduleError
from autopipe.runtime.schedule import Action, ActionKind, all_rank_actions

__all__ = ["Replay", "replay"]

_SENDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
_RECEIVES = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


@dataclass
class Replay:
    """A replayed step; see [Note: timed replay]."""

    makespan: float  # seconds from the first compute to the last rank's end
    busy: list[float]  # compute seconds per rank
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)  # rank, action, start, end

    @property
    def bubble(self) -> float:
        """Idle fraction of the ranks over the makespan (0 for one rank with no waits)."""
        if self.makespan <= 0 or not self.busy:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def replay(schedule: str, pp: int, microbatches: int, chunks: int, forward: Sequence[float],
           backward: Sequence[float], *, send_act: Sequence[float] = (), send_grad: Sequence[float] = (),
           action_overhead: float = 0.0, host_act: Sequence[float] = (), host_grad: Sequence[float] = (),
           keep_spans: bool = False) -> Replay:
    """Replay ``schedule`` for ``pp`` ranks; ``forward[s]``/``backward[s]`` are stage s's seconds,
    ``send_act[s]``/``send_grad[s]`` the seconds of its activations to stage s + 1 and of its
    input gradients to stage s - 1 (latency included; missing: 0), ``host_act[s]`` and
    ``host_grad[s]`` the host seconds each end spends on such a transfer (missing: 0)."""
    stages = pp * chunks
    if len(forward) != stages or len(backward) != stages:
        raise ScheduleError(f"replay needs one forward and one backward time per stage ({stages}), got "
                            f"{len(forward)} and {len(backward)}")
    actions = all_rank_actions(schedule, pp, microbatches, chunks)
    send_act = list(send_act) or [0.0] * stages
    send_grad = list(send_grad) or [0.0] * stages
    host_act = list(host_act) or [0.0] * stages
    host_grad = list(host_grad) or [0.0] * stages
    clock, busy = [0.0] * pp, [0.0] * pp
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    arrivals: dict[tuple[int, int], deque[float]] = defaultdict(deque)
    pc = [0] * pp
    spans: list[tuple[int, str, float, float]] = []
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pc[r] < len(actions[r]):
                a = actions[r][pc[r]]
                if a.kind in _RECEIVES:
                    src = _peer(a, pp)
                    if not arrivals[(src, r)]:
                        break  # its message is not sent yet: another rank runs first
                    # The message is stage a.stage -/+ 1's; its host time is the sender's too.
                    sender = a.stage - 1 if a.kind is ActionKind.RECV_ACT else a.stage + 1
                    host = host_act[sender] if a.kind is ActionKind.RECV_ACT else host_grad[sender]
                    clock[r] = max(clock[r], arrivals[(src, r)].popleft()) + host
                elif a.kind in _SENDS:
                    dst = _peer(a, pp)
                    seconds = send_act[a.stage] if a.kind is ActionKind.SEND_ACT else send_grad[a.stage]
                    clock[r] += host_act[a.stage] if a.kind is ActionKind.SEND_ACT else host_grad[a.stage]
                    start = max(clock[r], link_free[(r, dst)])
                    link_free[(r, dst)] = start + seconds
                    arrivals[(r, dst)].append(start + seconds)
                else:
                    seconds = (forward if a.kind is ActionKind.FORWARD else backward)[a.stage] + action_overhead
                    if keep_spans:
                        spans.append((r, str(a), clock[r], clock[r] + seconds))
                    clock[r] += seconds
                    busy[r] += seconds
                pc[r] += 1
                progress = True
    if any(pc[r] < len(actions[r]) for r in range(pp)):
        blocked = [str(actions[r][pc[r]]) for r in range(pp) if pc[r] < len(actions[r])]
        raise ScheduleError(f"the replay of {schedule} blocked at {', '.join(blocked)}")
    return Replay(max(clock), busy, spans)


def _peer(a: Action, pp: int) -> int:
    ahead = a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD)
    return (a.stage + (1 if ahead else -1)) % pp
