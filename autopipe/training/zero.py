"""Zero redundancy over data parallelism: each dp replica keeps 1/dp of the optimizer state.

[Note: zero redundancy]
``pm.zero_optimizer(torch.optim.AdamW, lr=...)`` is torch's ``ZeroRedundancyOptimizer`` over
this rank's parameters and the dp group of its (pipeline, tensor) position: the dp ranks
split the parameters (whole tensors, largest first, each to the rank holding the fewest
elements so far), each keeps the optimizer state of its own share and steps it, and every
updated parameter is then broadcast from the rank that stepped it. ``train_step`` still
averages whole gradients over dp, so this is ZeRO stage 1 (optimizer state only), and what
reads gradients before the step is unchanged: ``pm.step`` unscales them (fp16) and skips
the step on every rank alike on an overflow, and clips them by the global norm, before it
calls ``optimizer.step()``. Learning-rate schedulers change ``optimizer.param_groups`` as
usual; the local optimizer takes them at each step.

Checkpoints keep one format: ``save_checkpoint`` writes each parameter's state from the dp
rank that holds it, under the keys a plain optimizer's state is saved under, and
``load_checkpoint`` hands each rank the state of the parameters it holds. A checkpoint saved
with ZeRO therefore loads without it, and back, in any pp x dp x tp layout.

The optimizer holds its process group: let it go before ``dist.destroy_process_group()``.
Destroyed first, gloo's group may abort the process at exit ("terminate called without an
active exception"; seen in about half the runs on torch 2.14).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..errors import ConfigError

__all__ = ["zero_optimizer", "held_parameters", "local_optimizer", "state_bytes"]


def zero_optimizer(pm: Any, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any] | None = None,
                   **defaults: Any) -> torch.optim.Optimizer:
    """``optimizer_class(params, **defaults)`` with its state sharded over ``pm``'s dp replicas.

    ``params`` (default: ``pm.parameters()``) may be parameter groups, as for any optimizer;
    they must be ``pm``'s. With dp = 1 this is the plain optimizer. See [Note: zero redundancy].
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer_class={optimizer_class!r}; pass an optimizer class such as torch.optim.AdamW "
                          "(not an instance), and its arguments as keywords")
    params = list(pm.parameters() if params is None else params)
    mine = {id(p) for p in pm.parameters()}
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    foreign = sum(id(p) not in mine for p in flat)
    if foreign:
        raise ConfigError(f"{foreign} of the parameters given are not this rank's stage parameters; pass "
                          "pm.parameters() (or groups of them), not the original model's")
    group = pm.mesh.dp_group
    if pm.dp_size == 1 or group is None:
        return optimizer_class(params, **defaults)
    return ZeroRedundancyOptimizer(params, optimizer_class, process_group=group, **defaults)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO's local one, or ``optimizer`` itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def held_parameters(optimizer: torch.optim.Optimizer) -> set[int] | None:
    """``id``s of the parameters whose state this rank holds under ZeRO; None: all of them."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return None
    return {id(p) for g in optimizer.optim.param_groups for p in g["params"]}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state tensors this rank holds (exp_avg, momentum_buffer...)."""
    return sum(v.numel() * v.element_size() for state in local_optimizer(optimizer).state.values()
               for v in state.values() if isinstance(v, torch.Tensor))
