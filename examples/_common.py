"""Helpers the examples share: process group, image data, batches, LR schedule, evaluation.

Nothing here is autopipe-specific except :func:`evaluate` and :func:`is_reporter`, which show how
a :class:`autopipe.ParallelModel` hands out its outputs: only the ranks of the last pipeline stage
hold them, and every tensor-parallel rank there holds the same ones.

Data: CIFAR-10 from a torchvision-format folder (``--data DIR``, never downloaded), else
scikit-learn's bundled digits (1,797 8x8 grey images of 10 classes, no download either) upsampled
to 32x32 and repeated to 3 channels, so every example runs offline. Images are kept as uint8 and
normalised batch by batch, so the 50,000 CIFAR images take 150 MB per process, not 600.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

__all__ = [
    "ImageData", "add_training_args", "parse_training_args", "init_distributed", "load_data", "train_batches",
    "test_batches", "warmup_cosine", "evaluate", "is_reporter", "world_mean", "progress",
]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
DIGITS_TRAIN = 1500  # of 1,797; the other 297 are the test split


def add_training_args(parser: argparse.ArgumentParser, *, batch_size: int, microbatches: int, lr: float,
                      epochs: int) -> None:
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


def parse_training_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses the command line; a batch must split into equal micro-batches (the plan fixes their shape)."""
    args = parser.parse_args()
    if args.batch_size % args.microbatches:
        parser.error(f"--batch-size {args.batch_size} must split into --microbatches {args.microbatches} "
                     "equal micro-batches")
    return args


def init_distributed() -> None:
    """The process group torchrun asked for: NCCL with one GPU per process, gloo on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


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


def train_batches(data: ImageData, batch_size: int, dp_rank: int, dp_size: int, *, epoch: int,
                  seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel replica's batches of one epoch, as DistributedSampler deals them.

    The shuffle and the augmentation draw from generators seeded by (seed, epoch, replica) only, so
    every pipeline and tensor-parallel rank of a replica builds the very same batch: stage 0 of each
    tensor-parallel rank reads the images, the last stage reads the labels. The last incomplete
    batch is dropped: a batch must split into the planned micro-batches.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(data.train_x), generator=g)
    steps = len(order) // (batch_size * dp_size)
    mine = order[: steps * batch_size * dp_size][dp_rank::dp_size]
    aug = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_009 + dp_rank)
    for i in range(steps):
        idx = mine[i * batch_size:(i + 1) * batch_size]
        x = data.train_x[idx]
        if data.augment:
            x = _augment(x, aug)
        yield data.normalise(x), data.train_y[idx]


def test_batches(data: ImageData, batch_size: int, dp_rank: int,
                 dp_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(images, labels, mask) of this replica's share of the test split. The plan fixes the batch
    shape, so the last batch is padded with repeats of its first sample, which ``mask`` excludes."""
    idx_all = torch.arange(dp_rank, len(data.test_x), dp_size)
    for start in range(0, len(idx_all), batch_size):
        idx = idx_all[start:start + batch_size]
        mask = torch.ones(batch_size, dtype=torch.bool)
        if len(idx) < batch_size:
            mask[len(idx):] = False
            idx = torch.cat([idx, idx[:1].expand(batch_size - len(idx))])
        yield data.normalise(data.test_x[idx]), data.test_y[idx], mask


# ----------------------------------------------------------------------------------- training
def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int,
                  warmup: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup * total_steps`` steps, then cosine decay to zero; step it per batch."""
    warm = max(1, round(warmup * total_steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total_steps - warm))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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

    ``pm.eval_step`` returns the model's outputs on the last stage's ranks and None elsewhere;
    ``logits`` picks the logits out of them (``lambda out: out.logits`` for a transformers model).
    Leaves the model in train mode.
    """
    pm.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=pm.device)  # correct, seen
    for i, (x, y, mask) in enumerate(test_batches(data, batch_size, pm.dp_rank, pm.dp_size)):
        if max_batches is not None and i >= max_batches:
            break
        out = pm.eval_step(x)
        if out is not None and pm.tp_rank == 0:  # tp ranks hold equal outputs: count them once
            pred = logits(out).argmax(dim=-1).cpu()
            counts[0] += ((pred == y) & mask).sum().item()
            counts[1] += mask.sum().item()
    pm.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def progress(iterable: Any, *, total: int, enabled: bool, desc: str) -> tqdm:
    """A progress bar on the reporting rank only; it clears itself at the end of the epoch."""
    return tqdm(iterable, total=total, disable=not enabled, desc=desc, dynamic_ncols=True, leave=False)


def fit(pm: Any, optimizer: torch.optim.Optimizer, data: ImageData, args: argparse.Namespace, *,
        max_norm: float | None = None, logits: Callable[[Any], torch.Tensor] = lambda o: o) -> float:
    """The training loop every example shares; returns the final test accuracy.

    Prints the partition report (rank 0), then per epoch: a progress bar, the train loss, test
    accuracy and throughput on the reporting rank; warm-up + cosine LR; ``pm.step`` clips over
    the whole mesh when ``max_norm`` is given. Ends the process group.
    """
    if dist.get_rank() == 0:
        print(pm.report(), flush=True)
    dist.barrier()  # the report prints before any progress bar starts
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
            loss = pm.train_step(images, labels).item()  # this replica's mean loss, on every rank
            pm.step(optimizer, max_norm=max_norm)
            scheduler.step()
            loss_sum, seen, step = loss_sum + loss, seen + 1, step + 1
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", refresh=False)
            if step >= total_steps:
                break
        elapsed = time.perf_counter() - start
        bar.close()
        train_loss = world_mean(loss_sum / max(seen, 1), pm.device)
        accuracy = evaluate(pm, data, args.batch_size, logits=logits, max_batches=args.max_steps)
        if reporter:
            samples = seen * args.batch_size * pm.dp_size
            print(f"epoch {epoch}/{args.epochs}: train loss {train_loss:.4f}, test accuracy {accuracy:.4f}, "
                  f"{samples / elapsed:.1f} samples/s ({elapsed:.1f} s)", flush=True)
        if step >= total_steps:
            break

    if reporter:
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    dist.destroy_process_group()
    return accuracy
