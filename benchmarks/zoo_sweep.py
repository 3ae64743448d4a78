"""Does every model of the zoo plan? ``autopipe report`` on every torchvision classification model,
one timm model per family and every transformers ``*ForImageClassification`` class.

Each model is planned as the CLI plans it (``autopipe.planning.plan_model``: built and traced on
the meta device, default image size, random init / default config): pp=4, a global batch of 8 in
4 micro-batches (2 images each), the h100 profile. Per model it records the outcome:

- ``planned``: a plan came back (its route, node count and imbalance are kept);
- ``typed``: an :class:`autopipe.errors.AutopipeError` (what the CLI prints in one line);
- ``raw``: any other exception (a raw traceback in the CLI: a bug), with its last frames;
- ``timeout`` / ``crashed``: the model's process did not answer in time, or died.

A timm family is a (defining module, first name token without its trailing digits) pair, e.g.
``eva/vit`` or ``resnet/ecaresnet``; its first model in timm's order stands for it.

Each model runs in a forked child (a hang or a crash costs that model alone). Results are written
after every model, so a sweep stopped half way resumes where it stopped; ``--only`` and
``--family`` run slices into the same file. Targets: >= 98% planned, no ``raw``.

    python benchmarks/zoo_sweep.py [--only SPEC,...] [--family PREFIX] [--out PATH] [--redo]
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import multiprocessing as mp
import os
import platform
import re
import sys
import time
import traceback
from typing import Any

SCHEMA = 1
PP, BATCH, MICROBATCHES, PROFILE = 4, 8, 4, "h100"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def default_out() -> str:
    return os.path.join(RESULTS, f"{datetime.date.today().isoformat()}-cpu-zoo-sweep.json")


# ----------------------------------------------------------------------------- the zoo
def torchvision_models() -> list[tuple[str, str]]:
    import torchvision.models as tvm

    return [("torchvision", f"torchvision:{n}") for n in tvm.list_models(module=tvm)]


def timm_family(module: str, name: str) -> str:
    return f"timm:{module}/{re.sub(r'[0-9]+$', '', name.split('_')[0])}"


def timm_models() -> list[tuple[str, str]]:
    import timm
    from timm.models import _registry

    first: dict[str, str] = {}
    for name in timm.list_models():  # timm's natural order
        module = _registry._model_to_module[name]
        first.setdefault(timm_family(module, name), name)
    return [(family, f"timm:{name}") for family, name in sorted(first.items())]


def hf_models() -> list[tuple[str, str]]:
    import torch.nn as nn
    import transformers

    out = []
    for name in sorted(dir(transformers)):
        if not name.endswith("ForImageClassification") or name.startswith("Auto"):
            continue
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            out.append(("hf", f"hf:{name}"))
    return out


def zoo() -> list[tuple[str, str]]:
    """(family, spec) of every model the sweep covers."""
    return torchvision_models() + timm_models() + hf_models()


# ----------------------------------------------------------------------------- one model
def plan_one(spec: str) -> dict[str, Any]:
    """Plan ``spec`` as the CLI does; the outcome as plain data."""
    from autopipe.errors import AutopipeError
    from autopipe.planning import plan_model

    start = time.perf_counter()
    try:
        plan = plan_model(spec, pp=PP, batch=BATCH, microbatches=MICROBATCHES, device=PROFILE)
    except AutopipeError as exc:
        return {"status": "typed", "error": type(exc).__name__, "message": str(exc),
                "seconds": round(time.perf_counter() - start, 2)}
    except Exception as exc:  # noqa: BLE001 - recording what escapes is the point
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
        return {"status": "raw", "error": type(exc).__name__, "message": str(exc)[:2000],
                "traceback": "".join(frames[-6:])[-4000:], "seconds": round(time.perf_counter() - start, 2)}
    return {"status": "planned", "seconds": round(time.perf_counter() - start, 2), "route": plan.route,
            "imbalance": round(plan.imbalance, 4), "nodes": sum(len(s.nodes) for s in plan.stages)}


def _child(spec: str, conn: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        conn.send(plan_one(spec))
    finally:
        conn.close()


def run_isolated(spec: str, timeout: float) -> dict[str, Any]:
    """``plan_one(spec)`` in a forked child: a hang or a crash is recorded, not inherited."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    start = time.perf_counter()
    proc = ctx.Process(target=_child, args=(spec, child), daemon=True)
    proc.start()
    child.close()
    result: dict[str, Any] | None = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:
            result = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is not None:
        return result
    seconds = round(time.perf_counter() - start, 2)
    if seconds >= timeout:
        return {"status": "timeout", "seconds": seconds, "message": f"no answer in {timeout:.0f} s"}
    return {"status": "crashed", "seconds": seconds, "message": f"exit code {proc.exitcode}"}


# ----------------------------------------------------------------------------- the file
def versions() -> dict[str, str]:
    import timm
    import torch
    import torchvision
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "timm": timm.__version__, "transformers": transformers.__version__}


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    total = len(results)
    planned = counts.get("planned", 0)
    libraries: dict[str, list[int]] = {}
    for spec, r in results.items():
        entry = libraries.setdefault(spec.split(":")[0], [0, 0])
        entry[0] += r["status"] == "planned"
        entry[1] += 1
    return {"models": total, "counts": counts,
            "planned_fraction": round(planned / total, 4) if total else None,
            "planned_by_library": {lib: f"{p} of {n}" for lib, (p, n) in sorted(libraries.items())},
            "not_planned": sorted(s for s, r in results.items() if r["status"] != "planned")}


def load(path: str) -> dict[str, Any]:
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        if data.get("schema") == SCHEMA:
            return data
    return {"schema": SCHEMA, "settings": {"pp": PP, "batch": BATCH, "microbatches": MICROBATCHES,
                                           "device_profile": PROFILE, "meta": True, "image_size": "default"},
            "results": {}}


def save(path: str, data: dict[str, Any]) -> None:
    data["summary"] = summary(data["results"])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def select(models: list[tuple[str, str]], only: str | None, family: str | None) -> list[tuple[str, str]]:
    if only:
        wanted = {s.strip() for s in only.split(",") if s.strip()}
        return [(f, s) for f, s in models if s in wanted or any(fnmatch.fnmatch(s, w) for w in wanted)]
    if family:
        return [(f, s) for f, s in models if f.startswith(family) or fnmatch.fnmatch(f, family)]
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", metavar="SPEC,...", help="these specs (globs allowed), e.g. torchvision:regnet*")
    parser.add_argument("--family", metavar="PREFIX", help="families starting so: torchvision, timm, timm:eva, hf")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/DATE-cpu-zoo-sweep.json)")
    parser.add_argument("--redo", action="store_true", help="plan models already in the file again")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model (default 600)")
    parser.add_argument("--list", action="store_true", help="print the selected models and exit")
    args = parser.parse_args(argv)

    models = select(zoo(), args.only, args.family)
    if args.list:
        for family, spec in models:
            print(f"{family:40s} {spec}")
        print(f"{len(models)} models")
        return 0
    out = args.out or default_out()
    data = load(out)
    data["versions"] = versions()
    data["date"] = datetime.date.today().isoformat()
    results = data["results"]
    todo = [(f, s) for f, s in models if args.redo or s not in results]
    print(f"{len(models)} selected, {len(todo)} to plan -> {out}", flush=True)
    for i, (family, spec) in enumerate(todo, 1):
        result = run_isolated(spec, args.timeout)
        result["family"] = family
        results[spec] = result
        save(out, data)
        message = result.get("message", "").splitlines()
        line = result.get("error", "") + (": " + message[0][:150] if message else "")
        print(f"[{i}/{len(todo)}] {spec}: {result['status']} {result['seconds']} s {line}", flush=True)
    save(out, data)
    s = data["summary"]
    print(f"planned {s['counts'].get('planned', 0)} of {s['models']} ({s['planned_fraction']}); {s['counts']}")
    return 0 if s["counts"].get("raw", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
