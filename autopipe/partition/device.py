"""Device profiles: turn a node's FLOPs and bytes into seconds with a roofline.

Built-in profiles carry achievable rates, not datasheet peaks. ``measure_profile`` times the
local device; ``measure_node_times`` times a graph node by node to check the cost model.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_aggregate

from autopipe.errors import ConfigError
from autopipe.partition.calibration import Calibration, class_of, load_calibration
from autopipe.partition.cost import FREE_KINDS, MATMUL_KINDS, NodeCost
from autopipe.partition.launch_queue import Launch, analytic_launches, queue_by_node

__all__ = ["DeviceProfile", "PROFILES", "EXECUTION_MODES", "SLOW_PACE", "execution_mode", "get_profile",
           "measure_profile", "measure_node_times"]

SCHEMA_VERSION = 2
# The host's slow pace over its fast one, which a planning probe reads: [Note: a cut at another pace].
SLOW_PACE = 1.35
# How stages run: eagerly, as CUDA graph replays, compiled by torch.compile (with or without
# graphs). A calibrated profile prices launches by it; see [Note: calibrated roofline].
EXECUTION_MODES = ("eager", "graphs", "compiled", "compiled+graphs")


@dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device and of the link to its pipeline neighbour (SI units: /s, B/s, s)."""

    name: str
    matmul_flops: float  # matmul-unit FLOP/s in the compute dtype
    vector_flops: float  # FLOP/s of elementwise and reduction kernels
    mem_bandwidth: float  # device memory bytes/s
    link_bandwidth: float  # bytes/s of one p2p send between pipeline neighbours
    link_latency: float  # seconds added to every send
    op_overhead: float  # seconds per launched node (dispatch + kernel launch), uncalibrated
    mode: str = "eager"  # one of EXECUTION_MODES
    calibration: Calibration | None = None  # fitted kernel efficiencies; see calibration.py

    def __post_init__(self) -> None:
        if self.mode not in EXECUTION_MODES:
            raise ConfigError(f"execution mode {self.mode!r} is not one of {', '.join(EXECUTION_MODES)}")
        rates = ("matmul_flops", "vector_flops", "mem_bandwidth", "link_bandwidth")
        bad = [f"{n}={getattr(self, n)!r}" for n in rates if not getattr(self, n) > 0]
        bad += [f"{n}={getattr(self, n)!r}" for n in ("link_latency", "op_overhead")
                if not getattr(self, n) >= 0]  # "not >=" also catches NaN
        if bad:
            raise ConfigError(f"device profile {self.name!r} needs positive rates and non-negative "
                              f"latencies, got {', '.join(bad)}")

    def node_time(self, c: NodeCost, *, backward: bool = False) -> float:
        """Roofline: the slower of compute and memory traffic, plus one launch overhead.

        Views and non-tensor nodes launch nothing and take 0 s. A composite module is the sum
        of its inner kernels, each on its own units ([Note: composite modules] in cost.py).
        With a calibration, the roofline is scaled by the kernel's fitted factor and the launch
        priced by the execution mode ([Note: calibrated roofline] in calibration.py). This is
        the node alone; ``node_times`` prices a graph's nodes together, as a stage runs them.
        """
        if c.parts:
            return sum(self.node_time(p, backward=backward) for p in c.parts)
        gpu = self.kernel_time(c, backward=backward)
        if self.calibration is None or not _launches(c, backward):
            return gpu
        if self.mode not in ("eager", "compiled"):
            return gpu + self.calibration.gap_time(self.mode)
        host = self.calibration.host[int(backward)]
        if self.mode == "compiled" and c.kind not in MATMUL_KINDS:
            host *= COMPILED_FUSION  # See [Note: compiled pricing].
        return max(gpu, host)

    def kernel_time(self, c: NodeCost, *, backward: bool = False) -> float:
        """The device seconds of one kernel (a node without ``parts``), launch included; 0 for a
        node that launches nothing. Uncalibrated, the roofline plus ``op_overhead``."""
        if not _launches(c, backward):
            return 0.0
        flops, nbytes = (c.bwd_flops, c.bwd_bytes) if backward else (c.fwd_flops, c.fwd_bytes)
        peak = self.matmul_flops if c.kind in MATMUL_KINDS else self.vector_flops
        if self.calibration is None:
            return max(flops / peak, nbytes / self.mem_bandwidth) + self.op_overhead
        gpu = self.calibration.gpu_time(c, compute=flops / peak, bandwidth=self.mem_bandwidth, backward=backward,
                                        vector=flops / self.vector_flops)
        if self.mode.startswith("compiled") and c.kind not in MATMUL_KINDS:
            gpu *= COMPILED_FUSION  # See [Note: compiled pricing]: the memory-bound kernels between GEMMs fuse.
        return gpu

    def node_times(self, costs: Sequence[NodeCost],
                   launches: tuple[list[Launch], list[Launch]] | None = None) -> list[tuple[float, float]]:
        """(forward, backward) seconds of each of ``costs``, a graph's nodes in graph order, as a
        stage runs them: eager stages under a table fitted through the launch queue
        (``Calibration.launch_queue``) replay their kernels through it, the host's work hiding
        under long kernels ([Note: eager launch queue] in measure/eager_host.py); otherwise
        each node as ``node_time`` prices it alone. ``launches``: ``self.launches(costs)``, where
        the caller has them."""
        launches = launches if launches is not None else self.launches(costs)
        if launches is not None:
            fwd, bwd = (queue_by_node(passed, len(costs)) for passed in launches)
            return [(float(f), float(b)) for f, b in zip(fwd, bwd)]
        return [(self.node_time(c), self.node_time(c, backward=True)) for c in costs]

    def launches(self, costs: Sequence[NodeCost]) -> tuple[list[Launch], list[Launch]] | None:
        """The forward and backward launches of ``costs`` through the launch queue, as eager stages
        under a table fitted that way run them (``launch_queue.analytic_launches``); None where
        nodes are priced each alone."""
        cal = self.calibration
        if self.mode != "eager" or cal is None or not cal.launch_queue:
            return None
        return analytic_launches(costs, lambda k, b: self.kernel_time(k, backward=b),
                                 lambda k, b: cal.launch_host(class_of(k, backward=b), b), cal.view_host)

    def at_host_pace(self, probe: float) -> DeviceProfile:
        """This profile for stages launched by a host whose pace probe reads ``probe`` seconds
        ([Note: host pace] in measure/host_pace.py): its table's host terms scaled by ``probe``
        over the probe of the host they were fitted on. Unchanged where either is unknown (0).

        [Note: a cut at another pace]
        A stage bound by its kernels costs the same at any pace of the host; one bound by its
        launches costs in proportion to it. So where a model has both (ResNet-50 at 128 images:
        the stem over 112 x 112 maps bound by its kernels, layer4 over 7 x 7 maps by its
        launches), a cut balanced at one pace is off at another. A host keeps two paces, the
        slow one about 1.35x the fast one that a planning probe reads ([Note: planning probe] in
        measure/host_pace.py), and slow spells can outlast a whole timing. On an H200, ResNet-50
        at 128 images in 4 eager stages, cut at a probe of 230 us, measured 1.230 max/mean in a
        timing whose sweeps all read the slow pace (323 us), where the plan of a probe a few
        minutes before measured 1.053; priced at 320 us, the cut reads 1.210. Other cuts do
        better at both: by the model, the least worst of the two paces reads 1.046 / 1.051 in 4
        stages and 1.052 / 1.057 in 8 (benchmarks/eager_pace_sensitivity.py), at a cost at the
        fast pace ([Note: a cut hedged over paces] in replayed_cuts.py, off by default). So a
        plan of eager stages priced at a probed pace also carries the max/mean of its cut at
        ``SLOW_PACE`` times that probe (``cost_source["slow_pace"]``), and its report says so
        where the two differ: stages run as CUDA graphs, or timed as they run
        (``costs="measured"``), do not depend on it."""
        cal = self.calibration
        if cal is None or not cal.host_probe > 0 or not probe > 0:
            return self
        r = probe / cal.host_probe
        scaled = replace(cal, host=(cal.host[0] * r, cal.host[1] * r), node_host=(cal.node_host[0] * r,
                         cal.node_host[1] * r), view_host=(cal.view_host[0] * r, cal.view_host[1] * r),
                         host_probe=probe)
        return replace(self, calibration=scaled)

    def with_mode(self, mode: str) -> DeviceProfile:
        """This profile for stages run in ``mode`` (one of EXECUTION_MODES)."""
        return self if mode == self.mode else replace(self, mode=mode)

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` to a pipeline neighbour; 0 when nothing is sent."""
        return 0.0 if nbytes <= 0 else self.link_latency + nbytes / self.link_bandwidth

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceProfile:
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        if values.get("calibration") is not None:
            values["calibration"] = Calibration.from_dict(values["calibration"])
        return cls(**values)


def _launches(c: NodeCost, backward: bool) -> bool:
    """Whether ``c`` (a kernel) launches work in that direction."""
    return c.kind not in FREE_KINDS and ((c.bwd_flops, c.bwd_bytes) if backward else (c.fwd_flops, c.fwd_bytes)) != (0, 0)


# Achievable rates, roughly what a well-fed large kernel reaches, not datasheet peaks:
# - cpu: a modest 2-core x86 box in fp32; the link is gloo over loopback TCP.
# - h100 (SXM): bf16 dense 989e12 peak, ~600e12 reached by large GEMMs; non-tensor-core
#   ~67e12 fp32 peak; HBM3 3.35e12 B/s peak, ~90% on copies.
# - h200: the H100's compute with 4.8e12 B/s HBM3e (~90% on copies).
# - h100/h200 link: 300e9 B/s, what NCCL send/recv between two NVLink-connected GPUs typically
#   reaches for multi-MB messages (NVLink 4: 450e9 B/s per direction peak). An achievable
#   figure, not a measured one: replace it with a measurement of the real fabric
#   (measure_profile cannot time a link, it needs a peer), and with a far lower one where
#   neighbours talk over PCIe or across nodes (InfiniBand: ~25-50e9 B/s).
# h100 and h200 carry the calibration fitted on that GPU where the project has one
# (calibration/<name>.json; [Note: calibrated roofline]).
PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", matmul_flops=50e9, vector_flops=10e9, mem_bandwidth=10e9,
                         link_bandwidth=1e9, link_latency=50e-6, op_overhead=10e-6),
    "h100": DeviceProfile("h100", matmul_flops=600e12, vector_flops=50e12, mem_bandwidth=3.0e12,
                          link_bandwidth=300e9, link_latency=10e-6, op_overhead=5e-6,
                          calibration=load_calibration("h100")),
    "h200": DeviceProfile("h200", matmul_flops=600e12, vector_flops=50e12, mem_bandwidth=4.3e12,
                          link_bandwidth=300e9, link_latency=10e-6, op_overhead=5e-6,
                          calibration=load_calibration("h200")),
}


# [Note: compiled pricing]
# torch.compile fuses the norms, activations, adds and casts between the GEMMs into fewer,
# larger kernels; the calibration tables were fitted on unfused kernels. Compiled stages are
# priced as their unfused kernels with the memory-bound ones at COMPILED_FUSION of their time
# and launches, GEMMs and attention as they are. This is an assumption, not a fit: on one
# H100, ViT-L's kernel time per step went from 317 to 261 ms compiled (-18%;
# benchmarks/microbatch_efficiency.py, 2026-11-25), which is what halving the memory-bound
# third of its time gives. A profile measured in a compiled mode replaces it.
COMPILED_FUSION = 0.5


def execution_mode(*, cuda_graphs: bool = False, compile_stages: bool = False) -> str:
    """The EXECUTION_MODES entry for stages run with these options."""
    return ("compiled+graphs" if cuda_graphs else "compiled") if compile_stages else \
        ("graphs" if cuda_graphs else "eager")


def gpu_profile_name(device_name: str) -> str:
    """The built-in profile for a GPU by the name it reports (``torch.cuda.get_device_name``):
    "h200" for an H200, "h100" for any other (the profile a plan made without a GPU uses)."""
    return "h200" if "H200" in device_name.upper() else "h100"


def get_profile(name_or_profile: str | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name (case-insensitive), or the profile given."""
    if isinstance(name_or_profile, DeviceProfile):
        return name_or_profile
    profile = PROFILES.get(str(name_or_profile).lower())
    if profile is None:
        raise ConfigError(f"unknown device profile {name_or_profile!r}; known profiles: "
                          f"{', '.join(PROFILES)}. Or pass a DeviceProfile, e.g. "
                          f"measure_profile('cuda:0')")
    return profile


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(getattr(torch, device.type, None), "synchronize"):
        getattr(torch, device.type).synchronize()


def _median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # warm-up: allocator, page faults, library autotuning
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_profile(device: torch.device | str, dtype: torch.dtype = torch.float32) -> DeviceProfile:
    """Time a square matmul, a large copy and a run of tiny kernels on ``device``.

    On CPU this takes well under a second. The link is not measured (it needs a peer): its
    numbers come from the "cpu" profile, or "h100" for an accelerator. vector_flops is the
    measured matmul rate scaled by that profile's vector/matmul ratio, because an elementwise
    kernel large enough to time is memory-bound and would only measure bandwidth again.
    """
    dev = torch.device(device)
    base = PROFILES["cpu" if dev.type == "cpu" else "h100"]
    n, copy_bytes, reps = (512, 32 << 20, 5) if dev.type == "cpu" else (8192, 1 << 30, 10)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    matmul = 2.0 * n**3 / _median_seconds(lambda: torch.mm(a, b), dev, reps)
    src = torch.empty(copy_bytes // dtype.itemsize, dtype=dtype, device=dev)
    dst = torch.empty_like(src)
    bandwidth = 2.0 * copy_bytes / _median_seconds(lambda: dst.copy_(src), dev, reps)  # read + write
    tiny, launches = torch.zeros(1, device=dev), 200

    def run_tiny() -> None:
        for _ in range(launches):
            tiny.add_(1)

    overhead = _median_seconds(run_tiny, dev, 3) / launches
    return DeviceProfile(f"measured:{dev}", matmul_flops=matmul,
                         vector_flops=matmul * base.vector_flops / base.matmul_flops,
                         mem_bandwidth=bandwidth, link_bandwidth=base.link_bandwidth,
                         link_latency=base.link_latency, op_overhead=overhead)


def _random_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _materialise(gm: fx.GraphModule, device: torch.device) -> None:
    """Move ``gm`` (a private copy) to ``device``, giving meta tensors values.

    Meta parameters become N(0, 0.02), floating buffers 1.0 (a positive running_var) and
    integer buffers 0 (always a valid index): enough to time kernels, not to train.
    """
    tensors = [*gm.parameters(), *gm.buffers()]
    if any(t.is_meta for t in tensors):
        gm.to_empty(device=device)
        with torch.no_grad():
            for p in gm.parameters():
                if p.is_floating_point():
                    p.normal_(0.0, 0.02)
                else:
                    p.zero_()
            for b in gm.buffers():
                if b.is_floating_point():
                    b.fill_(1.0)
                else:
                    b.zero_()
    else:
        gm.to(device)
    # Plain tensor attributes (export's lifted constants) are neither parameters nor buffers.
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        value = getattr(owner, attr)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.device != device:
            setattr(owner, attr, _random_like(value, device) if value.is_meta else value.to(device))
    # Factory calls traced on the meta device carry device=meta.
    def retarget(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a.type == "meta" else a

    for node in gm.graph.nodes:
        node.args = map_aggregate(node.args, retarget)
        node.kwargs = map_aggregate(node.kwargs, retarget)


def _seconds_per_call(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    # Back to back, as in a real forward where the host runs ahead of the device: a call
    # costs its kernel time or its launch time, whichever is longer.
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    _synchronize(device)
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    _synchronize(device)
    return (time.perf_counter() - begin) / calls


class _NodeTimer(fx.Interpreter):
    """Runs the graph once; stops at every call node to time it alone on its real inputs."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, runs: int, calls: int) -> None:
        super().__init__(gm)
        self.device, self.runs, self.calls = device, runs, calls
        self.seconds: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)  # also the warm-up call
        if n.op in ("call_function", "call_method", "call_module"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            call = getattr(self, n.op)
            samples = [_seconds_per_call(lambda: call(n.target, args, kwargs), self.device, self.calls)
                       for _ in range(self.runs)]
            self.seconds[n.name] = statistics.median(samples)
        else:
            self.seconds[n.name] = 0.0
        return result


def measure_node_times(gm: fx.GraphModule, example_inputs: Sequence[Any],
                       device: torch.device | str, *, runs: int = 5, calls: int = 5) -> dict[str, float]:
    """Forward seconds of every node of ``gm`` on ``device``: median of ``runs`` timings.

    Runs a deep copy of ``gm`` once with torch.fx.Interpreter under no_grad on real tensors;
    each call node is then re-run ``calls`` times back to back on its own inputs and timed
    with CUDA events on GPU, perf_counter on CPU. Placeholders, get_attr and output take 0.
    In-place nodes re-apply themselves, so values are garbage: timings only. Meta
    parameters and inputs get random values (see _materialise) and the whole model sits on
    ``device``: meant for small models.
    """
    dev = torch.device(device)
    work = copy.deepcopy(gm)
    _materialise(work, dev)
    inputs = [(_random_like(x, dev) if x.is_meta else x.to(dev)) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    timer = _NodeTimer(work, dev, max(runs, 1), max(calls, 1))
    with torch.no_grad():
        timer.run(*inputs)
    return timer.seconds
