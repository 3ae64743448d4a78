"""Train an unmodified timm Vision Transformer with pipeline x tensor x data parallelism.

What it shows: ``autopipe.parallelize`` on a model straight from ``timm.create_model``, cut into
``--pp`` pipeline stages by the cost model and split ``--tp`` ways Megatron-style, with any
processes left over as data-parallel replicas (dp = world size / (pp * tp)); then an ordinary
training loop around ``pm.train_step`` / ``pm.step``: AdamW, label smoothing, warm-up + cosine
learning rate, gradient clipping over the whole mesh, optional bf16 autocast, and evaluation with
``pm.eval_step``.

Run on CPU (4 processes over gloo, bundled digits data; about 20 s per epoch on two cores, and
about 96% test accuracy after the 3 epochs):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/vit_cifar10.py --pp 2 --tp 2 --epochs 3

On GPUs (one process per GPU over NCCL; the same script, unchanged), on CIFAR-10:

    torchrun --standalone --nproc-per-node 8 examples/vit_cifar10.py --pp 2 --tp 2 \\
        --data ~/data/cifar10 --embed-dim 384 --depth 12 --num-heads 6 \\
        --batch-size 256 --microbatches 8 --epochs 100 --lr 1e-3 --bf16

``--data`` is a folder holding torchvision's ``cifar-10-batches-py``; nothing is downloaded.
Without it the script trains on scikit-learn's digits upsampled to 32x32, which runs anywhere.
"""
from __future__ import annotations

import argparse

import timm
import torch
import torch.nn as nn

import autopipe
from _common import add_training_args, fit, init_distributed, load_data, parse_training_args


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (per model chunk)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; must divide --num-heads")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved 1F1B)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b"], default=None,
                   help="default: 1f1b, or interleaved_1f1b when --chunks > 1")
    p.add_argument("--depth", type=int, default=6, help="transformer blocks")
    p.add_argument("--embed-dim", type=int, default=192)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=None,
                   help="default: 16 on the digits (upsampled 8x8 images hold little detail), 4 on CIFAR-10")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast; parameters and optimizer stay fp32")
    add_training_args(p, batch_size=16, microbatches=4, lr=1e-3, epochs=3)
    return parse_training_args(p)


def main() -> None:
    args = parse_args()
    init_distributed()
    torch.manual_seed(args.seed)  # every rank builds the same model; each keeps its stages' shards
    data = load_data(args.data)
    patch_size = args.patch_size or (16 if data.name == "digits" else 4)

    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=patch_size, depth=args.depth,
        embed_dim=args.embed_dim, num_heads=args.num_heads, num_classes=10,
        global_pool="avg",  # mean of the patch tokens: learns much faster than the class token here
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    micro_batch = torch.randn(args.batch_size // args.microbatches, 3, 32, 32)
    pm = autopipe.parallelize(
        model, (micro_batch,), pp=args.pp, tp=args.tp, chunks=args.chunks, schedule=args.schedule,
        microbatches=args.microbatches, loss_fn=criterion, mixed_precision="bf16" if args.bf16 else None,
    )
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    fit(pm, optimizer, data, args, max_norm=args.clip)


if __name__ == "__main__":
    main()
