"""The trace summary of benchmarks/pipeline_trace_gpu.py on made-up kernels: which stage kernels
ran beside an NCCL kernel, how much slower, and which links' kernels waited."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from pipeline_trace_gpu import overlap, step_end  # noqa: E402


def _kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_stage_kernels_beside_a_waiting_send_are_priced_against_their_time_alone():
    kernels = [
        _kernel("gemm", 0, 100), _kernel("gemm", 100, 100),  # alone: 100 us each
        _kernel("ncclDevKernel_SendRecv", 200, 1000, stream=21),  # a send waiting for its peer
        _kernel("gemm", 200, 125), _kernel("gemm", 325, 125),  # beside it: 25% slower
        _kernel("ncclDevKernel_SendRecv", 1300, 60, stream=25),  # a transfer that did not wait
        _kernel("softmax", 1400, 50),  # seen only alone: not priced
    ]
    got = overlap(kernels)
    assert got["nccl_resident_ms"] == pytest.approx(1.06)
    assert got["compute_beside_nccl_ms"] == pytest.approx(0.25)
    assert got["beside_over_alone"] == pytest.approx(1.25)
    assert got["links"]["21"]["waits"] == 1 and got["links"]["25"]["waits"] == 0
    assert got["step_ms"] == pytest.approx(1.45)


def test_the_step_end_lists_the_outermost_host_ops_and_the_kernels_after_it_began():
    events = [
        {"cat": "user_annotation", "name": "step_end", "ts": 1000, "dur": 500},
        {"cat": "cpu_op", "name": "aten::_foreach_copy_", "ts": 1010, "dur": 100},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 1020, "dur": 50},  # inside the one above: not counted
        {"cat": "cpu_op", "name": "c10d::allreduce_", "ts": 1200, "dur": 40},
        {"cat": "cpu_op", "name": "aten::_foreach_copy_", "ts": 1300, "dur": 60},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 900, "dur": 50},  # before the step's end
        _kernel("gemm", 950, 40),  # before the step's end
        _kernel("ncclDevKernel_AllReduce", 1250, 300), _kernel("copy", 1560, 40),
    ]
    got = step_end(events)
    assert got["host_ms"] == pytest.approx(0.5) and got["to_gpu_end_ms"] == pytest.approx(0.6)
    assert got["host_ops"] == [["aten::_foreach_copy_", 2, pytest.approx(0.16)], ["c10d::allreduce_", 1, pytest.approx(0.04)]]
    assert got["kernels"] == 2 and got["kernel_ms"] == pytest.approx(0.34)
    assert [k[0] for k in got["top_kernels"]] == ["ncclDevKernel_AllReduce", "copy"]
    assert step_end([e for e in events if e["cat"] != "user_annotation"]) == {}
