"""When a rank posts its transfers, and a model of the streams they run on that proves the
posting order cannot deadlock.

Plain data, no torch and no processes, like :mod:`.schedule`: the driver posts transfers in
:func:`posting_order`, and :func:`stream_deadlock` replays every rank's posting order under the
rules below.

[Note: transfer streams]
On GPUs a transfer does not wait on the host: the driver posts every send and receive at once,
and the backend runs them on its own CUDA stream, after the compute already queued on the rank
(a send's data must be ready, a receive's buffer free). Consumers wait for a receive on the
compute stream. A large NCCL message moves only while both ends run: its send cannot finish
before the matching receive has started, and everything queued behind it on the same stream
waits with it. With every transfer of a rank on one stream (a pipeline group's one
communicator), a send held up by a busy peer blocks the receives queued behind it, and in
1F1B's steady state two neighbours' sends each wait for a receive the other has queued behind
its own send. Grouping each step's transfers into one ``batch_isend_irecv`` hides that for
1F1B, but interleaved schedules with pp = 2 carry activations and gradients both ways between
the same two ranks, and their groups form cycles: on two H200s, interleaved 1F1B with 8
chunks and 4 micro-batches stopped until NCCL's watchdog fired.

So every directed link (sending pipeline rank, receiving pipeline rank) gets a two-rank process
group of its own (:func:`autopipe.runtime.p2p.link_groups`), hence its own communicator and
stream, and carries messages one way only. A send then holds up only later sends on the same
link, which are matched in the same FIFO order anyway. Under the strictest rule (no message
moves before both ends have started it, and no buffering) :func:`stream_deadlock` finds no
deadlock for any schedule here (tests/test_streams.py checks pp 2-8, every chunk count and
micro-batch count up to 16), while the one-stream layout deadlocks already for 1F1B.

Between processes of one host a pipeline's messages go through shared memory instead ([Note:
shared-memory links] in host_links.py): a send is a copy on the copy engines and a receive holds
nothing until its consumer takes it, so nothing below about NCCL kernels holding SMs applies to
them, and their sends are posted right after the compute that made them.

[Note: receive lead]
Receives are posted ``lead`` computes before their consumer. The backend may start a receive
only once the compute queued before it is done, so a receive posted right before its consumer
(lead 0) cannot overlap the compute before that one, and a receive posted one compute ahead
(lead 1) can. But a posted NCCL receive is a kernel that holds its thread blocks, one SM each,
from its start until its data has arrived: with lead 1 it waits beside the whole compute before
its consumer, and the stages run slower. Between GPUs of one host the transfer itself is short
(ViT-L/16's boundary at 64 images, 26 MB, over NVLink), so posting it just in time exposes
little. On two H200s and on two H100s (ViT-L/16, pp=2, interleaved 1F1B, 4 chunks, 4
micro-batches; benchmarks/pipeline_links_gpu.py) lead 0 cut each rank's busy time by 5-6% and
raised samples/s by 3-3.4%, with CUDA graphs and with compiled stages; capping the links'
thread blocks instead (``autopipe.runtime.p2p.LINK_MAX_CTAS``) slowed the transfers more than it
sped the stages. Over gloo, and between hosts, where a transfer moves only while both ends
have posted it, lead 1 keeps the transfers overlapped: :func:`receive_lead`.

[Note: send timing]
A send is posted right after the compute that produced it, and its NCCL kernel then holds its
SMs until the peer posts the matching receive. With receives posted just in time, that wait is
the send's: one step of ViT-L/16 at pp=2 (interleaved 1F1B, 4 chunks, 4 micro-batches, CUDA
graphs), traced on two H200s (benchmarks/pipeline_trace_gpu.py), had on one link of each rank
10 and 14 point-to-point kernels resident over 0.3 ms, 45 and 59 ms of a 177 ms step (up to
8 ms each), with the stages' kernels running beside them (so sends: a receive posted just in
time has no compute beside it) 19-27% slower than alone: about 8-9 ms of compute per rank
and step. A transfer that did not wait took 50-100 us. :func:`send_delays` times every rank's
actions in a simulation (a backward twice its forward) and posts each send behind as many of
its rank's later computes as end one forward before the consumer starts on the peer; sends
keep their order. Measured on two H200s (benchmarks/pipeline_links_gpu.py --send-delays 0,1,
the same configuration), delayed sends cut each rank's busy time by 3-4% with CUDA graphs
(151 -> 146-148 ms) and by 3-6% with compiled stages (122-123 -> 116-118 ms), and raised
samples/s by 1.5% and 2.8%. :func:`delay_sends` applies them where receives are posted just in
time (CUDA devices of one host); over gloo and between hosts a message moves only while both
ends have posted it, so a later send would only start its transfer later.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from autopipe.runtime.schedule import Action, ActionKind, _peer, simulate

__all__ = ["posting_order", "stream_deadlock", "receive_lead", "send_delays", "delay_sends", "RECEIVE_LEAD",
           "DELAY_SENDS"]

RECEIVE_LEAD: int | None = None  # computes by which receives are posted ahead; None: receive_lead's rule
DELAY_SENDS: bool | None = None  # sends posted as late as the schedule allows; None: delay_sends' rule
_DURATIONS = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0}  # the simulation's forward and backward


def receive_lead(cuda: bool, one_host: bool) -> int:
    """How many computes ahead of its consumer a rank posts each receive (see [Note: receive
    lead]): 0 between CUDA devices of one host, 1 otherwise; ``RECEIVE_LEAD`` when set."""
    if RECEIVE_LEAD is not None:
        return RECEIVE_LEAD
    return 0 if cuda and one_host else 1


def delay_sends(cuda: bool, one_host: bool) -> bool:
    """Whether a rank posts each send as late as the schedule allows (see [Note: send timing]):
    between CUDA devices of one host, where receives are posted just in time; ``DELAY_SENDS``
    when set."""
    if DELAY_SENDS is not None:
        return DELAY_SENDS
    return cuda and one_host


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)
_SENDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)


def posting_order(actions: Sequence[Action], lead: int = 1, delays: dict[Action, int] | None = None) -> list[Action]:
    """``actions`` (one rank's, from :func:`~autopipe.runtime.schedule.rank_actions`) with every
    receive moved ``lead`` computes earlier (not before the first) and every send ``delays[send]``
    computes later (none by default; never ahead of an earlier send); everything else, and the
    order of the receives and of the sends among themselves, unchanged."""
    if lead < 0:
        raise ValueError(f"lead must be >= 0, got {lead}")
    total = sum(a.kind in _COMPUTE for a in actions)
    keyed, computes, last_send = [], 0, 0
    for i, a in enumerate(actions):
        if a.kind in _COMPUTE:
            keyed.append((2 * computes + 1, i, a))
            computes += 1
        elif a.kind in _SENDS:
            last_send = max(last_send, 2 * min(computes + (delays or {}).get(a, 0), total))
            keyed.append((last_send, i, a))
        else:
            keyed.append((2 * max(0, computes - lead), i, a))
    return [a for *_, a in sorted(keyed, key=lambda k: k[:2])]


def send_delays(actions: Sequence[Sequence[Action]], pp: int, chunks: int) -> list[dict[Action, int]]:
    """Per rank, how many of its own computes after the producer each send is posted behind, so
    that it starts about one forward before its consumer does on the peer, in a simulation of
    ``actions`` (every rank's) where a backward takes twice its forward; see [Note: send timing]."""
    sim = simulate([list(a) for a in actions], pp, chunks, durations=_DURATIONS)
    delays: list[dict[Action, int]] = []
    for own in actions:
        computes = [a for a in own if a.kind in _COMPUTE]
        position = {a: i for i, a in enumerate(computes)}
        mine: dict[Action, int] = {}
        for a in own:
            if a.kind not in _SENDS:
                continue
            forward = a.kind is ActionKind.SEND_ACT
            kind = ActionKind.FORWARD if forward else ActionKind.BACKWARD
            consumer = Action(kind, a.stage + 1 if forward else a.stage - 1, a.microbatch)
            due = sim.start[consumer][1] - _DURATIONS[ActionKind.FORWARD]
            later = computes[position[Action(kind, a.stage, a.microbatch)] + 1:]
            ended = [sim.start[c][1] + _DURATIONS[c.kind] <= due for c in later]
            mine[a] = ended.index(False) if False in ended else len(ended)
        delays.append(mine)
    return delays


def stream_deadlock(orders: Sequence[Sequence[Action]], pp: int, *, one_stream: bool = False) -> list[str]:
    """Replays every rank's posting order on streams; returns the blocked actions (none: no
    deadlock). See [Note: transfer streams] for the rules.

    Per rank: computes run in order, each after the receive it consumes; a transfer runs on its
    link's stream (or, with ``one_stream``, on one stream for all of the rank's transfers), in
    posting order, after every compute posted before it. The k-th send on a link finishes
    together with the k-th receive, once both have started.
    """
    stream_of: dict[tuple[int, int], tuple] = {}
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    consumer_recv: dict[tuple[int, ActionKind, int, int], tuple[int, int]] = {}
    queued: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # link -> sends in order
    for r, order in enumerate(orders):
        for i, a in enumerate(order):
            if a.kind in _COMPUTE:
                stream_of[(r, i)] = ("compute", r)
                continue
            link = (r, _peer(a, pp)) if a.kind in _SENDS else (_peer(a, pp), r)
            stream_of[(r, i)] = ("transfers", r) if one_stream else ("link", r, link)
            if a.kind in _SENDS:
                queued[link].append((r, i))
            else:
                kind = ActionKind.FORWARD if a.kind is ActionKind.RECV_ACT else ActionKind.BACKWARD
                consumer_recv[(r, kind, a.stage, a.microbatch)] = (r, i)
    taken: dict[tuple[int, int], int] = defaultdict(int)
    for r, order in enumerate(orders):
        for i, a in enumerate(order):
            if a.kind not in _COMPUTE and a.kind not in _SENDS:
                link = (_peer(a, pp), r)
                if taken[link] < len(queued[link]):
                    send = queued[link][taken[link]]
                    partner[(r, i)], partner[send] = send, (r, i)
                taken[link] += 1

    # Before each op: the op queued before it on its stream, and (transfers) the computes before it.
    before: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, order in enumerate(orders):
        last: dict[tuple, tuple[int, int]] = {}
        last_compute = None
        for i, a in enumerate(order):
            op, stream = (r, i), stream_of[(r, i)]
            deps = [last[stream]] if stream in last else []
            if a.kind in _COMPUTE:
                recv = consumer_recv.get((r, a.kind, a.stage, a.microbatch))
                deps += [recv] if recv is not None else []
                last_compute = op
            elif last_compute is not None:
                deps.append(last_compute)
            before[op] = deps
            last[stream] = op

    waiting = {op: len(deps) for op, deps in before.items()}
    dependents: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for op, deps in before.items():
        for d in deps:
            dependents[d].append(op)
    started: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    ready = [op for op, n in waiting.items() if n == 0]
    while ready:
        op = ready.pop()
        started.add(op)
        r, i = op
        finished = [op] if orders[r][i].kind in _COMPUTE else \
            [op, partner[op]] if partner.get(op) in started else []
        for f in finished:
            done.add(f)
            for nxt in dependents[f]:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready.append(nxt)
    blocked = []
    for r, order in enumerate(orders):
        first = next((i for i, _ in enumerate(order) if (r, i) not in done), None)
        if first is not None:
            blocked.append(f"rank {r} blocked at {order[first]}")
    return blocked
