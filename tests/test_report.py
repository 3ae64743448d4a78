"""The plan's table, JSON and figure, on a plan made by partition() and on hand-made ones."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from autopipe.errors import ConfigError
from autopipe.stages import plan_stages
from autopipe.partition.plan import CutTensor, PartitionPlan, StagePlan
from autopipe.partition.report import (
    figure_title, format_cut, format_table, human_bytes, human_count, human_flops, plot, time_parts,
)
from autopipe.tracer import trace

STAGE_KEYS = ("index", "cost", "params", "flops", "activation_bytes", "nodes", "cut_bytes")


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), *[Residual(32) for _ in range(6)], nn.Linear(32, 4))


@pytest.fixture(scope="module")
def plan() -> PartitionPlan:
    with torch.device("meta"):
        model = tiny_model()
    traced = trace(model, (torch.empty(8, 16, device="meta"),))
    return plan_stages(traced, 2, 2, microbatches=4, schedule="interleaved_1f1b", model_name="tiny")


def hand_plan(outputs: list[CutTensor]) -> PartitionPlan:
    stages = [
        StagePlan(i, i, 0, [f"a{i}", f"z{i}"], (f"blocks.{i}", f"blocks.{i}.fc"), 86_567_656, 4 << 20, 2.5e12,
                  0.010, 0.001, 0.011, 300 << 20, 2 << 30, [], outputs if i == 0 else [],
                  sum(t.nbytes for t in outputs) if i == 0 else 0)
        for i in range(2)
    ]
    return PartitionPlan("hand", "fx", 2, 1, 1, 4, 32, "cost", "h100", "1f1b", stages, 1.0, 2 * 86_567_656)


def test_table_names_every_stage_and_the_imbalance(plan: PartitionPlan) -> None:
    table = str(plan)
    lines = table.splitlines()
    assert f"imbalance {plan.imbalance:.3f}" in lines[0]
    assert "pp 2 x chunks 2 x tp 1" in lines[0] and "4 micro-batches of size 8" in lines[0]
    for stage in plan.stages:
        row = next(line for line in lines[3:] if line.split()[0] == str(stage.index))
        assert f"{stage.pp_rank}/{stage.chunk}" in row
        assert f"{stage.nodes[0]}..{stage.nodes[-1]}" in row or stage.nodes[0] in row
        assert f"{stage.cost / (sum(s.cost for s in plan.stages) / 4):.3f}x" in row


def test_columns_align() -> None:
    table = format_table(hand_plan([CutTensor("add_3", (32, 197, 768), "float32", 32 * 197 * 768 * 4)]))
    lines = table.splitlines()[1:-1]  # heading, rule, rows
    rule = lines[1]
    gaps = [i for i in range(1, len(rule)) if rule[i] == " " and rule[i - 1] == "-"]
    assert len(gaps) == 13  # fourteen columns
    assert len({len(line) for line in lines}) == 1
    for line in lines:
        assert all(line[g : g + 2] == "  " for g in gaps), line


def test_cut_tensors_listed_then_summarised() -> None:
    one = [CutTensor("add_3", (32, 197, 768), "float32", 32 * 197 * 768 * 4)]
    assert format_cut(one) == "add_3[32,197,768] float32 18.5 MiB"
    many = [CutTensor(f"t{i}", (256, 1024), "bfloat16", 512 << 10) for i in range(3)]
    assert format_cut(many) == "3 tensors, 1.5 MiB"
    assert format_cut([]) == "-"
    assert "add_3[32,197,768] float32 18.5 MiB" in format_table(hand_plan(one))


def test_human_units() -> None:
    assert human_count(86_567_656) == "86.6M"
    assert human_count(1_500_000_000) == "1.5B"
    assert human_flops(3.5e12) == "3.50 TFLOP"
    assert human_flops(123.4e9) == "123 GFLOP"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"


def test_json_has_the_schema_and_round_trips(plan: PartitionPlan) -> None:
    data = json.loads(plan.to_json())
    assert {"schema", "route", "imbalance", "stages"} <= data.keys()
    assert data["route"] == "fx" and data["imbalance"] == pytest.approx(plan.imbalance)
    assert [s["index"] for s in data["stages"]] == [0, 1, 2, 3]
    for stage in data["stages"]:
        assert all(key in stage for key in STAGE_KEYS)
        assert stage["nodes"] and stage["cost"] > 0
    again = PartitionPlan.from_dict(data)
    assert again == plan
    assert str(again) == str(plan)


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_figure_written(plan: PartitionPlan, tmp_path, suffix: str) -> None:
    path = tmp_path / f"plan.{suffix}"
    plot(plan, path)
    data = path.read_bytes()
    assert len(data) > 1000
    assert data.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in data[:2000]


def test_figure_refuses_unknown_extension(plan: PartitionPlan, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"\.png, \.svg or \.pdf"):
        plot(plan, tmp_path / "plan.bmp")


def test_figure_bars_add_up_to_the_stage_cost_the_mean_line_averages() -> None:
    # Link-bound stage 0 (comm 3 ms > compute 1 ms), compute-bound stage 1; both add latency.
    stages = [
        StagePlan(i, i, 0, [f"a{i}"], ("a", "b"), 1, 4, 1.0, compute, comm, cost, 0, 0, [], [], 0)
        for i, (compute, comm, cost) in enumerate([(0.001, 0.003, 0.0031), (0.004, 0.001, 0.0041)])
    ]
    hand = PartitionPlan("hand", "fx", 2, 1, 1, 8, 8, "cost", "h100", "1f1b", stages, 1.1, 2)
    compute, exposed, latency = time_parts(hand)
    assert compute == pytest.approx([1.0, 4.0]) and exposed == pytest.approx([2.0, 0.0])
    assert latency == pytest.approx([0.1, 0.1])
    for s, parts in zip(stages, zip(compute, exposed, latency)):
        assert sum(parts) == pytest.approx(s.cost * 1e3)
    assert figure_title(hand) == ("hand: 2 stages (pp 2 x chunks 1), tp 1, 8 micro-batches of 8, balance cost, "
                                  "h100 profile")
