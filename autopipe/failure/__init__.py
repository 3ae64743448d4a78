"""Failure propagation: waits on other ranks that raise, on every rank, when one of them fails.

Everything that waits on another rank (the pipeline's transfers, tensor-parallel collectives,
gradient all-reduces, checkpoints) waits through :class:`FailureMonitor`; see [Note: failure
propagation] and [Note: collective waits] in monitor.py.
"""
from autopipe.failure.monitor import DEFAULT_DEADLINE, FailureMonitor, active, synced, wait_works
from autopipe.failure.objects import all_gather_objects

__all__ = ["FailureMonitor", "DEFAULT_DEADLINE", "active", "synced", "wait_works", "all_gather_objects"]
