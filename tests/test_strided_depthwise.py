"""A depthwise convolution with a stride over one is a kind of its own in a calibration table, and
a table without it prices such a kernel as before ([Note: strided depthwise] in
autopipe/partition/calibration.py)."""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from autopipe.partition.calibration import BYTE_LABELS, COMPUTE, Calibration, class_of, compute_class
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import DeviceProfile
from autopipe.partition.kernel_classes import STRIDED, class_fallbacks, term_fallbacks
from autopipe.partition.op_rules import conv_strided
from autopipe.tracer import trace

BASE = DeviceProfile("p", matmul_flops=1e12, vector_flops=1e11, mem_bandwidth=1e11, link_bandwidth=1e9,
                     link_latency=1e-5, op_overhead=5e-6)


def _conv(channels: int, kernel: int, stride: int = 1, groups: int | None = None, channels_last: bool = False):
    conv = nn.Conv2d(channels, channels, kernel, stride, padding=kernel // 2, groups=groups or channels)
    x = torch.randn(8, channels, 32, 32)
    if channels_last:
        conv, x = conv.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    costs = graph_costs(trace(conv, (x,)).gm)
    return next(c for c in costs.values() if c.family in ("dwconv", "conv", "gconv"))


def test_a_strided_depthwise_convolution_has_a_kind_of_its_own():
    plain, strided = _conv(64, 3), _conv(64, 5, stride=2)
    assert class_of(plain).startswith("dwconv/") and compute_class(plain) == "dwconv" + COMPUTE
    assert class_of(strided).startswith("dwconv:strided/")
    assert compute_class(strided) == "dwconv:strided" + COMPUTE
    assert class_of(_conv(64, 3, stride=2, channels_last=True)).startswith("dwconv:strided-nhwc/")
    assert class_of(_conv(64, 3, stride=2, groups=1)).startswith("conv/")  # a dense one is not split
    assert strided.strided and not plain.strided and conv_strided(strided.shape) and not conv_strided("")
    from autopipe.search.costs import scaled
    assert class_of(scaled(strided, 4.0)).startswith("dwconv:strided/")  # at any batch: its shape is dropped there


def test_the_strided_kind_falls_back_to_the_depthwise_one():
    assert class_fallbacks("dwconv:strided-nhwc/16MiB") == (
        "dwconv:strided-nhwc/16MiB", "dwconv:strided/16MiB", "dwconv-nhwc/16MiB", "dwconv/16MiB")
    assert term_fallbacks("dwconv" + STRIDED + "-nhwc" + COMPUTE) == (
        "dwconv:strided-nhwc" + COMPUTE, "dwconv:strided" + COMPUTE, "dwconv-nhwc" + COMPUTE, "dwconv" + COMPUTE)


def _priced(cost, factors: dict, launches: dict | None = None) -> tuple[float, float]:
    table = Calibration("gpu", factors, launch=(0.0, 0.0), host=(0.0, 0.0), launches=launches or {})
    profile = dataclasses.replace(BASE, calibration=table, mode="graphs")
    return profile.node_time(cost), profile.node_time(cost, backward=True)


def test_a_table_without_the_kind_prices_a_strided_kernel_as_before_and_one_with_it_by_its_own():
    strided = _conv(64, 5, stride=2)
    depthwise = {**{f"dwconv/{b}": (2.0, 3.0) for b in BYTE_LABELS}, "dwconv" + COMPUTE: (4.0, 6.0)}
    own = {**{f"dwconv:strided/{b}": (5.0, 7.0) for b in BYTE_LABELS}, "dwconv:strided" + COMPUTE: (1.0, 9.0)}
    old = _priced(strided, depthwise, {"dwconv": (1e-6, 2e-6)})
    new = _priced(strided, {**depthwise, **own}, {"dwconv": (1e-6, 2e-6), "dwconv:strided": (3e-6, 8e-6)})
    for i, (flops, nbytes) in enumerate(((strided.fwd_flops, strided.fwd_bytes), (strided.bwd_flops, strided.bwd_bytes))):
        roofline = max(flops / BASE.matmul_flops, nbytes / BASE.mem_bandwidth)
        vector = flops / BASE.vector_flops
        assert old[i] == pytest.approx((2.0, 3.0)[i] * roofline + (4.0, 6.0)[i] * vector + (1e-6, 2e-6)[i])
        assert new[i] == pytest.approx((5.0, 7.0)[i] * roofline + (1.0, 9.0)[i] * vector + (3e-6, 8e-6)[i])
    # The stride-1 kernels keep the depthwise kind's figures.
    plain = _conv(64, 5)
    assert _priced(plain, {**depthwise, **own}) == pytest.approx(_priced(plain, depthwise))


def test_the_fit_finds_the_strided_kernels_apart_from_the_others():
    """Rows of stride-1 kernels at 2 x bytes and strided ones at 3.5 x bytes, each with arithmetic
    at 5 x: one factor for both (the kind before the split) misses both by about 25%; apart, the
    fit finds each."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import calibrate_device

    rng = np.random.default_rng(5)
    nodes = []
    for k in range(60):
        kind = "dwconv" + (STRIDED if k % 2 else "")
        memory = float(rng.uniform(20e-6, 400e-6))
        arithmetic = memory * float(rng.choice([0.2, 0.6, 1.6]))
        device = (3.5 if k % 2 else 2.0) * memory + 5.0 * arithmetic
        row = {"model": "m", "microbatch": 32, "node": f"n{k}"}
        for d in ("fwd", "bwd"):
            row[d] = {"features": {f"{kind}/4MiB": memory, kind + COMPUTE: arithmetic}, "kernels": 1,
                      "kinds": {kind: 1}, "device": device, "host": 0.0}
        nodes.append(row)
    segs = [{"model": "m", "microbatch": 32, "nodes": [k], "graphs": 2 * nodes[k]["fwd"]["device"],
             "eager": 2 * nodes[k]["fwd"]["device"]} for k in range(60)]
    model = calibrate_device.fit(nodes, segs)
    assert model["factors"]["dwconv/4MiB"][0] == pytest.approx(2.0, rel=0.05)
    assert model["factors"]["dwconv:strided/4MiB"][0] == pytest.approx(3.5, rel=0.05)


def test_a_refit_of_one_kind_keeps_every_other_figure_of_the_table():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import calibrate_device

    strided, other = "x=8,64,32,32 w=64,1,5,5 s=2,2 p=2,2 d=1,1 g=64 nhwc", "x=8,64,32,32 w=64,64,3,3 s=1,1 nhwc"
    committed = {"factors": {"dwconv-nhwc/4MiB": [2.0, 3.0], "conv-nhwc/64": [1.0, 1.1], "dwconv-nhwc:compute": [4.0, 6.0]},
                 "launches": {"dwconv-nhwc": [1e-6, 2e-6], "conv-nhwc": [3e-6, 4e-6]}, "host": [4e-5, 2e-5],
                 "kernels": {strided: [1e-4, 9e-4], other: [2e-4, 3e-4]}, "fit": {"date": "before"}}
    refitted = {"factors": {"dwconv-nhwc/4MiB": [1.5, 2.5], "dwconv:strided-nhwc/4MiB": [3.5, 4.5],
                            "dwconv:strided-nhwc:compute": [1.0, 2.0], "conv-nhwc/64": [9.0, 9.0]},
                "launches": {"dwconv:strided-nhwc": [5e-6, 6e-6], "conv-nhwc": [9e-6, 9e-6]}, "host": [1.0, 1.0],
                "kernels": {other: [5e-4, 5e-4]}, "fit": {"date": "rows", "nodes": 2, "error": {"x": 1}}}
    nodes = [{"shape": strided, "fwd": {"features": {"dwconv:strided-nhwc/4MiB": 1e-5}},
              "bwd": {"features": {"dwconv:strided-nhwc/4MiB": 1e-5}}},
             {"shape": other, "fwd": {"features": {"conv-nhwc/64": 1e-5}}, "bwd": {"features": {"conv-nhwc/64": 1e-5}}}]
    table = calibrate_device.refit_kinds(committed, refitted, nodes, ["dwconv:strided"])
    assert table["factors"] == {"dwconv-nhwc/4MiB": [2.0, 3.0], "conv-nhwc/64": [1.0, 1.1],
                                "dwconv-nhwc:compute": [4.0, 6.0], "dwconv:strided-nhwc/4MiB": [3.5, 4.5],
                                "dwconv:strided-nhwc:compute": [1.0, 2.0]}
    assert table["launches"] == {"dwconv-nhwc": [1e-6, 2e-6], "conv-nhwc": [3e-6, 4e-6],
                                 "dwconv:strided-nhwc": [5e-6, 6e-6]}
    # The strided shape is no longer off its class in the refit: its own price goes; the other stays.
    assert table["kernels"] == {other: [2e-4, 3e-4]} and table["host"] == [4e-5, 2e-5]
    assert table["fit"]["date"] == "before" and table["fit"]["refits"][0]["kinds"] == ["dwconv:strided"]
    assert committed["factors"]["conv-nhwc/64"] == [1.0, 1.1] and "refits" not in committed["fit"]
