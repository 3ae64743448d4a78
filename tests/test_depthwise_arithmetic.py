"""A depthwise convolution is priced by its bytes and by its arithmetic on the vector units
([Note: depthwise arithmetic] in autopipe/partition/calibration.py)."""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from autopipe.partition.calibration import (BYTE_LABELS, COMPUTE, Calibration, class_of, compute_class, compute_features,
                                            kernel_features)
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import DeviceProfile
from autopipe.tracer import trace

BASE = DeviceProfile("p", matmul_flops=1e12, vector_flops=1e11, mem_bandwidth=1e11, link_bandwidth=1e9,
                     link_latency=1e-5, op_overhead=5e-6)


def _conv(channels: int, kernel: int, stride: int = 1, groups: int | None = None):
    conv = nn.Conv2d(channels, channels, kernel, stride, padding=kernel // 2, groups=groups or channels)
    costs = graph_costs(trace(conv, (torch.randn(8, channels, 32, 32),)).gm)
    return next(c for c in costs.values() if c.family in ("dwconv", "conv", "gconv"))


def test_a_depthwise_convolution_has_an_arithmetic_term_and_a_dense_one_has_none():
    small, large, dense = _conv(64, 3), _conv(64, 5), _conv(64, 3, groups=1)
    assert compute_class(small) == compute_class(large) == "dwconv" + COMPUTE
    assert compute_class(dense) is None and compute_features(dense, BASE, backward=False) == []
    (term, seconds), = compute_features(large, BASE, backward=True)
    assert term == "dwconv" + COMPUTE and seconds == pytest.approx(large.bwd_flops / BASE.vector_flops)
    # The term is not a kernel: the kernel count the fit's launch times use stays one.
    assert len(kernel_features(large, BASE, backward=True)) == 1
    # Same bytes, 25/9 of the arithmetic.
    assert large.fwd_bytes == pytest.approx(small.fwd_bytes, rel=0.01)
    assert large.fwd_flops / small.fwd_flops == pytest.approx(25 / 9)


def test_a_table_with_the_term_prices_arithmetic_and_one_without_prices_bytes():
    small, large, strided = _conv(64, 3), _conv(64, 5), _conv(64, 3, stride=2)
    assert class_of(large) == class_of(small) != class_of(strided)  # by bytes: the stride's output is smaller
    buckets = {f"dwconv/{label}": (2.0, 3.0) for label in BYTE_LABELS}
    plain = Calibration("gpu", buckets, launch=(0.0, 0.0), host=(0.0, 0.0))
    table = Calibration("gpu", {**buckets, "dwconv" + COMPUTE: (4.0, 6.0)}, launch=(0.0, 0.0), host=(0.0, 0.0))
    without = dataclasses.replace(BASE, calibration=plain, mode="graphs")
    with_term = dataclasses.replace(BASE, calibration=table, mode="graphs")
    for cost in (small, large, strided):
        for backward, i in ((False, 0), (True, 1)):
            flops, nbytes = (cost.bwd_flops, cost.bwd_bytes) if backward else (cost.fwd_flops, cost.fwd_bytes)
            roofline = (2.0, 3.0)[i] * max(flops / BASE.matmul_flops, nbytes / BASE.mem_bandwidth)
            assert without.node_time(cost, backward=backward) == pytest.approx(roofline)
            assert with_term.node_time(cost, backward=backward) == pytest.approx(
                roofline + (4.0, 6.0)[i] * flops / BASE.vector_flops)
    assert with_term.node_time(large) > with_term.node_time(small) > with_term.node_time(strided)
    assert without.node_time(large) == pytest.approx(without.node_time(small), rel=0.01)


def test_the_fit_recovers_the_arithmetic_factor_apart_from_the_bytes_factor():
    """Rows whose device time is 2 x bytes + 5 x arithmetic over a spread of kernel sides: the fit
    finds both factors, which bytes alone could not explain."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import calibrate_device

    rng = np.random.default_rng(3)
    nodes = []
    for k in range(40):
        memory = float(rng.uniform(20e-6, 400e-6))
        arithmetic = memory * float(rng.choice([0.2, 0.6, 1.6]))  # stride 2, 3x3, 5x5
        row = {"model": "m", "microbatch": 32, "node": f"n{k}"}
        for d in ("fwd", "bwd"):
            row[d] = {"features": {"dwconv/4MiB": memory, "dwconv" + COMPUTE: arithmetic}, "kernels": 1,
                      "kinds": {"dwconv": 1}, "device": 2.0 * memory + 5.0 * arithmetic, "host": 0.0}
        nodes.append(row)
    segs = [{"model": "m", "microbatch": 32, "nodes": [k], "graphs": 2 * nodes[k]["fwd"]["device"],
             "eager": 2 * nodes[k]["fwd"]["device"]} for k in range(40)]
    model = calibrate_device.fit(nodes, segs)
    assert model["factors"]["dwconv/4MiB"][0] == pytest.approx(2.0, rel=0.05)
    assert model["factors"]["dwconv" + COMPUTE][0] == pytest.approx(5.0, rel=0.05)
