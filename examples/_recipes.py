"""The pieces of the Colossal-AI tutorials' training recipes, from the libraries that have them:
timm's ``Mixup`` targets and ``SoftTargetCrossEntropy``, timm's ``Lamb``, torch's optimizers and
``LambdaLR``, autopipe's ZeRO optimizer, and an accuracy that counts mixed targets.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn as nn

__all__ = ["parallel_options", "make_criterion", "make_optimizer", "warmup_schedule", "mixed_accuracy"]


def parallel_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``parallelize`` options the recipe flags set. Batches split unevenly, so the last
    incomplete batch of an epoch trains as it is (see autopipe's [Note: batch splits])."""
    return dict(mixed_precision=None if args.precision == "fp32" else args.precision,
                activation_checkpointing=args.activation_checkpointing, batch_split="uneven")


def make_criterion(args: argparse.Namespace) -> nn.Module:
    """Cross-entropy on the labels, or on the soft targets timm's Mixup makes (which carry the
    label smoothing then)."""
    if args.mixup or args.cutmix:
        from timm.loss import SoftTargetCrossEntropy

        return SoftTargetCrossEntropy()
    return nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)


def make_optimizer(pm: Any, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW, timm's Lamb or SGD over this rank's parameters; ZeRO-sharded over dp with ``--zero``."""
    kw: dict[str, Any] = dict(lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer == "lamb":
        from timm.optim import Lamb

        # Lamb's own clipping would use this rank's gradients only: pm.step clips over the mesh.
        cls, kw = Lamb, dict(kw, max_grad_norm=None)
    elif args.optimizer == "sgd":
        cls, kw = torch.optim.SGD, dict(kw, momentum=0.9, nesterov=True)
    else:
        cls = torch.optim.AdamW
    return pm.zero_optimizer(cls, **kw) if args.zero else cls(pm.parameters(), **kw)


def warmup_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup: float,
                    decay: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup * total_steps`` steps, then cosine or linear decay to zero
    (Colossal-AI's CosineAnnealingWarmupLR and LinearWarmupLR); step it per optimizer step."""
    warm = max(1, round(warmup * total_steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        done = min(1.0, (step - warm) / max(1, total_steps - warm))
        return 0.5 * (1 + math.cos(math.pi * done)) if decay == "cosine" else 1 - done

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def mixed_accuracy(logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.0) -> float:
    """Top-1 accuracy that counts a mixed sample as far as the prediction hits its mix.

    With labels it is the plain accuracy. With timm's Mixup targets ``lam * onehot(a) + (1 -
    lam) * onehot(b)`` (smoothed: off-values s / C, on-values 1 - s + s / C) a prediction of
    class a scores lam, of b 1 - lam, of both 1 (a = b) and of any other class 0.
    """
    pred, targets = logits.argmax(dim=-1), targets.to(logits.device)
    if targets.dim() == 1:
        return (pred == targets).float().mean().item()
    off = smoothing / targets.shape[-1]
    on = 1 - smoothing + off
    return ((targets.gather(1, pred[:, None]) - off) / (on - off)).mean().item()
