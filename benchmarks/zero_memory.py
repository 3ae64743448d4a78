"""Per-rank optimizer state with and without zero redundancy: ViT-B/16, dp=2, AdamW, CPU.

Both runs take one real step (AdamW makes its state at the first step) on 2 images per
replica, from the same weights. Reported per rank: the bytes of optimizer state it holds
(``autopipe.training.zero.state_bytes``), the parameters whose state it holds, and how much its
resident memory grew during the optimizer step, where the state is made (glibc's mmap
threshold is pinned, so every large block comes from fresh pages and goes back when freed,
and the second run does not reuse the first one's memory). Also checks that both runs end
with the same parameters.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/zero_memory.py \\
        --json benchmarks/results/zero_memory_vit_b_dp2_cpu.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autopipe  # noqa: E402
from autopipe.training.zero import held_parameters, state_bytes  # noqa: E402

MIB = 2**20


def pin_mmap_threshold() -> None:
    """Blocks of 128 KiB and more are mmapped, and freed ones unmapped (no dynamic threshold)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except OSError:  # not glibc: the growth figures may then undercount the second run
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(zero: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", num_classes=10)
    pm = autopipe.parallelize(model, (torch.randn(2, 3, 224, 224),), microbatches=1, loss_fn=F.cross_entropy)
    kw = dict(lr=1e-4, weight_decay=0.05)
    opt = pm.zero_optimizer(torch.optim.AdamW, **kw) if zero else torch.optim.AdamW(pm.parameters(), **kw)
    g = torch.Generator().manual_seed(1 + pm.dp_rank)
    x, y = torch.randn(2, 3, 224, 224, generator=g), torch.randint(0, 10, (2,), generator=g)
    start = time.perf_counter()
    pm.train_step(x, y)
    before = rss_bytes()
    pm.step(opt, max_norm=1.0)
    growth = rss_bytes() - before
    held = held_parameters(opt)
    params = list(pm.parameters())
    row = {
        "zero": zero,
        "rank": dist.get_rank(),
        "optimizer_state_bytes": state_bytes(opt),
        "optimizer_state_mib": round(state_bytes(opt) / MIB, 1),
        "parameters_held": len(held) if held is not None else len(params),
        "parameters": len(params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "rss_growth_in_step_mib": round(growth / MIB, 1),
        "step_seconds": round(time.perf_counter() - start, 2),
    }
    return row, pm.full_state_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows here (rank 0)")
    args = p.parse_args()
    pin_mmap_threshold()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = []
    plain_row, plain_params = run(False)
    zero_row, zero_params = run(True)
    same = all(torch.equal(zero_params[k], v) for k, v in plain_params.items())
    for row in (plain_row, zero_row):
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        rows.extend(gathered)
    if dist.get_rank() == 0:
        for r in rows:
            print(f"zero={r['zero']!s:5} rank {r['rank']}: optimizer state {r['optimizer_state_mib']:7.1f} MiB "
                  f"({r['parameters_held']}/{r['parameters']} parameters), resident memory +"
                  f"{r['rss_growth_in_step_mib']:.1f} MiB in the step")
        plain = sum(r["optimizer_state_bytes"] for r in rows if not r["zero"]) / 2
        per_rank = [r["optimizer_state_bytes"] / plain for r in rows if r["zero"]]
        print(f"ZeRO keeps {', '.join(f'{f:.3f}' for f in per_rank)} of the unsharded state per rank; "
              f"parameters after the step equal: {same}")
        if args.json:
            out = {"model": "vit_base_patch16_224", "dp": 2, "optimizer": "AdamW", "device": "cpu",
                   "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                   "fraction_per_rank": per_rank, "parameters_equal": same, "rows": rows}
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
