"""What class a launched kernel belongs to, in a calibration table: the names its fitted factors
and launch times are kept by ([Note: calibrated roofline] in partition/calibration.py, where the
notes named here are)."""
from __future__ import annotations

import math

from autopipe.partition.cost import MATMUL_KINDS, NodeCost

__all__ = ["class_of", "compute_class", "split_by_bound", "plain_class", "dense_class", "class_fallbacks",
           "kernel_kind", "launch_key", "DIM_BOUNDS", "BYTE_BOUNDS", "BYTE_LABELS", "BYTE_LIMITS", "NHWC", "FLOPS",
           "COMPUTE", "SHORT_REDUCTION", "SHORT_ROW", "PARENT_KINDS", "CLASS_LAUNCH_KINDS", "STRIDED",
           "term_fallbacks"]

DIM_BOUNDS = (4, 16, 32, 64, 128, 256, 512, 1024)
NHWC = "-nhwc"  # the layout mark of a channels-last kernel's class
FLOPS = ":flops"  # the mark of a class's compute-bound factor ([Note: bound by what])
COMPUTE = ":compute"  # the mark of a kernel kind's vector-arithmetic term ([Note: depthwise arithmetic])
BYTE_BOUNDS = tuple(2**18 * 4**i for i in range(5))  # 256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB
SHORT_REDUCTION = 2**14  # bytes a channel: a batch norm over fewer rows is short ([Note: short reductions])
SHORT_ROW = 256  # elements a row: a row norm over shorter rows is short ([Note: short rows] in op_rules.py)
STRIDED = ":strided"  # the mark of a depthwise convolution with a stride over 1 ([Note: strided depthwise])
# kinds split off another: a table fitted before the split prices them by it (op_rules: [Note: short rows], SCALE)
PARENT_KINDS = {"norm:row:short": "norm:row", "elementwise:scale": "elementwise:broadcast",
                "dwconv" + STRIDED: "dwconv", "dwconv" + STRIDED + NHWC: "dwconv" + NHWC}

BYTE_LABELS = tuple(f"{b >> 20}MiB" if b >= 2**20 else f"{b >> 10}KiB" for b in BYTE_BOUNDS) \
    + (f">{BYTE_BOUNDS[-1] >> 20}MiB",)
BYTE_LIMITS = BYTE_BOUNDS + (math.inf,)  # the most bytes of each bucket of BYTE_LABELS


def _bucket(value: float, bounds: tuple[int, ...], label=str) -> str:
    for b in bounds:
        if value <= b:
            return label(b)
    return ">" + label(bounds[-1])


def _bytes_label(b: int) -> str:
    return BYTE_LABELS[BYTE_BOUNDS.index(b)]


def class_of(cost: NodeCost, *, backward: bool = False) -> str:
    """The calibration class of one launched kernel (a node, or a part of a composite one)."""
    nbytes = cost.bwd_bytes if backward else cost.fwd_bytes
    layout = NHWC if cost.channels_last else ""  # see [Note: kernel layout]
    if cost.kind in MATMUL_KINDS:
        if cost.family == "dwconv":  # memory-bound: by bytes, as the vector kernels
            strided = STRIDED if cost.strided else ""  # [Note: strided depthwise]
            return f"dwconv{strided}{layout}/{_bucket(nbytes, BYTE_BOUNDS, _bytes_label)}"
        if cost.family in ("gemm", "conv", "gconv") and cost.min_dim > 0:
            return f"{cost.family}{layout}/{_bucket(cost.min_dim, DIM_BOUNDS)}"
        return cost.kind  # attention, or a GEMM whose shape the rule could not tell
    if cost.family == "batch" and cost.min_dim > 0:  # by channels: see op_rules.norm
        short = ":short" if cost.channels_last and cost.out_bytes <= SHORT_REDUCTION * cost.min_dim else ""
        return f"norm:batch{layout}{short}/{_bucket(cost.min_dim, DIM_BOUNDS)}ch"  # [Note: short reductions]
    short = ":short" if cost.family == "row" and 0 < cost.min_dim <= SHORT_ROW else ""  # [Note: short rows]
    kind = (f"{cost.kind}:{cost.family}" if cost.family else cost.kind) + short
    return f"{kind}{layout}/{_bucket(nbytes, BYTE_BOUNDS, _bytes_label)}"


def compute_class(cost: NodeCost, *, backward: bool = False) -> str | None:
    """The class of a kernel's vector-arithmetic term, for the kernels that carry one: depthwise
    convolutions ([Note: depthwise arithmetic]); None for any other."""
    if cost.kind in MATMUL_KINDS and cost.family == "dwconv":
        return kernel_kind(class_of(cost, backward=backward)) + COMPUTE
    return None


def split_by_bound(name: str) -> bool:
    """Whether class ``name`` keeps a factor for its compute-bound kernels apart from its
    memory-bound ones ([Note: bound by what]): convolutions over the thinnest inputs."""
    return dense_class(name).startswith("conv") and name.endswith(f"/{DIM_BOUNDS[0]}")


def plain_class(name: str) -> str:
    """The NCHW class of the same kernel shape ("conv-nhwc/64" -> "conv/64")."""
    return name.replace(NHWC, "", 1)


def dense_class(name: str) -> str:
    """The class of the ungrouped convolution of the same shape ("gconv-nhwc/32" -> "conv-nhwc/32")."""
    return name[1:] if name.startswith("gconv") else name


def term_fallbacks(term: str) -> tuple[str, ...]:
    """The terms whose fitted factor prices a kind's term ``term`` ("dwconv:strided-nhwc:compute"),
    first found first: its own, its NCHW one, and for a kind split off another that other's."""
    kind, mark = term.rsplit(":", 1)
    parent = (f"{PARENT_KINDS[kind]}:{mark}",) if kind in PARENT_KINDS else ()
    return tuple(dict.fromkeys(t for k in (term, *parent) for t in (k, plain_class(k))))


def class_fallbacks(name: str) -> tuple[str, ...]:
    """The classes whose fitted figures price class ``name``, first found first: its own, its
    NCHW class ([Note: kernel layout]), and for a grouped convolution the dense ones
    ([Note: grouped convolutions]), and for a kind split off another that other's (PARENT_KINDS)."""
    dense, (kind, _, bucket) = dense_class(name), name.partition("/")
    parent = f"{PARENT_KINDS[kind]}/{bucket}" if kind in PARENT_KINDS else ""
    return (name, plain_class(name)) + ((dense, plain_class(dense)) if dense != name else ()) \
        + (tuple(dict.fromkeys((parent, plain_class(parent)))) if parent else ())


def kernel_kind(name: str) -> str:
    """The kind of a calibration class ("conv/64" -> "conv")."""
    return name.split("/", 1)[0]


CLASS_LAUNCH_KINDS = ("gemm",)  # kinds whose launch time is kept by class ([Note: a GEMM class's fixed time])


def launch_key(name: str) -> str:
    """What the launch time of class ``name`` is kept by: the class for a GEMM ("gemm/128"), the
    kind for any other ("conv-nhwc/64" -> "conv-nhwc")."""
    kind = kernel_kind(name)
    return name if kind in CLASS_LAUNCH_KINDS else kind
