"""Zero redundancy over dp ([Note: zero redundancy] in autopipe/training/zero.py): the optimizer state
is split over the dp replicas, training matches the unsharded optimizer (with clipping and
fp16 loss scaling), and checkpoints move between ZeRO and plain optimizers both ways.

4 gloo processes: pp=2 x dp=2. The unsharded and the ZeRO runs share the process group and
see the same batches, so their gradients are the same to the bit; AdamW then runs the same
arithmetic on whichever rank holds a parameter.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import autopipe
from autopipe.errors import ConfigError
from autopipe.training.zero import held_parameters, state_bytes
from tests.distributed import run_distributed
from tests.models import ADAMW_MODELS

BATCH = 4  # per dp replica


def _loss(out, y):
    return F.cross_entropy(out, y)


def _build(precision=None):
    torch.manual_seed(0)
    return autopipe.parallelize(ADAMW_MODELS["timm_vit"]().eval(), (torch.randn(2, 3, 32, 32),), pp=2, microbatches=2,
                                loss_fn=_loss, mixed_precision=precision).eval()


def _optimizer(pm, zero):
    kw = dict(lr=1e-3, weight_decay=0.1)
    return pm.zero_optimizer(torch.optim.AdamW, **kw) if zero else torch.optim.AdamW(pm.parameters(), **kw)


def _steps(pm, opt, first, n):
    out = []
    for step in range(first, first + n):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (2 * BATCH,), generator=g)
        sl = slice(pm.dp_rank * BATCH, (pm.dp_rank + 1) * BATCH)
        opt.zero_grad()
        loss = pm.train_step(x[sl], y[sl])
        result = pm.step(opt, max_norm=1.0)
        out.append((float(loss), result.skipped, result.loss_scale))
    return out


def _optim_state(pm, opt):
    """name -> this rank's optimizer state tensors (ZeRO: those it holds)."""
    names = {id(p): n for n, p in pm.named_parameters()}
    local = getattr(opt, "optim", opt)
    return {names[id(p)]: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
            for p, st in local.state.items()}


def _zero(rank, world, root):
    out = {}
    for precision in (None, "fp16"):
        runs = {}
        for zero in (False, True):
            pm = _build(precision)
            opt = _optimizer(pm, zero)
            steps = _steps(pm, opt, 0, 3)
            runs[zero] = dict(steps=steps, params=pm.full_state_dict(), bytes=state_bytes(opt),
                              held=len(held_parameters(opt) or ()), total=len(list(pm.parameters())))
            if precision is None:
                pm.save_checkpoint(os.path.join(root, f"zero={zero}"), opt, extra={"step": 3})
                runs[zero]["state"] = _optim_state(pm, opt)
                _steps(pm, opt, 3, 1)
                runs[zero]["next"] = pm.full_state_dict()
        out[precision] = runs
    # Checkpoints cross over: ZeRO's into a plain optimizer, the plain one's into ZeRO.
    crossed = {}
    for saved_with in (False, True):
        pm = _build()
        opt = _optimizer(pm, not saved_with)
        assert pm.load_checkpoint(os.path.join(root, f"zero={saved_with}"), opt) == {"step": 3}
        crossed[saved_with] = dict(state=_optim_state(pm, opt), lr=opt.param_groups[0]["lr"])
        _steps(pm, opt, 3, 1)
        crossed[saved_with]["next"] = pm.full_state_dict()
    out["crossed"] = crossed
    try:
        pm.zero_optimizer(torch.optim.AdamW(pm.parameters()))
    except ConfigError as exc:
        out["error"] = str(exc)
    return out


def test_zero_shards_optimizer_state_and_trains_like_the_plain_optimizer(tmp_path):
    results = run_distributed(_zero, 4, str(tmp_path), timeout=400)
    for rank, r in enumerate(results):
        for precision in (None, "fp16"):
            plain, zero = r[precision][False], r[precision][True]
            assert zero["steps"] == plain["steps"]  # losses, skip decisions and loss scales
            assert any(not skipped for _, skipped, _ in zero["steps"])
            for k, v in plain["params"].items():
                torch.testing.assert_close(zero["params"][k], v, rtol=1e-6, atol=1e-7, msg=k)
            # This rank holds the state of part of its stage's parameters...
            assert 0 < zero["held"] < zero["total"] and 0.25 < zero["bytes"] / plain["bytes"] < 0.75
        # ...and the two dp ranks of its pipeline rank (ranks 0 and 1, 2 and 3) hold all of it, once.
        partner = results[rank ^ 1][None]
        assert r[None][True]["bytes"] + partner[True]["bytes"] == r[None][False]["bytes"]
        assert r[None][True]["held"] + partner[True]["held"] == r[None][False]["total"]
        # The ZeRO checkpoint loads into the plain optimizer as the plain run's state, and back.
        plain_state = r[None][False]["state"]
        assert r["crossed"][True]["state"].keys() == plain_state.keys()
        for name, st in plain_state.items():
            for k, v in st.items():
                torch.testing.assert_close(r["crossed"][True]["state"][name][k], v, rtol=1e-6, atol=1e-7)
        held = r["crossed"][False]["state"]  # the plain checkpoint in ZeRO: this rank's share only
        assert held.keys() == r[None][True]["state"].keys() and len(held) < len(plain_state)
        assert r["crossed"][True]["lr"] == r["crossed"][False]["lr"] == 1e-3
        for saved_with in (False, True):
            for k, v in r[None][False]["next"].items():
                torch.testing.assert_close(r["crossed"][saved_with]["next"][k], v, rtol=1e-6, atol=1e-7, msg=k)
        assert "optimizer_class=AdamW" in r["error"] and "not an instance" in r["error"]
