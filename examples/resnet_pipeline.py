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

import torch
import torchvision

import autopipe
from _common import (add_training_args, fit, init_distributed, load_data, parse_training_args,
                     shutdown_distributed)
from _recipes import make_criterion, make_optimizer, parallel_options

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
    add_training_args(p, batch_size=32, microbatches=4, lr=0.05, epochs=3, optimizer="sgd", weight_decay=5e-4,
                      clip=None, label_smoothing=0.0)
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
    # In train mode each micro-batch is normalised by its own mean and variance (as under gradient
    # accumulation, and per replica as under DDP without SyncBatchNorm), so BatchNorm normalises
    # batches of --batch-size / --microbatches samples: keep that large enough. The running
    # statistics are updated once per step from the whole batch of every replica (the default,
    # batchnorm="deferred"; docs/batchnorm.md).
    split = {}
    if args.split == "manual":
        split = dict(exec_sequence=EXEC_SEQUENCE, balance=SPLIT_POINTS[args.pp])
    pm = autopipe.parallelize(
        model, (torch.randn(args.batch_size // args.microbatches, 3, 32, 32),), pp=args.pp,
        microbatches=args.microbatches, schedule=args.schedule, loss_fn=make_criterion(args), **split,
        **parallel_options(args),
    )
    fit(pm, make_optimizer(pm, args), data, args)
    pm.close()  # its process groups (the --zero optimizer's dp group too) go before the default group
    shutdown_distributed()


if __name__ == "__main__":
    main()
