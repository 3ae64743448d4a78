"""What a stage replayed as CUDA graphs pays for the bytes crossing its boundaries, fitted on a
profile's segments.

[Note: a profile's boundary copies]
A stage replayed as CUDA graphs copies what crosses its boundaries into and out of its static
buffers ([Note: boundary copies] in partition/calibration.py). A profile reads its nodes' kernel
times from a run under the profiler without the graphs ([Note: node times from kernels] in
kernels.py), so the copies are in what a segment's timing exceeds its nodes by; that excess used
to become one fixed cost per stage (its median over segments), and a plan paid the same for a
cut carrying 51 MB as for one carrying 1 MB. On an H200 under CUDA graphs, ResNet-50 at 32 images
in 8 stages: moving one boundary inside layer1 past an addition (its cut then carries the
residual too, 51 MB more) made the stage before it 22 us slower and the one after it 84 us
slower, the addition's own 38 us aside, about 47 us a side; the profile priced the move at the
addition alone, and the closed loop stopped at 1.06 (benchmarks/results/2026-11-29-h200-measured-
balance-retimed-resnet50-graphs-32-8x1-4x2.json). So a profile in that mode fits the segments'
excess as a fixed time plus a rate per byte crossing their boundaries (``fit_boundary_rate``: the
median of the slopes between segments, robust to one segment that stands out), and keeps the
rate (``MeasuredCosts.boundary_rate``), which the partitioner charges on both stages beside
every cut, as the analytic model charges its calibrated one, and the closed loop counts as known.
In the next runs (benchmarks/results/2026-11-29-h200-measured-balance-boundary-rate-*.json) the
rates came out 0.3-1.3 us per MB (the H200 table's: 0.92), ResNet-50's profile priced its stages
within 2% (3-82% before), and at 32 images in 8 stages it priced the best cut at 1.068: three
cuts inside layer1, each carrying 51-64 MB. That plan timed 1.061. The pipeline then stopped
making those copies ([Note: graph slots as boundaries] in runtime/graphs.py): the same profile
fits a rate of 0, ResNet-50's stages of 32 images take 1.11-1.20 ms instead of 1.13-1.29, and 8
stages time 1.046 (benchmarks/results/2026-11-29-h200-measured-balance-graph-boundaries-*.json).
The rate stays where a mode still copies at its boundaries.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

__all__ = ["boundary_bytes", "fit_boundary_rate"]

# Segments whose boundary bytes differ by less than this fraction of the largest tell no rate apart.
SPREAD = 0.05


def boundary_bytes(plan: Any) -> list[int]:
    """Each stage's bytes crossing its boundaries: what the stage before sends it, and what it
    sends the stage after (as the partitioner's cuts count them; the model's inputs and outputs
    are not a cut)."""
    sent = [int(s.cut_bytes) for s in plan.stages]
    last = len(sent) - 1
    return [(sent[i - 1] if i > 0 else 0) + (sent[i] if i < last else 0) for i in range(len(sent))]


def fit_boundary_rate(beyond: Sequence[float], nbytes: Sequence[int]) -> float:
    """Seconds per boundary byte from segments that each took ``beyond`` seconds more than their
    nodes' kernels with ``nbytes`` crossing their boundaries: the median slope over pairs of
    segments whose bytes differ (Theil-Sen), never below 0; 0 where the bytes hardly differ."""
    top = max(nbytes, default=0)
    slopes = [(beyond[i] - beyond[j]) / (nbytes[i] - nbytes[j])
              for i in range(len(nbytes)) for j in range(i)
              if abs(nbytes[i] - nbytes[j]) > SPREAD * top]
    return max(statistics.median(slopes), 0.0) if slopes else 0.0
