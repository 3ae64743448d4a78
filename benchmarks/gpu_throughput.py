"""Training throughput and peak memory of autopipe beside what users would pick instead.

One invocation, one torchrun world, every configuration of a suite in turn on the same GPUs:

* ``--suite 2``: one GPU (rank 0 alone); autopipe pp=2 (1f1b, interleaved_1f1b) and tp=2;
  torch.distributed.pipelining with the same stages' split and micro-batching (GPipe, 1F1B,
  interleaved 1F1B); DTensor tensor parallelism (head-aware qkv, Colwise/RowwiseParallel).
* ``--suite 4``: autopipe pp=2 x tp=2 and pp=4; torch pipelining pp=4 and pp=2 composed
  with DTensor TP on a (pp, tp) mesh.

Before any timing, a correctness check: autopipe's parameters after 3 SGD-momentum steps in
fp32 (TF32 off) equal a single-GPU reference that runs the same micro-batches with gradient
accumulation (max relative error printed; the run is flagged, not stopped, when over 1e-5).

Timed runs: timm ViT (``--model``, default vit_large_patch16_224), random 224x224 images,
bf16 autocast with fp32 master weights, fused AdamW, ``--warmup`` then ``--steps`` optimizer
steps between two synchronisations; samples/s counts the global batch. Peak memory is
``torch.cuda.max_memory_allocated`` per GPU (the maximum over GPUs is printed). For
autopipe's pipelines, each rank's busy time (forward + backward, CUDA events) in one
further step is printed beside the others' ("busy spread": max/min - 1).

    torchrun --nproc-per-node 2 benchmarks/gpu_throughput.py --suite 2 --out results.json
    torchrun --nproc-per-node 4 benchmarks/gpu_throughput.py --suite 4 --out results4.json
    torchrun --nproc-per-node 2 benchmarks/gpu_throughput.py --suite 2 --smoke   # CPU, gloo, tiny

Results are appended to ``--out`` after every configuration, so a run cut short keeps what
it measured. The table is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopipe  # noqa: E402

RANK = int(os.environ.get("RANK", 0))


def log(*args: Any) -> None:
    if RANK == 0:
        print(*args, flush=True)


# ----------------------------------------------------------------------------- setup
class Env:
    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.cuda = torch.cuda.is_available() and not smoke
        dist.init_process_group("nccl" if self.cuda else "gloo", timeout=datetime.timedelta(seconds=180))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.amp = torch.bfloat16

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def reset_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0


def build_vit(name: str, smoke: bool, **kw: Any) -> nn.Module:
    import timm

    if smoke:
        kw = dict(img_size=32, patch_size=8, depth=4, embed_dim=64, num_heads=4, num_classes=10) | kw
        return timm.create_model("vit_tiny_patch16_224", **kw)
    return timm.create_model(name, **kw)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def batch(env: Env, n: int, img: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, img, img, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x.to(env.device), y.to(env.device)


def adamw(params: Any, env: Env, fused: bool = True) -> torch.optim.Optimizer:
    """Fused AdamW where it runs. DTensor parameters mixed with plain ones (norms, embeddings,
    head) refuse the fused and the foreach kernels: they take the per-parameter path."""
    params = list(params)
    if env.cuda and fused:
        with contextlib.suppress(Exception):
            return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=fused)


def time_steps(env: Env, step: Callable[[], None], warmup: int, steps: int, *, barrier: bool = True) -> float:
    """Seconds for ``steps`` calls after ``warmup``; ``barrier=False`` for a run on one rank."""
    sync = env.sync if barrier else (torch.cuda.synchronize if env.cuda else (lambda: None))
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - t0


def eager_step(env: Env, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> Callable[[], None]:
    """One bf16-autocast training step of a whole (possibly DTensor-sharded) model."""

    def step() -> None:
        with torch.autocast(env.device.type, dtype=env.amp):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def gather_max(env: Env, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ----------------------------------------------------------------------------- correctness
def check_equivalence(env: Env, pp: int, tp: int, schedule: str, chunks: int, graphs: bool = False,
                      sequence_parallel: bool = False, compiled: bool = False) -> float:
    """Max relative parameter error after 3 fp32 SGD steps against a one-GPU reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = {} if env.smoke else dict(img_size=64, patch_size=16, depth=4, embed_dim=256, num_heads=8,
                                    num_classes=10)
    name = "vit_tiny_patch16_224"
    m, n = 4, 16
    img = 32 if env.smoke else 64
    torch.manual_seed(0)
    ref = build_vit(name, env.smoke, **kw).eval()
    model = copy.deepcopy(ref)
    ref = ref.to(env.device)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    pm = autopipe.parallelize(model, (torch.randn(n // m, 3, img, img),), pp=pp, tp=tp, microbatches=m,
                              schedule=schedule, chunks=chunks, loss_fn=loss_fn, device=env.device,
                              cuda_graphs=graphs and env.cuda, sequence_parallel=sequence_parallel,
                              compile_stages=compiled)
    pm.eval()
    opt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = batch(env, n, img, 10, seed=step)
        opt.zero_grad()
        pm.train_step(x, y)
        opt.step()
        opt_ref.zero_grad()
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (loss_fn(ref(xm), ym) / m).backward()
        opt_ref.step()
    full = pm.full_state_dict()
    worst = 0.0
    for k, v in ref.state_dict().items():
        v = v.detach().cpu()
        err = (full[k] - v).abs().max().item() / max(v.abs().max().item(), 1e-12)
        worst = max(worst, err)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return gather_max(env, worst)


# ----------------------------------------------------------------------------- configurations
class Bench:
    def __init__(self, env: Env, args: argparse.Namespace) -> None:
        self.env, self.args = env, args
        self.results: list[dict] = []
        self.img = 32 if env.smoke else 224
        self.classes = 10 if env.smoke else 1000
        self._cpu_model: nn.Module | None = None

    def fresh_model(self) -> nn.Module:
        """A copy of one randomly initialised model (built once: ViT-L's init takes seconds)."""
        if self._cpu_model is None:
            torch.manual_seed(0)
            self._cpu_model = build_vit(self.args.model, self.env.smoke)
        return copy.deepcopy(self._cpu_model)

    def record(self, name: str, batch_size: int, gpus: int, fn: Callable[[], dict]) -> None:
        env = self.env
        env.reset_memory()
        row: dict[str, Any] = {"config": name, "batch": batch_size, "gpus": gpus}
        failed = 0.0
        try:
            row.update(fn())
            row["peak_gib"] = round(gather_max(env, env.peak_gib()), 2)
        except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"[rank {env.rank}] {name} failed:\n{traceback.format_exc()}", flush=True)
            failed = 1.0
        # Go on only when every rank failed alike (a rank left alone in a collective cannot).
        if gather_max(env, failed) and not -gather_max(env, -failed):
            self.results.append(row)
            self.save()
            raise RuntimeError(f"{name} failed on some ranks only; stopping")
        self.results.append(row)
        log(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("config", "events")))
        self.save()
        env.reset_memory()

    def save(self) -> None:
        if self.env.rank == 0 and self.args.out:
            meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if self.env.cuda else platform.processor(),
                    "world": self.env.world, "model": self.args.model, "command": " ".join(sys.argv),
                    "steps": self.args.steps, "warmup": self.args.warmup}
            with open(self.args.out, "w") as f:
                json.dump({"meta": meta, "results": self.results}, f, indent=1)

    # --- one GPU
    def single(self, batch_size: int, compiled: bool = False) -> dict:
        env = self.env
        out: dict[str, Any] = {}
        if env.rank == 0:
            model = self.fresh_model().to(env.device).train()
            if compiled:
                model.compile(dynamic=False)
            opt = adamw(model.parameters(), env)
            x, y = batch(env, batch_size, self.img, self.classes)
            elapsed = time_steps(env, eager_step(env, model, opt, x, y), self.args.warmup, self.args.steps,
                                 barrier=False)
            out["samples_s"] = round(batch_size * self.args.steps / elapsed, 1)
            del model, opt
        dist.barrier()
        return out

    # --- autopipe
    def autopipe(self, batch_size: int, *, pp: int, tp: int, m: int, schedule: str, chunks: int = 1,
                 graphs: bool = False, sequence_parallel: bool = False, compiled: bool = False) -> dict:
        env = self.env
        t0 = time.perf_counter()
        model = self.fresh_model()
        x_mb = torch.randn(batch_size // m, 3, self.img, self.img)
        pm = autopipe.parallelize(model, (x_mb,), pp=pp, tp=tp, microbatches=m, schedule=schedule, chunks=chunks,
                                  loss_fn=loss_fn, mixed_precision="bf16", device=env.device,
                                  profile=None if not env.cuda else "h200", record_timeline=pp > 1,
                                  cuda_graphs=graphs and env.cuda, sequence_parallel=sequence_parallel,
                                  compile_stages=compiled)
        build_s = time.perf_counter() - t0
        del model
        pm.train()
        opt = adamw(pm.parameters(), env)
        x, y = batch(env, batch_size, self.img, self.classes)

        def step() -> None:
            pm.train_step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)

        elapsed = time_steps(env, step, self.args.warmup, self.args.steps)
        out = {"samples_s": round(batch_size * self.args.steps / elapsed, 1), "build_s": round(build_s, 1),
               "imbalance": round(pm.plan.imbalance, 3)}
        if pm.timeline is not None:  # one more step, its per-rank busy time from CUDA events
            pm.timeline.clear()
            step()
            from autopipe.runtime.timeline import busy_seconds, gather, measured_bubble

            events = gather(pm.timeline)
            if events is not None:
                busy = busy_seconds(events)
                out["busy_ms"] = [round(busy[r] * 1e3, 1) for r in sorted(busy)]
                out["busy_spread"] = round(max(busy.values()) / min(busy.values()) - 1, 3)
                out["bubble"] = round(measured_bubble(events), 3)
                t0 = min(e.start for e in events)  # every span of that step, ms from its first
                out["events"] = [[e.rank, e.action, e.stage, e.microbatch, round((e.start - t0) * 1e3, 3),
                                  round((e.end - t0) * 1e3, 3)] for e in events]
        del opt
        pm.close()
        return out

    # --- torch.distributed.pipelining, stages split by blocks like autopipe's ViT plans
    def torch_pipeline(self, batch_size: int, *, pp: int, m: int, schedule: str, chunks: int = 1,
                       tp: int = 1, compiled: bool = False) -> dict:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        env = self.env
        model = self.fresh_model()
        pp_group, pp_rank = None, env.rank
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(env.device.type, (pp, tp), mesh_dim_names=("pp", "tp"))
            pp_group, pp_rank = mesh.get_group("pp"), mesh.get_local_rank("pp")
            dtensor_tp(model, mesh["tp"], tp)
        n_stages = pp * chunks
        parts = split_vit(model, n_stages)
        if compiled:
            for part in parts:
                part.compile(dynamic=False)
        local = [s for s in range(n_stages) if s % pp == pp_rank]
        stages = [PipelineStage(parts[s].to(env.device).train(), s, n_stages, env.device, group=pp_group)
                  for s in local]
        del parts, model
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[schedule]
        sched = cls(stages if schedule == "interleaved_1f1b" else stages[0], n_microbatches=m, loss_fn=loss_fn)
        opt = adamw([p for st in stages for p in st.submod.parameters()], env, fused=tp == 1)
        x, y = batch(env, batch_size, self.img, self.classes)
        first, last = 0 in local, n_stages - 1 in local

        def step() -> None:
            kwargs: dict[str, Any] = {}
            if last:
                kwargs["target"], kwargs["losses"] = y, []
            if first:
                sched.step(x, **kwargs)
            else:
                sched.step(**kwargs)
            opt.step()
            opt.zero_grad(set_to_none=True)

        elapsed = time_steps(env, step, self.args.warmup, self.args.steps)
        del sched, stages, opt
        return {"samples_s": round(batch_size * self.args.steps / elapsed, 1)}

    # --- DTensor tensor parallelism on the whole model
    def dtensor(self, batch_size: int, *, tp: int) -> dict:
        from torch.distributed.device_mesh import init_device_mesh

        env = self.env
        model = self.fresh_model()
        mesh = init_device_mesh(env.device.type, (tp,), mesh_dim_names=("tp",))
        dtensor_tp(model, mesh["tp"], tp)
        model = model.to(env.device).train()
        opt = adamw(model.parameters(), env, fused=False)
        x, y = batch(env, batch_size, self.img, self.classes)
        elapsed = time_steps(env, eager_step(env, model, opt, x, y), self.args.warmup, self.args.steps)
        del model, opt
        return {"samples_s": round(batch_size * self.args.steps / elapsed, 1)}


class ViTPart(nn.Module):
    """Blocks ``lo:hi`` of a timm ViT, with the embedding (first part) or the head (last part)."""

    def __init__(self, vit: nn.Module, lo: int, hi: int, first: bool, last: bool, amp: torch.dtype) -> None:
        super().__init__()
        self.first, self.last, self.amp = first, last, amp
        if first:
            self.patch_embed, self.cls_token, self.pos_embed = vit.patch_embed, vit.cls_token, vit.pos_embed
        self.blocks = nn.Sequential(*vit.blocks[lo:hi])
        if last:
            self.norm, self.head = vit.norm, vit.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.amp):
            if self.first:
                x = self.patch_embed(x)
                x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
            x = self.blocks(x)
            if self.last:
                x = self.head(self.norm(x)[:, 0])
        return x


def split_vit(vit: nn.Module, n: int) -> list[nn.Module]:
    depth = len(vit.blocks)
    bounds = [round(i * depth / n) for i in range(n + 1)]
    return [ViTPart(vit, bounds[i], bounds[i + 1], i == 0, i == n - 1, torch.bfloat16) for i in range(n)]


def dtensor_tp(vit: nn.Module, mesh: Any, tp: int) -> None:
    """Megatron TP with DTensor: qkv rows regrouped so each rank's shard holds q, k, v of its heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for blk in vit.blocks:
        attn = blk.attn
        d = attn.qkv.out_features // 3
        with torch.no_grad():
            w = attn.qkv.weight.view(3, tp, d // tp, -1).transpose(0, 1).reshape(3 * d, -1).clone()
            attn.qkv.weight.copy_(w)
            if attn.qkv.bias is not None:
                attn.qkv.bias.copy_(attn.qkv.bias.view(3, tp, d // tp).transpose(0, 1).reshape(-1).clone())
        attn.num_heads //= tp
        attn.attn_dim //= tp
        parallelize_module(blk, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                       "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})


# ----------------------------------------------------------------------------- suites
def suite(bench: Bench, which: str) -> None:
    env, a = bench.env, bench.args
    B, Btp, m = a.batch, a.tp_batch, a.microbatches
    only = set(a.only.split(",")) if a.only else None

    def run(name: str, batch_size: int, gpus: int, fn: Callable[[], dict]) -> None:
        if only is None or any(name == o[1:] if o.startswith("=") else o in name for o in only):
            bench.record(name, batch_size, gpus, fn)

    def check(pp: int, tp: int, sched: str, chunks: int, graphs: bool = False, sp: bool = False,
              compiled: bool = False) -> None:
        name = (f"check autopipe pp={pp} tp={tp} {sched}" + (" graphs" if graphs else "") + (" seq-par" if sp else "")
                + (" compiled" if compiled else ""))

        def measure() -> dict:
            err = check_equivalence(env, pp, tp, sched, chunks, graphs, sp, compiled)
            return {"max_rel_err": err, "ok": err <= 1e-5}

        run(name, 0, pp * tp, measure)

    if which == "2":
        for args in ((2, 1, "1f1b", 1), (2, 1, "interleaved_1f1b", 2), (1, 2, "1f1b", 1)):
            check(*args)
        check(1, 2, "1f1b", 1, sp=True)
        run("one GPU", B, 1, lambda: bench.single(B))
        run("one GPU", Btp, 1, lambda: bench.single(Btp))
        run("autopipe pp=2 1f1b", B, 2, lambda: bench.autopipe(B, pp=2, tp=1, m=m, schedule="1f1b"))
        run("autopipe pp=2 interleaved", B, 2,
            lambda: bench.autopipe(B, pp=2, tp=1, m=m, schedule="interleaved_1f1b", chunks=2))
        run("autopipe tp=2", Btp, 2, lambda: bench.autopipe(Btp, pp=1, tp=2, m=1, schedule="1f1b"))
        run("autopipe tp=2 sequence parallel", Btp, 2,
            lambda: bench.autopipe(Btp, pp=1, tp=2, m=1, schedule="1f1b", sequence_parallel=True))
        for sched, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
            run(f"torch pipelining pp=2 {sched}", B, 2,
                lambda s=sched, c=chunks: bench.torch_pipeline(B, pp=2, m=m, schedule=s, chunks=c))
        run("DTensor tp=2", Btp, 2, lambda: bench.dtensor(Btp, tp=2))
        check(2, 1, "1f1b", 1, graphs=True)
        check(2, 1, "interleaved_1f1b", 2, graphs=True)
        run("autopipe pp=2 interleaved graphs chunks=4 m=8", B, 2,
            lambda: bench.autopipe(B, pp=2, tp=1, m=m, schedule="interleaved_1f1b", chunks=4, graphs=True))
        # Fewer, larger micro-batches (each GPU more efficient) with more chunks (the bubble kept small).
        run(f"autopipe pp=2 interleaved graphs chunks=4 m={m // 2}", B, 2,
            lambda: bench.autopipe(B, pp=2, tp=1, m=m // 2, schedule="interleaved_1f1b", chunks=4, graphs=True))
        for mm in (m, 2 * m):
            run(f"autopipe pp=2 1f1b graphs m={mm}", B, 2,
                lambda mm=mm: bench.autopipe(B, pp=2, tp=1, m=mm, schedule="1f1b", graphs=True))
            run(f"autopipe pp=2 interleaved graphs m={mm}", B, 2,
                lambda mm=mm: bench.autopipe(B, pp=2, tp=1, m=mm, schedule="interleaved_1f1b", chunks=2,
                                             graphs=True))
        # Compiled stages (inductor; [Note: compiled stages]), beside torch.compile'd baselines.
        check(2, 1, "interleaved_1f1b", 2, graphs=True, compiled=True)
        check(1, 2, "1f1b", 1, compiled=True)
        check(1, 2, "1f1b", 1, sp=True, compiled=True)
        for chunks, mm in ((4, m // 2), (4, m), (2, m), (8, m // 2)):  # the bubble against micro-batch size
            run(f"autopipe pp=2 interleaved graphs compiled chunks={chunks} m={mm}", B, 2,
                lambda c=chunks, mm=mm: bench.autopipe(B, pp=2, tp=1, m=mm, schedule="interleaved_1f1b", chunks=c,
                                                       graphs=True, compiled=True))
        run(f"autopipe pp=2 1f1b graphs compiled m={m}", B, 2,
            lambda: bench.autopipe(B, pp=2, tp=1, m=m, schedule="1f1b", graphs=True, compiled=True))
        run("autopipe tp=2 compiled", Btp, 2,
            lambda: bench.autopipe(Btp, pp=1, tp=2, m=1, schedule="1f1b", compiled=True))
        run("autopipe tp=2 sequence parallel compiled", Btp, 2,
            lambda: bench.autopipe(Btp, pp=1, tp=2, m=1, schedule="1f1b", sequence_parallel=True, compiled=True))
        run("one GPU compiled", B, 1, lambda: bench.single(B, compiled=True))
        if Btp != B:  # tp=2's baseline at its own batch
            run("one GPU compiled", Btp, 1, lambda: bench.single(Btp, compiled=True))
        for sched, chunks in (("1f1b", 1), ("interleaved_1f1b", 2)):
            run(f"torch pipelining pp=2 {sched} compiled", B, 2,
                lambda s=sched, c=chunks: bench.torch_pipeline(B, pp=2, m=m, schedule=s, chunks=c, compiled=True))
        # On 2 x H200 (2026-11-23), when a rank's transfers shared one NCCL stream, this one stopped
        # in a coalesced send/recv until NCCL's watchdog aborted both ranks; links now have streams
        # of their own ([Note: transfer streams] in autopipe/runtime/streams.py). Still run last.
        run(f"autopipe pp=2 interleaved graphs chunks=8 m={m // 2}", B, 2,
            lambda: bench.autopipe(B, pp=2, tp=1, m=m // 2, schedule="interleaved_1f1b", chunks=8, graphs=True))
    else:
        check(2, 2, "1f1b", 1)
        check(2, 2, "1f1b", 1, sp=True)
        check(4, 1, "1f1b", 1)
        run("one GPU", B, 1, lambda: bench.single(B))
        run("autopipe pp=2 x tp=2 1f1b", B, 4, lambda: bench.autopipe(B, pp=2, tp=2, m=m, schedule="1f1b"))
        run("autopipe pp=2 x tp=2 1f1b sequence parallel", B, 4,
            lambda: bench.autopipe(B, pp=2, tp=2, m=m, schedule="1f1b", sequence_parallel=True))
        run("autopipe pp=4 1f1b", B, 4, lambda: bench.autopipe(B, pp=4, tp=1, m=m, schedule="1f1b"))
        run("autopipe pp=4 interleaved", B, 4,
            lambda: bench.autopipe(B, pp=4, tp=1, m=m, schedule="interleaved_1f1b", chunks=2))
        run("torch pipelining pp=4 1f1b", B, 4, lambda: bench.torch_pipeline(B, pp=4, m=m, schedule="1f1b"))
        run("torch pipelining pp=2 + DTensor tp=2 1f1b", B, 4,
            lambda: bench.torch_pipeline(B, pp=2, m=m, schedule="1f1b", tp=2))
        check(4, 1, "1f1b", 1, graphs=True)
        run("autopipe pp=4 1f1b graphs", B, 4, lambda: bench.autopipe(B, pp=4, tp=1, m=m, schedule="1f1b", graphs=True))
        run("autopipe pp=4 interleaved graphs", B, 4,
            lambda: bench.autopipe(B, pp=4, tp=1, m=m, schedule="interleaved_1f1b", chunks=2, graphs=True))
        run("autopipe pp=4 1f1b graphs m=16", B, 4,
            lambda: bench.autopipe(B, pp=4, tp=1, m=2 * m, schedule="1f1b", graphs=True))


def table(results: list[dict]) -> str:
    one = {r["batch"]: r["samples_s"] for r in results if r["config"] == "one GPU" and "samples_s" in r}
    lines = [f"{'configuration':44} {'batch':>5} {'samples/s':>9} {'per GPU':>8} {'vs 1 GPU':>8} {'peak GiB':>8}  notes"]
    for r in results:
        if "max_rel_err" in r:
            lines.append(f"{r['config']:44} {'':>5} {'':>9} {'':>8} {'':>8} {'':>8}  max rel err "
                         f"{r['max_rel_err']:.1e} {'ok' if r['ok'] else 'OVER 1e-5'}")
            continue
        if "samples_s" not in r:
            lines.append(f"{r['config']:44} {r['batch']:>5}  failed: {r.get('error', '')[:80]}")
            continue
        s, g = r["samples_s"], r["gpus"]
        base = one.get(r["batch"])
        notes = " ".join(f"{k}={r[k]}" for k in ("imbalance", "busy_spread", "bubble", "build_s") if k in r)
        lines.append(f"{r['config']:44} {r['batch']:>5} {s:>9.1f} {s / g:>8.1f} "
                     f"{(s / base if base else float('nan')):>8.2f} {r.get('peak_gib', 0):>8.2f}  {notes}")

    def best(prefix: str, compiled: bool = True) -> tuple[float, str]:
        rows = [(r["samples_s"], r["config"]) for r in results if r["config"].startswith(prefix) and "samples_s" in r
                and ("tp=2" in prefix or "tp=2" not in r["config"]) and (compiled or "compiled" not in r["config"])]
        return max(rows) if rows else (float("nan"), "-")

    for ours, theirs in (("autopipe pp=2 ", "torch pipelining pp=2 "), ("autopipe tp=2", "DTensor tp=2"),
                         ("autopipe pp=4 ", "torch pipelining pp=4 "),
                         ("autopipe pp=2 x tp=2", "torch pipelining pp=2 + DTensor")):
        shown = set()
        for compiled in (False, True):  # against the eager baselines, then against any
            (a, an), (b, bn) = best(ours), best(theirs, compiled)
            if a == a and b == b and (an, bn) not in shown:
                shown.add((an, bn))
                lines.append(f"best {an} / best {bn}: {a / b:.2f}x")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("2", "4"), default="2")
    p.add_argument("--model", default="vit_large_patch16_224")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tp-batch", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated substrings of configuration names to run "
                   "('=name': that name exactly)")
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU over gloo (a check of the script)")
    args = p.parse_args()
    env = Env(args.smoke)
    if args.smoke:
        args.batch, args.tp_batch, args.warmup, args.steps = 16, 16, 1, 2
        args.microbatches = min(args.microbatches, 4)
    bench = Bench(env, args)
    log(f"suite {args.suite}: {env.world} ranks, {args.model}, torch {torch.__version__}")
    try:
        suite(bench, args.suite)
    finally:
        bench.save()
        log(table(bench.results))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
