"""Kernel efficiencies fitted on a device: what turns the roofline into measured seconds.

[Note: calibrated roofline]
The plain roofline (``DeviceProfile.node_time`` without a calibration) prices every GEMM at
one achievable rate and every memory-bound kernel at one bandwidth. Measured on an H100, that
is 1.3-2.8x below the truth and wrong by different factors for different stages: ResNet-50's
stem and layer1 (convolutions of 64 channels over 56x56 maps, batch norms over large maps)
run far below the rates that ViT's 1024-wide GEMMs reach. A calibration keeps, per class of
kernel, a factor that multiplies the roofline time, one for the forward and one for the
backward pass:

- GEMMs and convolutions by the dimension that bounds their parallelism, in powers of two
  (``gemm/64`` holds linear layers whose weight's smaller side is in (32, 64]; for batched
  products of activations the smallest of M, N, K; for convolutions the channels in or out per
  group, so that a stem's 3 input channels form a class of their own), never the batch, so that
  a class holds at any micro-batch size; grouped convolutions as a kind of their own, by the
  same dimension ([Note: grouped convolutions]); depthwise convolutions, which run on vector
  units, by the bytes they move;
- attention kernels in one class;
- memory-bound kernels (norms, elementwise, reductions, copies) by their kind and the bytes
  they move, in factors of four from 256 KiB to 64 MiB (small kernels do not reach full
  bandwidth); batch norms by their channels instead (one reduction over N x H x W per channel:
  64 channels over 56x56 maps run at a quarter of the bandwidth 512 channels reach), pooling
  apart from other reductions.

More numbers: the GPU time each launched kernel adds, by its kind (the part of a class name before
the first "/"), or for a GEMM by its class ([Note: a GEMM class's fixed time]): a convolution's
set-up, format conversions and tail, or an elementwise kernel's, and the gap before the next;
what CUDA graph replays still pay (a squeeze-excite convolution of a few thousand FLOPs takes
10-15 us on an H100). Then the host time of eager mode (Python, dispatch,
launch; forward and autograd backward) and the fixed time of a stage in each mode (its first
launch, autograd's start). In eager mode the host runs ahead of the device where it can: a table
fitted so (``launch_queue``) replays a stage's kernels through the launch queue ([Note: eager
launch queue] in measure/eager_host.py): an op (a node, a composite's part) costs the host
``node_host`` and ``host`` per kernel its kind launches (``host_kernels``, profiler counts), a view
``view_host``, at the pace of the host they were fitted on (``host_probe``; ``at_host_pace``
scales them); in an older table a node takes the longer of its GPU and its host time.

[Note: monotone in bytes]
A class by bytes has its own factor in each bucket, and small kernels run further below the
bandwidth than large ones, so a kernel just over a bucket's edge would be priced below one
just under it. More work must never cost less (the balancer and the search rely on it), so a
kernel of bucket b costs the most of f_j x roofline(bytes clipped to bucket j's top) over the
buckets j <= b: the price within a bucket starts where the bucket below ended and grows with
the bytes. The fit (kernel_features) still sees each kernel's own bucket and roofline.

[Note: kernel layout]
A convolution, a batch norm or a pooling over channels-last maps (a model moved to
``memory_format=torch.channels_last``) runs other kernels than over NCHW maps: on an H200,
ResNet-50's first batch norm at 32 x 64 x 112 x 112 takes 0.33 ms forward and backward in NHWC
against 1.15 ms in NCHW, and a depthwise convolution's NHWC kernel is not its NCHW one. So the
class of such a kernel (``NodeCost.channels_last``) carries the layout after its kind
("conv-nhwc/64", "norm:batch-nhwc/64ch", "dwconv-nhwc/4MiB"), and a table fitted on rows of
both layouts keeps a factor and a launch time for each. A table that has no factor for a
channels-last class (fitted on NCHW rows alone) prices it as the NCHW class of the same shape.

[Note: grouped convolutions]
A convolution with groups of more than one input channel (ResNeXt's 32 groups, RegNet's groups
of 24 channels) runs cuDNN's grouped kernels, not a dense convolution's: on an H100 the 3x3
convolutions of RegNetY-1.6GF's third stage, 24 channels a group, take 0.7 ms forward and
backward at 128 images, 8-12x what the dense class of their channels per group
("conv-nhwc/32", fitted on 1x1 convolutions) prices. So their class has a kind of its own
("gconv-nhwc/32"). A table with no rows of grouped convolutions prices them by the dense class
of the same shape, as it did before the kind existed.

[Note: short reductions]
A channels-last batch norm reduces each channel over N x H x W rows; over few rows (ResNet's
and EfficientNet's 7x7 maps at 32 images: 1568) its kernels take a floor of their own, on an
H100 about 35 us forward and 20-28 us backward for 192 to 2048 channels, against 17 us for 256
channels over 6272 rows. Such a kernel (SHORT_REDUCTION bytes a channel or fewer, in the traced
dtype: 4096 rows of fp32) is a kind of its own ("norm:batch-nhwc:short/512ch"), with its own
launch time that holds the floor.

[Note: bound by what]
A convolution over 3 input channels (a stem, a patch embedding) runs far below both peaks, and
by how much depends on which side binds: on an H100 the memory-bound stems of ResNet, ConvNeXt
and EfficientNet take 3-5x their roofline, ViT's 16x16 patch embedding (compute-bound in the
roofline: 7.4 GFLOP over 32 images) 20x, 288 us forward against 79 us from the stems' one
factor. So such a class (``split_by_bound``) keeps a second factor for the compute side
("conv-nhwc/4:flops"), fitted on the rows the roofline calls compute-bound, and a kernel of it
takes max(compute x that factor, bytes x the class's factor): monotone in both. Any other class
has no compute factor of its own and prices as f x max(compute, bytes).

[Note: depthwise arithmetic]
A depthwise convolution runs on the vector units, and its time follows its arithmetic as well as
its bytes: per byte moved, a 5x5 kernel does 2.8x the multiply-adds of a 3x3 one, and a stride-2
one a quarter of a stride-1 one over the same input. Priced by bytes alone, they missed both
ways (on an H100 at 128 images, EfficientNet-B0's stride-2 3x3 ``blocks.1.0`` was priced 2.1 ms
against 0.91 ms measured, while ConvNeXt-B's 7x7 ones were priced under theirs). So a
depthwise kernel carries a second term, its FLOPs at the vector peak times a factor of its own
("dwconv-nhwc:compute"), added to the bytes term of its class: the fit shares that factor
between every kernel side and stride, where a class per kernel side saw each side in few models
(the h100 table's error on a model left out, 4-stage groups under CUDA graphs: median 15.4% ->
10.7%). One shape stays out of their reach: see [Note: kernels off their class].

[Note: strided depthwise]
A depthwise convolution with a stride over one runs other kernels than a stride-1 one, and
further below its price: on an H200 at 128 channels-last images, EfficientNet-B0's and
MobileNetV3-L's stride-2 ones took 1.35-1.54x what the depthwise kind priced (the 5x5 one over
56 x 56 x 144: 0.625 ms against 0.429, its backward 1.54x), while their stride-1 ones took
0.6-0.9x: one kind's factors split the difference. The strided ones sit at the high-resolution
ends of those models, one or two to a stage, so the error stays in a stage's sum: an 8-stage
plan of EfficientNet-B0 at 128 images priced one stage 18% low and measured 1.195. So such a
kernel's class is a kind of its own ("dwconv:strided-nhwc/16MiB", ``STRIDED`` in
kernel_classes.py), with its own arithmetic term, and a table fitted before the split prices it
by the depthwise kind's figures (``PARENT_KINDS``).

[Note: kernels off their class]
A few kernels run far from every price their class can give, for reasons of the library's own:
the weight gradient of the 5x5 stride-2 depthwise convolution over 672 channels at 14x14
(EfficientNet-B0's and MobileNetV3-L's ``blocks.5.0``) takes 0.90 ms at 128 channels-last images
on an H100, where cuDNN runs it in 0.035 ms at 32 images and its neighbours' take 0.06-0.12 ms
at 128 (``cudnn.benchmark`` picks the same kernel). No term of bytes or arithmetic prices one
shape at 7x its neighbours. So a table keeps, by exact shape (``NodeCost.shape``: operands,
stride, padding, dilation, groups, layout), the measured seconds of the kernels its rows found
at OFF_CLASS_RATIO times their class's price or more, and OFF_CLASS_SECONDS beyond it
(``kernels``); the class factors are fitted without them, and a kernel of such a shape is
priced at its measured time. A shape no row has seen is priced by its class.

[Note: replay gaps]
A stage replayed as a CUDA graph still leaves the GPU idle between two of its kernels, about
0.5 us on an H100, which no kernel's duration holds: on the hundreds of small kernels of a Swin
or ViT stage it adds up. A table keeps it per execution mode (``gap``), fitted with a stage's
fixed cost and its boundary copies on what a segment takes beyond its measured kernels.

[Note: boundary copies]
A stage replayed as CUDA graphs copies what crosses its boundaries on the device, outside any
node: its inputs into the graph's static buffers and its outputs out of them (forward), its
outputs' gradients in and its inputs' gradients out (backward; runtime/graphs.py): four
copies of every boundary byte, each read and written. On an H100, what a segment of a profile
takes beyond the measured kernel times of its nodes is 87 us plus a byte of its inputs and
outputs per 0.77 TB/s (median residual 31 us over 448 segments of seven models at 32 and 128
images, against 80 us around the median). At 128 images a cut after ResNet-50's layer1
carries 205 MB (bf16): about 0.27 ms on each stage beside it, more than a stage's fixed cost.
So a table keeps, per execution mode, seconds per boundary byte (``boundary``), fitted on that
excess over measured kernel times (so that it does not soak up the node model's own errors),
and the partitioner and the layout search add them to both stages beside each cut
(partition/transfers.py, ``boundary_copy_seconds``). Eager stages hand their tensors over as
they are: no rate. A measured profile fits its own ([Note: a profile's boundary copies] in
measure/boundary_copies.py). The replayed stages have since stopped copying ([Note: graph slots
as boundaries] in runtime/graphs.py; a ResNet-50 profile then fits a rate of 0 on an H200), so
the committed tables' ``graphs`` rates (fitted at 1.34 and 0.92 us per MB on the H100 and H200)
were set to 0; the rate stays for a table fitted where a mode copies.

[Note: a GEMM class's fixed time]
A GEMM's backward at a small micro-batch takes more than its share of the same GEMM at a large
one, and by how much depends on its class: on an H200 (calibration rows of eleven models at 32
and 128 images), the line through each linear layer's backward at the two sizes crosses zero
work at 66-70 us for ``gemm/128`` (Swin-B's and ConvNeXt-B's first blocks), 34 us for
``gemm/256``, 16-18 us for ``gemm/512`` and ``gemm/1024``; a convolution's is 11-15 us at every
width. One launch time per kind (20.6 us for every GEMM backward) left the first blocks of
Swin-B at 32 images priced at 0.69x what their backward ran, and the stage holding them the
slowest of eight. So a GEMM's launch time is kept by its class (``launch_key``); every other
kind keeps one. A table fitted with one per kind prices every GEMM class by it.

The factors are fitted by ``benchmarks/calibrate_device.py`` from the measured forward and
backward kernel times of every node of real models (non-negative least squares on relative
error; see that script), and kept as data beside this module (``calibration/<device>.json``)
with the fit's error on models it was not fitted on.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from autopipe.errors import ConfigError
from autopipe.partition.cost import FREE_KINDS, NodeCost
from autopipe.partition.kernel_classes import (BYTE_BOUNDS, BYTE_LABELS, BYTE_LIMITS, COMPUTE, DIM_BOUNDS, FLOPS, NHWC,
                                               SHORT_REDUCTION, SHORT_ROW, class_fallbacks, class_of, compute_class,
                                               kernel_kind, launch_key, plain_class, split_by_bound,
                                               term_fallbacks)

__all__ = ["Calibration", "class_of", "kernel_kind", "launch_key", "plain_class", "load_calibration", "CALIBRATION_DIR",
           "DIM_BOUNDS", "BYTE_BOUNDS", "BYTE_LABELS", "BYTE_LIMITS", "NHWC", "FLOPS", "COMPUTE", "SHORT_REDUCTION",
           "SHORT_ROW", "split_by_bound", "compute_class", "compute_features", "OFF_CLASS_RATIO", "OFF_CLASS_SECONDS"]

SCHEMA_VERSION = 1
CALIBRATION_DIR = os.path.join(os.path.dirname(__file__), "calibration")
OFF_CLASS_RATIO, OFF_CLASS_SECONDS = 3.0, 100e-6  # [Note: kernels off their class]


@dataclass(frozen=True)
class Calibration:
    """Fitted factors of one device; see [Note: calibrated roofline]."""

    device: str  # the name the device reports, e.g. torch.cuda.get_device_name()
    factors: dict[str, tuple[float, float]]  # class -> (forward, backward) multiplier of roofline time
    launch: tuple[float, float]  # GPU seconds per launched kernel of a kind not in launches
    host: tuple[float, float]  # host seconds per launched node in eager mode (forward, backward)
    stage: dict[str, float] = field(default_factory=dict)  # execution mode -> a stage's fixed seconds
    fit: dict[str, Any] = field(default_factory=dict)  # how it was made and its error
    launches: dict[str, tuple[float, float]] = field(default_factory=dict)  # launch_key -> (fwd, bwd) seconds
    # execution mode -> device seconds per byte crossing a stage's boundaries ([Note: boundary copies])
    boundary: dict[str, float] = field(default_factory=dict)
    # execution mode -> device seconds between two kernels of a replayed stage ([Note: replay gaps])
    gap: dict[str, float] = field(default_factory=dict)
    # kernel shape -> (fwd, bwd) measured GPU seconds, 0 where its class prices it ([Note: kernels off their class])
    kernels: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Whether ``host`` was fitted through the launch queue, and eager stages are priced so
    # ([Note: eager launch queue] in measure/eager_host.py); older tables price an eager node
    # as the larger of its device and host time.
    launch_queue: bool = False
    view_host: tuple[float, float] = (0.0, 0.0)  # host seconds per view in eager mode (fwd, bwd), with the queue
    node_host: tuple[float, float] = (0.0, 0.0)  # host seconds per op besides its kernels', with the queue
    # kernel_kind -> (fwd, bwd) kernels one of that kind launches, counted by the profiler; 1 where absent
    host_kernels: dict[str, tuple[float, float]] = field(default_factory=dict)
    host_probe: float = 0.0  # the pace probe of the host the eager host terms are for (s; 0: unknown)
    schema: int = SCHEMA_VERSION

    def gpu_time(self, cost: NodeCost, *, compute: float, bandwidth: float, backward: bool,
                 vector: float = 0.0) -> float:
        """GPU seconds of one launched kernel: ``compute`` seconds of arithmetic at the plain
        peak, its bytes at ``bandwidth``, ``vector`` seconds of arithmetic at the vector peak
        (priced where its class has a term for it: [Note: depthwise arithmetic]). See [Note:
        monotone in bytes]."""
        measured = self.kernel_seconds(cost.shape, backward)
        if measured > 0:
            return measured
        return self._roofline_time(cost, compute, bandwidth, backward) + self._vector_time(cost, vector, backward)

    def _vector_time(self, cost: NodeCost, vector: float, backward: bool) -> float:
        term = compute_class(cost, backward=backward)
        return self.vector_factor(term, backward) * vector if term is not None and vector > 0 else 0.0

    def vector_factor(self, term: str, backward: bool) -> float:
        """The multiplier of a vector-arithmetic term ``term`` (a channels-last term the fit never
        saw takes its NCHW one's; none: 0): [Note: depthwise arithmetic]."""
        pair = next((self.factors[k] for k in term_fallbacks(term) if k in self.factors), None)
        return pair[int(backward)] if pair is not None else 0.0

    def kernel_seconds(self, shape: str, backward: bool) -> float:
        """The measured GPU seconds of a kernel of exact ``shape``, or 0 where its class prices
        it ([Note: kernels off their class])."""
        return self.kernels.get(shape, (0.0, 0.0))[int(backward)] if shape else 0.0

    def _roofline_time(self, cost: NodeCost, compute: float, bandwidth: float, backward: bool) -> float:
        nbytes = cost.bwd_bytes if backward else cost.fwd_bytes
        name = class_of(cost, backward=backward)
        prefix, _, bucket = name.rpartition("/")
        if not bucket.endswith("iB"):  # a class by shape: see [Note: bound by what]
            return max(compute * self.flops_factor(name, backward), nbytes / bandwidth * self.factor(name, backward)) \
                + self.launch_time(name, backward)
        top = BYTE_LABELS.index(bucket)
        seconds = max(self.factor(f"{prefix}/{BYTE_LABELS[j]}", backward)
                      * max(compute, min(nbytes, BYTE_LIMITS[j]) / bandwidth) for j in range(top + 1))
        return seconds + self.launch_time(name, backward)

    def launch_time(self, name: str, backward: bool) -> float:
        """The GPU seconds a launched kernel of class ``name`` adds besides its roofline: its
        ``launch_key``'s, else its kind's (a table fitted with one per kind), else ``launch``."""
        keys = [k for f in class_fallbacks(name) for k in dict.fromkeys((launch_key(f), kernel_kind(f)))]
        pair = next((self.launches[k] for k in keys if k in self.launches), self.launch)
        return pair[int(backward)]

    def launch_host(self, name: str, backward: bool) -> float:
        """The host seconds an eager op of class ``name`` costs the launch queue: ``node_host``, and
        ``host`` for each kernel its kind launches (``host_kernels``)."""
        d = int(backward)
        return self.node_host[d] + self.host[d] * next((self.host_kernels[k][d] for k in map(
            kernel_kind, class_fallbacks(name)) if k in self.host_kernels), 1.0)

    def factor(self, name: str, backward: bool) -> float:
        """The fitted multiplier of class ``name``, else of its fallbacks (``class_fallbacks``), else 1
        (a class the fit never saw)."""
        pair = next((self.factors[k] for k in class_fallbacks(name) if k in self.factors), None)
        return pair[int(backward)] if pair is not None else 1.0

    def flops_factor(self, name: str, backward: bool) -> float:
        """The multiplier of the compute side of class ``name``'s roofline: its own where the fit
        kept one ([Note: bound by what]), else the class's."""
        pair = next((self.factors[k + FLOPS] for k in class_fallbacks(name) if k + FLOPS in self.factors), None)
        return pair[int(backward)] if pair is not None else self.factor(name, backward)

    def gap_time(self, mode: str) -> float:
        """The device seconds between two kernels a stage replays in ``mode`` ([Note: replay gaps])."""
        return self.gap.get("graphs", 0.0) if mode.endswith("graphs") else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        try:
            if data.get("schema") != SCHEMA_VERSION:
                raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA_VERSION}")
            factors = {str(k): (float(v[0]), float(v[1])) for k, v in data["factors"].items()}
            bad = [k for k, v in factors.items() if not all(math.isfinite(x) and x >= 0 for x in v)]
            if bad:
                raise ValueError(f"negative or non-finite factors for {', '.join(bad)}")
            launches = {str(k): (float(v[0]), float(v[1])) for k, v in data.get("launches", {}).items()}
            if not all(math.isfinite(x) and x >= 0 for v in launches.values() for x in v):
                raise ValueError("negative or non-finite launch times")
            boundary = {str(k): float(v) for k, v in data.get("boundary", {}).items()}
            gap = {str(k): float(v) for k, v in data.get("gap", {}).items()}
            if not all(math.isfinite(v) and v >= 0 for v in (*boundary.values(), *gap.values())):
                raise ValueError("negative or non-finite boundary seconds per byte or gaps between kernels")
            kernels = {str(k): (float(v[0]), float(v[1])) for k, v in data.get("kernels", {}).items()}
            if not all(math.isfinite(x) and x >= 0 for v in kernels.values() for x in v):
                raise ValueError("negative or non-finite kernel seconds")
            pairs = {key: tuple(map(float, data.get(key, (0.0, 0.0)))) for key in ("view_host", "node_host")}
            host_kernels = {str(k): tuple(map(float, v)) for k, v in data.get("host_kernels", {}).items()}
            for key, pair in (*pairs.items(), *host_kernels.items()):
                if len(pair) != 2 or not all(math.isfinite(x) and x >= 0 for x in pair):
                    raise ValueError(f"{key} must be two non-negative numbers, got {pair!r}")
            host_probe = float(data.get("host_probe", 0.0))
            if not (math.isfinite(host_probe) and host_probe >= 0):
                raise ValueError(f"host_probe must be non-negative seconds, got {host_probe!r}")
            return cls(str(data["device"]), factors, tuple(map(float, data["launch"])),
                       tuple(map(float, data["host"])), {str(k): float(v) for k, v in data.get("stage", {}).items()},
                       dict(data.get("fit", {})), launches, boundary, gap, kernels,
                       launch_queue=bool(data.get("launch_queue", False)), host_kernels=host_kernels,
                       host_probe=host_probe, **pairs)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"not a calibration table: {exc}") from exc


def load_calibration(name_or_path: str) -> Calibration | None:
    """A calibration by device profile name (``calibration/<name>.json`` beside this module, None
    when the project has none for it) or from a file path (a ConfigError naming it if unreadable)."""
    path = name_or_path if os.sep in name_or_path or name_or_path.endswith(".json") \
        else os.path.join(CALIBRATION_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        if path.startswith(CALIBRATION_DIR):
            return None
        raise ConfigError(f"calibration file {path!r} does not exist")
    try:
        with open(path) as f:
            return Calibration.from_dict(json.load(f))
    except (OSError, json.JSONDecodeError, ConfigError) as exc:
        raise ConfigError(f"cannot read calibration {path!r}: {exc}; remake it with "
                          "benchmarks/calibrate_device.py or delete it") from exc


def launched(cost: NodeCost) -> list[NodeCost]:
    """The kernels a node launches: its parts (a composite module) or itself; none for views."""
    kernels = cost.parts or (cost,)
    return [k for k in kernels if k.kind not in FREE_KINDS]


def kernel_features(cost: NodeCost, profile: Any, *, backward: bool) -> list[tuple[str, float]]:
    """(class, plain roofline seconds) of every kernel a node launches in one direction, on an
    uncalibrated ``profile``: the terms a calibration's factors multiply."""
    base = profile if profile.calibration is None else _uncalibrated(profile)
    out = []
    for k in launched(cost):
        seconds = base.node_time(k, backward=backward)
        if seconds > 0:
            name = class_of(k, backward=backward)
            flops, nbytes = (k.bwd_flops, k.bwd_bytes) if backward else (k.fwd_flops, k.fwd_bytes)
            if split_by_bound(name) and flops / base.matmul_flops > nbytes / base.mem_bandwidth:
                name += FLOPS
            out.append((name, seconds - base.op_overhead))
    return out


def compute_features(cost: NodeCost, profile: Any, *, backward: bool) -> list[tuple[str, float]]:
    """(class, seconds at the vector peak) of the arithmetic terms of the kernels a node launches
    in one direction ([Note: depthwise arithmetic]): terms a factor multiplies, not kernels."""
    out = []
    for k in launched(cost):
        term = compute_class(k, backward=backward)
        flops = k.bwd_flops if backward else k.fwd_flops
        if term is not None and flops > 0:
            out.append((term, flops / profile.vector_flops))
    return out


def _uncalibrated(profile: Any) -> Any:
    from dataclasses import replace

    return replace(profile, calibration=None)
