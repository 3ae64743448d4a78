"""A layout search for people: a ranked table with the refused layouts, and a figure."""
from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING

from autopipe.partition.report import check_figure_path, human_bytes

if TYPE_CHECKING:
    from .search import SearchResult

__all__ = ["format_search", "plot_search"]


def format_search(result: SearchResult, top: int = 12, refused: int = 12) -> str:
    """The header, the ``top`` fastest layouts and up to ``refused`` reasons layouts were refused."""
    head = (f"{result.devices} devices ({result.device}), global batch {result.batch}"
            + (f", {human_bytes(result.memory_budget)} per device" if result.memory_budget else "")
            + f"; costs {result.costs}; links {result.links}; {result.estimated} layouts weighed in "
              f"{result.seconds:.2f} s")
    rows = [["rank", "layout", "samples/s", "step", "memory/device", "bubble", "dp all-reduce"]]
    for i, p in enumerate(result.ranked[:top], 1):
        rows.append([str(i), str(p.layout), f"{p.samples_per_second:,.1f}", f"{p.step_seconds * 1e3:.1f} ms",
                     human_bytes(p.memory_bytes), f"{p.bubble:.1%}", f"{p.parts.get('dp_all_reduce', 0) * 1e3:.1f} ms"])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [head, ""] + ["  ".join(cell.ljust(w) if c == 1 else cell.rjust(w) for c, (cell, w) in
                                    enumerate(zip(r, widths))).rstrip() for r in rows]
    best = result.best
    lines += ["", f"chosen: {best.layout} -> parallelize({', '.join(f'{k}={v!r}' for k, v in best.layout.parallelize_kwargs().items())})"]
    if result.rejected:
        counts = Counter(r.reason for r in result.rejected)
        lines += ["", f"refused ({len(result.rejected)}):"]
        for reason, n in counts.most_common(refused):
            example = next(r.layout for r in result.rejected if r.reason == reason)
            lines.append(f"- {example}{f' and {n - 1} more' if n > 1 else ''}: {reason}")
    return "\n".join(lines)


def plot_search(result: SearchResult, path: str | os.PathLike[str], top: int = 10) -> None:
    """Predicted throughput of the top layouts, and the chosen layout's timeline (one row per
    pipeline rank, forwards light, backwards dark)."""
    ext = check_figure_path(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = result.ranked[:top]
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    bars, gantt = fig.subplots(1, 2, width_ratios=[1, 1.4])
    names = [str(p.layout) for p in shown][::-1]
    bars.barh(names, [p.samples_per_second for p in shown][::-1], color="#4c72b0")
    bars.set(xlabel="predicted samples/s", title=f"top {len(shown)} of {result.estimated} layouts")
    bars.tick_params(axis="y", labelsize="x-small")
    best = result.best
    for rank, action, start, end in best.spans:
        backward = action.startswith("B")
        gantt.barh(rank, (end - start) * 1e3, left=start * 1e3, color="#c44e52" if backward else "#55a868",
                   edgecolor="white", linewidth=0.3)
    gantt.set(xlabel="ms", ylabel="pipeline rank", title=f"chosen: {best.layout} (bubble {best.bubble:.1%})")
    gantt.set_yticks(range(best.layout.pp))
    gantt.invert_yaxis()
    fig.suptitle(f"{result.devices} devices, batch {result.batch}: predicted step {best.step_seconds * 1e3:.1f} ms, "
                 f"{best.samples_per_second:,.0f} samples/s", fontsize="medium")
    fig.savefig(path, format=ext)
