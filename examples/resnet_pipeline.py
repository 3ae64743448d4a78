"""Pipeline-parallel ResNet-18 from torchvision, split by the cost model or by hand.

What it shows: the two ways to cut a CNN into pipeline stages.

* ``--split auto``: ``parallelize`` traces the model with torch.fx and the cost model places the
  cuts (at node granularity: a cut may fall inside a residual block if that balances better).
* ``--split manual``: the model is given as an execution sequence of submodule names and
  callables, as with Colossal-AI's ``PipelinableContext`` ``exec_seq``, and the stages start at
  the named layers (``balance=[...]``), e.g. ``conv1..layer2 | layer3..fc`` for 2 stages.

Processes beyond ``--pp`` become data-parallel replicas: 4 processes with ``--pp 2`` train
2 pipelines of 2 stages. SGD with Nesterov momentum, warm-up + cosine learning rate.

Run on CPU (4 processes over gloo, bundled digits data):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/resnet_pipeline.py --pp 4 --split manual

On GPUs (one process per GPU over NCCL; the same script, unchanged), on CIFAR-10:

    torchrun --standalone --nproc-per-node 8 examples/resnet_pipeline.py --pp 4 --data ~/data/cifar10 \\
        --batch-size 256 --microbatches 8 --epochs 30 --lr 0.2
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision

import autopipe
from _common import (add_training_args, evaluate, init_distributed, is_reporter, load_data,
                     parse_training_args, progress, train_batches, warmup_cosine, world_mean)

# The forward of torchvision's ResNet as a chain: each item takes the previous item's output.
EXEC_SEQUENCE = [
    "conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool",
    lambda x: torch.flatten(x, 1),
    "fc",
]
# Where each stage after the first starts, for --split manual.
SPLIT_POINTS = {2: ["layer3"], 4: ["layer2", "layer3", "layer4"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (2 or 4 with --split manual)")
    p.add_argument("--split", choices=["auto", "manual"], default="auto",
                   help="auto: cost model on the fx graph; manual: exec_sequence and split points")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    add_training_args(p, batch_size=32, microbatches=4, lr=0.05, epochs=3)
    args = parse_training_args(p)
    if args.split == "manual" and args.pp not in SPLIT_POINTS:
        p.error(f"--split manual has split points for --pp {' or '.join(map(str, SPLIT_POINTS))}, not {args.pp}")
    return args


def main() -> None:
    args = parse_args()
    init_distributed()
    torch.manual_seed(args.seed)
    data = load_data(args.data)

    model = torchvision.models.resnet18(num_classes=10)
    # BatchNorm statistics are per micro-batch: in train mode each micro-batch is normalised by its
    # own mean and variance, and the running statistics are updated once per micro-batch (as under
    # gradient accumulation, and per replica as under DDP without SyncBatchNorm). So BatchNorm sees
    # batches of --batch-size / --microbatches samples: keep that large enough for stable statistics.
    split = {}
    if args.split == "manual":
        split = dict(exec_sequence=EXEC_SEQUENCE, balance=SPLIT_POINTS[args.pp])
    pm = autopipe.parallelize(
        model, (torch.randn(args.batch_size // args.microbatches, 3, 32, 32),), pp=args.pp,
        microbatches=args.microbatches, schedule=args.schedule, loss_fn=nn.CrossEntropyLoss(), **split,
    )
    if dist.get_rank() == 0:
        print(pm.report(), flush=True)
    dist.barrier()  # the report prints before any progress bar starts

    optimizer = torch.optim.SGD(pm.parameters(), lr=args.lr, momentum=args.momentum, nesterov=True,
                                weight_decay=args.weight_decay)
    steps_per_epoch = len(data.train_x) // (args.batch_size * pm.dp_size)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    scheduler = warmup_cosine(optimizer, total_steps, args.warmup)
    reporter = is_reporter(pm)

    step, accuracy = 0, 0.0
    for epoch in range(1, args.epochs + 1):
        pm.train()
        batches = train_batches(data, args.batch_size, pm.dp_rank, pm.dp_size, epoch=epoch, seed=args.seed)
        bar = progress(batches, total=min(steps_per_epoch, total_steps - step), enabled=reporter,
                       desc=f"epoch {epoch}/{args.epochs}")
        loss_sum, seen, start = 0.0, 0, time.perf_counter()
        for images, labels in bar:
            optimizer.zero_grad(set_to_none=True)
            loss = pm.train_step(images, labels).item()
            pm.step(optimizer)
            scheduler.step()
            loss_sum, seen, step = loss_sum + loss, seen + 1, step + 1
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", refresh=False)
            if step >= total_steps:
                break
        elapsed = time.perf_counter() - start
        bar.close()
        train_loss = world_mean(loss_sum / max(seen, 1), pm.device)
        accuracy = evaluate(pm, data, args.batch_size, max_batches=args.max_steps)  # running BN statistics
        if reporter:
            samples = seen * args.batch_size * pm.dp_size
            print(f"epoch {epoch}/{args.epochs}: train loss {train_loss:.4f}, test accuracy {accuracy:.4f}, "
                  f"{samples / elapsed:.1f} samples/s ({elapsed:.1f} s)", flush=True)
        if step >= total_steps:
            break

    if reporter:
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
