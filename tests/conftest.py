import os
import sys

import pytest
import torch

# Tests import shared helpers as `from tests.models import ...`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: a GPU test; every other test sees no CUDA, so that it runs on the "
                                       "CPU on any machine (parallelize's default device is the GPU where one is)")


@pytest.fixture(autouse=True)
def _cpu_unless_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """CPU tests pin their device: on a GPU workstation they must compute what they compute on
    a CPU-only machine. Tests marked ``cuda`` see the GPU."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    else:  # fp32 comparisons on the GPU: full-precision matrix products and convolutions
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    yield


@pytest.fixture(autouse=True)
def _seed(_cpu_unless_marked):
    torch.manual_seed(0)
    yield
