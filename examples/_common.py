"""Helpers the examples share: process group, image data, batches, the flags of the Colossal-AI
tutorials' training recipes (their pieces: _recipes.py), evaluation, and :func:`fit`, the plain
training loop every example runs: mixup/cutmix, gradient accumulation, clipping, the fp16 loss
scale, TensorBoard scalars, a checkpoint per epoch and ``--resume``.

autopipe adds only the calls that span the mesh (``pm.train_step``, ``pm.no_sync``, ``pm.step``,
``pm.save_checkpoint``); the rest is the ecosystem's (timm, torch's schedulers,
``torch.utils.tensorboard``, tqdm). :func:`evaluate` and :func:`is_reporter` show how a
:class:`autopipe.ParallelModel` hands out its outputs: only the ranks of the last pipeline stage
hold them, and every tensor-parallel rank there holds the same ones.

Data: CIFAR-10 from a torchvision-format folder (``--data DIR``, never downloaded), else
scikit-learn's bundled digits (1,797 8x8 grey images of 10 classes, no download either) upsampled
to 32x32 and repeated to 3 channels, so every example runs offline. Images are kept as uint8 and
normalised batch by batch, so the 50,000 CIFAR images take 150 MB per process, not 600.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from _recipes import mixed_accuracy, warmup_schedule

__all__ = [
    "ImageData", "add_training_args", "parse_training_args", "init_distributed", "load_data", "batch_sizes",
    "train_batches", "test_batches", "evaluate", "is_reporter", "world_mean", "progress", "fit",
]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
DIGITS_TRAIN = 1500  # of 1,797; the other 297 are the test split


def add_training_args(parser: argparse.ArgumentParser, *, batch_size: int, microbatches: int, lr: float,
                      epochs: int, optimizer: str = "adamw", weight_decay: float = 0.05, clip: float | None = 1.0,
                      label_smoothing: float = 0.1) -> None:
    """The flags every example takes; model-specific ones are added by the example."""
    parser.add_argument("--data", metavar="DIR", help="CIFAR-10 in torchvision's folder format "
                        "(cifar-10-batches-py inside); default: scikit-learn's digits, upsampled")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help="samples per optimizer step and data-parallel replica; split into --microbatches")
    parser.add_argument("--microbatches", type=int, default=microbatches)
    parser.add_argument("--lr", type=float, default=lr, help="peak learning rate, after warm-up")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps spent warming up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many optimizer steps and evaluate as many batches (smoke tests)")
    recipe = parser.add_argument_group("training recipes (the Colossal-AI tutorials' features)")
    recipe.add_argument("--optimizer", choices=["adamw", "lamb", "sgd"], default=optimizer,
                        help="AdamW; timm's Lamb (layer-wise trust ratios; per tensor-parallel shard under --tp); "
                        "SGD with Nesterov momentum")
    recipe.add_argument("--weight-decay", type=float, default=weight_decay)
    recipe.add_argument("--lr-decay", choices=["cosine", "linear"], default="cosine",
                        help="after the linear warm-up: cosine or linear decay to zero (Colossal-AI's LinearWarmupLR)")
    recipe.add_argument("--clip", type=float, default=clip, help="max global gradient norm (0: no clipping)")
    recipe.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="gradient accumulation: one optimizer step per N batches (dp all-reduce once)")
    recipe.add_argument("--label-smoothing", type=float, default=label_smoothing)
    recipe.add_argument("--mixup", type=float, default=0.0, metavar="ALPHA", help="timm Mixup's mixup_alpha")
    recipe.add_argument("--cutmix", type=float, default=0.0, metavar="ALPHA", help="timm Mixup's cutmix_alpha")
    recipe.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="autocast dtype; fp16 adds a dynamic loss scale (parameters stay fp32)")
    recipe.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                        help="recompute each stage's forward in backward (Colossal-AI's CHECKPOINT = True)")
    recipe.add_argument("--zero", action="store_true", help="shard the optimizer state over the dp replicas")
    recipe.add_argument("--tensorboard", metavar="DIR", help="write scalars here from the reporting rank")
    recipe.add_argument("--checkpoint", metavar="DIR", help="save a checkpoint here after every epoch")
    recipe.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint")
    recipe.add_argument("--stop-after-epoch", type=int, default=None, metavar="E",
                        help="leave after epoch E's checkpoint (a job that --resume continues later)")


def parse_training_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses the command line and checks what the flags need of each other."""
    args = parser.parse_args()
    if args.resume and not args.checkpoint:
        parser.error("--resume continues from --checkpoint DIR; give it")
    if args.accumulate < 1:
        parser.error(f"--accumulate {args.accumulate}: give a positive number of batches")
    if args.batch_size < args.microbatches:
        parser.error(f"--batch-size {args.batch_size} is smaller than --microbatches {args.microbatches}: "
                     "the plan is made for micro-batches of batch-size / microbatches samples")
    return args


def init_distributed() -> None:
    """The process group torchrun asked for: NCCL with one GPU per process, gloo on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def shutdown_distributed() -> None:
    """Leave together: every rank reaches here, then the process groups go.

    Call it after the last reference to the parallel model and its optimizer is gone: they hold
    process groups (a ZeroRedundancyOptimizer its own) whose threads must stop before the groups do.
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- data
@dataclass
class ImageData:
    """Train and test splits as uint8 NCHW tensors with int64 labels, and how to normalise them."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: torch.Tensor  # (3, 1, 1), on the 0..1 scale
    std: torch.Tensor
    augment: bool  # random crops and mirroring (CIFAR); a mirrored digit is no longer its class

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 255 - self.mean) / self.std


def _digits() -> ImageData:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16  # pixel values are 0..16
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x.clamp(0, 1) * 255).round().to(torch.uint8)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # the same split always
    x, y = x[order], y[order]
    train = x[:DIGITS_TRAIN].float() / 255
    mean = train.mean(dim=(0, 2, 3)).view(3, 1, 1)
    std = train.std(dim=(0, 2, 3)).view(3, 1, 1)
    return ImageData("digits", x[:DIGITS_TRAIN], y[:DIGITS_TRAIN], x[DIGITS_TRAIN:], y[DIGITS_TRAIN:],
                     mean, std, augment=False)


def _cifar10(root: str) -> ImageData:
    from torchvision.datasets import CIFAR10

    def split(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ds = CIFAR10(root, train=train, download=False)
        return torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets)

    (train_x, train_y), (test_x, test_y) = split(True), split(False)
    return ImageData("cifar10", train_x, train_y, test_x, test_y, torch.tensor(CIFAR_MEAN).view(3, 1, 1),
                     torch.tensor(CIFAR_STD).view(3, 1, 1), augment=True)


def load_data(root: str | None) -> ImageData:
    return _cifar10(root) if root else _digits()


def _augment(x: torch.Tensor, g: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crops of the zero-padded images (shifts of up to ``pad`` pixels) and mirroring."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy, dx = torch.randint(0, 2 * pad + 1, (2, n), generator=g).tolist()
    out = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    flip = torch.rand(n, generator=g) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def batch_sizes(samples: int, batch_size: int, dp_size: int, multiple: int = 1) -> list[int]:
    """The sizes of one replica's batches in an epoch of ``samples``: full batches, then the last
    incomplete one, the same size on every replica and a multiple of ``multiple`` (timm's Mixup
    mixes pairs); the fewer than ``dp_size * multiple`` samples that do not deal so are left out."""
    full = samples // (batch_size * dp_size)
    last = (samples - full * batch_size * dp_size) // dp_size // multiple * multiple
    return [batch_size] * full + ([last] if last else [])


def train_batches(data: ImageData, batch_size: int, dp_rank: int, dp_size: int, *, epoch: int,
                  seed: int, multiple: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel replica's batches of one epoch (sizes: :func:`batch_sizes`), as
    DistributedSampler deals them.

    The shuffle and the augmentation draw from generators seeded by (seed, epoch, replica) only, so
    every pipeline and tensor-parallel rank of a replica builds the very same batch: stage 0 of each
    tensor-parallel rank reads the images, the last stage reads the labels. The last incomplete
    batch is kept: ``parallelize(..., batch_split="uneven")`` runs it as it is.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(data.train_x), generator=g)
    sizes = batch_sizes(len(order), batch_size, dp_size, multiple)
    mine = order[: sum(sizes) * dp_size][dp_rank::dp_size]
    aug = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_009 + dp_rank)
    for start in range(0, len(mine), batch_size):
        idx = mine[start:start + batch_size]
        x = data.train_x[idx]
        if data.augment:
            x = _augment(x, aug)
        yield data.normalise(x), data.train_y[idx]


def test_batches(data: ImageData, batch_size: int, dp_rank: int,
                 dp_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) of this replica's share of the test split; the last batch is smaller.
    Replicas may get different numbers of batches: evaluation has no dp collective."""
    idx_all = torch.arange(dp_rank, len(data.test_x), dp_size)
    for start in range(0, len(idx_all), batch_size):
        idx = idx_all[start:start + batch_size]
        yield data.normalise(data.test_x[idx]), data.test_y[idx]


# ----------------------------------------------------------------------------------- evaluation
def is_reporter(pm: Any) -> bool:
    """The one rank that prints progress: it holds the loss and the outputs (the last stage), and is
    the first of the identical tensor-parallel ranks there and of the data-parallel replicas."""
    return pm.is_last_stage and pm.tp_rank == 0 and pm.dp_rank == 0


def world_mean(value: float, device: torch.device) -> float:
    """The mean over data-parallel replicas of a value every rank holds (its replica's). Every
    pipeline and tensor-parallel rank holds the same value, so the mean over the world is it."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(pm: Any, data: ImageData, batch_size: int, *, logits: Callable[[Any], torch.Tensor] = lambda o: o,
             max_batches: int | None = None) -> float:
    """Test accuracy over every replica's share of the test split. Collective: call it on every rank.

    ``pm.eval_step`` takes batches of any size and returns the model's outputs on the last
    stage's ranks and None elsewhere; ``logits`` picks the logits out of them (``lambda out:
    out.logits`` for a transformers model). Leaves the model in train mode.
    """
    pm.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=pm.device)  # correct, seen
    for i, (x, y) in enumerate(test_batches(data, batch_size, pm.dp_rank, pm.dp_size)):
        if max_batches is not None and i >= max_batches:
            break
        out = pm.eval_step(x)
        if out is not None and pm.tp_rank == 0:  # tp ranks hold equal outputs: count them once
            counts[0] += (logits(out).argmax(dim=-1).cpu() == y).sum().item()
            counts[1] += len(y)
    pm.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def progress(iterable: Any, *, total: int, enabled: bool, desc: str) -> tqdm:
    """A progress bar on the reporting rank only; it clears itself at the end of the epoch."""
    return tqdm(iterable, total=total, disable=not enabled, desc=desc, dynamic_ncols=True, leave=False)


# ----------------------------------------------------------------------------------- the loop
def _seed_epoch(seed: int, epoch: int, dp_rank: int) -> None:
    """timm's Mixup draws from numpy's global generator: every rank of a replica draws the same
    mixes, and a resumed run draws what the uninterrupted one drew (dropout likewise)."""
    np.random.seed((seed * 1_000_003 + epoch) * 1_009 + dp_rank)
    torch.manual_seed(seed * 1_000_003 + epoch)


def _resume(pm: Any, optimizer: torch.optim.Optimizer, scheduler: Any, args: argparse.Namespace,
            reporter: bool) -> tuple[int, int]:
    """Loads the last checkpoint in ``--checkpoint``; returns the step count and the next epoch."""
    extra = pm.load_checkpoint(args.checkpoint, optimizer)
    scheduler.load_state_dict(extra["scheduler"])
    if reporter:
        print(f"resumed from {args.checkpoint} after epoch {extra['epoch']} (step {extra['step']})", flush=True)
    return extra["step"], extra["epoch"] + 1


def _accumulate(pm: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], mixup: Any, smoothing: float,
                logits: Callable[[Any], torch.Tensor]) -> tuple[float, float]:
    """Gradients of one optimizer step's batches, each weighed by its share of their samples;
    returns this replica's mean loss (every rank) and mixed accuracy (last stage, else 0)."""
    n = sum(len(x) for x, _ in batches)
    loss, hits = 0.0, 0.0
    for i, (images, labels) in enumerate(batches):
        targets = labels
        if mixup is not None:
            images, targets = mixup(images, labels)
        # One dp all-reduce per step: every batch but the last accumulates under no_sync().
        with contextlib.nullcontext() if i == len(batches) - 1 else pm.no_sync():
            part, out = pm.train_step(images, targets, return_outputs=True, grad_scale=len(images) / n)
        loss += part.item() * len(images) / n
        if out is not None:
            hits += mixed_accuracy(logits(out), targets, smoothing) * len(images) / n
    return loss, hits


def fit(pm: Any, optimizer: torch.optim.Optimizer, data: ImageData, args: argparse.Namespace, *,
        logits: Callable[[Any], torch.Tensor] = lambda o: o) -> float:
    """The training loop every example shares; returns the final test accuracy.

    A plain loop around ``pm.train_step`` and ``pm.step``, in the order Colossal-AI's Trainer
    hooks ran: mixup (timm), ``--accumulate`` batches per step (all but the last under
    ``pm.no_sync()``), clipping and the fp16 loss scale in ``pm.step``, the LR schedule per step,
    TensorBoard scalars from the reporting rank, evaluation and a checkpoint per epoch.
    Prints the partition report (rank 0) and, per epoch, the train loss, test accuracy and
    throughput on the reporting rank.
    """
    if dist.get_rank() == 0:
        print(pm.report(), flush=True)
    dist.barrier()  # the report prints before any progress bar starts
    mixup = None
    if args.mixup or args.cutmix:
        from timm.data import Mixup

        mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.label_smoothing,
                      num_classes=10)
    multiple = 2 if mixup else 1  # timm's Mixup mixes a batch with its reverse: pairs
    sizes = batch_sizes(len(data.train_x), args.batch_size, pm.dp_size, multiple)
    groups = [sizes[i:i + args.accumulate] for i in range(0, len(sizes), args.accumulate)]  # one per step
    total_steps = len(groups) * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    scheduler = warmup_schedule(optimizer, total_steps, args.warmup, args.lr_decay)
    reporter = is_reporter(pm)
    writer = None
    if args.tensorboard and reporter:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    step, first = _resume(pm, optimizer, scheduler, args, reporter) if args.resume else (0, 1)
    accuracy = 0.0
    for epoch in range(first, args.epochs + 1):
        if step >= total_steps:
            break
        pm.train()
        _seed_epoch(args.seed, epoch, pm.dp_rank)
        batches = train_batches(data, args.batch_size, pm.dp_rank, pm.dp_size, epoch=epoch, seed=args.seed,
                                multiple=multiple)
        bar = progress(groups, total=min(len(groups), total_steps - step), enabled=reporter,
                       desc=f"epoch {epoch}/{args.epochs}")
        loss_sum, seen, samples, start = 0.0, 0, 0, time.perf_counter()
        for group in bar:
            tick = time.perf_counter()
            n = sum(group)  # this replica's samples in the step
            loss, hits = _accumulate(pm, [next(batches) for _ in group], mixup, args.label_smoothing, logits)
            lr = scheduler.get_last_lr()[0]  # this step's
            result = pm.step(optimizer, max_norm=args.clip or None)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            loss_sum, seen, step, samples = loss_sum + loss, seen + 1, step + 1, samples + n * pm.dp_size
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", refresh=False)
            if writer is not None:
                writer.add_scalar("train/loss", loss, step)
                writer.add_scalar("train/accuracy", hits, step)
                writer.add_scalar("train/lr", lr, step)
                writer.add_scalar("train/samples_per_s", n * pm.dp_size / (time.perf_counter() - tick), step)
                writer.add_scalar("train/loss_scale", result.loss_scale, step)
            if step >= total_steps:
                break
        elapsed = time.perf_counter() - start
        bar.close()
        train_loss = world_mean(loss_sum / max(seen, 1), pm.device)
        accuracy = evaluate(pm, data, args.batch_size, logits=logits, max_batches=args.max_steps)
        if reporter:
            print(f"epoch {epoch}/{args.epochs}: train loss {train_loss:.4f}, test accuracy {accuracy:.4f}, "
                  f"{samples / elapsed:.1f} samples/s ({elapsed:.1f} s)", flush=True)
        if writer is not None:
            writer.add_scalar("test/accuracy", accuracy, step)
            writer.flush()
        if args.checkpoint:
            pm.save_checkpoint(args.checkpoint, optimizer,
                               extra={"epoch": epoch, "step": step, "scheduler": scheduler.state_dict()})
        if args.stop_after_epoch is not None and epoch >= args.stop_after_epoch:
            break

    if reporter:
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    if writer is not None:
        writer.close()
    return accuracy
