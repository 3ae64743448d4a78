"""``autopipe report``: exit codes, files written, and one clean line for a user's mistake."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import autopipe
from autopipe.cli import main
from autopipe.partition.plan import PartitionPlan
from tests.distributed import run_distributed


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class TinyNet(nn.Module):
    """A 3x8x8 image classifier of eight residual blocks."""

    image_size = 8

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 4, stride=4)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(8)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.blocks(x).mean(1))


def tiny_net() -> nn.Module:
    return TinyNet()


TINY = f"{__name__}:tiny_net"


def test_report_prints_and_writes(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, figure = tmp_path / "plan.json", tmp_path / "plan.png"
    code = main(["report", TINY, "--pp", "2", "--chunks", "2", "--batch", "32", "--microbatches", "4",
                 "--json", str(out_json), "--figure", str(figure)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "pp 2 x chunks 2 x tp 1" in printed and "4 micro-batches of size 8" in printed
    assert "schedule interleaved_1f1b" in printed
    plan = PartitionPlan.from_dict(json.loads(out_json.read_text()))
    assert plan.num_stages == 4 and plan.microbatch_size == 8 and plan.model == TINY
    assert figure.stat().st_size > 1000


def test_report_split_points_and_balance_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", TINY, "--pp", "2", "--batch", "4", "--split-points", "blocks.4"]) == 0
    assert "balance split_points:blocks.4" in capsys.readouterr().out
    assert main(["report", TINY, "--pp", "4", "--batch", "4", "--balance", "params", "--device", "h200"]) == 0
    assert "balance params, device h200" in capsys.readouterr().out


def test_report_with_a_stage_scale(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = {}
    for scale in (None, "1.5,1", "1,1.5"):
        out = tmp_path / f"plan-{scale}.json"
        extra = [] if scale is None else ["--stage-scale", scale]
        assert main(["report", TINY, "--pp", "2", "--batch", "4", "--json", str(out), *extra]) == 0
        plans[scale] = PartitionPlan.from_dict(json.loads(out.read_text()))
    assert "balance cost:stage_scale=1.5,1" in capsys.readouterr().out
    first = {k: len(p.stages[0].nodes) for k, p in plans.items()}
    assert first["1.5,1"] < first[None] < first["1,1.5"]
    assert main(["report", TINY, "--pp", "2", "--batch", "4", "--stage-scale", "1.5"]) == 2  # one per stage
    assert main(["report", TINY, "--pp", "2", "--batch", "4", "--stage-scale", "a,b"]) == 2
    assert "--stage-scale 'a,b'" in capsys.readouterr().err


def test_report_timm_model_with_image_size(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["report", "timm:vit_tiny_patch16_224", "--image-size", "32", "--pp", "2", "--batch", "8",
                 "--microbatches", "2"])
    assert code == 0
    assert "vit_tiny_patch16_224" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "timm:vit_tiny_patch16_22", "--pp", "2", "--batch", "8"],
         "unknown timm model 'vit_tiny_patch16_22'; close matches: vit_tiny_patch16_224"),
        (["report", TINY, "--pp", "2", "--batch", "30", "--microbatches", "4"],
         "batch 30 does not split into 4 equal micro-batches (30 % 4 = 2)"),
        (["report", TINY, "--pp", "2", "--chunks", "2", "--batch", "8", "--schedule", "1f1b"],
         "1f1b runs one model chunk per rank, got chunks=2"),
        (["report", TINY, "--pp", "2", "--batch", "8", "--split-points", "blocks.4,blocks.6"],
         "--split-points names 2 modules but pp 2 x chunks 1 = 2 stages need 1"),
        (["report", TINY, "--pp", "2", "--batch", "8", "--split-points", "blocks.44"],
         "split point 'blocks.44' names no module"),
        (["report", TINY, "--pp", "2", "--batch", "8", "--device", "tpu"], "unknown device profile 'tpu'"),
    ],
)
def test_user_errors_exit_2_with_one_clean_line(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("autopipe: error: ") and message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", TINY, "--batch", "8"]) == 2  # --pp missing
    assert "--pp" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_python_dash_m() -> None:
    result = subprocess.run([sys.executable, "-m", "autopipe", "report", "no_such_package:build", "--pp", "2",
                             "--batch", "8"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("autopipe: error: model spec 'no_such_package:build': cannot import")
    assert "Traceback" not in result.stderr


def slow_net() -> nn.Module:
    raise AssertionError("the model must not be built: the output path is checked first")


@pytest.mark.parametrize("option", ["--figure", "--json"])
def test_unwritable_output_is_refused_before_planning(option: str, tmp_path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_folder" / "plan.png"
    assert main(["report", f"{__name__}:slow_net", "--pp", "2", "--batch", "8", option, str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autopipe: error: {option} ") and "does not exist" in err
    assert main(["report", f"{__name__}:slow_net", "--pp", "2", "--batch", "8", option, str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    if option == "--figure":
        assert main(["report", f"{__name__}:slow_net", "--pp", "2", "--batch", "8", option,
                     str(tmp_path / "plan.bmp")]) == 2
        assert ".png, .svg or .pdf" in capsys.readouterr().err


def test_an_internal_error_is_one_line_unless_traceback_is_asked(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import autopipe.cli

    def bug(*args, **kwargs):
        raise KeyError("stage 7")

    monkeypatch.setattr(autopipe.cli, "plan_model", bug)
    argv = ["report", TINY, "--pp", "2", "--batch", "8"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopipe: internal error: KeyError: 'stage 7'") and "--traceback" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(KeyError):
        main(argv + ["--traceback"])


def test_help_describes_model_and_image_size_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "MODEL the model: timm:NAME, torchvision:NAME, hf:CLASS or package.module:factory" in text
    assert "input height and width (default: the model's own" in text


def _parallelized_plan(rank: int, world: int, microbatch: int) -> dict:
    from tests.models import timm_vit

    torch.manual_seed(0)
    pm = autopipe.parallelize(timm_vit(), (torch.randn(microbatch, 3, 32, 32),), pp=2, tp=2, microbatches=2,
                              device="cpu", loss_fn=torch.nn.functional.cross_entropy)
    return json.loads(pm.plan.to_json())  # as the report writes it (tuples as lists)


def test_report_gives_the_plan_parallelize_runs(tmp_path) -> None:
    """One front door: `autopipe report` prints the plan that parallelize runs for the same
    arguments (pp x tp, micro-batches, the CPU's profile), tp rank 0's graph planned by both."""
    out = tmp_path / "plan.json"
    assert main(["report", "tests.models:timm_vit", "--pp", "2", "--tp", "2", "--batch", "8",
                 "--microbatches", "2", "--device", "cpu", "--json", str(out)]) == 0
    reported = json.loads(out.read_text())
    ran = run_distributed(_parallelized_plan, 4, 4, timeout=300)
    assert all(r == ran[0] for r in ran)  # every rank runs one plan
    # The model's label differs (the spec against the class name); the measured-only fields are empty.
    assert reported.pop("model") == "tests.models:timm_vit" and ran[0].pop("model") == "VisionTransformer"
    assert reported["tp"] == 2 and len(reported["stages"]) == 2 and reported["refinement"] == []
    assert reported == ran[0]


def test_report_and_plan_price_eager_stages_at_a_host_pace_read_elsewhere(tmp_path, capsys) -> None:
    from autopipe.partition.device import PROFILES

    fitted = PROFILES["h200"].calibration.host_probe * 1e6
    plans = {}
    for pace in (None, fitted, 3 * fitted):
        out = tmp_path / f"plan-{pace}.json"
        extra = [] if pace is None else ["--host-pace", str(pace)]
        assert main(["report", TINY, "--pp", "2", "--batch", "8", "--device", "h200", "--mode", "eager",
                     "--json", str(out), *extra]) == 0
        plans[pace] = json.loads(out.read_text())
    assert plans[3 * fitted]["cost_source"]["host_probe_us"] == pytest.approx(3 * fitted)
    time = {k: sum(s["compute_time"] for s in p["stages"]) for k, p in plans.items()}
    assert time[None] == pytest.approx(time[fitted]) and time[3 * fitted] > 1.5 * time[None]  # a host-bound model
    capsys.readouterr()
    assert main(["report", TINY, "--pp", "2", "--batch", "8", "--device", "h200", "--host-pace", "-3"]) == 2
    assert "--host-pace -3.0: give the microseconds `autopipe pace` printed" in capsys.readouterr().err
    assert main(["plan", TINY, "--gpus", "2", "--batch", "8", "--device", "h100", "--host-pace", "200"]) == 2
    assert "the h100 device table records no host pace to scale from" in capsys.readouterr().err


def test_pace_reads_the_host_against_a_gpu_and_refuses_without_one(capsys) -> None:
    code = main(["pace"])
    captured = capsys.readouterr()
    if torch.cuda.is_available():
        assert code == 0 and "host pace" in captured.out and "--host-pace" in captured.out
    else:
        assert code == 2 and "this machine has none" in captured.err
    assert main(["pace", "--device", "cpu"]) == 2
    assert "the host's pace is read against a GPU's launches" in capsys.readouterr().err
