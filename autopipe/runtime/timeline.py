"""What each pipeline rank did and when: record, gather to rank 0, export, draw, measure.

The driver marks every forward, backward and receive wait; times are host ``perf_counter``
seconds, or CUDA events turned into the same clock (the GPU's own timing of the work).
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from autopipe.errors import ConfigError
from autopipe.runtime.schedule import theoretical_bubble

__all__ = [
    "Event",
    "Timeline",
    "gather",
    "to_chrome_trace",
    "plot_gantt",
    "measured_bubble",
    "busy_seconds",
    "bubble_report",
]

COMPUTE = ("F", "B")  # ActionKind.FORWARD.value, ActionKind.BACKWARD.value
_NAMES = {"F": "forward", "B": "backward"}


class Event(NamedTuple):
    """One span: ``action`` is "F", "B", or the receive waited on ("RECV_ACT", "RECV_GRAD")."""

    rank: int
    action: str
    stage: int
    microbatch: int
    start: float  # seconds
    end: float


class Timeline:
    """Collects :class:`Event` s of one rank: ``mark = begin()`` ... ``end(mark, ...)``.

    With ``cuda_events=True`` a mark is a CUDA event on the current stream, so spans measure
    the GPU's work rather than the host's kernel launches; they are resolved (one
    synchronisation) by :meth:`events`. Host marks cost one ``perf_counter`` call.
    """

    def __init__(self, rank: int, *, cuda_events: bool = False) -> None:
        self.rank = rank
        self.cuda_events = cuda_events
        self._done: list[Event] = []
        self._pending: list[tuple[Any, Any, str, int, int]] = []
        self._base: tuple[Any, float] | None = None  # (CUDA event, perf_counter) of one instant

    def begin(self) -> Any:
        if not self.cuda_events:
            return time.perf_counter()
        if self._base is None:
            torch.cuda.synchronize()
            base = torch.cuda.Event(enable_timing=True)
            base.record()
            self._base = (base, time.perf_counter())
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def end(self, mark: Any, action: str, stage: int, microbatch: int) -> None:
        if not self.cuda_events:
            self._done.append(Event(self.rank, action, stage, microbatch, mark, time.perf_counter()))
            return
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self._pending.append((mark, stop, action, stage, microbatch))

    def events(self) -> list[Event]:
        """Every span recorded so far, in recording order."""
        if self._pending and self._base is not None:  # the base is set by the first begin()
            base, at = self._base
            torch.cuda.synchronize()
            for mark, stop, action, stage, mb in self._pending:
                start = at + base.elapsed_time(mark) / 1e3
                end = at + base.elapsed_time(stop) / 1e3
                self._done.append(Event(self.rank, action, stage, mb, start, end))
            self._pending.clear()
        return list(self._done)

    def clear(self) -> None:
        """Forgets every span (call between steps to measure one step)."""
        self._done.clear()
        self._pending.clear()


def gather(timeline: Timeline, group: dist.ProcessGroup | None = None) -> list[Event] | None:
    """Every rank's events on the group's rank 0 (None on the others); collective.

    Clocks are aligned at a barrier: each rank's times are shifted so that the instant after
    the barrier reads the same everywhere (good to the barrier's skew, tens of microseconds).
    """
    dist.barrier(group=group)
    payload = (time.perf_counter(), timeline.events())
    world = group if group is not None else dist.group.WORLD
    root = dist.get_global_rank(world, 0)
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == root else None
    dist.gather_object(payload, gathered, dst=root, group=group)
    if gathered is None:
        return None
    anchor = gathered[0][0]
    return [
        e._replace(start=e.start + anchor - at, end=e.end + anchor - at)
        for at, events in gathered
        for e in events
    ]


def to_chrome_trace(events: Sequence[Event]) -> dict:
    """Chrome trace JSON (chrome://tracing, Perfetto): one process per rank, "X" spans in us."""
    t0 = min((e.start for e in events), default=0.0)
    trace: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"pipeline rank {r}"}}
        for r in sorted({e.rank for e in events})
    ]
    for e in events:
        kind = _NAMES.get(e.action, "comm")
        name = _NAMES.get(e.action, f"wait {e.action.lower()}")
        trace.append(
            {
                "name": f"{name} s{e.stage} mb{e.microbatch}",
                "cat": kind,
                "ph": "X",
                "pid": e.rank,
                "tid": 0,
                "ts": (e.start - t0) * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "args": {"stage": e.stage, "microbatch": e.microbatch, "action": e.action},
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def plot_gantt(events: Sequence[Event], path: str, *, title: str | None = None) -> None:
    """Draws ranks (y) against time (x): forwards blue, backwards orange, receive waits grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    from matplotlib.patches import Patch

    colours = {"F": "tab:blue", "B": "tab:orange"}
    ranks = sorted({e.rank for e in events})
    t0 = min((e.start for e in events), default=0.0)
    fig = Figure(figsize=(10, 1 + 0.5 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for e in events:
        compute = e.action in colours
        ax.barh(
            e.rank,
            (e.end - e.start) * 1e3,
            left=(e.start - t0) * 1e3,
            height=0.8 if compute else 0.4,
            color=colours.get(e.action, "lightgrey"),
            edgecolor="black" if compute else "none",
            linewidth=0.3,
        )
    legend = (("tab:blue", "forward"), ("tab:orange", "backward"), ("lightgrey", "receive wait"))
    ax.legend(handles=[Patch(color=c, label=label) for c, label in legend], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measured_bubble(events: Sequence[Event]) -> float:
    """``1 - busy / (ranks * makespan)``: busy is forward + backward time summed over ranks,
    the makespan runs from the first compute start to the last compute end."""
    compute = [e for e in events if e.action in COMPUTE]
    if not compute:
        raise ConfigError("no forward or backward recorded; pass timeline=Timeline(rank) to the driver")
    busy = sum(e.end - e.start for e in compute)
    makespan = max(e.end for e in compute) - min(e.start for e in compute)
    ranks = len({e.rank for e in compute})
    return 1.0 - busy / (ranks * makespan) if makespan > 0 else 0.0


def busy_seconds(events: Sequence[Event]) -> dict[int, float]:
    """Each rank's forward + backward seconds (its busy time), by rank."""
    busy: dict[int, float] = {}
    for e in events:
        if e.action in COMPUTE:
            busy[e.rank] = busy.get(e.rank, 0.0) + e.end - e.start
    return dict(sorted(busy.items()))


def bubble_report(events: Sequence[Event], schedule: str, pp: int, m: int, chunks: int) -> str:
    """The measured bubble beside :func:`~autopipe.runtime.schedule.theoretical_bubble`."""
    return (
        f"bubble: measured {measured_bubble(events):.3f}, theoretical "
        f"{theoretical_bubble(schedule, pp, m, chunks):.3f} "
        f"({schedule}, pp={pp}, microbatches={m}, chunks={chunks})"
    )
