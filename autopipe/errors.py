"""Every error autopipe raises for a user's mistake derives from :class:`AutopipeError`.

Messages name the offending value (node, module, number) and say what to do instead.
Errors are raised before any collective that could hang, on every rank alike.
"""
from __future__ import annotations

__all__ = [
    "AutopipeError",
    "ConfigError",
    "TraceError",
    "PartitionError",
    "ShardingError",
    "ScheduleError",
    "InputError",
    "PipelineFailure",
    "CheckpointError",
    "ProfileError",
    "positive_int",
]


class AutopipeError(Exception):
    """Base class of every error autopipe raises on purpose."""


class ConfigError(AutopipeError, ValueError):
    """A degree, count or option is invalid (pp, tp, chunks, microbatches, world size...)."""


class TraceError(AutopipeError, RuntimeError):
    """No tracing route could turn the model into a graph."""


class PartitionError(AutopipeError, ValueError):
    """The graph cannot be cut as asked (too many stages, unknown split point, memory cap)."""


class ShardingError(AutopipeError, ValueError):
    """A tensor-parallel rule does not fit the node or parameter it matched."""


class ScheduleError(AutopipeError, ValueError):
    """A pipeline schedule cannot run with the given stages and micro-batches."""


class InputError(AutopipeError, ValueError):
    """Inputs or targets given at run time do not match the plan."""


class PipelineFailure(AutopipeError, RuntimeError):
    """Another rank failed; raised on every rank so that none hangs."""


class CheckpointError(AutopipeError, RuntimeError):
    """A checkpoint cannot be saved or loaded into this model."""


class ProfileError(ConfigError):
    """A measured cost profile cannot be made here, cannot be read, or was made for another
    graph, input shape, dtype, execution mode or device."""


def positive_int(name: str, value: object, error: type[AutopipeError] = ConfigError) -> int:
    """``value`` when it is an int of at least 1 (a bool is not), else ``error`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{name} must be a positive integer, got {value!r}")
    return value
