"""Fit the analytic cost model's kernel efficiencies to a GPU: collect on the GPU, fit anywhere.

    # on the GPU machine: each node's kernel times of real models, forward and backward, under
    # bf16 autocast, and the segments' eager and CUDA-graph timings
    python benchmarks/calibrate_device.py collect --out rows.json
    # the same models channels-last (their convolutions, norms and pooling are classes apart:
    # [Note: kernel layout] in autopipe/partition/calibration.py)
    python benchmarks/calibrate_device.py collect --channels-last --out rows-nhwc.json
    # anywhere: fit the factors, write the table the h100 profile loads, print the fit's error
    python benchmarks/calibrate_device.py fit rows.json --name h100

What is fitted is [Note: calibrated roofline] (autopipe/partition/calibration.py). Each node
of each model gives one row per direction: its kernels' measured device time (the profiler's
kernel records: [Note: node times from kernels] in autopipe/measure/kernels.py) and, per kernel
class, the plain roofline seconds of the kernels the cost model says it launches, with their
count. The factors and the launch time of each kind of kernel (of each class, for GEMMs: [Note: a
GEMM class's fixed time]) are the non-negative least-squares solution of

    device(node) ~= sum over classes of factor[class] * roofline[class]
                    + sum over launch keys of launch[key] * kernels[key]

on relative error (each row divided by its measured time), with a light pull of every factor
towards the median factor so that classes seen in few rows stay sensible. The host time per
kernel in eager mode, and the fixed cost of a stage in each mode, are the values that best
predict the segments' own eager and CUDA-graph timings (a node taking max(device, host) in
eager mode). The error is reported in-sample (nodes of 20 us or more, and segments) and,
leaving each model out of the fit in turn, on contiguous groups of segments the size of pp=4
and pp=8 stages: the error a plan's stage times carry for a model the fit has not seen.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ["resnet50", "resnet152", "convnext_base", "swin_base_patch4_window7_224", "vit_base_patch16_224",
          "vit_large_patch16_224", "efficientnet_b0"]
MICROBATCHES = (32, 128)
PRIOR_WEIGHT = 0.001  # pull of each factor towards the median factor, against the rows
WEIGHT_POWER = 0.5  # rows weighted by 1 / measured ** this


# ---------------------------------------------------------------------------------- collect
def rows_from_profiles(traced: Any, graphs: Any, eager: Any, model: str, microbatch: int,
                       profile: str = "h100") -> tuple[list, list]:
    """Calibration rows of one model: a row per node (its kernels' device time from the CUDA-graph
    profile, its host time from the eager one, its roofline terms by class) and a row per profile
    segment (its own timings in both modes). The two profiles must share their segments. The
    roofline terms are those of ``profile``: a table's factors multiply them, so a table is right
    only for the profile it was fitted on."""
    from autopipe.partition.calibration import compute_features, kernel_features
    from autopipe.partition.cost import graph_costs
    from autopipe.partition.device import PROFILES

    if [(s.start, s.end) for s in graphs.segments] != [(s.start, s.end) for s in eager.segments]:
        raise ValueError("the graphs and eager profiles were cut into different segments")
    base = PROFILES[profile]
    costs = graph_costs(traced.gm)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    nodes: list[dict[str, Any]] = []
    segs: list[dict[str, Any]] = []
    for k, (sg, se) in enumerate(zip(graphs.segments, eager.segments)):
        ids = []
        for name in order[sg.start:sg.end]:
            dev, host = graphs.node_detail.get(name), eager.node_detail.get(name)
            row: dict[str, Any] = {"model": model, "microbatch": microbatch, "node": name}
            for direction, i in (("fwd", 0), ("bwd", 1)):
                kernels = kernel_features(costs[name], base, backward=bool(i))
                feats: dict[str, float] = defaultdict(float)
                for cls, seconds in kernels + compute_features(costs[name], base, backward=bool(i)):
                    feats[cls] += seconds
                row[direction] = {"features": dict(feats), "kernels": len(kernels),
                                  "device": dev[i] if dev else 0.0, "host": host[2 + i] if host else 0.0,
                                  "kernels_seen": int(dev[4 + i]) if dev else 0}
            ids.append(len(nodes))
            nodes.append(row)
        segs.append({"model": model, "microbatch": microbatch, "segment": k, "nodes": ids,
                     "graphs": sg.seconds, "eager": se.seconds})
    return nodes, segs


def write_rows(path: str, nodes: list, segs: list, device: str, channels_last: bool = False) -> None:
    import torch

    meta = {"device": device, "torch": torch.__version__, "dtype": "bfloat16", "channels_last": channels_last,
            "date": datetime.date.today().isoformat(), "models": sorted({r["model"] for r in nodes}),
            "microbatches": sorted({r["microbatch"] for r in nodes}), "host": platform.node()}
    with open(path, "w") as f:
        json.dump({"meta": meta, "nodes": nodes, "segments": segs}, f)


def collect(models: list[str], microbatches: list[int], reps: int, out: str, device: str = "cuda",
            image_size: int | None = None, channels_last: bool = False) -> None:
    import torch

    from autopipe.measure import RunSetup, profile_graph
    from autopipe.measure.timer import device_name
    from autopipe.models import default_input, load_model
    from autopipe.partition.device import gpu_profile_name
    from autopipe.tracer import trace

    dev = torch.device(device)
    nodes: list[dict[str, Any]] = []
    segs: list[dict[str, Any]] = []
    for name in models:
        for mb in microbatches:
            begin = time.perf_counter()
            model = load_model(name if ":" in name else f"timm:{name}", image_size=image_size)
            traced = trace(*_laid_out(model, default_input(model, mb, image_size=image_size), channels_last))
            profiles = {mode: profile_graph(traced, RunSetup(dev, mode, torch.bfloat16, reps=reps))
                        for mode in (("graphs", "eager") if dev.type == "cuda" else ("eager",))}
            n, s = rows_from_profiles(traced, profiles.get("graphs", profiles["eager"]), profiles["eager"], name, mb,
                                      gpu_profile_name(device_name(dev)))
            offset = len(nodes)
            nodes += n
            segs += [dict(x, nodes=[i + offset for i in x["nodes"]]) for x in s]
            print(f"{name} mb={mb}: {len(n)} nodes in {time.perf_counter() - begin:.1f} s", flush=True)
    write_rows(out, nodes, segs, device_name(dev), channels_last)
    print(f"wrote {len(nodes)} nodes, {len(segs)} segments to {out}")


def _laid_out(model: Any, example: Any, channels_last: bool) -> tuple[Any, tuple]:
    """``model`` and its example input, moved to channels-last where asked."""
    import torch

    if not channels_last:
        return model, (example,)
    return model.to(memory_format=torch.channels_last), (example.contiguous(memory_format=torch.channels_last),)


# ---------------------------------------------------------------------------------- fit
def refeature(nodes: list[dict], profile: str) -> None:
    """Recompute every row's roofline terms with this checkout's cost model on ``profile`` (the
    models are traced again here on the meta device; the measured times are kept)."""
    from autopipe.models import default_input, load_model
    from autopipe.partition.calibration import compute_features, kernel_features, launch_key
    from autopipe.partition.cost import graph_costs
    from autopipe.partition.device import PROFILES
    from autopipe.tracer import trace

    base = PROFILES[profile]
    costs: dict[tuple[str, int, bool], Any] = {}
    for row in nodes:
        key = (row["model"], row["microbatch"], row.get("channels_last", False))
        if key not in costs:
            model = load_model(key[0] if ":" in key[0] else f"timm:{key[0]}")
            costs[key] = graph_costs(trace(*_laid_out(model, default_input(model, key[1]), key[2])).gm)
        cost = costs[key][row["node"]]
        row["shape"] = "" if cost.parts else cost.shape
        for direction, backward in (("fwd", False), ("bwd", True)):
            kernels = kernel_features(cost, base, backward=backward)
            feats: dict[str, float] = defaultdict(float)
            for cls, seconds in kernels + compute_features(cost, base, backward=backward):
                feats[cls] += seconds
            row[direction]["features"], row[direction]["kernels"] = dict(feats), len(kernels)
            row[direction]["kinds"] = dict(Counter(launch_key(cls) for cls, _ in kernels))


def attach_boundaries(nodes: list[dict], segs: list[dict]) -> None:
    """Each segment's ``boundary_bytes``: what crosses its cuts, inputs and outputs, in bf16 (the
    rows' compute dtype), by this checkout's cut model ([Note: boundary copies])."""
    import torch

    from autopipe.models import default_input, load_model
    from autopipe.partition.cost import graph_costs
    from autopipe.partition.cuts import cut_dag
    from autopipe.tracer import trace

    runs: dict[tuple[str, int, bool], list[dict]] = defaultdict(list)
    for s in segs:
        runs[(s["model"], s["microbatch"], s.get("channels_last", False))].append(s)
    for (name, mb, layout), run in runs.items():
        model = load_model(name if ":" in name else f"timm:{name}")
        traced = trace(*_laid_out(model, default_input(model, mb), layout))
        cut = cut_dag(traced, graph_costs(traced.gm), torch.bfloat16).cut_bytes
        order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
        position = {n: i for i, n in enumerate(order)}
        for s in run:
            at = [position[nodes[k]["node"]] for k in s["nodes"]]
            a, b = min(at), max(at) + 1
            s["boundary_bytes"] = float((cut[a - 1] if a > 0 else 0) + (cut[b - 1] if b < len(order) else 0))


def _kinds(d: dict) -> dict[str, int]:
    """The kernels a row's node launches, by launch_key (rows made before kinds were kept: all "*")."""
    return d.get("kinds") or ({"*": d["kernels"]} if d["kernels"] else {})


def _design(rows: list[dict], direction: str, classes: list[str], kinds: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(A, measured): A[row, class] roofline seconds, then a column per kernel kind: the
    kernels of that kind the model launches."""
    index = {c: i for i, c in enumerate(classes)}
    # Kinds apart from classes: "attention" names both a class and its kind.
    kind_index = {k: len(classes) + i for i, k in enumerate(kinds)}
    a = np.zeros((len(rows), len(classes) + len(kinds)))
    y = np.zeros(len(rows))
    for r, row in enumerate(rows):
        d = row[direction]
        for cls, seconds in d["features"].items():
            if cls in index:
                a[r, index[cls]] += seconds
        for kind, count in _kinds(d).items():
            if kind in kind_index:
                a[r, kind_index[kind]] += count
        y[r] = d["device"]
    return a, y


def _nnls_relative(a: np.ndarray, y: np.ndarray, factors: int) -> np.ndarray:
    """Non-negative least squares with each row weighted by 1 / measured ** WEIGHT_POWER (1:
    relative error, which underweights the large kernels that set a stage's time; 0: absolute),
    every factor (the first ``factors`` columns; the rest are launch times) pulled lightly
    towards the median factor."""
    from scipy.optimize import nnls

    keep = (y > 0) & (a[:, :factors].sum(axis=1) > 0)
    w = 1.0 / y[keep] ** WEIGHT_POWER
    aw, yw = a[keep] * w[:, None], y[keep] * w
    first, _ = nnls(aw, yw, maxiter=5000)
    used = (a[keep][:, :factors] > 0).any(axis=0) & (first[:factors] > 0)
    prior = float(np.median(first[:factors][used])) if used.any() else 1.0
    weight = PRIOR_WEIGHT * math.sqrt(len(yw)) * float(np.sqrt(np.mean(yw ** 2)))
    reg = np.zeros((factors, a.shape[1]))
    reg[:, :factors] = np.eye(factors) * weight / prior
    sol, _ = nnls(np.vstack([aw, reg]), np.concatenate([yw, np.full(factors, weight)]), maxiter=5000)
    return sol


def _gpu(rows: list[dict], model: dict[str, Any]) -> np.ndarray:
    """Predicted device seconds per node row, per direction: shape (rows, 2)."""
    out = np.zeros((len(rows), 2))
    for k, d in enumerate(("fwd", "bwd")):
        a, _ = _design(rows, d, model["classes"], model["kinds"])
        out[:, k] = a @ model["sols"][d]
    for r, row in enumerate(rows):
        measured = model.get("kernels", {}).get(row.get("shape") or "")
        for k in range(2) if measured else ():
            out[r, k] = measured[k] or out[r, k]
    return out


def _off_class(nodes: list[dict], model: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Kernel shape -> (fwd, bwd) median measured seconds of its rows, where that median is
    OFF_CLASS_RATIO x its class's price or more and OFF_CLASS_SECONDS beyond it, 0 in a direction
    that is not ([Note: kernels off their class] in autopipe/partition/calibration.py)."""
    from autopipe.partition.calibration import OFF_CLASS_RATIO, OFF_CLASS_SECONDS

    pred = _gpu(nodes, dict(model, kernels={}))
    rows: dict[str, list[int]] = defaultdict(list)
    for r, row in enumerate(nodes):
        if row.get("shape"):
            rows[row["shape"]].append(r)
    found = {}
    for shape, idx in rows.items():
        times = [0.0, 0.0]
        for k, d in enumerate(("fwd", "bwd")):
            measured = float(np.median([nodes[r][d]["device"] for r in idx]))
            priced = float(np.median(pred[idx, k]))
            if measured >= OFF_CLASS_RATIO * priced and measured - priced >= OFF_CLASS_SECONDS:
                times[k] = measured
        if any(times):
            found[shape] = (times[0], times[1])
    return found


def _kernels(rows: list[dict]) -> np.ndarray:
    return np.array([[r["fwd"]["kernels"], r["bwd"]["kernels"]] for r in rows], dtype=float)


def _segment_prediction(nodes: list[dict], segs: list[dict], model: dict[str, Any], mode: str,
                        host: tuple[float, float] | None = None, gpu: np.ndarray | None = None) -> np.ndarray:
    """Predicted seconds of each segment; ``gpu``: the nodes' device seconds when known."""
    gpu = _gpu(nodes, model) if gpu is None else gpu
    if mode == "eager":
        h = np.array(host if host is not None else model["host"])
        gpu = np.maximum(gpu, _kernels(nodes) * h[None, :])
    per_node = gpu.sum(axis=1)
    copies = model.get("boundary", {}).get(mode, 0.0) * _boundary_bytes(segs)
    gaps = model.get("gap", {}).get(mode, 0.0) * _launches(nodes, segs)
    return np.array([per_node[s["nodes"]].sum() for s in segs]) + copies + gaps + model["overhead"][mode]


def _boundary_bytes(segs: list[dict]) -> np.ndarray:
    return np.array([s.get("boundary_bytes", 0.0) for s in segs])


def _launches(nodes: list[dict], segs: list[dict]) -> np.ndarray:
    """The kernels the cost model says each segment launches, forward and backward."""
    per_node = _kernels(nodes).sum(axis=1)
    return np.array([per_node[s["nodes"]].sum() for s in segs])


def _excess_terms(excess: np.ndarray, measured: np.ndarray, nbytes: np.ndarray,
                  launches: np.ndarray) -> tuple[float, float, float]:
    """(seconds per stage, per boundary byte, per launched kernel) that best explain ``excess``."""
    from scipy.optimize import least_squares

    a = np.stack([np.ones_like(nbytes), nbytes, launches], axis=1) * np.array([1e-4, 1e-12, 1e-6])
    scale = np.sqrt(measured)
    spread = float(np.median(np.abs(excess) / scale)) or 1.0
    sol = least_squares(lambda p: (a @ p - excess) / scale, np.ones(3), loss="soft_l1", f_scale=spread,
                        bounds=(0.0, np.inf)).x * np.array([1e-4, 1e-12, 1e-6])
    return float(sol[0]), float(sol[1]), float(sol[2])


def fit(nodes: list[dict], segs: list[dict]) -> dict[str, Any]:
    classes = sorted({c for row in nodes for d in ("fwd", "bwd") for c in row[d]["features"]})
    kinds = sorted({k for row in nodes for d in ("fwd", "bwd") for k in _kinds(row[d])})
    sols = {d: _nnls_relative(*_design(nodes, d, classes, kinds), len(classes)) for d in ("fwd", "bwd")}
    model: dict[str, Any] = {"classes": classes, "kinds": kinds, "sols": sols,
                             "overhead": {"graphs": 0.0, "eager": 0.0}, "boundary": {"graphs": 0.0, "eager": 0.0}}
    # The kernels far off their class are priced by their own time, and the classes fitted without them.
    model["kernels"] = _off_class(nodes, model)
    for k, d in enumerate(("fwd", "bwd")):
        rows = [r for r in nodes if not model["kernels"].get(r.get("shape") or "", (0.0, 0.0))[k]]
        sols[d] = _nnls_relative(*_design(rows, d, classes, kinds), len(classes))
    # What a segment replayed as CUDA graphs takes beyond the measured kernel times of its nodes:
    # a stage's fixed cost (first launch, autograd's start), its boundary copies ([Note: boundary
    # copies]) and the gaps between its kernels ([Note: replay gaps]), fitted together (robust
    # least squares, relative error). Measured, not predicted, node times: these terms must not
    # soak up the node model's own errors. Eager stages copy nothing and pay their host instead.
    measured = {m: np.array([s[m] for s in segs]) for m in ("graphs", "eager")}
    kernels = np.array([r["fwd"]["device"] + r["bwd"]["device"] for r in nodes])
    excess = measured["graphs"] - np.array([kernels[s["nodes"]].sum() for s in segs])
    fixed, rate, gap = _excess_terms(excess, measured["graphs"], _boundary_bytes(segs), _launches(nodes, segs))
    model["overhead"]["graphs"], model["boundary"]["graphs"], model["gap"] = fixed, rate, {"graphs": gap}
    gpu = _gpu(nodes, model)

    def unfixed(mode: str, host: tuple[float, float] | None = None) -> np.ndarray:
        """Predicted segment seconds without a stage's fixed cost."""
        return _segment_prediction(nodes, segs, dict(model, overhead={"graphs": 0.0, "eager": 0.0}), mode, host, gpu)

    best, best_err = (0.0, 0.0), float("inf")
    for h in np.geomspace(1e-6, 1e-4, 60):
        for ratio in (1.0, 1.5, 2.0, 3.0):
            host = (float(h), float(h * ratio))
            pred = unfixed("eager", host)
            fixed = max(float(np.median(measured["eager"] - pred)), 0.0)
            err = float(np.median(np.abs(pred + fixed - measured["eager"]) / measured["eager"]))
            if err < best_err:
                best, best_err, model["overhead"]["eager"] = host, err, fixed
    model["host"] = best
    model["factors"] = {c: (float(sols["fwd"][i]), float(sols["bwd"][i])) for i, c in enumerate(classes)}
    n = len(classes)
    model["launches"] = {k: (float(sols["fwd"][n + i]), float(sols["bwd"][n + i])) for i, k in enumerate(kinds)}
    # Kernels of a kind no model launched: the median kind's launch time.
    model["launch"] = tuple(float(np.median([v[i] for v in model["launches"].values()])) if kinds else 0.0
                            for i in (0, 1))
    return model


def _stage_errors(segs: list[dict], pred: np.ndarray, meas: np.ndarray, parts: int) -> list[float]:
    by_run: dict[tuple, list[int]] = defaultdict(list)
    for i, s in enumerate(segs):
        by_run[(s["model"], s["microbatch"], s.get("channels_last", False))].append(i)
    errs = []
    for idx in by_run.values():
        for chunk in np.array_split(np.array(idx), parts):
            if len(chunk):
                m = meas[chunk].sum()
                errs.append(abs(pred[chunk].sum() - m) / m)
    return errs


def _summary(errs: list[float]) -> dict[str, float]:
    return {"median": float(np.median(errs)), "p90": float(np.percentile(errs, 90)), "max": float(np.max(errs))}


def report(nodes: list[dict], segs: list[dict], meta: dict[str, Any]) -> dict[str, Any]:
    model = fit(nodes, segs)
    errors: dict[str, Any] = {}
    gpu = _gpu(nodes, model)
    dev = np.array([[r["fwd"]["device"], r["bwd"]["device"]] for r in nodes])
    big = dev.sum(axis=1) > 20e-6  # nodes of at least 20 us: the ones that move a cut
    node_err = np.abs(gpu.sum(axis=1) - dev.sum(axis=1))[big] / dev.sum(axis=1)[big]
    errors["nodes_over_20us_in_sample"] = _summary(list(node_err))
    held_out = _held_out_fits(nodes, segs)
    for mode in ("graphs", "eager"):
        meas = np.array([s[mode] for s in segs])
        errors[mode] = {"segments_in_sample": _summary(list(np.abs(_segment_prediction(nodes, segs, model, mode)
                                                                          - meas) / meas)),
                        "leave_one_model_out": {}}
        for parts in (4, 8):
            loo: list[float] = []
            per_model: dict[str, float] = {}
            for held, (m, test_n, test_segs) in held_out.items():
                t_meas = np.array([s[mode] for s in test_segs])
                e = _stage_errors(test_segs, _segment_prediction(test_n, test_segs, m, mode), t_meas, parts)
                loo += e
                per_model[held] = float(np.max(e))
            if loo:
                errors[mode]["leave_one_model_out"][f"{parts}_stages"] = {**_summary(loo), "max_by_model": per_model}
    return {
        "schema": 1, "device": meta["device"], "launch": model["launch"], "launches": model["launches"],
        "host": model["host"],
        "factors": model["factors"], "kernels": model["kernels"], "stage": model["overhead"],
        "boundary": model["boundary"], "gap": model["gap"],
        "fit": {"made_by": "benchmarks/calibrate_device.py", "dtype": meta["dtype"], "torch": meta["torch"],
                "date": meta["date"], "models": meta["models"], "microbatches": meta["microbatches"],
                "layouts": meta.get("layouts", ["contiguous"]),
                "nodes": len(nodes), "segments": len(segs), "stage_overhead": model["overhead"], "error": errors},
    }


def _held_out_fits(nodes: list[dict], segs: list[dict]) -> dict[str, tuple[dict, list[dict], list[dict]]]:
    """Per model (when there are several): the fit made without it, and its own nodes and segments."""
    models = sorted({s["model"] for s in segs})
    out = {}
    for held in models if len(models) > 1 else ():
        keep_n = [r for r in nodes if r["model"] != held]
        train_segs = [dict(s, nodes=_renumber(s, nodes, keep_n)) for s in segs if s["model"] != held]
        test_n = [r for r in nodes if r["model"] == held]
        test_segs = [dict(s, nodes=_renumber(s, nodes, test_n)) for s in segs if s["model"] == held]
        out[held] = (fit(keep_n, train_segs), test_n, test_segs)
    return out


def _renumber(seg: dict, all_nodes: list[dict], subset: list[dict]) -> list[int]:
    position = {id(r): i for i, r in enumerate(subset)}
    return [position[id(all_nodes[i])] for i in seg["nodes"]]


def _kind_of(name: str) -> str:
    """The kernel kind of a table key, its layout mark dropped ("dwconv:strided-nhwc/4MiB",
    "dwconv:strided-nhwc:compute" -> "dwconv:strided")."""
    from autopipe.partition.kernel_classes import COMPUTE, FLOPS, NHWC, kernel_kind

    kind = kernel_kind(name)
    for mark in (COMPUTE, FLOPS):
        kind = kind[: -len(mark)] if kind.endswith(mark) else kind
    return kind.replace(NHWC, "", 1)


def refit_kinds(committed: dict[str, Any], refitted: dict[str, Any], nodes: list[dict],
                kinds: list[str]) -> dict[str, Any]:
    """``committed`` with the figures of ``kinds`` taken from ``refitted``: their factors, launch
    times and off-class kernels, and nothing else. A kind split off another (PARENT_KINDS) is
    fitted on rows that its parent was fitted on before; the rest of the table, the eager host
    terms fitted on timed plans (fit_eager_host.py) among them, stays what it was checked to be.
    ``fit["refits"]`` records the refit and its in-sample error."""
    wanted = set(kinds)
    table = json.loads(json.dumps(committed))
    for key in ("factors", "launches"):
        table[key] = {k: v for k, v in table.get(key, {}).items() if _kind_of(k) not in wanted}
        table[key].update({k: v for k, v in refitted.get(key, {}).items() if _kind_of(k) in wanted})
    shapes = {r["shape"] for r in nodes if r.get("shape")
              and any(_kind_of(c) in wanted for d in ("fwd", "bwd") for c in r[d]["features"])}
    table["kernels"] = {k: v for k, v in table.get("kernels", {}).items() if k not in shapes}
    table["kernels"].update({k: v for k, v in refitted.get("kernels", {}).items() if k in shapes})
    table.setdefault("fit", {}).setdefault("refits", []).append(
        {"kinds": sorted(wanted), "date": datetime.date.today().isoformat(), "rows": refitted["fit"]["nodes"],
         "error": refitted["fit"]["error"]})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--models", default=",".join(MODELS))
    c.add_argument("--microbatch", default=",".join(map(str, MICROBATCHES)))
    c.add_argument("--reps", type=int, default=10)
    c.add_argument("--out", required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--image-size", type=int, default=None)
    c.add_argument("--channels-last", action="store_true",
                   help="the models and their inputs in channels-last layout (rows for the kernels' NHWC classes)")
    f = sub.add_parser("fit")
    f.add_argument("rows", nargs="+")
    f.add_argument("--name", required=True, help="profile name: writes autopipe/partition/calibration/NAME.json")
    f.add_argument("--only", metavar="KINDS",
                   help="refit the kernel kinds named (comma-separated, e.g. dwconv:strided; both layouts) and keep "
                        "every other figure of the committed table NAME.json as it is (see refit_kinds)")
    f.add_argument("--stored-features", action="store_true",
                   help="fit the roofline terms stored in the rows instead of recomputing them with this "
                        "checkout's cost model (the default: the table must match the model that reads it)")
    args = parser.parse_args(argv)
    if args.cmd == "collect":
        collect(args.models.split(","), [int(x) for x in args.microbatch.split(",")], args.reps, args.out,
                args.device, args.image_size, args.channels_last)
        return 0
    from autopipe.partition.device import PROFILES

    nodes, segs, meta = [], [], None
    for path in args.rows:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as fh:
            data = json.load(fh)
        offset, layout = len(nodes), bool(data["meta"].get("channels_last", False))
        nodes += [dict(r, channels_last=layout) for r in data["nodes"]]
        segs += [dict(s, nodes=[i + offset for i in s["nodes"]], channels_last=layout) for s in data["segments"]]
        meta = meta or data["meta"]
    if meta is None:
        raise SystemExit("no rows given")
    meta["models"] = sorted({r["model"] for r in nodes})
    meta["layouts"] = sorted({"channels_last" if r["channels_last"] else "contiguous" for r in nodes})
    if args.name not in PROFILES:
        raise SystemExit(f"--name {args.name!r} is not a device profile; one of {sorted(PROFILES)}")
    if not args.stored_features:
        refeature(nodes, args.name)
    attach_boundaries(nodes, segs)
    table = report(nodes, segs, meta)
    from autopipe.partition.calibration import CALIBRATION_DIR

    path = os.path.join(CALIBRATION_DIR, f"{args.name}.json")
    written = table
    if args.only:
        with open(path) as fh:
            written = refit_kinds(json.load(fh), table, nodes, args.only.split(","))
    with open(path, "w") as fh:
        json.dump(written, fh, indent=1, sort_keys=True)
    print(f"wrote {path}")
    e = table["fit"]["error"]["nodes_over_20us_in_sample"]
    print(f"nodes of 20 us or more, in sample: median {e['median']:.3f} p90 {e['p90']:.3f}")
    for shape, (fwd, bwd) in table["kernels"].items():
        print(f"priced by its own time: {shape}  fwd {fwd * 1e6:.0f} us  bwd {bwd * 1e6:.0f} us")
    for mode in ("graphs", "eager"):
        e = table["fit"]["error"][mode]
        seg = e["segments_in_sample"]
        print(f"{mode:6s} segments in sample: median {seg['median']:.3f} p90 {seg['p90']:.3f}")
        for parts, loo in e["leave_one_model_out"].items():
            print(f"{mode:6s} leave-one-model-out, {parts}: median {loo['median']:.3f} p90 {loo['p90']:.3f} "
                  f"max {loo['max']:.3f}  " + " ".join(f"{k}={v:.3f}" for k, v in loo["max_by_model"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
