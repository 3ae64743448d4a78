"""Measured costs: a graph's forward+backward seconds timed on a device, as plain data.

[Note: measured costs]
A profile times the traced graph on the device it will train on, in the execution mode and
compute dtype it will run in, at the planned micro-batch shape (autopipe/measure/profile.py
makes it). The graph is cut at candidate stage boundaries into segments (many more than any
plan has stages), each segment is emitted as a stage would be and timed alone, forward plus
backward, on the real outputs of the segments before it. A segment's seconds are spread over
its nodes in proportion to the analytic model's times for them (``spread``), so the balancer
still cuts at node granularity; only the split inside one segment is modelled. The sum over
a stage is its measured time up to the boundary effects the closed loop corrects
(measure/closed_loop.py).

A profile is keyed by the graph's fingerprint (nodes, targets, shapes and dtypes, parameter
shapes; no values), its input shapes, the compute dtype, the execution mode, the device's
name and the torch version. ``check`` refuses a profile whose key does not match what is being
planned, naming each difference, so a profile made on a GPU machine can be given to
``autopipe report`` on a laptop without pricing another graph.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name

from autopipe.errors import ProfileError
from autopipe.graph import tensor_values, value_of
from autopipe.memory_format import channels_last_model

__all__ = ["MeasuredCosts", "Segment", "fingerprint", "spread", "dtype_name", "SCHEMA_VERSION"]

SCHEMA_VERSION = 3  # 2: eager node prices through the launch queue (measure/eager_host.py); 3: and segment pairs


@dataclass(frozen=True)
class Segment:
    """Positions [start, end) of the graph's node order, timed together (one micro-batch)."""

    start: int
    end: int
    forward: float  # seconds
    backward: float

    @property
    def seconds(self) -> float:
        return self.forward + self.backward


@dataclass
class MeasuredCosts:
    """Measured forward+backward seconds of a graph's nodes; see [Note: measured costs]."""

    fingerprint: str
    input_shapes: list[list[int]]
    dtype: str  # the compute dtype stages run in ("float32", "bfloat16", "float16")
    mode: str  # execution mode, one of partition.device.EXECUTION_MODES
    device: str  # as the device names itself (torch.cuda.get_device_name, or "cpu")
    torch_version: str
    segments: list[Segment]
    node_seconds: dict[str, float]  # per node, forward + backward
    profile_seconds: float = 0.0  # wall time the profiling took
    recompute: bool = False  # stages ran with activation checkpointing
    stage_overhead: float = 0.0  # seconds a stage takes beyond its nodes' (see [Note: segments])
    # Per node, where kernel times were read: [device fwd, device bwd, host fwd, host bwd,
    # kernels fwd, kernels bwd] (seconds, counts); what a calibration is fitted from.
    node_detail: dict[str, list[float]] = field(default_factory=dict)
    # Eager mode: pairs of adjacent segments timed whole (see [Note: segment pairs] in measure/profile.py).
    pairs: list[Segment] = field(default_factory=list)
    # CUDA graphs: seconds per byte crossing a stage's boundaries, paid by the stages on both
    # sides of a cut (see [Note: a profile's boundary copies] in measure/profile.py); 0 in other modes.
    boundary_rate: float = 0.0
    schema: int = SCHEMA_VERSION

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.segments)

    def key(self) -> dict[str, Any]:
        """What a profile must match to price a graph."""
        return {"fingerprint": self.fingerprint, "input_shapes": self.input_shapes, "dtype": self.dtype,
                "mode": self.mode, "recompute": self.recompute, "device": self.device,
                "torch_version": self.torch_version}

    def check(self, expected: Mapping[str, Any], *, source: str = "the profile") -> None:
        """Raise ProfileError listing every key field that differs from ``expected`` (fields
        absent from ``expected`` are not compared)."""
        mine = self.key()
        diffs = [f"- {k}: profile has {mine[k]!r}, this plan needs {v!r}"
                 for k, v in expected.items() if k in mine and mine[k] != v]
        if diffs:
            raise ProfileError(
                f"{source} was made for another setup:\n" + "\n".join(diffs)
                + "\nProfile again for this one (autopipe profile ..., or parallelize(costs='measured')), "
                "or plan with costs='analytic'")

    # ------------------------------------------------------------------------------- JSON
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeasuredCosts:
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA_VERSION:
            found = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"schema {found!r}, expected {SCHEMA_VERSION}: a profile written by another version "
                             "of autopipe")
        segments = [_segment(s) for s in data["segments"]]
        pairs = [_segment(s) for s in data.get("pairs", [])]
        nodes = {str(k): float(v) for k, v in data["node_seconds"].items()}
        bad = [k for k, v in nodes.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"node seconds not finite and >= 0 for {', '.join(bad[:3])}")
        return cls(str(data["fingerprint"]), [list(map(int, s)) for s in data["input_shapes"]],
                   str(data["dtype"]), str(data["mode"]), str(data["device"]), str(data["torch_version"]),
                   segments, nodes, float(data.get("profile_seconds", 0.0)), bool(data.get("recompute", False)),
                   float(data.get("stage_overhead", 0.0)),
                   {str(k): [float(x) for x in v] for k, v in data.get("node_detail", {}).items()}, pairs,
                   float(data.get("boundary_rate", 0.0)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON (atomically: a reader never sees half a file)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MeasuredCosts:
        """Read a profile; a ProfileError naming the file if it is missing, truncated or not one."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except FileNotFoundError as exc:
            raise ProfileError(f"no cost profile at {path!r}; make one with `autopipe profile MODEL ... "
                               "--out FILE` on the GPU machine") from exc
        except (OSError, ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise ProfileError(f"cost profile {path!r} is unreadable or corrupt ({type(exc).__name__}: "
                               f"{exc}); delete it and profile again") from exc


# ----------------------------------------------------------------------------- fingerprint
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.memory_format, torch.layout, slice)


def _describe(value: Any) -> Any:
    """A deterministic description of a node argument: node names, plain constants, type names
    (never a repr with an address, which would differ between processes; never a device)."""
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (tuple, list)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, _PLAIN):
        return repr(value)
    return type(value).__qualname__


def _target(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        params = sorted((k, tuple(p.shape), str(p.dtype)) for k, p in module.named_parameters())
        return f"{node.target}:{type(module).__qualname__}:{params}"
    if node.op == "call_function":
        try:
            return _get_qualified_name(node.target)
        except (RuntimeError, AttributeError, TypeError):
            return str(node.target)
    if node.op == "get_attr":
        try:
            t = gm.get_parameter(node.target)
        except AttributeError:
            t = None
        return f"{node.target}:{tuple(t.shape) if t is not None else ''}"
    return str(node.target)


def fingerprint(gm: fx.GraphModule) -> str:
    """A hash of the graph's structure, targets, shapes and dtypes, and of its layout where it is
    channels-last (which changes every convolution's kernels; see [Note: measured costs])."""
    h = hashlib.sha256()
    if channels_last_model(gm):  # a plain model's fingerprint stays what it was
        h.update(b"channels_last")
    for node in gm.graph.nodes:
        values = [(tuple(t.shape), str(t.dtype)) for t in tensor_values(value_of(node))]
        line = [node.op, node.name, _target(gm, node), _describe(node.args), _describe(node.kwargs), values]
        h.update(json.dumps(line, default=str).encode())
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------- node times
def spread(segments: Sequence[Segment], order: Sequence[str], modelled: Sequence[float]) -> dict[str, float]:
    """Each segment's measured seconds over its nodes, in proportion to their ``modelled`` times
    (evenly where the model gives the whole segment nothing)."""
    if not segments or segments[0].start != 0 or segments[-1].end != len(order) or any(
            a.end != b.start or a.start >= a.end for a, b in zip(segments, segments[1:])):
        raise ProfileError(f"profile segments do not tile the graph's {len(order)} nodes")
    out: dict[str, float] = {}
    for seg in segments:
        names, weights = order[seg.start:seg.end], list(modelled[seg.start:seg.end])
        total = sum(weights)
        if total <= 0:
            weights, total = [1.0] * len(names), float(len(names))
        for name, w in zip(names, weights):
            out[name] = seg.seconds * w / total
    return out


def dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


def _segment(data: Mapping[str, Any]) -> Segment:
    return Segment(int(data["start"]), int(data["end"]), float(data["forward"]), float(data["backward"]))
