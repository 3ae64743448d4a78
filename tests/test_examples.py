"""The examples run end to end: 4 CPU processes under torchrun, a few steps each.

Each run is a fresh ``python -m torch.distributed.run --standalone`` (a free port is picked) in its
own process group, killed whole when it overruns, so a hung collective fails the test instead of
hanging CI. GPUs are hidden: the examples take gloo on CPU, as the README's commands do.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # seconds per example; a run takes about 20 s on two cores
SMOKE = ["--epochs", "1", "--max-steps", "3", "--batch-size", "8", "--microbatches", "2"]

CASES = {
    "vit_pp2_tp2": ("vit_cifar10.py", ["--pp", "2", "--tp", "2"], ("timm", "sklearn", "tqdm")),
    "resnet_auto_pp2_dp2": ("resnet_pipeline.py", ["--pp", "2", "--split", "auto"],
                            ("torchvision", "sklearn", "tqdm")),
    "resnet_manual_pp4": ("resnet_pipeline.py", ["--pp", "4", "--split", "manual"],
                          ("torchvision", "sklearn", "tqdm")),
    "hf_vit_pp2_tp2": ("hf_vit.py", ["--pp", "2", "--tp", "2"], ("transformers", "sklearn", "tqdm")),
}


def _run(script: str, args: list[str]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        out, _ = proc.communicate()
        pytest.fail(f"{script} {' '.join(args)} did not finish in {TIMEOUT} s; output ends:\n{out[-4000:]}")
    return proc.returncode, out.replace("\r", "\n")  # tqdm redraws its bar with carriage returns


@pytest.mark.parametrize("case", sorted(CASES))
def test_example_runs(case: str) -> None:
    script, args, _ = CASES[case]
    code, out = _run(script, args + SMOKE)
    tail = out[-4000:]
    assert code == 0, f"{script} exited with {code}; output ends:\n{tail}"
    assert "rank/chunk" in out, f"the partition report is missing:\n{tail}"  # its table header
    epoch = re.findall(r"^epoch 1/1: train loss (\S+), test accuracy (\S+), (\S+) samples/s", out, re.M)
    assert len(epoch) == 1, f"expected one epoch line from the reporting rank:\n{tail}"
    loss, accuracy, throughput = map(float, epoch[0])
    assert loss > 0 and 0 <= accuracy <= 1 and throughput > 0
    final = re.findall(r"^final test accuracy: (\d\.\d{4})$", out, re.M)
    assert len(final) == 1 and float(final[0]) == accuracy, tail
