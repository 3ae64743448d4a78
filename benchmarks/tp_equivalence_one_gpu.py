"""Tensor parallelism checked on ONE GPU: two gloo ranks share it, CUDA tensors throughout.

tp=2, with and without sequence parallelism, fp32 and bf16 (weight casts, the fp32-output
GEMM on CUDA), 3 SGD steps against one process running the same micro-batches (autocast for
bf16). Exits 1 when fp32 is off by more than 1e-5 or bf16 by more than 1e-2.

    torchrun --standalone --nproc-per-node 2 benchmarks/tp_equivalence_one_gpu.py
"""
import copy, os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autopipe, timm
dist.init_process_group("gloo")
rank = dist.get_rank()
dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)
base = timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=16, depth=4, embed_dim=256, num_heads=8, num_classes=10)
g = torch.Generator().manual_seed(0)
x = torch.randn(16, 3, 64, 64, generator=g).to(dev); y = torch.randint(0, 10, (16,), generator=g).to(dev)
loss_fn = lambda o, t: F.cross_entropy(o.float(), t)
failed = False
for sp in (False, True):
    for mp in (None, "bf16"):
        ref = copy.deepcopy(base).to(dev).train()
        pm = autopipe.parallelize(copy.deepcopy(base), (x[:4].cpu(),), tp=2, microbatches=4, loss_fn=loss_fn,
                                  mixed_precision=mp, device=dev, sequence_parallel=sp)
        pm.train()
        opt, opt_ref = torch.optim.SGD(pm.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
        worst = 0.0
        for step in range(3):
            loss = float(pm.train_step(x, y)); pm.step(opt); opt.zero_grad()
            rl = 0.0
            for xs, ys in zip(x.chunk(4), y.chunk(4)):
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mp is not None):
                    part = loss_fn(ref(xs), ys) / 4
                part.backward(); rl += float(part.detach())
            opt_ref.step(); opt_ref.zero_grad()
            worst = max(worst, abs(loss - rl) / abs(rl))
        full = pm.full_state_dict()
        sd = ref.state_dict()
        perr = (sum(float((full[k].float() - sd[k].float().cpu()).square().sum()) for k in sd)
                / sum(float(sd[k].float().square().sum()) for k in sd)) ** 0.5
        from autopipe.runtime import weight_casts
        failed |= max(worst, perr) > (1e-5 if mp is None else 1e-2)
        if rank == 0:
            print(f"tp=2 sp={sp} mixed={mp}: loss rel err {worst:.2e}, params rel err {perr:.2e}, "
                  f"fp32 GEMM {weight_casts._mm_out_dtype}, casts {len(pm._runtime.weight_casts or [])}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failed else 0)
