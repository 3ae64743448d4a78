"""Pipeline schedules: which forwards, backwards and transfers each rank runs, in order.

Plain data, no torch and no processes: the stage driver iterates over :func:`rank_actions`;
:func:`simulate` replays every rank's list to check it without a GPU.

# pp: number of pipeline ranks
# m: number of micro-batches
# v: number of model chunks per rank (``chunks``)
# S: number of stages, pp * v; stage s lives on rank s % pp

[Note: transfer order]
The runtime posts sends without waiting and blocks on receives. NCCL matches the messages
between two ranks in issue order, whatever their tags, so the k-th send from rank a to rank b
must be the k-th receive that b posts from a. So each rank's compute order is fixed first, and
then, before a compute that needs a message, the rank receives every message that peer sent
before it, in the peer's order. In the schedules here neighbours consume in the order they
produce (with v >= 2 too, and with pp = 2 where one pair of ranks carries both activations and
gradients), so each receive sits right before its consumer; the rule keeps FIFO true should an
order ever differ, at no extra waiting, since the peer posted those messages first.

Timetables drawn by :func:`timetable` (pp = 4; one column per step, F and B take one step each,
transfers none; the number is the micro-batch; with v = 2, f/b is chunk 0 and F/B chunk 1):

    1f1b, m = 6: rank r warms up with pp - r - 1 forwards, then alternates one F and one B;
    it never holds more than pp - r micro-batches. 2 * (m + pp - 1) = 18 steps.
    rank 0  F0 F1 F2 F3          B0 F4 B1 F5 B2    B3    B4    B5
    rank 1     F0 F1 F2       B0 F3 B1 F4 B2 F5 B3    B4    B5
    rank 2        F0 F1    B0 F2 B1 F3 B2 F4 B3 F5 B4    B5
    rank 3           F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

    interleaved_1f1b, m = 4, v = 2: a round of micro-batches per chunk, backward from the last
    chunk; warm-up (v - 1) * 4 + 2 * (pp - r - 1). 2 * (m * v + pp - 1) = 22 steps.
    rank 0  f0 f1 f2 f3 F0 F1 F2 F3          B0    B1    B2    B3 b0 b1 b2 b3
    rank 1     f0 f1 f2 f3 F0 F1 F2 F3    B0    B1    B2    B3 b0 b1 b2 b3
    rank 2        f0 f1 f2 f3 F0 F1 F2 B0 F3 B1    B2    B3 b0 b1 b2 b3
    rank 3           f0 f1 f2 f3 F0 B0 F1 B1 F2 B2 F3 B3 b0 b1 b2 b3
"""
from __future__ import annotations

import enum
import functools
from collections import defaultdict, deque
from dataclasses import dataclass, field

from autopipe.errors import ScheduleError

__all__ = [
    "SCHEDULES", "ActionKind", "Action", "Simulation",
    "validate", "rank_actions", "all_rank_actions", "simulate", "timetable",
    "theoretical_bubble", "max_in_flight_bound", "stage_slots", "interleaved_rounds",
]  # fmt: skip

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "forward_only")


class ActionKind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)
_RECEIVES = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of a rank; ``stage`` is always the stage held by the rank that runs it."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        if self.kind in _COMPUTE:
            return f"{self.kind.value}{self.stage}.{self.microbatch}"
        return f"{self.kind.value} s{self.stage} mb{self.microbatch}"


def validate(schedule: str, pp: int, m: int, chunks: int) -> None:
    """Raises :class:`ScheduleError` listing every reason the schedule cannot run."""
    problems = [
        f"{name}={value} must be an integer >= 1"
        for name, value in (("pp", pp), ("microbatches", m), ("chunks", chunks))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1
    ]
    if schedule not in SCHEDULES:
        problems.append(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if problems:
        raise ScheduleError("invalid pipeline schedule:\n" + "\n".join(f"  - {p}" for p in problems))
    if schedule == "1f1b" and chunks != 1:
        raise ScheduleError(
            f"1f1b runs one model chunk per rank, got chunks={chunks}; "
            f"use schedule='interleaved_1f1b' for chunks > 1, or chunks=1"
        )
    if schedule == "interleaved_1f1b" and chunks > 1:
        rounds = interleaved_rounds(pp, m)[0]
        if m % rounds:
            below = max(n for n in range(1, m) if _schedulable(pp, n))
            above = next(n for n in range(m + 1, m + pp + 1) if _schedulable(pp, n))
            raise ScheduleError(
                f"microbatches={m} cannot be scheduled by interleaved_1f1b with pp={pp}: "
                f"it runs them in max(1, {m} // {pp}) = {rounds} equal rounds, "
                f"and {m} % {rounds} = {m % rounds}; use microbatches={below} or {above}"
            )


def interleaved_rounds(pp: int, m: int) -> tuple[int, int]:
    """``(rounds, micro-batches per round)`` of interleaved 1F1B (torch >= 2.6's rule)."""
    rounds = max(1, m // pp)
    return rounds, m // rounds


def _schedulable(pp: int, m: int) -> bool:
    return m % interleaved_rounds(pp, m)[0] == 0


def _interleaved_warmup(pp: int, m: int, chunks: int, rank: int) -> int:
    # Megatron/torch: the last rank fills all but its last chunk for one round; each hop
    # towards rank 0 adds two (one forward out, one backward back).
    per_round = interleaved_rounds(pp, m)[1]
    return min((chunks - 1) * per_round + 2 * (pp - rank - 1), m * chunks)


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    order = fwd[:warmup]
    for f, b in zip(fwd[warmup:], bwd):
        order += [f, b]
    return order + bwd[len(fwd) - warmup :]


def _compute_order(schedule: str, pp: int, m: int, chunks: int, rank: int) -> list[Action]:
    """Forwards and backwards of one rank, without transfers."""
    local = [c * pp + rank for c in range(chunks)]
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    if schedule in ("gpipe", "forward_only"):
        # Chunk-major (torch's looped BFS): a rank finishes chunk c for every micro-batch
        # before chunk c + 1, so with m >= pp no rank waits between chunks.
        fwd = [Action(F, s, mb) for s in local for mb in range(m)]
        if schedule == "forward_only":
            return fwd
        # Backward in micro-batch order (like torch's ScheduleGPipe), last chunk first.
        return fwd + [Action(B, s, mb) for s in reversed(local) for mb in range(m)]
    if chunks == 1:  # 1f1b, and interleaved_1f1b with a single chunk
        warmup = min(pp - rank - 1, m)
        return _one_f_one_b(
            [Action(F, rank, mb) for mb in range(m)],
            [Action(B, rank, mb) for mb in range(m)],
            warmup,
        )
    rounds, per_round = interleaved_rounds(pp, m)
    mbs = [[r * per_round + i for i in range(per_round)] for r in range(rounds)]
    fwd = [Action(F, s, mb) for batch in mbs for s in local for mb in batch]
    bwd = [Action(B, s, mb) for batch in mbs for s in reversed(local) for mb in batch]
    return _one_f_one_b(fwd, bwd, _interleaved_warmup(pp, m, chunks, rank))


def _recv_before(a: Action, pp: int, stages: int) -> Action | None:
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD and s > 0 and (s - 1) % pp != s % pp:
        return Action(ActionKind.RECV_ACT, s, mb)
    if a.kind is ActionKind.BACKWARD and s < stages - 1 and (s + 1) % pp != s % pp:
        return Action(ActionKind.RECV_GRAD, s, mb)
    return None


def _send_after(a: Action, pp: int, stages: int) -> Action | None:
    s, mb = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD and s < stages - 1 and (s + 1) % pp != s % pp:
        return Action(ActionKind.SEND_ACT, s, mb)
    if a.kind is ActionKind.BACKWARD and s > 0 and (s - 1) % pp != s % pp:
        return Action(ActionKind.SEND_GRAD, s, mb)
    return None


def _peer(a: Action, pp: int) -> int:
    """The rank at the other end of a transfer."""
    ahead = a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD)
    return (a.stage + (1 if ahead else -1)) % pp


def _matching_recv(send: Action) -> Action:
    if send.kind is ActionKind.SEND_ACT:
        return Action(ActionKind.RECV_ACT, send.stage + 1, send.microbatch)
    return Action(ActionKind.RECV_GRAD, send.stage - 1, send.microbatch)


def all_rank_actions(schedule: str, pp: int, m: int, chunks: int) -> list[list[Action]]:
    """Every rank's action list, transfers included. See [Note: transfer order]."""
    return [list(actions) for actions in _all_rank_actions(schedule, pp, m, chunks)]


@functools.lru_cache(maxsize=128)  # the layout search replays the same schedules many times
def _all_rank_actions(schedule: str, pp: int, m: int, chunks: int) -> tuple[tuple[Action, ...], ...]:
    validate(schedule, pp, m, chunks)
    stages = pp * chunks
    orders = [_compute_order(schedule, pp, m, chunks, r) for r in range(pp)]
    # What each ordered pair of ranks carries, in the sender's issue order, as receives.
    outbox: dict[tuple[int, int], deque[Action]] = defaultdict(deque)
    for r, order in enumerate(orders):
        for a in order:
            send = _send_after(a, pp, stages)
            if send is not None:
                outbox[(r, _peer(send, pp))].append(_matching_recv(send))
    result = []
    for r, order in enumerate(orders):
        actions: list[Action] = []
        received: set[Action] = set()
        for a in order:
            need = _recv_before(a, pp, stages)
            if need is not None and need not in received:
                queue = outbox[(_peer(need, pp), r)]
                while need not in received:
                    received.add(queue[0])
                    actions.append(queue.popleft())
            actions.append(a)
            send = _send_after(a, pp, stages)
            if send is not None:
                actions.append(send)
        result.append(tuple(actions))
    return tuple(result)


def rank_actions(schedule: str, pp: int, m: int, chunks: int, rank: int) -> list[Action]:
    """The actions rank ``rank`` runs, in order (the neighbours' orders decide its receives)."""
    validate(schedule, pp, m, chunks)
    if not isinstance(rank, int) or not 0 <= rank < pp:
        raise ScheduleError(f"rank={rank} is outside the pipeline of pp={pp} ranks (0..{pp - 1})")
    return all_rank_actions(schedule, pp, m, chunks)[rank]


def theoretical_bubble(schedule: str, pp: int, m: int, chunks: int) -> float:
    """Idle fraction of the makespan when F and B of a chunk each take one step.

    Exact for every schedule here (tests check it against :func:`simulate`). With m >= pp it is
    (pp-1)/(m*v + pp-1): Megatron's interleaved bubble, and 1F1B's and GPipe's for v = 1.
    With m < pp, micro-batch 0 reaches chunk c + 1 only after crossing all pp ranks.
    """
    validate(schedule, pp, m, chunks)
    span = (chunks - 1) * max(m, pp) + m + pp - 1  # forward makespan; backward mirrors it
    return 1 - m * chunks / span


def max_in_flight_bound(schedule: str, pp: int, m: int, chunks: int, rank: int) -> int:
    """Most (stage, micro-batch) activations rank ``rank`` keeps for backward at once."""
    validate(schedule, pp, m, chunks)
    if schedule == "forward_only":
        return 0
    if schedule == "gpipe":
        return m * chunks
    if chunks == 1:
        return min(pp - rank, m)
    return min(_interleaved_warmup(pp, m, chunks, rank) + 1, m * chunks)


def stage_slots(schedule: str, pp: int, m: int, chunks: int, rank: int) -> dict[int, int]:
    """The most micro-batches each of rank ``rank``'s stages holds between forward and backward
    at once (at least 1): the CUDA graphs a captured stage needs, one per micro-batch it holds
    ([Note: graph slots] in graphs.py). Their sum may exceed :func:`max_in_flight_bound`: each
    stage reaches its own most at its own time."""
    return dict(_stage_slots(schedule, pp, m, chunks, rank))


@functools.lru_cache(maxsize=4096)  # the layout search asks for the same schedules many times
def _stage_slots(schedule: str, pp: int, m: int, chunks: int, rank: int) -> tuple[tuple[int, int], ...]:
    held: dict[int, int] = defaultdict(int)
    most: dict[int, int] = {}
    for a in rank_actions(schedule, pp, m, chunks, rank):
        if a.kind is ActionKind.FORWARD:
            held[a.stage] += 1
        elif a.kind is ActionKind.BACKWARD:
            held[a.stage] -= 1
        else:
            continue
        most[a.stage] = max(most.get(a.stage, 1), held[a.stage])
    return tuple(most.items())


@dataclass
class Simulation:
    """The replay of every rank's actions; see :func:`simulate`."""

    completed: bool
    steps: int  # makespan; F and B take one step, transfers none
    max_in_flight: list[int]
    deadlock: list[str] = field(default_factory=list)
    fifo_violations: list[str] = field(default_factory=list)
    dependency_violations: list[str] = field(default_factory=list)
    start: dict[Action, tuple[int, int]] = field(default_factory=dict)  # F/B -> (rank, step)


def simulate(actions: list[list[Action]], pp: int, chunks: int,
             durations: dict[ActionKind, float] | None = None) -> Simulation:
    """Replays per-rank actions with blocking receives, posted sends and per-pair FIFO matching.
    A forward and a backward take one step each, or ``durations[kind]``.

    Without any backward the run is inference: nothing is kept for backward, in-flight is 0.
    """
    stages = pp * chunks
    training = any(a.kind is ActionKind.BACKWARD for acts in actions for a in acts)
    pipes: dict[tuple[int, int], deque[tuple[Action, int]]] = defaultdict(deque)
    pc, clock, in_flight = [0] * pp, [0] * pp, [0] * pp
    peak = [0] * pp
    inputs: list[set[Action]] = [set() for _ in range(pp)]  # which F/B have their input here
    sim = Simulation(completed=False, steps=0, max_in_flight=peak)
    bad = sim.dependency_violations.append
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pc[r] < len(actions[r]):
                a = actions[r][pc[r]]
                s, mb = a.stage, a.microbatch
                if s % pp != r:
                    bad(f"rank {r} runs {a}, but stage {s} lives on rank {s % pp}")
                if a.kind in _RECEIVES:
                    src = _peer(a, pp)
                    if not pipes[(src, r)]:
                        break
                    sent, posted = pipes[(src, r)].popleft()
                    if sent != a:
                        sim.fifo_violations.append(
                            f"rank {r} posts {a} from rank {src}, whose next message is for {sent}"
                        )
                    clock[r] = max(clock[r], posted)
                    kind = ActionKind.FORWARD if sent.kind is ActionKind.RECV_ACT else ActionKind.BACKWARD
                    inputs[r].add(Action(kind, sent.stage, sent.microbatch))
                elif a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                    source = ActionKind.FORWARD if a.kind is ActionKind.SEND_ACT else ActionKind.BACKWARD
                    if Action(source, s, mb) not in sim.start:
                        bad(f"rank {r} posts {a} before computing it")
                    pipes[(r, _peer(a, pp))].append((_matching_recv(a), clock[r]))
                else:
                    first = s == 0 if a.kind is ActionKind.FORWARD else s == stages - 1
                    if a in sim.start:
                        bad(f"rank {r} runs {a} twice")
                    if not first and a not in inputs[r]:
                        bad(f"rank {r} runs {a} before its input arrived")
                    if a.kind is ActionKind.BACKWARD and Action(ActionKind.FORWARD, s, mb) not in sim.start:
                        bad(f"rank {r} runs {a} before its forward")
                    inputs[r].discard(a)
                    sim.start[a] = (r, clock[r])
                    clock[r] += 1 if durations is None else durations[a.kind]
                    step = 1 if a.kind is ActionKind.FORWARD else -1
                    in_flight[r] += step if training else 0
                    peak[r] = max(peak[r], in_flight[r])
                    nxt = s + step  # the stage whose input this produces
                    if 0 <= nxt < stages and nxt % pp == r:
                        inputs[r].add(Action(a.kind, nxt, mb))
                pc[r] += 1
                progress = True
    sim.completed = all(pc[r] == len(actions[r]) for r in range(pp))
    sim.deadlock = [f"rank {r} blocked at {actions[r][pc[r]]}" for r in range(pp) if pc[r] < len(actions[r])]
    sim.fifo_violations += [
        f"rank {src} sent {sent} to rank {dst}, never received"
        for (src, dst), pipe in pipes.items()
        for sent, _ in pipe
    ]
    sim.steps = max(clock, default=0)
    return sim


def timetable(sim: Simulation, pp: int, chunks: int = 1) -> str:
    """Draws the simulated F/B per rank and step: the letter, then the micro-batch.

    With chunks > 1, chunk 0 is drawn lower-case (f, b) and later chunks upper-case.
    """
    width = max((len(str(a.microbatch)) + 1 for a in sim.start), default=2)
    grid = [[" " * width] * sim.steps for _ in range(pp)]
    for a, (r, t) in sim.start.items():
        letter = a.kind.value.lower() if chunks > 1 and a.stage < pp else a.kind.value
        grid[r][t] = f"{letter}{a.microbatch}".ljust(width)
    return "\n".join(f"rank {r}  " + " ".join(row).rstrip() for r, row in enumerate(grid))
