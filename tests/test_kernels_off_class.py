"""A kernel whose measured time is far from its class's price is priced by its exact shape
([Note: kernels off their class] in autopipe/partition/calibration.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.partition.calibration import BYTE_LABELS, Calibration
from autopipe.partition.cost import graph_costs
from autopipe.partition.device import DeviceProfile
from autopipe.tracer import trace

BASE = DeviceProfile("p", matmul_flops=1e12, vector_flops=1e11, mem_bandwidth=1e11, link_bandwidth=1e9,
                     link_latency=1e-5, op_overhead=5e-6)


def _conv_cost(conv: nn.Module, x: torch.Tensor):
    costs = graph_costs(trace(conv, (x,)).gm)
    return next(c for c in costs.values() if c.family in ("dwconv", "conv", "gconv"))


def test_a_convolution_names_its_exact_shape():
    x = torch.randn(4, 16, 14, 14)
    base = _conv_cost(nn.Conv2d(16, 16, 5, 2, padding=2, groups=16), x)
    assert base.shape == "x=4,16,14,14 w=16,1,5,5 s=2,2 p=2,2 d=1,1 g=16 nchw"
    others = [
        _conv_cost(nn.Conv2d(16, 16, 5, 1, padding=2, groups=16), x),  # stride
        _conv_cost(nn.Conv2d(16, 16, 5, 2, padding=2, groups=16), torch.randn(8, 16, 14, 14)),  # batch
        _conv_cost(nn.Conv2d(16, 16, 5, 2, padding=2, groups=4), x),  # groups
        _conv_cost(nn.Conv2d(16, 16, 5, 2, padding=2, groups=16).to(memory_format=torch.channels_last),
                   x.contiguous(memory_format=torch.channels_last)),  # layout
    ]
    assert len({base.shape, *(c.shape for c in others)}) == 5
    assert others[3].shape.endswith(" nhwc")
    # A functional convolution names the same geometry from its arguments.
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 1, 5, 5))

        def forward(self, x):
            return nn.functional.conv2d(x, self.weight, None, 2, 2, 1, 16)

    assert _conv_cost(Functional(), x).shape == base.shape


def test_a_table_prices_a_known_shape_by_its_time_and_others_by_their_class():
    x = torch.randn(4, 16, 14, 14)
    slow = _conv_cost(nn.Conv2d(16, 16, 5, 2, padding=2, groups=16), x)
    other = _conv_cost(nn.Conv2d(16, 16, 5, 1, padding=2, groups=16), x)
    buckets = {f"dwconv/{label}": (2.0, 3.0) for label in BYTE_LABELS}
    table = Calibration("gpu", buckets, launch=(0.0, 0.0), host=(0.0, 0.0), kernels={slow.shape: (0.0, 900e-6)})
    plain = Calibration("gpu", buckets, launch=(0.0, 0.0), host=(0.0, 0.0))
    priced, by_class = (dataclasses.replace(BASE, calibration=t, mode="graphs") for t in (table, plain))
    assert priced.node_time(slow, backward=True) == pytest.approx(900e-6)
    assert priced.node_time(slow, backward=False) == pytest.approx(by_class.node_time(slow, backward=False))
    for backward in (False, True):
        assert priced.node_time(other, backward=backward) == pytest.approx(by_class.node_time(other, backward=backward))
    # The table carries them through its JSON, and refuses a negative time.
    data = json.loads(table.to_json())
    assert Calibration.from_dict(data).kernels == {slow.shape: (0.0, 900e-6)}
    with pytest.raises(ConfigError, match="kernel seconds"):
        Calibration.from_dict(dict(data, kernels={slow.shape: [0.0, -1.0]}))


def _row(node: int, memory: float, device: tuple[float, float], shape: str = "", model: str = "m") -> dict:
    row = {"model": model, "microbatch": 32, "node": f"n{node}", "shape": shape}
    for d, seconds in zip(("fwd", "bwd"), device):
        row[d] = {"features": {"dwconv/4MiB": memory}, "kernels": 1, "kinds": {"dwconv": 1}, "device": seconds,
                  "host": 0.0}
    return row


def test_the_fit_keeps_a_shape_far_off_its_class_and_fits_the_class_without_it():
    """Rows at 2 x their bytes, one shape's backward (in two models) at 20 x: the fit keeps that
    shape's measured time, and the class factor stays 2."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import calibrate_device

    rng = np.random.default_rng(5)
    nodes = [_row(k, m := float(rng.uniform(50e-6, 200e-6)), (2 * m, 2 * m), f"s{k}") for k in range(30)]
    nodes += [_row(30 + k, 60e-6, (120e-6, 1.2e-3), "slow", model=f"m{k}") for k in range(2)]
    segs = [{"model": r["model"], "microbatch": 32, "nodes": [k], "graphs": 2.2 * (r["fwd"]["device"] + r["bwd"]["device"]),
             "eager": 2.2 * (r["fwd"]["device"] + r["bwd"]["device"])} for k, r in enumerate(nodes)]
    model = calibrate_device.fit(nodes, segs)
    assert model["kernels"] == {"slow": (0.0, pytest.approx(1.2e-3))}
    assert model["factors"]["dwconv/4MiB"][1] == pytest.approx(2.0, rel=0.05)
    gpu = calibrate_device._gpu(nodes, model)
    assert gpu[30, 1] == pytest.approx(1.2e-3) and gpu[30, 0] == pytest.approx(120e-6, rel=0.05)
    # Without the shapes (rows made before shapes were kept), the class soaks part of it up and
    # misprices the others.
    plain = calibrate_device.fit([dict(r, shape="") for r in nodes], segs)
    assert plain["kernels"] == {}
    measured = np.array([r["bwd"]["device"] for r in nodes[:30]])
    err = [float(np.median(np.abs(calibrate_device._gpu(nodes[:30], m)[:, 1] - measured) / measured))
           for m in (model, plain)]
    assert err[0] < 0.01 and err[1] > 0.02
    assert calibrate_device._gpu(nodes, plain)[30, 1] < 0.5e-3  # and the slow kernel at under half its time
    # A kernel at 8x its price but under OFF_CLASS_SECONDS beyond it stays with its class.
    small = [_row(40, 5e-6, (10e-6, 80e-6), "small")]
    assert calibrate_device._off_class(small, model) == {}
    assert calibrate_device._off_class([_row(40, 5e-6, (10e-6, 200e-6), "small")], model) == {
        "small": (0.0, pytest.approx(200e-6))}


def test_a_cost_at_another_batch_or_sharded_has_no_shape_to_be_priced_by():
    """The search prices nodes at other micro-batch sizes and tp shards by scaling one trace's
    costs; a scaled kernel is not the kernel whose time the table kept."""
    from autopipe.search.costs import scaled

    cost = _conv_cost(nn.Conv2d(16, 16, 5, 2, padding=2, groups=16), torch.randn(4, 16, 14, 14))
    assert scaled(cost, 1.0).shape == cost.shape != ""
    assert scaled(cost, 4.0).shape == scaled(cost, 0.5).shape == ""
    composite = dataclasses.replace(cost, kind="composite", parts=(cost, cost))
    assert all(p.shape == "" for p in scaled(composite, 2.0).parts) and scaled(composite, 2.0).shape == ""


def test_the_search_prices_every_kernel_as_the_planner_does():
    """The layout search prices all nodes in one numpy pass; it must agree with
    ``DeviceProfile.node_time``, the depthwise arithmetic term and the kept shapes included."""
    from autopipe.partition.device import PROFILES
    from autopipe.search.costs import GraphCosts, scaled

    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 5, 2, padding=2, groups=16), nn.ReLU(),
                          nn.Conv2d(16, 8, 1))
    traced = trace(model, (torch.randn(2, 3, 16, 16),))
    dw = next(c for c in graph_costs(traced.gm).values() if c.family == "dwconv")
    base = PROFILES["h100"]
    table = dataclasses.replace(base.calibration, kernels={dw.shape: (0.0, 900e-6)})
    graph = GraphCosts(traced, 2)
    where = [i for i, c in enumerate(graph.costs) if c.family == "dwconv"]
    for mode in ("graphs", "eager", "compiled"):
        profile = dataclasses.replace(base, calibration=table).with_mode(mode)
        for size in (2, 8):
            fwd, bwd = graph.node_times(size, profile)
            assert fwd.tolist() == pytest.approx([profile.node_time(scaled(c, size / 2)) for c in graph.costs],
                                                 rel=1e-9, abs=1e-15)
            assert bwd.tolist() == pytest.approx([profile.node_time(scaled(c, size / 2), backward=True)
                                                  for c in graph.costs], rel=1e-9, abs=1e-15)
        # At the traced size the kept kernel's time, at another its class's price.
        _, bwd2 = graph.node_times(2, profile)
        _, bwd8 = graph.node_times(8, profile)
        assert bwd2[where[0]] >= 900e-6 and bwd8[where[0]] < 900e-6
