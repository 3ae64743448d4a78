"""The trace summary of benchmarks/pipeline_trace_gpu.py on made-up kernels: which stage kernels
ran beside an NCCL kernel, how much slower, and which links' kernels waited."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from pipeline_trace_gpu import overlap  # noqa: E402


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
