"""One torchrun rank of tests/test_graphs_two_gpus.py: pipelines of CUDA-graph stages over two
GPUs, trained three SGD steps beside a one-GPU reference on the same micro-batches, through
shared-memory links and through NCCL. Rank 0 prints one line per case: its name and the largest
relative difference of any parameter; any exception fails the run."""
from __future__ import annotations

import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopipe  # noqa: E402
from autopipe.runtime import host_links  # noqa: E402
from tests.models import MODELS  # noqa: E402

CASES = [("timm_vit", "gpipe", 1), ("timm_vit", "1f1b", 1), ("timm_vit", "interleaved_1f1b", 2),
         ("timm_resnet", "1f1b", 1), ("timm_resnet", "interleaved_1f1b", 2)]


def case(name: str, schedule: str, chunks: int, shared: bool, device: torch.device) -> float:
    host_links.SHARED_LINKS = shared
    m, n = 4, 16
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    if name == "timm_resnet":
        model = model.to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model).to(device)
    pm = autopipe.parallelize(model, (torch.randn(n // m, 3, 32, 32),), pp=2, microbatches=m, schedule=schedule,
                              chunks=chunks, loss_fn=F.cross_entropy, device=device, cuda_graphs=True)
    pm.eval()
    opt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(n, 3, 32, 32, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)
        opt.zero_grad()
        loss = pm.train_step(x, y)
        opt.step()
        opt_ref.zero_grad()
        ref_loss = 0.0
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            part = F.cross_entropy(ref(xm), ym) / m
            part.backward()
            ref_loss += float(part)
        opt_ref.step()
        if abs(float(loss) - ref_loss) > 1e-4 * max(abs(ref_loss), 1.0):
            raise AssertionError(f"step {step}: loss {float(loss)} against {ref_loss}")
    full = pm.full_state_dict()
    worst = 0.0
    for k, v in ref.state_dict().items():
        v = v.detach().float().cpu()
        worst = max(worst, (full[k].float() - v).abs().max().item() / max(v.abs().max().item(), 1e-12))
    return worst


def main() -> None:
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name, schedule, chunks in CASES:
        for shared in (True, False):
            worst = case(name, schedule, chunks, shared, device)
            if dist.get_rank() == 0:
                print(f"case {name} {schedule} chunks={chunks} {'shared' if shared else 'nccl'} worst={worst:.2e}",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
