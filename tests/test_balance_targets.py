"""benchmarks/balance_targets.py: each case's last committed timings against the balance targets."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import balance_targets as bt  # noqa: E402

COMMAND = "benchmarks/measured_balance.py --models resnet50 --channels-last --out x.json"


def _run(folder, name: str, rows: list[dict], command: str = COMMAND, channels_last: bool = True,
         device: str = "NVIDIA H200") -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump({"device": device, "torch": "2.11", "channels_last": channels_last, "command": command,
                   "date": name[:10], "rows": rows}, f)
    return path


def _row(imbalance: float, plans: str = "measured", calibration: float = 0.02, mb: int = 32, pp: int = 8,
         mode: str = "graphs") -> dict:
    timed = {"measured_imbalance": imbalance}
    if plans == "measured":
        timed["calibration_error"] = calibration
    return {"model": "resnet50", "microbatch": mb, "mode": mode, "pp": pp, "chunks": 1, plans: timed}


def _case(timings: dict, plans: str = "measured", mb: int = 32, layout: str = "8x1", mode: str = "graphs"):
    key = ("h200", plans, mode, "resnet50", mb, layout)
    return bt.Case(*key, timings.get(key, []))


def test_the_last_commit_that_timed_a_case_decides(tmp_path):
    old = _run(tmp_path, "2026-11-26-a.json", [_row(1.09)])
    new = _run(tmp_path, "2026-11-28-b.json", [_row(1.03)])
    timings = bt.collect([old, new], {"2026-11-26-a.json": 100.0, "2026-11-28-b.json": 200.0})
    case = _case(timings)
    assert [t.imbalance for t in case.timings] == [1.03]
    assert case.holds and case.cell() == "1.030"
    # The other order of commits: the older file is the newer result.
    timings = bt.collect([old, new], {"2026-11-26-a.json": 300.0, "2026-11-28-b.json": 200.0})
    assert not _case(timings).holds and _case(timings).cell() == "1.090*"


def test_every_timing_of_the_last_commit_must_hold(tmp_path):
    a = _run(tmp_path, "2026-11-28-a.json", [_row(1.03)])
    b = _run(tmp_path, "2026-11-28-b.json", [_row(1.07)])
    case = _case(bt.collect([a, b], {"2026-11-28-a.json": 5.0, "2026-11-28-b.json": 5.0}))
    assert not case.holds
    assert case.cell() == "1.030-1.070*"


def test_the_profile_must_be_within_ten_percent_and_analytic_plans_within_1_15(tmp_path):
    path = _run(tmp_path, "2026-11-28-a.json", [_row(1.02, calibration=0.12, pp=4), _row(1.12, plans="analytic", pp=4),
                                                _row(1.16, plans="analytic", mb=128, pp=4)])
    timings = bt.collect([path])
    assert not _case(timings, layout="4x1").holds  # balanced, but its profile 12% off
    assert _case(timings, plans="analytic", layout="4x1").holds
    assert not _case(timings, plans="analytic", mb=128, layout="4x1").holds


def test_runs_off_the_default_options_and_other_files_are_left_out(tmp_path):
    paths = [
        _run(tmp_path, "2026-11-28-a.json", [_row(1.20)], command=COMMAND + " --split-convolutions"),
        _run(tmp_path, "2026-11-28-b.json", [_row(1.20)], channels_last=False),
        _run(tmp_path, "2026-11-28-c.json", [_row(1.20)], command="benchmarks/analytic_balance.py"),
        _run(tmp_path, "2026-11-28-d.json", [_row(1.01)]),
    ]
    (tmp_path / "not-json.json").write_text("{")
    timings = bt.collect(paths + [str(tmp_path / "not-json.json")])
    assert [t.source for t in _case(timings).timings] == ["2026-11-28-d.json"]


def test_an_untimed_case_is_a_miss_and_the_script_says_which(tmp_path, capsys):
    _run(tmp_path, "2026-11-28-a.json", [_row(1.01)])
    every = bt.cases(bt.collect([str(tmp_path / "2026-11-28-a.json")]), ["h200"])
    assert len(every) == 2 * 2 * len(bt.MODELS) * 2 * 3
    assert sum(c.holds for c in every) == 1
    assert all(c.cell() == "-" for c in every if not c.timings)
    out = tmp_path / "cases.json"
    assert bt.main(["--results", str(tmp_path), "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "h200, measured plans, CUDA graphs: 1 of 42 within 1.05" in printed
    assert "MISS h200 measured eager ResNet-50 32 images 4x1: never timed" in printed
    kept = json.loads(out.read_text())
    assert [c["holds"] for c in kept].count(True) == 1
    assert bt.main(["--results", str(tmp_path), "--device", "h200", "--commands"]) == 1
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python ")]
    assert len(runs) == len(bt.MODELS) * 2 * 2 * 2  # per model, images, mode and plans
    assert ("python benchmarks/measured_balance.py --models resnet50 --microbatch 32 --modes graphs --plans measured "
            "--layouts 4x1,4x2 --channels-last --out RESULTS.json") in runs  # its 8x1 holds


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb")])
def test_device_names_become_profile_keys(name, key):
    assert bt.device_key(name) == key
