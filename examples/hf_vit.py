"""Train a Hugging Face transformers ViT with pipeline x tensor parallelism.

What it shows: ``parallelize`` on ``ViTForImageClassification`` as transformers builds it (plain
``torch.fx`` cannot trace transformers models; autopipe captures them with ``torch.export``, and
the report names the route taken). The model returns a ``ModelOutput``, and so does the
pipeline: the loss function and the evaluation read ``out.logits``. The model is a small ViT
built from a ``ViTConfig`` with random weights; ``pm.load_full_state_dict`` would load a
pretrained checkpoint of the same configuration instead.

Run on CPU (4 processes over gloo, bundled digits data):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/hf_vit.py --pp 2 --tp 2

On GPUs (one process per GPU over NCCL; the same script, unchanged), on CIFAR-10:

    torchrun --standalone --nproc-per-node 8 examples/hf_vit.py --pp 2 --tp 4 --data ~/data/cifar10 \\
        --hidden-size 384 --layers 12 --heads 8 --batch-size 256 --microbatches 8 --epochs 50 --precision bf16
"""
from __future__ import annotations

import argparse

import torch
from transformers import ViTConfig, ViTForImageClassification

import autopipe
from _common import (add_training_args, fit, init_distributed, load_data, parse_training_args,
                     shutdown_distributed)
from _recipes import make_criterion, make_optimizer, parallel_options


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2, help="must divide --heads")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=None,
                   help="default: 16 on the digits (upsampled 8x8 images hold little detail), 4 on CIFAR-10")
    add_training_args(p, batch_size=16, microbatches=4, lr=1e-3, epochs=3)
    return parse_training_args(p)


def main() -> None:
    args = parse_args()
    init_distributed()
    torch.manual_seed(args.seed)
    data = load_data(args.data)
    patch_size = args.patch_size or (16 if data.name == "digits" else 4)

    config = ViTConfig(
        image_size=32, patch_size=patch_size, hidden_size=args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, intermediate_size=2 * args.hidden_size,
        num_labels=10,
    )
    model = ViTForImageClassification(config)
    criterion = make_criterion(args)

    def loss_fn(out, targets):  # out: the ImageClassifierOutput of the whole model
        return criterion(out.logits, targets)

    pm = autopipe.parallelize(
        model, (torch.randn(args.batch_size // args.microbatches, 3, 32, 32),), pp=args.pp, tp=args.tp,
        microbatches=args.microbatches, loss_fn=loss_fn, **parallel_options(args),
    )
    fit(pm, make_optimizer(pm, args), data, args, logits=lambda out: out.logits)
    pm.close()  # its process groups (the --zero optimizer's dp group too) go before the default group
    shutdown_distributed()


if __name__ == "__main__":
    main()
