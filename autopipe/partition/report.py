"""A partition plan for people: an aligned text table (what ``str(plan)`` prints) and a figure.

Reads only the plan's plain data, so a plan loaded back from JSON renders the same way; the
figure needs matplotlib (``pip install 'autopipe[report]'``), the table nothing.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

from ..errors import ConfigError

if TYPE_CHECKING:
    from .plan import CutTensor, PartitionPlan, StagePlan

__all__ = ["format_table", "plot", "check_figure_path", "time_parts", "figure_title", "human_count",
           "human_flops", "human_bytes", "format_cut"]

# A cut listed tensor by tensor while it has this many tensors and fits in this many characters;
# past that the cell says "5 tensors, 1.5 MiB" so one long residual list cannot widen the table.
_CUT_MAX_TENSORS = 2
_CUT_MAX_CHARS = 64
_MODULE_MAX_CHARS = 48
SLOW_PACE_NOTED = 0.03  # max/mean beyond the plan's at which its cut at the host's slow pace is reported

_OPTIMIZER_NOTE = "params/grads/optimizer state"


def human_count(n: float) -> str:
    """``86_567_656 -> "86.6M"``: parameter counts in K, M, B."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def human_flops(f: float) -> str:
    """``3.5e12 -> "3.50 TFLOP"``; three significant figures from MFLOP up to PFLOP."""
    for div, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if abs(f) >= div:
            return f"{_three_figures(f / div)} {unit}"
    return f"{f:.0f} FLOP"


def human_bytes(b: float) -> str:
    """Binary units, as memory is sized: ``1536 -> "1.5 KiB"``."""
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(b) >= div:
            return f"{b / div:.1f} {unit}"
    return f"{b:.0f} B"


def _three_figures(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _tensor(t: CutTensor) -> str:
    return f"{t.name}[{','.join(map(str, t.shape))}] {t.dtype} {human_bytes(t.nbytes)}"


def format_cut(tensors: Sequence[CutTensor]) -> str:
    """The tensors a stage sends on: each as ``name[shape] dtype bytes``, or a count when long."""
    if not tensors:
        return "-"
    listed = ", ".join(_tensor(t) for t in tensors)
    if len(tensors) <= _CUT_MAX_TENSORS and len(listed) <= _CUT_MAX_CHARS:
        return listed
    total = sum(t.nbytes for t in tensors)
    noun = "tensor" if len(tensors) == 1 else "tensors"
    return f"{len(tensors)} {noun}, {human_bytes(total)}"


def _shorten(text: str, width: int) -> str:
    # Cut in the middle: both ends of a module path say where a stage lies.
    if len(text) <= width:
        return text
    half = (width - 1) // 2
    return text[:half] + "…" + text[len(text) - (width - 1 - half):]


def _range(first: str, last: str) -> str:
    return first if first == last else f"{first}..{last}"


def _stage_row(stage: StagePlan, mean: float) -> list[str]:
    nodes = _range(stage.nodes[0], stage.nodes[-1]) if stage.nodes else "-"
    modules = _range(*stage.modules) if any(stage.modules) else "(root)"
    return [
        str(stage.index),
        f"{stage.pp_rank}/{stage.chunk}",
        f"{nodes} ({len(stage.nodes)})",
        _shorten(modules, _MODULE_MAX_CHARS),
        human_count(stage.params),
        human_flops(stage.flops),
        _ms(stage.cost),
        _ms(stage.analytic_time) if stage.analytic_time else "-",
        _ms(stage.measured_time) if stage.measured_time is not None else "-",
        _ms(stage.comm_time),
        human_bytes(stage.activation_bytes),
        human_bytes(stage.memory_bytes),
        format_cut(stage.outputs),
        f"{stage.cost / mean:.3f}x" if mean > 0 else "-",
    ]


_HEADINGS = [
    "stage", "rank/chunk", "nodes (count)", "modules", "params", "fwd+bwd",
    "time", "modelled", "measured", "of it comm", "activations", "memory", "cut at end", "vs mean",
]  # fmt: skip
_LEFT = {2, 3, 12}  # text columns; numbers align right


def _header(plan: PartitionPlan) -> str:
    """One line saying what was planned and how well it balances."""
    stages = plan.pp * plan.chunks
    return (
        f"{plan.model or '(model)'}: route {plan.route}, pp {plan.pp} x chunks {plan.chunks} x tp {plan.tp}"
        f" = {stages} stage{'s' if stages != 1 else ''}, {plan.microbatches} micro-batch"
        f"{'es' if plan.microbatches != 1 else ''} of size {plan.microbatch_size}, balance {plan.balance},"
        f" device {plan.device}, schedule {plan.schedule}, {human_count(plan.total_params)} params,"
        f" imbalance {plan.imbalance:.3f} (max/mean{_floor_note(plan)}){_measured_note(plan)}; {_source(plan)}"
    )


def _floor_note(plan: PartitionPlan) -> str:
    """The floor where the plan sits on it: no cut between nodes balances better."""
    if plan.floor is None or plan.imbalance > plan.floor * 1.005 or plan.floor < 1.02:
        return ""
    return f"; at the floor of cuts between nodes, {plan.floor:.3f}: a node is a large share of a stage"


def _measured_note(plan: PartitionPlan) -> str:
    ratio = plan.measured_imbalance
    return "" if ratio is None else f", measured {ratio:.3f}"


def _source(plan: PartitionPlan) -> str:
    """What priced the stages (plan.cost_source), in words."""
    src = plan.cost_source or {}
    if src.get("source") == "measured":
        loop = f", {len(plan.refinement)} timing round{'s' if len(plan.refinement) != 1 else ''}" \
            if plan.refinement else ""
        return f"costs measured on {src.get('device')} ({src.get('mode')}, {src.get('dtype')}{loop}{_pace(src)})"
    if src.get("source") == "analytic":
        how = "calibrated" if src.get("calibrated") else "uncalibrated"
        return f"costs modelled ({src.get('profile')} {how}, {src.get('mode')})"
    return "costs modelled"


def _slow_pace_lines(plan: PartitionPlan) -> list[str]:
    """The cut's max/mean at the host's slow pace, where it is off the plan's by more than
    SLOW_PACE_NOTED ([Note: a cut at another pace] in device.py)."""
    src = plan.cost_source or {}
    slow = src.get("slow_pace") or {}
    if not slow or not slow["imbalance"] > plan.imbalance + SLOW_PACE_NOTED:
        return []
    return [f"host pace: these eager stages were priced at a probe of {src['host_probe_us']:.0f} us; at the host's "
            f"slow pace ({slow['host_probe_us']:.0f} us) this cut reads {slow['imbalance']:.3f} max/mean. Stages "
            "as CUDA graphs (cuda_graphs=True) or timed as they run (costs=\"measured\") do not depend on the pace."]


def _pace(src: dict) -> str:
    """How often the timings waited for the host's pace, where any did ([Note: host pace])."""
    pace = src.get("host_pace") or {}
    if not pace.get("waited"):
        return ""
    short = f", {pace['short']} never reached it" if pace.get("short") else ""
    return f"; {pace['waited']} of {pace['timings']} timings waited for the host's pace{short}"


def format_table(plan: PartitionPlan) -> str:
    """The plan as a header line and one aligned row per stage (times per micro-batch)."""
    costs = [s.cost for s in plan.stages]
    mean = sum(costs) / len(costs) if costs else 0.0
    rows = [_HEADINGS] + [_stage_row(s, mean) for s in plan.stages]
    widths = [max(len(r[c]) for r in rows) for c in range(len(_HEADINGS))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(w) if c in _LEFT else cell.rjust(w) for c, (cell, w) in enumerate(zip(cells, widths))
        ).rstrip()

    body = [line(rows[0]), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]]
    notes = (
        "time: what the cut was priced at, forward+backward of one micro-batch, communication "
        "included; modelled: the analytic model's compute; measured: the stage timed alone on the "
        f"device; memory: {_OPTIMIZER_NOTE} plus activations of the micro-batches in flight"
    )
    return "\n".join([_header(plan), *body, *_pieces_lines(plan), *_slow_pace_lines(plan), notes])


def _pieces_lines(plan: PartitionPlan) -> list[str]:
    """One line per MLP a boundary falls inside: its pieces of hidden units (channels, for
    convolutions: a run of them, concatenated, or a pair with BatchNorms between); and one per
    pooling a boundary falls inside: its pieces of samples."""
    lines = []
    for fc1, spec in sorted(plan.mlp_pieces.items()):
        bounds = spec.get("samples", spec.get("hidden"))
        cuts = " | ".join(f"{a}:{b}" for a, b in zip(bounds, bounds[1:]))
        if "samples" in spec:
            lines.append(f"pooling cut across stages by sample: {fc1}, samples {cuts}")
        elif spec["fc2"] is None or spec.get("norms"):
            lines.append(f"convolution cut across stages by channel: {fc1} -> {spec['fc2'] or 'concatenated'}, "
                         f"channels {cuts}")
        else:
            lines.append(f"MLP cut across stages: {fc1} -> {spec['fc2']}, hidden units {cuts}")
    return lines


def _in_flight(plan: PartitionPlan) -> int:
    # Mirrors partition(): GPipe keeps every micro-batch's activations, 1F1B about one per stage.
    return plan.microbatches if plan.schedule == "gpipe" else min(plan.microbatches, plan.pp * plan.chunks)


def plot(plan: PartitionPlan, path: str | os.PathLike[str]) -> None:
    """Draw per-stage time (compute, exposed communication and latency, whose sum the mean line
    averages) and memory; format from ``path``.

    ``.png``, ``.svg`` and ``.pdf`` work; the figure is drawn without pyplot, so it neither needs
    a display nor changes the caller's matplotlib backend.
    """
    ext = check_figure_path(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x = [s.index for s in plan.stages]
    compute, exposed, latency = time_parts(plan)
    mean = sum(s.cost for s in plan.stages) * 1e3 / max(len(plan.stages), 1)
    in_flight = _in_flight(plan)
    activations = [s.activation_bytes * in_flight / 2**30 for s in plan.stages]
    # The partitioner adds state and activations; what is not activations is training state.
    state = [max(s.memory_bytes / 2**30 - a, 0.0) for s, a in zip(plan.stages, activations)]

    fig = Figure(figsize=(max(8.0, 0.45 * len(x) + 6), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_time, ax_mem = fig.subplots(1, 2)
    ax_time.bar(x, compute, label="compute", color="#4c72b0")
    ax_time.bar(x, exposed, bottom=compute, label="communication beyond compute", color="#dd8452")
    ax_time.bar(x, latency, bottom=[c + e for c, e in zip(compute, exposed)], label="transfer latency",
                color="#8172b3")
    ax_time.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.2f} ms")
    modelled = [s.analytic_time * 1e3 for s in plan.stages]
    if any(modelled) and (plan.cost_source or {}).get("source") == "measured":
        ax_time.plot(x, modelled, "D", color="#8172b2", label="analytic model")
    if all(s.measured_time is not None for s in plan.stages) and plan.stages:
        ax_time.plot(x, [s.measured_time * 1e3 for s in plan.stages], "o", color="black",
                     label=f"measured (max/mean {plan.measured_imbalance:.3f})")
    ax_time.set(xlabel="stage", ylabel="ms per micro-batch (fwd+bwd)", title=f"time, imbalance {plan.imbalance:.3f}")
    ax_mem.bar(x, state, label=_OPTIMIZER_NOTE, color="#55a868")
    ax_mem.bar(x, activations, bottom=state, label=f"activations ({in_flight} in flight)", color="#c44e52")
    ax_mem.set(xlabel="stage", ylabel="GiB", title="memory per stage")
    for ax in (ax_time, ax_mem):
        ax.set_xticks(x)
        ax.legend(fontsize="small")
    fig.suptitle(figure_title(plan), fontsize="medium")
    fig.savefig(path, format=ext)


def check_figure_path(path: str | os.PathLike[str]) -> str:
    """The figure format ``path`` names (png, svg, pdf), once matplotlib is known to be there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError("plotting a plan needs matplotlib: pip install 'autopipe[report]'") from exc
    ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if ext not in ("png", "svg", "pdf"):
        raise ConfigError(f"figure path {os.fspath(path)!r} must end in .png, .svg or .pdf")
    return ext


def time_parts(plan: PartitionPlan) -> tuple[list[float], list[float], list[float]]:
    """Each stage's modelled time in ms as the balancer counts it, in three parts that add up to
    ``StagePlan.cost`` (max(compute, comm) + latency; see [Note: communication in the stage
    cost]): compute, the communication compute does not hide, and the transfers' latency."""
    compute = [s.compute_time * 1e3 for s in plan.stages]
    exposed = [max(s.comm_time - s.compute_time, 0.0) * 1e3 for s in plan.stages]
    latency = [max(s.cost - max(s.compute_time, s.comm_time), 0.0) * 1e3 for s in plan.stages]
    return compute, exposed, latency


def figure_title(plan: PartitionPlan) -> str:
    stages = plan.pp * plan.chunks
    return (f"{plan.model}: {stages} stages (pp {plan.pp} x chunks {plan.chunks}), tp {plan.tp}, "
            f"{plan.microbatches} micro-batch{'es' if plan.microbatches != 1 else ''} of "
            f"{plan.microbatch_size}, balance {plan.balance}, {plan.device} profile")
