"""Fit a calibration table's eager host terms to eager stages timed on the GPU.

The analytic model prices an eager stage by replaying its kernels through the launch queue
([Note: eager launch queue] in autopipe/measure/eager_host.py): each kernel costs the host
``host`` seconds (forward, backward), each view ``view_host``, and a stage its fixed
``stage["eager"]``. The kernels' device times come from the table. This script fits those host
terms on stages as they ran: the analytic plans that ``benchmarks/measured_balance.py --plans
analytic --modes eager`` timed, whose rows keep each stage's first node (``stage_starts``) and
the pieces the plan cut nodes into (``mlp_pieces``). Each model is traced again here (no GPU
needed), cut into those pieces, and its stages replayed.

    python benchmarks/fit_eager_host.py benchmarks/results/2026-11-28-h200-analytic-plans-eager-node-by-node.json \
        --name h200 [--write]

Prints the error of the table as it is, of the fit in sample, and leaving each model out of the
fit in turn (the error a model the fit has not seen carries), and per timed plan the spread of
its stages' measured over modelled times (max/mean: what a plan the fitted terms balance would
measure, to first order); with ``--write`` the fitted terms
go into autopipe/partition/calibration/NAME.json (``launch_queue`` set). With ``--launch-counts
ROWS...`` the model fitted is a host time per op (a node, a composite's part) plus one per
kernel launched, the kernels an op of each class family launches counted in calibration rows
(``Calibration.node_host``, ``host_kernels``). With ``--pace`` each stage's host terms are scaled by the host's pace when it
was timed, the timer's reference probe over the median one ([Note: host pace];
``Calibration.host_probe``, in the units of the probe a plan is made at).
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import statistics
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopipe.models import default_input, load_model  # noqa: E402
from autopipe.partition.calibration import CALIBRATION_DIR, class_of  # noqa: E402
from autopipe.partition.cost import graph_costs  # noqa: E402
from autopipe.partition.device import PROFILES  # noqa: E402
from autopipe.partition.launch_queue import queue_steps  # noqa: E402
from autopipe.stages import cut_mlps  # noqa: E402
from autopipe.tracer import trace  # noqa: E402

US = 1e-6
# Starting points, in microseconds: host per kernel (fwd, bwd), per view (fwd, bwd) and, for the
# model with counted launches, per op (fwd, bwd).
STARTS = ((30.0, 30.0, 10.0, 0.0), (50.0, 50.0, 0.0, 0.0), (20.0, 60.0, 20.0, 5.0), (60.0, 20.0, 5.0, 0.0))
COUNTED_STARTS = ((5.0, 5.0, 10.0, 0.0, 20.0, 20.0), (10.0, 10.0, 20.0, 0.0, 10.0, 10.0), (2.0, 8.0, 10.0, 0.0, 30.0, 10.0))


@dataclasses.dataclass
class Stage:
    model: str
    microbatch: int
    # in graph order: (is a view, device fwd s, device bwd s, launches fwd, launches bwd)
    kernels: list[tuple[bool, float, float, float, float]]
    measured: float  # seconds, forward + backward, as timed
    table_price: float  # seconds, as the table prices it today
    pace: float = 0.0  # the timer's reference probe when it was timed ([Note: host pace]), s; 0: not kept
    probe: float = 0.0  # the probe its plan was made at (measure.host_pace.probe_seconds), s; 0: not kept
    plan: str = ""  # the timed plan it is a stage of
    scale: float = 1.0  # what its host terms are multiplied by: its pace over the table's (--pace)

    def __post_init__(self) -> None:
        # Per pass, in launch order, the steps that launch or are views: (is a view, device s,
        # launches), as launch_queue.analytic_launches lists them.
        self.passes = [[(k[0], k[1 + d], k[3 + d]) for k in kernels if k[0] or k[1 + d] > 0]
                       for d, kernels in ((0, self.kernels), (1, self.kernels[::-1]))]


def launch_counts(rows: list[str]) -> dict[str, tuple[float, float]]:
    """The kernels a node of each class family launches, forward and backward, on average over
    calibration rows (``calibrate_device.py collect``; the profiler's count, small kernels too)."""
    sums: dict[str, list[float]] = {}
    for path in rows:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as fh:
            for r in json.load(fh)["nodes"]:
                if r["fwd"]["features"]:
                    acc = sums.setdefault(sorted(r["fwd"]["features"])[0].split("/")[0], [0, 0.0, 0.0])
                    acc[0] += 1
                    acc[1] += r["fwd"].get("kernels_seen", 1)
                    acc[2] += r["bwd"].get("kernels_seen", 1)
    return {k: (f / n, b / n) for k, (n, f, b) in sums.items()}


def stages_of(paths: list[str], name: str, counts: dict[str, tuple[float, float]] | None = None) -> list[Stage]:
    """The timed eager stages of the analytic plans in ``paths``, each with its kernels' device
    times under table ``name`` and, with ``counts`` (``launch_counts``), the kernels each
    launches by its class family (else one)."""
    profile = PROFILES[name].with_mode("eager")
    # a table whose host time per kernel is 1: its launch_host is the kernels a class launches
    counter = dataclasses.replace(profile.calibration, host=(1.0, 1.0), host_kernels=counts or {})
    out: list[Stage] = []
    traced_by: dict[tuple, Any] = {}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        layout = bool(data.get("channels_last"))
        for row_index, row in enumerate(data["rows"]):
            plan = row.get("analytic")
            if row.get("mode") != "eager" or not plan or "stage_starts" not in plan:
                continue
            key = (row["model"], row["microbatch"], layout)
            if key not in traced_by:
                traced_by.clear()  # one model held at a time
                model = load_model(f"timm:{row['model']}")
                example = default_input(model, row["microbatch"])
                if layout:
                    model = model.to(memory_format=torch.channels_last)
                    example = example.contiguous(memory_format=torch.channels_last)
                traced_by[key] = trace(model, (example,))
            traced = traced_by[key]
            gm = (cut_mlps(traced, plan["mlp_pieces"]) if plan.get("mlp_pieces") else traced).gm
            costs = graph_costs(gm)
            order = [n.name for n in gm.graph.nodes if n.op != "output"]
            starts = [order.index(n) for n in plan["stage_starts"]] + [len(order)]
            for i, (a, b) in enumerate(zip(starts, starts[1:])):
                kernels = []
                for n in order[a:b]:
                    c = costs[n]
                    for p in c.parts or (c,):
                        launches = (counter.launch_host(class_of(p), False),
                                    counter.launch_host(class_of(p, backward=True), True))
                        kernels.append((False, profile.kernel_time(p), profile.kernel_time(p, backward=True),
                                        *launches))
                    if c.kind == "view":
                        kernels.append((True, 0.0, 0.0, 0.0, 0.0))
                out.append(Stage(row["model"], row["microbatch"], kernels, plan["measured_ms"][i] * 1e-3,
                                 plan["modelled_ms"][i] * 1e-3, row.get("host_pace", {}).get("reference_us", 0.0) * US,
                                 plan.get("host_probe_us", 0.0) * US, f"{path}:{row_index}"))
    return out


def replay(stage: Stage, terms: tuple[float, ...]) -> float:
    """The stage's seconds through the launch queue, without its fixed cost; ``terms`` in us: per
    launched kernel, per view and (where given) per op, forward and backward."""
    node = terms[4:6] if len(terms) > 4 else (0.0, 0.0)
    total, us = 0.0, US * stage.scale
    for d, steps in enumerate(stage.passes):
        total += sum(queue_steps([(terms[2 + d] * us, 0.0) if view else ((terms[d] * launches + node[d]) * us, seconds)
                                  for view, seconds, launches in steps if not view or terms[2 + d] > 0]))
    return total


def errors(stages: list[Stage], terms: tuple[float, ...], fixed: float) -> np.ndarray:
    return np.array([(replay(s, terms) + fixed) / s.measured - 1 for s in stages])


def fit(stages: list[Stage], starts: tuple[tuple[float, ...], ...] = STARTS) -> tuple[tuple[float, ...], float]:
    """The host terms (us) and the stage's fixed seconds of least mean relative error."""
    from scipy.optimize import minimize

    def loss(x: np.ndarray) -> float:
        if (x < 0).any():
            return 1e3 + float(-x[x < 0].sum())
        replayed = [replay(s, tuple(x)) for s in stages]
        fixed = max(statistics.median(s.measured - r for s, r in zip(stages, replayed)), 0.0)
        return float(np.mean([abs(r + fixed - s.measured) / s.measured for s, r in zip(stages, replayed)]))

    # The loss has flat stretches (a host term that never binds) and local minima: several starts.
    found = [minimize(loss, np.array(x0), method="Nelder-Mead", options={"xatol": 0.2, "fatol": 1e-5, "maxiter": 600})
             for x0 in starts]
    terms = tuple(float(max(v, 0.0)) for v in min(found, key=lambda r: r.fun).x)
    fixed = max(statistics.median(s.measured - replay(s, terms) for s in stages), 0.0)
    return terms, fixed


def plan_spreads(stages: list[Stage], terms: tuple[float, ...], fixed: float) -> np.ndarray:
    """Per timed plan, the max/mean over its stages of measured over modelled time: what a plan
    the model balances measures, to first order."""
    ratios: dict[str, list[float]] = {}
    for s in stages:
        ratios.setdefault(s.plan, []).append(s.measured / (replay(s, terms) + fixed))
    return np.array([max(r) / statistics.mean(r) for r in ratios.values() if len(r) > 1])


def summary(err: np.ndarray) -> dict[str, float]:
    a = np.abs(err)
    return {"stages": int(len(a)), "mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "within_10pct": int((a < 0.10).sum())}


def _line(label: str, s: dict[str, float]) -> str:
    return (f"{label:34s} mean {s['mean']:.3f}  median {s['median']:.3f}  p90 {s['p90']:.3f}  "
            f"within 10% {s['within_10pct']}/{s['stages']}")


def evaluate(stages: list[Stage], starts: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], float, dict, dict]:
    """(terms, fixed seconds, in-sample error, leave-one-model-out error with each model's mean)."""
    terms, fixed = fit(stages, starts)
    left_out: list[float] = []
    by_model: dict[str, float] = {}
    for model in sorted({s.model for s in stages}):
        t, f = fit([s for s in stages if s.model != model], (terms,))
        err = errors([s for s in stages if s.model == model], t, f)
        left_out += list(err)
        by_model[model] = float(np.mean(np.abs(err)))
    return terms, fixed, summary(errors(stages, terms, fixed)), dict(summary(np.array(left_out)), by_model=by_model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="measured_balance.py results with eager analytic plans")
    parser.add_argument("--name", required=True, help="the device profile whose table is fitted (h100, h200)")
    parser.add_argument("--write", action="store_true", help="write the fitted terms into the table")
    parser.add_argument("--launch-counts", nargs="+", metavar="ROWS",
                        help="fit a host time per op plus one per kernel launched instead, the kernels each class "
                             "launches counted in these calibration rows")
    parser.add_argument("--pace", action="store_true",
                        help="scale each stage's host terms by the host's probe when it was timed over the median "
                             "probe, written as the table's host_probe ([Note: host pace])")
    args = parser.parse_args(argv)
    if args.name not in PROFILES:
        raise SystemExit(f"--name {args.name!r} is not a device profile; one of {sorted(PROFILES)}")
    counts = launch_counts(args.launch_counts) if args.launch_counts else None
    stages = stages_of(args.results, args.name, counts)
    if not stages:
        raise SystemExit("no eager analytic plan with stage_starts in the results given")
    reference = 0.0
    if args.pace:
        if not all(s.pace > 0 for s in stages):
            raise SystemExit("--pace needs every row's host probe (results of measured_balance.py that keep host_pace)")
        reference = statistics.median(s.pace for s in stages)
        for s in stages:
            s.scale = s.pace / reference
        # The table keeps the pace as a plan reads it: the probe before planning (back to back)
        # reads lower than the timer's between sweeps on the same host, by this much.
        probed = [s.probe / s.pace for s in stages if s.probe > 0]
        reference *= statistics.median(probed) if probed else 1.0
    as_is = summary(np.array([s.table_price / s.measured - 1 for s in stages]))
    terms, fixed, in_sample, loo = evaluate(stages, COUNTED_STARTS if counts else STARTS)
    by_model = loo.pop("by_model")
    label = "counted launches" if counts else "one host time per kernel"
    print(_line("the table as it is", as_is))
    print(_line(f"{label}, in sample", in_sample))
    print(_line(f"{label}, each left out", loo) + "  " + " ".join(f"{k}={v:.3f}" for k, v in by_model.items()))
    spreads = plan_spreads(stages, terms, fixed)
    spread = {"plans": int(len(spreads)), "within_1.15": int((spreads <= 1.15).sum()),
              "within_1.10": int((spreads <= 1.10).sum()), "mean": float(spreads.mean())}
    print(f"a plan these terms balance would measure, to first order: {spread['within_1.15']} of {spread['plans']} "
          f"within 1.15, {spread['within_1.10']} within 1.10, mean {spread['mean']:.3f}")
    node = terms[4:6] if counts else (0.0, 0.0)
    print("host per launched kernel fwd %.1f us bwd %.1f us; per view fwd %.1f us bwd %.1f us; per op fwd %.1f us "
          "bwd %.1f us; stage %.0f us; host probe %.1f us" % (*terms[:4], *node, fixed / US, reference / US))
    table_terms = {"host": [terms[0] * US, terms[1] * US], "view_host": [terms[2] * US, terms[3] * US],
                   "node_host": [node[0] * US, node[1] * US], "host_probe": reference,
                   "host_kernels": {k: list(v) for k, v in sorted((counts or {}).items())}}
    fitted = {"how": "benchmarks/fit_eager_host.py: eager stages of analytic plans replayed through the launch queue"
                     + (", a host time per op plus one per kernel launched (counted)" if counts else "")
                     + (", each at its host's pace" if args.pace else ""),
              "results": [os.path.basename(p) for p in args.results], "models": sorted(by_model),
              "launch_counts": [os.path.basename(p) for p in args.launch_counts or ()],
              "error_before": as_is, "error_in_sample": in_sample, "error_leave_one_model_out": loo,
              "plan_spread_in_sample": spread}
    if args.write:
        path = os.path.join(CALIBRATION_DIR, f"{args.name}.json")
        with open(path) as fh:
            table = json.load(fh)
        table.update(launch_queue=True, **table_terms)
        table.setdefault("stage", {})["eager"] = fixed
        table.setdefault("fit", {})["eager_host"] = fitted
        with open(path, "w") as fh:
            json.dump(table, fh, indent=1, sort_keys=True)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
