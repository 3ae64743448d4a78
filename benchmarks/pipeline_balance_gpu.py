"""Balance in real pipelines: stages cut on measured times against the other cuts, on several GPUs.

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_balance_gpu.py --out results.json
    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_balance_gpu.py --smoke   # CPU, gloo, tiny

One torchrun world, pp = its size, the same GPUs for every row. For each timm model (default
ResNet-50, Swin-B, ViT-L/16; 224x224 random images, ``--batch`` per step in ``--microbatches``
micro-batches, bf16 autocast, AdamW, stages run in ``--mode``), the pipeline is cut four ways
and each is trained:

- ``measured``: ``costs="measured"`` (the graph timed on this GPU in the mode that runs, then the
  emitted stages timed and re-cut while unbalanced);
- ``pipeline-scaled``: the same, cut again with the ``measured`` row's stage scale: each stage's
  time in that pipeline over its time alone (``autopipe.measure.stage_scale``, [Note: stage
  scale] in autopipe/measure/pipeline_scale.py);
- ``pipeline-steps``: ``MeasureOptions(pipeline_steps=2)``, parallelize finding those factors in
  a stand-in pipeline of its own (its build time includes that pipeline's);
- ``analytic``: the calibrated analytic model (``costs="analytic"``, the default);
- ``roofline``: the plain roofline of the same profile, uncalibrated (what plans were before);
- ``filed``: the analytic plan as it stood when the several-GPU issue was filed, the baseline
  its 1.3x target names (``FILED``: that plan's stage starts, as module split points);
- ``equal layers``: ``balance="uniform"``, the same number of blocks in each stage: the cut users
  place by hand for torch.distributed.pipelining;

and, for ViTs, torch.distributed.pipelining itself on that equal split (1F1B, eager).

Before any timing, equivalence in fp32: each model, small, at pp = world size with its measured
cut, 3 SGD steps against one GPU running the same micro-batches (max relative parameter error).

Per row: samples/s (``--steps`` after ``--warmup``, between two synchronisations), each rank's
busy time in one more step (forward + backward, CUDA events) and its spread (max/min - 1), the
measured bubble, and the peak memory of the fullest GPU. Targets (issue: several-GPU checks):
busy spread <= 5% for the best measured cut (measured or pipeline-scaled); ResNet-50 and Swin-B
>= 1.3x the filed cut's samples/s (the roofline cut's where the filed one did not run). Written
after every row; the table is printed last; exits 1 on a miss.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import autopipe  # noqa: E402
from autopipe.partition.device import PROFILES  # noqa: E402
from autopipe.measure import MeasureOptions, stage_scale  # noqa: E402
from autopipe.runtime.timeline import busy_seconds, gather, measured_bubble  # noqa: E402
from _ranks import finish, init_ranks, log, max_over_ranks, peak_gib, record_row  # noqa: E402

MODELS = ("resnet50", "swin_base_patch4_window7_224", "vit_large_patch16_224")
MAX_SPREAD, MIN_SPEEDUP = 0.05, 1.3
SCALES: dict[str, tuple[float, ...]] = {}  # model class -> the measured cut's stage scale in the pipeline
# The analytic plan of the day the several-GPU issue was filed (commit 19277bd: ``plan_model(M, pp=pp,
# batch=256, microbatches=8, device="h100")``, the uncalibrated h100 roofline on an NCHW trace, Swin's
# WindowAttention a leaf priced as elementwise). Each stage's first node, named by the module that owns
# it; a cut between two nodes of one module moves to that module's nearest child (ResNet-50's first cut
# falls before layer1.1's residual add, here before its act3: one add moves; Swin-B's third before two
# views ahead of layers.2.blocks.12.attn). Its stages timed alone on one H100 measured 1.42 (ResNet-50)
# and 1.23 (Swin-B) max/mean at pp=4 where that plan modelled 1.015 and 1.002.
FILED: dict[tuple[str, int], tuple[str, ...]] = {
    ("ResNet", 4): ("layer1.1.act3", "layer2.1.bn1", "layer3.1.bn3"),
    ("ResNet", 2): ("layer2.1.bn1",),
    ("SwinTransformer", 4): ("layers.1.blocks.0.mlp.act", "layers.2.blocks.4.mlp.drop1", "layers.2.blocks.12.attn"),
    ("SwinTransformer", 2): ("layers.2.blocks.4.mlp.drop1",),
}


def build(name: str, smoke: bool) -> nn.Module:
    import timm

    if smoke:
        if name.startswith("vit"):
            return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, embed_dim=64,
                                     num_heads=4, num_classes=10)
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    return timm.create_model(name)


def layout(args: argparse.Namespace) -> torch.memory_format:
    return torch.channels_last if args.channels_last else torch.contiguous_format


def images(n: int, img: int, args: argparse.Namespace, g: torch.Generator | None = None) -> torch.Tensor:
    """``n`` random images, in the layout the models run in (``--channels-last``)."""
    return torch.randn(n, 3, img, img, generator=g).contiguous(memory_format=layout(args))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def check_equivalence(name: str, args: argparse.Namespace, device: torch.device) -> float:
    """Max relative parameter error after 3 fp32 SGD steps of the measured cut against one GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True  # the same convolution algorithms in both
    img = 32 if args.smoke else (224 if name.startswith("swin") else 64)
    kw = {} if args.smoke or name.startswith("swin") else {"img_size": img} if name.startswith("vit") else {}
    import timm

    torch.manual_seed(0)
    ref = (build(name, True) if args.smoke else timm.create_model(name, num_classes=10, **kw)).eval()
    ref = ref.to(memory_format=layout(args))
    model = copy.deepcopy(ref)
    ref = ref.to(device)
    m, n, pp = 4, 8, dist.get_world_size()
    pm = autopipe.parallelize(model, (images(n // m, img, args),), pp=pp, microbatches=m, loss_fn=loss_fn,
                              device=device, costs="measured" if device.type == "cuda" else "analytic")
    pm.eval()  # norms on running statistics: the reference's micro-batches see the same
    opt = torch.optim.SGD(pm.parameters(), lr=0.01, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = images(n, img, args, g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)
        pm.train_step(x, y)
        opt.step()
        opt.zero_grad()
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (loss_fn(ref(xm), ym) / m).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    full = pm.full_state_dict()
    worst = max((full[k] - v.detach().cpu()).abs().max().item() / max(v.abs().max().item(), 1e-12)
                for k, v in ref.state_dict().items() if v.is_floating_point())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.deterministic = False
    pm.close()
    del ref, model
    return max_over_ranks(worst, device)


def train_autopipe(model: nn.Module, how: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    pp = dist.get_world_size()
    img, classes = (32, 10) if args.smoke else (224, 1000)
    kw: dict[str, Any] = {}
    if how == "measured":
        kw["costs"] = "measured"
    elif how == "pipeline-scaled":  # the measured cut's factors in the pipeline: [Note: stage scale]
        kw["costs"] = "measured"
        kw["measure"] = MeasureOptions(stage_scale=SCALES[type(model).__name__])
    elif how == "pipeline-steps":  # parallelize finds the factors in a stand-in pipeline of its own
        kw["costs"] = "measured"
        kw["measure"] = MeasureOptions(pipeline_steps=2)
    elif how == "roofline":
        kw["profile"] = dataclasses.replace(PROFILES["h100"], calibration=None)
    elif how == "equal layers":
        kw["balance"] = "uniform"
    elif how == "filed":
        kw["balance"] = list(FILED[type(model).__name__, pp])
    graphs = args.mode == "graphs" and device.type == "cuda"
    begin = time.perf_counter()
    model = model.to(memory_format=layout(args))
    pm = autopipe.parallelize(model, (images(args.batch // args.microbatches, img, args),), pp=pp,
                              microbatches=args.microbatches, loss_fn=loss_fn, device=device,
                              mixed_precision=None if args.smoke else "bf16", cuda_graphs=graphs,
                              record_timeline=True, **kw)
    build_s = time.perf_counter() - begin
    pm.train()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = images(args.batch, img, args, g).to(device)
    y = torch.randint(0, classes, (args.batch,), generator=g).to(device)

    def step() -> None:
        pm.train_step(x, y)
        pm.step(opt)
        opt.zero_grad(set_to_none=True)

    out = timed(step, args, device)
    pm.timeline.clear()
    step()
    events = gather(pm.timeline)
    if events is not None:
        busy = busy_seconds(events)
        per_stage: dict[tuple[int, str], list[float]] = {}
        for e in events:
            if e.action in ("F", "B"):
                per_stage.setdefault((e.stage, e.action), []).append((e.end - e.start) * 1e3)
        out["stage_f_b_ms"] = {f"{s}{a}": round(sorted(v)[len(v) // 2], 3) for (s, a), v in sorted(per_stage.items())}
        out["busy_ms"] = [round(busy[r] * 1e3, 2) for r in sorted(busy)]
        out["busy_spread"] = max(busy.values()) / min(busy.values()) - 1
        out["bubble"] = measured_bubble(events)
    if how in ("measured", "pipeline-scaled", "pipeline-steps"):  # each stage in the pipeline over alone
        used = pm.plan.balance.partition("cost:stage_scale=")[2]  # the factors the plan was cut with
        found = [None if events is None else stage_scale(events, pm.plan, scale=tuple(
            float(f) for f in used.split(",")) if used else None)]
        dist.broadcast_object_list(found, src=0)
        out["stage_scale"] = [round(f, 4) for f in found[0]]
        SCALES[type(model).__name__] = tuple(found[0])
    if args.diagnose and how == "measured" and device.type == "cuda":
        out["kernels"] = kernel_summary(step)
    out.update(build_s=build_s, stages=[list(s.modules) for s in pm.plan.stages],
               modelled_ms=[s.compute_time * 1e3 for s in pm.plan.stages],
               stage_measured_ms=[(s.measured_time or 0) * 1e3 for s in pm.plan.stages],
               cost_source=pm.plan.cost_source.get("source"))
    del opt
    pm.close()
    return out


def kernel_summary(step: Callable[[], None]) -> dict[str, Any]:
    """One step under the profiler: this rank's kernel time, and the kernels that took most."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.self_device_time_total / 1e3) for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"[rank {dist.get_rank()}] kernel time {total:.1f} ms; top: " +
          "; ".join(f"{k[:50]} x{c} {t:.2f}ms" for k, c, t in rows[:12]), flush=True)
    return {"kernel_ms": total, "top": rows[:25]}


def train_torch_pipelining(model: nn.Module, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """torch.distributed.pipelining, 1F1B, on a ViT split into equal runs of blocks."""
    from gpu_throughput import split_vit
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp, rank = dist.get_world_size(), dist.get_rank()
    parts = split_vit(model, pp)
    if args.smoke:
        for part in parts:
            part.amp = torch.float32
    stage = PipelineStage(parts[rank].to(device).train(), rank, pp, device)
    sched = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-4)
    img, classes = (32, 10) if args.smoke else (224, 1000)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, img, img, generator=g).to(device)
    y = torch.randint(0, classes, (args.batch,), generator=g).to(device)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        elif rank == pp - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = timed(step, args, device)
    del sched, stage, opt, parts
    return out


def timed(step: Callable[[], None], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    for _ in range(args.warmup):
        step()
    sync(device)
    begin = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    return {"samples_s": args.batch * args.steps / (time.perf_counter() - begin)}


def record(rows: list[dict], row: dict, fn: Callable[[], dict], device: torch.device, save: Callable) -> None:
    record_row(rows, row, lambda: {**fn(), "peak_gib": peak_gib(device)}, device, save)
    log("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                         if k not in ("stages", "modelled_ms", "stage_measured_ms", "kernels", "stage_f_b_ms")))


def table(rows: list[dict]) -> tuple[str, list[str]]:
    lines = [f"{'model':30s} {'cut':14s} {'samples/s':>9s} {'busy ms per rank':>22s} {'spread':>7s} {'bubble':>7s} "
             f"{'peak GiB':>8s}"]
    failures = []
    for r in rows:
        if "check" in r:
            lines.append(f"{r['model']:30s} {'fp32 check':14s} max rel err {r.get('max_rel_err', float('nan')):.1e}")
            if not r.get("max_rel_err", 1.0) <= 1e-5:
                failures.append(f"{r['model']}: fp32 equivalence {r.get('max_rel_err', r.get('failure'))}")
            continue
        if "samples_s" not in r:
            lines.append(f"{r['model']:30s} {r['cut']:14s} failed: {r.get('failure', '')[:80]}")
            continue
        busy = "/".join(f"{b:.1f}" for b in r.get("busy_ms", []))
        lines.append(f"{r['model']:30s} {r['cut']:14s} {r['samples_s']:9.1f} {busy:>22s} "
                     f"{r.get('busy_spread', float('nan')):7.3f} {r.get('bubble', float('nan')):7.3f} "
                     f"{r.get('peak_gib', 0):8.2f}")
    for name in dict.fromkeys(r["model"] for r in rows):
        by = {r["cut"]: r for r in rows if r["model"] == name and "samples_s" in r}
        if "measured" not in by:
            failures.append(f"{name}: the measured cut did not run")
            continue
        for cut in ("pipeline-scaled", "pipeline-steps"):
            if cut in by:
                lines.append(f"{name}: {cut} cut / measured: {by[cut]['samples_s'] / by['measured']['samples_s']:.2f}x")
        spread = min(by[c].get("busy_spread", 1.0) for c in ("measured", "pipeline-scaled", "pipeline-steps")
                     if c in by)
        if spread > MAX_SPREAD:
            failures.append(f"{name}: busy spread {spread:.3f} > {MAX_SPREAD}")
        for other in ("filed", "roofline", "analytic", "equal layers", "torch pipelining"):
            if other in by:
                lines.append(f"{name}: measured cut / {other}: {by['measured']['samples_s'] / by[other]['samples_s']:.2f}x")
        base = next((c for c in ("filed", "roofline") if c in by), None)
        if not name.startswith("vit") and base and by["measured"]["samples_s"] < MIN_SPEEDUP * by[base]["samples_s"]:
            failures.append(f"{name}: measured cut {by['measured']['samples_s'] / by[base]['samples_s']:.2f}x "
                            f"the {base} cut < {MIN_SPEEDUP}x")
    return "\n".join(lines), failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cuts", default="measured,pipeline-scaled,analytic,roofline,equal layers,torch pipelining",
                        help="comma-separated; 'pipeline-scaled' (after 'measured') cuts again with the measured "
                             "cut's stage scale in the pipeline")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--mode", choices=("graphs", "eager"), default="graphs")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--diagnose", action="store_true", help="profile one step of each measured cut (kernels)")
    parser.add_argument("--no-check", action="store_true", help="skip the fp32 equivalence checks")
    parser.add_argument("--channels-last", action="store_true",
                        help="autopipe's models and images in channels-last layout (torch pipelining's stay NCHW)")
    parser.add_argument("--out", default="")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU over gloo (a check of the script)")
    args = parser.parse_args(argv)
    device = init_ranks(args.smoke)
    cuda = device.type == "cuda"
    rows: list[dict] = []
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": dist.get_world_size(),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "command": " ".join(sys.argv),
            "batch": args.batch, "microbatches": args.microbatches, "mode": args.mode,
            "channels_last": args.channels_last}

    def save() -> None:
        if dist.get_rank() == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)

    models = args.models.split(",")
    if not args.no_check:
        for name in models:
            record(rows, {"model": name, "check": True},
                   lambda: {"max_rel_err": check_equivalence(name, args, device)}, device, save)
    for name in models:
        torch.manual_seed(0)
        base = build(name, args.smoke)
        for cut in args.cuts.split(","):
            if (cut == "torch pipelining" and not name.startswith("vit")) or \
                    (cut == "filed" and (type(base).__name__, dist.get_world_size()) not in FILED):
                continue
            fn = (lambda: train_torch_pipelining(copy.deepcopy(base), args, device)) if cut == "torch pipelining" \
                else (lambda: train_autopipe(copy.deepcopy(base), cut, args, device))
            record(rows, {"model": name, "cut": cut}, fn, device, save)
    text, failures = table(rows) if dist.get_rank() == 0 else ("", [])
    log(text)
    return finish(failures, device)


if __name__ == "__main__":
    raise SystemExit(main())
