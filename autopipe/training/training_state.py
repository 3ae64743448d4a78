"""``TrainingState``: what a training run carries from step to step besides the weights and the
optimizer (the fp16 loss scale, updates skipped). One object owns it; the runtime reads the
loss scale from it, ``ParallelModel.step`` advances it, checkpoints save and restore it.
See docs/architecture.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gradients import LossScaler

__all__ = ["TrainingState"]


@dataclass
class TrainingState:
    """The loss scaler (fp16 only) and the count of updates skipped for a non-finite gradient norm."""

    scaler: LossScaler | None = None
    skipped_steps: int = 0

    @classmethod
    def for_precision(cls, fp16: bool) -> "TrainingState":
        return cls(LossScaler() if fp16 else None)

    @property
    def loss_scale(self) -> float:
        """The factor losses are multiplied by before backward (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def after_step(self, skipped: bool) -> None:
        """An optimizer step was taken, or ``skipped`` (the loss scale backs off or grows)."""
        if self.scaler is not None:
            self.scaler.update(skipped)

    def record_skip(self) -> int:
        """One more update skipped for a non-finite gradient norm; returns how many so far."""
        self.skipped_steps += 1
        return self.skipped_steps

    def scaler_state(self) -> dict[str, Any] | None:
        """What a checkpoint's manifest keeps of the loss scaler (None without fp16)."""
        if self.scaler is None:
            return None
        return {"scale": self.scaler.scale, "good_steps": self.scaler.good_steps}

    def load_scaler_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`scaler_state`'s answer (ignored without fp16, or when none was saved)."""
        if self.scaler is not None and state is not None:
            self.scaler.scale, self.scaler.good_steps = state["scale"], state["good_steps"]
