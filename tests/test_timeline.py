"""Timelines: recording, Chrome trace export, the Gantt chart, and the measured bubble."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopipe.errors import ConfigError
from autopipe.runtime import PipelineDriver
from autopipe.runtime.schedule import ActionKind, all_rank_actions, theoretical_bubble
from autopipe.runtime.timeline import (
    Event,
    Timeline,
    bubble_report,
    busy_seconds,
    gather,
    measured_bubble,
    plot_gantt,
    to_chrome_trace,
)
from tests.distributed import run_distributed
from tests.test_driver import Net, batch, boundary_specs, loss_fn, make_stages, postprocess

__all__: list[str] = []

# Two ranks, one micro-batch each way: F0 | F1 B1 | B0, so half of the 2 x 4 s is idle.
EVENTS = [
    Event(0, "F", 0, 0, 10.0, 11.0),
    Event(1, "RECV_ACT", 1, 0, 10.0, 11.0),
    Event(1, "F", 1, 0, 11.0, 12.0),
    Event(1, "B", 1, 0, 12.0, 13.0),
    Event(0, "RECV_GRAD", 0, 0, 11.0, 13.0),
    Event(0, "B", 0, 0, 13.0, 14.0),
]


def test_timeline_records_and_clears() -> None:
    tl = Timeline(3)
    mark = tl.begin()
    tl.end(mark, "F", 6, 2)
    (e,) = tl.events()
    assert (e.rank, e.action, e.stage, e.microbatch) == (3, "F", 6, 2) and e.end >= e.start
    tl.clear()
    assert tl.events() == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_timeline_with_cuda_events() -> None:
    tl = Timeline(0, cuda_events=True)
    mark = tl.begin()
    torch.randn(512, 512, device="cuda").matmul(torch.randn(512, 512, device="cuda"))
    tl.end(mark, "F", 0, 0)
    (e,) = tl.events()
    assert e.end > e.start


def test_chrome_trace_has_one_pid_per_rank_and_named_spans() -> None:
    trace = to_chrome_trace(EVENTS)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(EVENTS)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert [e["name"] for e in spans[:3]] == ["forward s0 mb0", "wait recv_act s1 mb0", "forward s1 mb0"]
    assert [e["cat"] for e in spans] == ["forward", "comm", "forward", "backward", "comm", "backward"]
    assert spans[0]["ts"] == 0 and spans[-1]["ts"] == pytest.approx(3e6) and spans[-1]["dur"] == pytest.approx(1e6)
    json.dumps(trace)


def test_measured_bubble_counts_only_compute() -> None:
    assert measured_bubble(EVENTS) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="no forward or backward recorded"):
        measured_bubble([e for e in EVENTS if e.action.startswith("RECV")])


def test_busy_seconds_sum_each_ranks_forward_and_backward() -> None:
    assert busy_seconds(EVENTS) == {0: pytest.approx(2.0), 1: pytest.approx(2.0)}
    assert busy_seconds([e for e in EVENTS if e.action.startswith("RECV")]) == {}


def test_gantt_png_is_written(tmp_path: Path) -> None:
    path = tmp_path / "gantt.png"
    plot_gantt(EVENTS, str(path), title="two ranks")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def timed_pipeline(rank: int, pp: int, schedule: str, m: int) -> list[Event] | None:
    torch.manual_seed(0)
    stages = {s: st for s, st in enumerate(make_stages(Net(), pp)) if s == rank}
    timeline = Timeline(rank)
    driver = PipelineDriver(
        stages, boundary_specs(pp), pp=pp, chunks=1, pp_rank=rank, pp_group=None, schedule=schedule,
        microbatches=m, loss_fn=loss_fn, postprocess=postprocess, device="cpu", timeline=timeline,
    )
    x, ids, y = batch(0, m)
    driver.train_step((x, ids), {"y": y})  # warm-up
    timeline.clear()
    driver.train_step((x, ids), {"y": y})
    return gather(timeline)


def test_pipeline_timeline(tmp_path: Path) -> None:
    pp, schedule, m = 2, "1f1b", 4
    events = run_distributed(timed_pipeline, pp, schedule, m)[0]
    assert events is not None
    trace = to_chrome_trace(events)
    computes = [e for e in trace["traceEvents"] if e.get("cat") in ("forward", "backward")]
    actions = [a for acts in all_rank_actions(schedule, pp, m, 1) for a in acts]
    assert len(computes) == sum(a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD) for a in actions)
    assert {e["pid"] for e in computes} == {0, 1}
    plot_gantt(events, str(tmp_path / "pipeline.png"))
    assert (tmp_path / "pipeline.png").stat().st_size > 0
    bubble, theory = measured_bubble(events), theoretical_bubble(schedule, pp, m, 1)
    assert 0.0 <= bubble <= 1.0
    assert bubble >= 0.5 * theory, bubble_report(events, schedule, pp, m, 1)
    assert bubble_report(events, schedule, pp, m, 1).endswith("theoretical 0.200 (1f1b, pp=2, microbatches=4, chunks=1)")
