"""The host's pace, read by a probe before every sweep, so that stages are timed at the pace the
host keeps when nothing slows it.

[Note: host pace]
At the host's pace a slow spell slows some stages and not others ([Note: paired timings] in
timer.py), and it can outlast a whole timing: on an H100 host, ResNet-50 at 128 images in 8
stages, eager, three timings in a row of one plan read its last four stages 6.3-7.3 ms, where
the loop had timed them at 4.7-4.8 a minute before; the first four read 5.0-5.5 in all of them
(benchmarks/results/2026-11-27-h100-measured-plans-eager-resnets-aim.json). A plan balanced in
one spell is off by 0.15-0.2 in the next, and no choice among the sweeps of a timing that fell
wholly in a spell can undo it.
So every sweep starts with a probe: ``PROBE_OPS`` in-place additions on a one-element tensor
on the device, their host seconds the sweep's pace (what slows the host, Python, dispatch and
launches, slows the probe: it is the host work of a stage in small). The process keeps the
probes it has seen; the reference is their lowest decile. A sweep is at pace when its probe is
within ``TOLERANCE`` of the reference. A timing whose sweeps are not at pace often enough goes
on sweeping, up to ``MORE_SWEEPS`` times as many again, to wait a spell out; the stages' times
come from the sweeps at pace (timer.kept_sweeps), or, where too few were, from those of the
fastest probes. A measured plan counts its loop's timings that waited, and those that never
reached the pace, in ``cost_source["host_pace"]``, and its report says so.
The pace differs from one host to the next too: on two H200 hosts a day apart, the probe read
244 and 337 us, and ResNet-50's eager stages at 32 images 17.6 and 25.6 ms in all. So the
analytic model's eager host terms are for the pace of the host they were fitted on
(``Calibration.host_probe``), and a plan made for eager stages on a GPU probes this host first
(``probe_seconds``) and scales them to it (``DeviceProfile.at_host_pace``).

[Note: planning probe]
The host keeps two paces, and switches between them every half second to few seconds: on an
H200 host, probes read 190-215 us in one spell and 255-290 in the next, idle, after a model was
loaded and after it trained alike (benchmarks/results/2026-11-29-h200-host-probe-series.txt).
A probe of 0.1 s falls in one spell, and reads either. Plans priced at the slow reading
overpriced every host-bound stage by the ratio, 1.3-1.4x: ConvNeXt-B at 32 images measured
1.30 and 1.54 max/mean in 4 and 8 stages, where its stem stage, bound by the GPU, was priced
right (benchmarks/results/2026-11-29-h200-analytic-plans-eager-paced-v3.json). So the probe is
spread over ``PROBE_WINDOW`` seconds, longer than most slow spells, in bursts whose medians
shrug off a lone fast or slow reading, and reads the ``FAST_BURSTS``-th lowest of them: the fast
pace, at which stages are also timed ([Note: host pace]).
Slow spells can outlast the window. On another H200 host the two paces read 225-245 and
300-340 us, and right after a model was traced on the CPU, slow spells of 2-3 s came with a
fast half second between them; seven of nine 2.5 s probes read 262-319 us. Plans priced at
those readings were off by as much: ConvNeXt-B at 32 images in 4 x 2 stages, probed at 318
us, measured 1.22 max/mean, its host-bound stages priced 1.2-1.3x what they took
(benchmarks/results/2026-11-29-h200-analytic-plans-eager-exact-replay-cut-4x2.json;
2026-11-29-h200-probe-after-trace.txt). A burst of the fast pace amid slow ones is the sign
of such a spell, so the probe goes on, up to ``PROBE_WINDOW_LONGEST`` seconds, while a burst
reads faster than the reading by more than ``TOLERANCE``: on a host that keeps one pace it
stops at the window.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["HostPace", "PACE", "PROBE_OPS", "TOLERANCE", "MORE_SWEEPS", "PROBE_WINDOW", "PROBE_WINDOW_LONGEST",
           "FAST_BURSTS", "probe_seconds", "recent_probe_seconds"]

PROBE_OPS = 32  # operations a probe issues
TOLERANCE = 0.15  # a sweep whose probe is within this of the reference is at pace
PROBE_WINDOW = 2.5  # seconds a planning probe spreads over ([Note: planning probe])
PROBE_WINDOW_LONGEST = 10.0  # seconds it goes on for, at most, while it has seen a faster pace
FAST_BURSTS = 5  # bursts of the fast pace a planning probe reads it from
MORE_SWEEPS = 3  # a timing goes on for at most this many times its sweeps, waiting for the pace
KEPT_PROBES = 20_000  # probes remembered, the latest


@dataclass
class HostPace:
    """Probes of the host's pace seen in this process ([Note: host pace])."""

    seen: list[float] = field(default_factory=list)
    timings: int = 0  # timings that read the pace
    waited: int = 0  # of them, those that swept more to wait for it
    short: int = 0  # of them, those that had too few sweeps at pace even then
    _scratch: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def probe(self, device: torch.device) -> float:
        """Host seconds to issue ``PROBE_OPS`` small operations on ``device``."""
        x = self._scratch.get(str(device))
        if x is None:
            x = self._scratch[str(device)] = torch.zeros(1, device=device)
        begin = time.perf_counter()
        for _ in range(PROBE_OPS):
            x.add_(1.0)
        return time.perf_counter() - begin

    def reference(self, probes: Sequence[float] = ()) -> float:
        """The lowest decile of the probes seen, with ``probes`` among them."""
        every = sorted([*self.seen, *probes])
        return every[len(every) // 10] if every else 0.0

    def at_pace(self, probes: Sequence[float]) -> list[bool]:
        limit = self.reference(probes) * (1 + TOLERANCE)
        return [p <= limit for p in probes]

    def record(self, probes: Sequence[float], *, waited: bool, short: bool) -> None:
        self.seen = (self.seen + list(probes))[-KEPT_PROBES:]
        self.timings += 1
        self.waited += waited
        self.short += short

    def summary(self) -> dict[str, float]:
        """What a benchmark reports: the reference probe and how often timings waited."""
        return {"reference_us": self.reference() * 1e6, "timings": self.timings, "waited": self.waited,
                "short": self.short}


PACE = HostPace()  # the process's probes: the pace is the host's, whatever is timed


def probe_seconds(device: torch.device, window: float = PROBE_WINDOW, burst: int = 10, pause: float = 0.05,
                  longest: float = PROBE_WINDOW_LONGEST) -> float:
    """This host's pace on ``device``: bursts of ``burst`` probes, ``pause`` seconds apart, for
    ``window`` seconds after a warm-up, and on up to ``longest`` while a burst reads a faster
    pace than the reading; the ``FAST_BURSTS``-th lowest of the bursts' medians
    ([Note: planning probe])."""
    for _ in range(10):
        PACE.probe(device)
    medians: list[float] = []
    begin = time.perf_counter()
    while not medians or (elapsed := time.perf_counter() - begin) < window or \
            (elapsed < longest and _faster_burst(medians)):
        if medians:
            time.sleep(pause)
        readings = sorted(PACE.probe(device) for _ in range(max(burst, 1)))
        medians.append(readings[len(readings) // 2])
    return _reading(medians)


def _reading(medians: list[float]) -> float:
    return sorted(medians)[min(FAST_BURSTS, len(medians)) - 1]


def _faster_burst(medians: list[float]) -> bool:
    """Whether a burst read a pace faster than the reading by more than ``TOLERANCE``: a fast
    spell that the window caught too little of to read."""
    return min(medians) * (1 + TOLERANCE) < _reading(medians)


_RECENT: dict[str, tuple[float, float]] = {}  # device -> (when, reading)


def recent_probe_seconds(device: torch.device, max_age: float = 60.0) -> float:
    """``probe_seconds(device)``, or the reading this process took less than ``max_age`` seconds
    ago: a layout search and the plan it leads to price at one pace, probed once."""
    now = time.monotonic()
    when, reading = _RECENT.get(str(device), (-math.inf, 0.0))
    if now - when >= max_age:
        reading = probe_seconds(device)
        _RECENT[str(device)] = (now, reading)
    return reading
