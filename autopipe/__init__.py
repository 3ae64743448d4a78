"""autopipe: pipeline and tensor parallelism for unmodified PyTorch models."""
from .api import parallelize
from .errors import AutopipeError
from .training.parallel_model import ParallelModel
from .tracer import trace

__all__ = ["parallelize", "ParallelModel", "AutopipeError", "trace"]
__version__ = "0.1.0"
