import os
import sys

import pytest
import torch

# Tests import shared helpers as `from tests.models import ...`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
