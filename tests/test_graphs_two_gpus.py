"""Pipelines of CUDA-graph stages over two GPUs equal one GPU (tests/graph_pipeline_worker.py):
the slots' static tensors as the stages' boundary ([Note: graph slots as boundaries]), through
shared-memory links and through NCCL, under GPipe, 1F1B and interleaved 1F1B."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_graph_stages_over_two_gpus_train_as_one_gpu() -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", "29517", os.path.join(ROOT, "tests", "graph_pipeline_worker.py")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    cases = re.findall(r"^case (.+) worst=(\S+)$", done.stdout, re.M)
    assert len(cases) == 10, done.stdout
    for name, worst in cases:
        assert float(worst) < 1e-4, name
