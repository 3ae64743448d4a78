"""Kernel classes the calibration keeps apart by shape: row norms over short rows ([Note: short
rows] in partition/op_rules.py), learned per-channel scales (op_rules.SCALE), and the launch time
of each GEMM class ([Note: a GEMM class's fixed time] in partition/calibration.py)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopipe.partition.calibration import Calibration, class_of, kernel_kind, launch_key
from autopipe.partition.cost import graph_costs
from autopipe.tracer import trace


def _classes(model: nn.Module, x: torch.Tensor) -> list[str]:
    costs = graph_costs(trace(model, (x,)).gm)
    return [class_of(p) for c in costs.values() for p in (c.parts or (c,)) if p.kind not in ("view", "none", "placeholder")]


class _FunctionalNorm(nn.Module):  # as timm's LayerNorm2d: F.layer_norm over the channels, last
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias)


@pytest.mark.parametrize("norm", [nn.LayerNorm, _FunctionalNorm])
def test_a_row_norm_over_short_rows_is_a_class_of_its_own(norm):
    (short,) = _classes(norm(128), torch.randn(2, 14, 14, 128))
    (long,) = _classes(norm(768), torch.randn(2, 197, 768))
    assert short.startswith("norm:row:short/") and kernel_kind(short) == "norm:row:short"
    assert long.startswith("norm:row/")
    (edge,) = _classes(norm(256), torch.randn(2, 7, 7, 256))
    (over,) = _classes(norm(384), torch.randn(2, 7, 7, 384))
    assert edge.startswith("norm:row:short/") and over.startswith("norm:row/")  # SHORT_ROW: 256 elements or fewer


def test_a_table_fitted_without_short_rows_prices_them_as_the_row_norms_of_their_bytes():
    (short,) = _classes(nn.LayerNorm(128), torch.randn(2, 14, 14, 128))
    plain = short.replace(":short", "")
    older = Calibration("gpu", {plain: (2.0, 3.0)}, launch=(1e-6, 1e-6), host=(0.0, 0.0),
                        launches={"norm:row": (4e-6, 5e-6)}, host_kernels={"norm:row": (2.0, 7.0)})
    assert older.factor(short, False) == 2.0 and older.factor(short, True) == 3.0
    assert older.launch_time(short, True) == 5e-6 and older.launch_host(short, True) == 0.0
    newer = Calibration("gpu", {plain: (2.0, 3.0), short: (5.0, 6.0)}, launch=(1e-6, 1e-6), host=(1.0, 1.0),
                        host_kernels={"norm:row": (2.0, 7.0), "norm:row:short": (3.0, 9.0)})
    assert newer.factor(short, False) == 5.0 and newer.factor(plain, False) == 2.0
    assert newer.launch_host(short, True) == 9.0 and newer.launch_host(plain, True) == 7.0


class _LayerScale(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((channels,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.reshape(1, -1, 1, 1)


class _PositionEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(1, 197, 64))  # 12,608 elements: not a few

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos


class _Gate(nn.Module):  # squeeze-excite: the broadcast operand is an activation
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(64, 64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x * torch.sigmoid(x.mean((2, 3), keepdim=True))


class _FixedScale(nn.Module):  # a buffer gets no gradient: no reduction in backward
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1, 64, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_learned_per_channel_scale_is_a_family_of_its_own():
    x = torch.randn(2, 64, 8, 8)
    (scale,) = [c for c in _classes(_LayerScale(64), x) if c.startswith("elementwise")]
    assert scale.startswith("elementwise:scale/")
    (pos,) = _classes(_PositionEmbedding(), torch.randn(2, 197, 64))
    assert pos.startswith("elementwise:broadcast/")
    table = Calibration("gpu", {"elementwise:broadcast/" + scale.split("/")[1]: (2.0, 4.0)}, launch=(0.0, 0.0),
                        host=(0.0, 0.0))
    assert table.factor(scale, True) == 4.0  # a table fitted before the family priced it as a broadcast
    gate = _classes(_Gate(), x)
    assert gate[-1].startswith("elementwise:broadcast/"), gate
    (fixed,) = _classes(_FixedScale(), x)
    assert fixed.startswith("elementwise/")


def test_a_gemm_keeps_its_launch_time_by_class_and_any_other_kernel_by_kind():
    assert launch_key("gemm/128") == "gemm/128" and launch_key("gemm/1024") == "gemm/1024"
    assert launch_key("conv-nhwc/64") == "conv-nhwc" and launch_key("norm:row:short/1MiB") == "norm:row:short"
    newer = Calibration("gpu", {}, launch=(1e-6, 2e-6), host=(0.0, 0.0),
                        launches={"gemm": (3e-6, 20e-6), "gemm/128": (4e-6, 70e-6), "conv-nhwc": (5e-6, 13e-6)})
    assert newer.launch_time("gemm/128", True) == 70e-6 and newer.launch_time("gemm/128", False) == 4e-6
    assert newer.launch_time("gemm/256", True) == 20e-6  # a class the fit did not key: its kind's
    assert newer.launch_time("conv-nhwc/64", True) == 13e-6 and newer.launch_time("conv/64", True) == 2e-6
    older = Calibration("gpu", {}, launch=(1e-6, 2e-6), host=(0.0, 0.0), launches={"gemm": (3e-6, 20e-6)})
    assert older.launch_time("gemm/128", True) == older.launch_time("gemm/512", True) == 20e-6


def test_the_fit_finds_each_gemm_class_its_own_fixed_time():
    """Rows of two GEMM classes, each the same factor times its roofline plus a fixed time of its
    own (70 us and 16 us): keyed by class, the fit finds both; one time per kind could not."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import calibrate_device

    rng = np.random.default_rng(5)
    nodes = []
    for k in range(60):
        cls, fixed = ("gemm/128", 70e-6) if k % 2 else ("gemm/512", 16e-6)
        roofline = float(rng.uniform(20e-6, 500e-6))
        row = {"model": "m", "microbatch": 32, "node": f"n{k}"}
        for d in ("fwd", "bwd"):
            row[d] = {"features": {cls: roofline}, "kernels": 1, "kinds": {launch_key(cls): 1},
                      "device": 1.5 * roofline + fixed, "host": 0.0}
        nodes.append(row)
    segs = [{"model": "m", "microbatch": 32, "nodes": [k], "graphs": 2 * nodes[k]["fwd"]["device"],
             "eager": 2 * nodes[k]["fwd"]["device"]} for k in range(60)]
    model = calibrate_device.fit(nodes, segs)
    assert model["launches"]["gemm/128"][1] == pytest.approx(70e-6, rel=0.05)
    assert model["launches"]["gemm/512"][1] == pytest.approx(16e-6, rel=0.05)
    assert model["factors"]["gemm/128"][1] == pytest.approx(1.5, rel=0.02)
    measured = np.array([r["bwd"]["device"] for r in nodes])
    by_class = calibrate_device._gpu(nodes, model)[:, 1]
    for r in nodes:
        r["fwd"]["kinds"] = r["bwd"]["kinds"] = {"gemm": 1}
    by_kind = calibrate_device._gpu(nodes, calibrate_device.fit(nodes, segs))[:, 1]
    assert np.max(np.abs(by_class / measured - 1)) < 0.02 < 0.1 < np.max(np.abs(by_kind / measured - 1))
