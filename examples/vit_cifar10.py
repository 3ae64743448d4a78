"""Train an unmodified timm Vision Transformer with pipeline x tensor x data parallelism.

What it shows: ``autopipe.parallelize`` on a model straight from ``timm.create_model``, cut into
``--pp`` pipeline stages by the cost model and split ``--tp`` ways Megatron-style, with any
processes left over as data-parallel replicas (dp = world size / (pp * tp)); then a plain
training loop around ``pm.train_step`` / ``pm.step`` (examples/_common.py: ``fit``) with the
recipes of the Colossal-AI ViT tutorials: AdamW or timm's Lamb with linear warm-up, label
smoothing or timm's mixup/cutmix (with an accuracy that counts mixed targets), gradient
accumulation, clipping at 1.0, fp16 with a dynamic loss scale or bf16, activation
checkpointing, ZeRO, TensorBoard scalars, a checkpoint every epoch and ``--resume``.

``--parallel`` picks the layout of the tutorial's three configurations, one flag apart
(``--pp``/``--tp`` override it):

* ``data``: data parallelism alone (pp=1, tp=1);
* ``pipeline``: 2 pipeline stages (pp=2), data-parallel replicas beyond them;
* ``hybrid`` (default): 2 stages of 2 tensor-parallel shards (pp=2, tp=2), as in the tutorial's
  hybrid config: 2 micro-batches per batch, clipping at 1.0, activation checkpointing (its
  ``CHECKPOINT = True``; ``--no-activation-checkpointing`` turns it off). Its fp16 is
  ``--precision fp16``; the default stays fp32, which CPUs run fastest.

Run on CPU (4 processes over gloo, bundled digits data; about 96% test accuracy after the 3
epochs):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/vit_cifar10.py --epochs 3

The tutorial's data-parallel recipe (Lamb at 1.8e-2 with linear warm-up and decay, mixup 0.2,
16 batches accumulated per step, fp16) and its pipeline one:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/vit_cifar10.py --parallel data \\
        --optimizer lamb --lr 1.8e-2 --weight-decay 0.1 --lr-decay linear --mixup 0.2 --accumulate 16 \\
        --precision fp16 --tensorboard runs/dp --checkpoint ckpt/dp
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/vit_cifar10.py --parallel pipeline \\
        --precision fp16 --zero

On GPUs (one process per GPU over NCCL; the same script, unchanged), on CIFAR-10:

    torchrun --standalone --nproc-per-node 8 examples/vit_cifar10.py --parallel hybrid \\
        --data ~/data/cifar10 --embed-dim 384 --depth 12 --num-heads 6 \\
        --batch-size 256 --microbatches 8 --epochs 100 --lr 1e-3 --precision bf16

``--data`` is a folder holding torchvision's ``cifar-10-batches-py``; nothing is downloaded.
Without it the script trains on scikit-learn's digits upsampled to 32x32, which runs anywhere.
"""
from __future__ import annotations

import argparse

import timm
import torch

import autopipe
from _common import (add_training_args, fit, init_distributed, load_data, parse_training_args,
                     shutdown_distributed)
from _recipes import make_criterion, make_optimizer, parallel_options

LAYOUTS = {"data": (1, 1), "pipeline": (2, 1), "hybrid": (2, 2)}  # --parallel -> (pp, tp)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", choices=sorted(LAYOUTS), default="hybrid",
                   help="data: pp=1 tp=1; pipeline: pp=2; hybrid: pp=2 tp=2 (processes left over: dp)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages per model chunk (overrides --parallel)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree; must divide --num-heads")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved 1F1B)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b"], default=None,
                   help="default: 1f1b, or interleaved_1f1b when --chunks > 1")
    p.add_argument("--depth", type=int, default=6, help="transformer blocks")
    p.add_argument("--embed-dim", type=int, default=192)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=None,
                   help="default: 16 on the digits (upsampled 8x8 images hold little detail), 4 on CIFAR-10")
    add_training_args(p, batch_size=16, microbatches=2, lr=1e-3, epochs=3)
    p.set_defaults(activation_checkpointing=True)  # the tutorial's CHECKPOINT = True
    args = parse_training_args(p)
    pp, tp = LAYOUTS[args.parallel]
    args.pp, args.tp = args.pp or pp, args.tp or tp
    return args


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
    micro_batch = torch.randn(args.batch_size // args.microbatches, 3, 32, 32)
    pm = autopipe.parallelize(
        model, (micro_batch,), pp=args.pp, tp=args.tp, chunks=args.chunks, schedule=args.schedule,
        microbatches=args.microbatches, loss_fn=make_criterion(args), **parallel_options(args),
    )
    fit(pm, make_optimizer(pm, args), data, args)
    pm.close()  # its process groups (the --zero optimizer's dp group too) go before the default group
    shutdown_distributed()


if __name__ == "__main__":
    main()
