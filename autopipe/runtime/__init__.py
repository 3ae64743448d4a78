"""Runtime: the stage driver and the pipeline schedules it iterates over.

Schedules are plain data (:mod:`.schedule`); :class:`PipelineDriver` runs one rank's share of
one over p2p, with failure propagation, micro-batching and an optional :class:`Timeline`.
"""
from autopipe.runtime.driver import PipelineDriver
from autopipe.runtime.microbatch import merge, nearest_divisible, split_inputs, split_targets
from autopipe.runtime.p2p import P2P, BufferPool, TensorSpec
from autopipe.runtime.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    rank_actions,
    theoretical_bubble,
    validate,
)
from autopipe.runtime.timeline import (
    Event,
    Timeline,
    bubble_report,
    gather,
    measured_bubble,
    plot_gantt,
    to_chrome_trace,
)

__all__ = [
    "PipelineDriver",
    "TensorSpec",
    "P2P",
    "BufferPool",
    "split_inputs",
    "split_targets",
    "merge",
    "nearest_divisible",
    "SCHEDULES",
    "Action",
    "ActionKind",
    "rank_actions",
    "theoretical_bubble",
    "validate",
    "Timeline",
    "Event",
    "gather",
    "to_chrome_trace",
    "plot_gantt",
    "measured_bubble",
    "bubble_report",
]
