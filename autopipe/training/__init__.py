"""The training side: the ParallelModel users hold, the state its steps keep, its mesh,
checkpoints and zero redundancy. See docs/architecture.md."""
from .parallel_model import ParallelModel, StepResult

__all__ = ["ParallelModel", "StepResult"]
