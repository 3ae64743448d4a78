"""Transparency: a pipelined model trains exactly like the single-process model it was cut from.

Every (pp, chunks, schedule, optimizer) runs in one gloo world per pp (module-scoped fixture);
each test compares one configuration against a gradient-accumulation reference in this process.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopipe.errors import ConfigError, InputError, ScheduleError
from autopipe.runtime import PipelineDriver, TensorSpec, host_links, streams
from autopipe.runtime.schedule import max_in_flight_bound
from tests.distributed import run_distributed

__all__: list[str] = []

IN, WIDTH, OUT, IDS, DEPTH = 16, 32, 4, 5, 8
SKIP_FROM, SKIP_TO = 1, 6  # block 1's output is added to block 6's input
BN_BLOCK, DROPOUT_BLOCK = 3, 5
STEPS, MB_SIZE = 3, 3
SCHEDULES_BY_CHUNKS = {1: ("gpipe", "1f1b", "interleaved_1f1b"), 2: ("gpipe", "interleaved_1f1b")}
OPTIMIZERS = ("sgd", "adamw")


def block(i: int) -> nn.Sequential:
    # No bias before batch norm: its gradient is zero up to rounding, which AdamW would amplify.
    layers: list[nn.Module] = [nn.Linear(IN if i == 0 else WIDTH, WIDTH, bias=i != BN_BLOCK)]
    if i == BN_BLOCK:
        layers.append(nn.BatchNorm1d(WIDTH))
    if i == DROPOUT_BLOCK:
        layers.append(nn.Dropout(p=0.0))
    return nn.Sequential(*layers, nn.GELU())


class Net(nn.Module):
    """8 Linear+GELU blocks with a long skip, a head, and an integer-indexed bias."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(i) for i in range(DEPTH))
        self.head = nn.Linear(WIDTH, OUT)
        self.bias = nn.Parameter(0.1 * torch.randn(IDS, OUT))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h, skip = x, None
        for i, b in enumerate(self.blocks):
            h = b(h + skip if i == SKIP_TO else h)
            skip = h if i == SKIP_FROM else skip
        return self.head(h) + self.bias[ids]


def skip_live(boundary: int) -> bool:
    """Whether the skip tensor crosses the cut before block ``boundary``."""
    return SKIP_FROM < boundary <= SKIP_TO


class Stage(nn.Module):
    """Blocks [lo, hi) of a Net, sharing its parameters; inputs/outputs as the stage contract."""

    def __init__(self, net: Net, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi, self.last = lo, hi, hi == DEPTH
        self.blocks = nn.ModuleList(net.blocks[lo:hi])
        if self.last:
            self.head, self.bias = net.head, net.bias

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, ids = args[0], args[-1]
        skip = args[1] if self.lo and skip_live(self.lo) else None
        for i, b in zip(range(self.lo, self.hi), self.blocks):
            h = b(h + skip if i == SKIP_TO else h)
            skip = h if i == SKIP_FROM else skip
        if self.last:
            return (self.head(h) + self.bias[ids],)
        # With skip live across both cuts, the stage passes its input through untouched.
        return (h, skip, ids) if skip_live(self.hi) else (h, ids)


def make_stages(net: Net, n: int) -> list[Stage]:
    cuts = [round(k * DEPTH / n) for k in range(n + 1)]
    return [Stage(net, cuts[k], cuts[k + 1]) for k in range(n)]


def boundary_specs(n: int, mb: int = MB_SIZE) -> list[list[TensorSpec]]:
    specs = []
    for k in range(1, n):
        cut = round(k * DEPTH / n)
        h = TensorSpec((mb, WIDTH), torch.float32)
        specs.append([h, h] * skip_live(cut) or [h])
        specs[-1].append(TensorSpec((mb,), torch.int64))
    return specs


def postprocess(outputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    return {"out": outputs[0]}


def loss_fn(output: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(output["out"], target["y"])


def batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = m * MB_SIZE
    return torch.randn(n, IN, generator=g), torch.randint(0, IDS, (n,), generator=g), torch.randn(n, OUT, generator=g)


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def configs(pp: int) -> list[tuple[int, int, str, str]]:
    return [(pp, c, s, o) for c, names in SCHEDULES_BY_CHUNKS.items() for s in names for o in OPTIMIZERS]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_pipeline(rank: int, pp: int, chunks: int, schedule: str, opt: str, m: int) -> dict:
    """One rank's run: 3 steps (step 0 returning outputs), then an eval step."""
    torch.manual_seed(0)
    n = pp * chunks
    stages = make_stages(Net(), n)
    local = {s: stages[s] for s in range(n) if s % pp == rank}
    driver = PipelineDriver(
        local, boundary_specs(n), pp=pp, chunks=chunks, pp_rank=rank, pp_group=None,
        schedule=schedule, microbatches=m, loss_fn=loss_fn, postprocess=postprocess, device="cpu",
        input_specs=[TensorSpec((MB_SIZE, IN), torch.float32), TensorSpec((MB_SIZE,), torch.int64)],
    )
    # Activations alive after each forward: only autograd holds a stage's first Linear output
    # (the stage's outputs may also wait in a posted send until the next rank receives them).
    alive: list[weakref.ref] = []
    peak = [0]

    def track(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        alive.append(weakref.ref(out))
        peak[0] = max(peak[0], sum(r() is not None for r in alive))

    for st in local.values():
        st.blocks[0][0].register_forward_hook(track)
    opt_ = optimizer(opt, driver.parameters())
    losses, first_outputs = [], None
    for step in range(STEPS):
        x, ids, y = batch(step, m)
        opt_.zero_grad()
        if step == 0:
            loss, first_outputs = driver.train_step((x, ids), {"y": y}, return_outputs=True)
        else:
            loss = driver.train_step((x, ids), {"y": y})
        losses.append(loss.item())
        opt_.step()
    driver.train(False)
    x, ids, _ = batch(99, m)
    out = driver.eval_step((x, ids))
    return {
        "losses": losses,
        "state": {s: {k: v.clone() for k, v in local[s].state_dict().items()} for s in local},
        "eval": None if out is None else out["out"],
        "first": None if first_outputs is None else first_outputs["out"],
        "shared": None if driver.p2p is None or driver.p2p.shared is None else
        {"received": sum(r.count for r in driver.p2p.shared.inbox.values()),
         "sent": sum(r.count for r in driver.p2p.shared.outbox.values())},
        "peak": peak[0],
    }


def reference(n: int, opt: str, m: int) -> dict:
    """The same micro-batches through the unsplit Net, gradients accumulated.

    One thread, like the ranks: matmul kernels sum in a different order with more threads.
    """
    with one_thread():
        return _reference(n, opt, m)


def _reference(n: int, opt: str, m: int) -> dict:
    torch.manual_seed(0)
    net = Net()
    opt_ = optimizer(opt, net.parameters())
    losses, first = [], None
    for step in range(STEPS):
        x, ids, y = batch(step, m)
        opt_.zero_grad()
        total, outs = 0.0, []
        for xm, im, ym in zip(x.split(MB_SIZE), ids.split(MB_SIZE), y.split(MB_SIZE)):
            out = net(xm, im)
            loss = loss_fn({"out": out}, {"y": ym})
            (loss / m).backward()
            total += loss.item() / m
            outs.append(out.detach())
        first = torch.cat(outs) if step == 0 else first
        losses.append(total)
        opt_.step()
    net.eval()
    x, ids, _ = batch(99, m)
    with torch.no_grad():
        out = net(x, ids)
    return {"losses": losses, "stages": make_stages(net, n), "eval": out, "first": first}


def world_worker(rank: int, world_size: int) -> list[dict]:
    return [train_pipeline(rank, *cfg, m=2 * world_size) for cfg in configs(world_size)]


@pytest.fixture(scope="module")
def worlds() -> dict[int, Any]:
    return {}


def results_for(worlds: dict, pp: int) -> list[list[dict]]:
    if pp not in worlds:
        try:
            worlds[pp] = run_distributed(world_worker, pp, timeout=150)
        except Exception as exc:  # fail every configuration once, not after one timeout each
            worlds[pp] = exc
    if isinstance(worlds[pp], Exception):
        raise worlds[pp]
    return worlds[pp]


@pytest.mark.parametrize("cfg", configs(2) + configs(4), ids=lambda c: "pp{}-v{}-{}-{}".format(*c))
def test_matches_single_process(worlds: dict, cfg: tuple[int, int, str, str]) -> None:
    pp, chunks, schedule, opt = cfg
    m = 2 * pp
    per_rank = [r[configs(pp).index(cfg)] for r in results_for(worlds, pp)]
    ref = reference(pp * chunks, opt, m)
    for rank, got in enumerate(per_rank):
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {rank}"
        for s, state in got["state"].items():
            torch.testing.assert_close(state, ref["stages"][s].state_dict(), rtol=1e-5, atol=1e-6)
        assert got["peak"] <= max_in_flight_bound(schedule, pp, m, chunks, rank), f"rank {rank}"
    last = per_rank[(pp * chunks - 1) % pp]
    torch.testing.assert_close(last["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last["first"], ref["first"], rtol=1e-5, atol=1e-6)
    assert all(r["eval"] is None for i, r in enumerate(per_rank) if i != (pp * chunks - 1) % pp)


JUST_IN_TIME = ((1, "1f1b"), (2, "interleaved_1f1b"))


def just_in_time_worker(rank: int, world_size: int) -> list[dict]:
    streams.RECEIVE_LEAD = 0  # as between GPUs of one host: [Note: receive lead]
    return [train_pipeline(rank, world_size, chunks, schedule, "sgd", m=4) for chunks, schedule in JUST_IN_TIME]


def delayed_sends_worker(rank: int, world_size: int) -> list[dict]:
    streams.RECEIVE_LEAD, streams.DELAY_SENDS = 0, True  # [Note: send timing]
    return [train_pipeline(rank, world_size, chunks, schedule, "sgd", m=4) for chunks, schedule in JUST_IN_TIME]


def assert_like_one_process(per_rank: list[list[dict]], configs: tuple[tuple[int, str], ...]) -> None:
    """Every rank's run of each (chunks, schedule) in ``configs`` (2 ranks, SGD, 4 micro-batches)
    against one process: losses, parameters and the eval outputs."""
    for i, (chunks, schedule) in enumerate(configs):
        ref = reference(2 * chunks, "sgd", 4)
        for rank, runs in enumerate(per_rank):
            assert runs[i]["losses"] == pytest.approx(ref["losses"], rel=1e-5), (schedule, rank)
            for s, state in runs[i]["state"].items():
                torch.testing.assert_close(state, ref["stages"][s].state_dict(), rtol=1e-5, atol=1e-6)
            if runs[i]["eval"] is not None:
                torch.testing.assert_close(runs[i]["eval"], ref["eval"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("worker", [just_in_time_worker, delayed_sends_worker], ids=["receives", "sends-delayed"])
def test_transfers_posted_just_in_time_train_the_same(worker: Any) -> None:
    assert_like_one_process(run_distributed(worker, 2, timeout=120), JUST_IN_TIME)


@pytest.mark.parametrize("chunks,schedule", [(1, "gpipe"), (1, "1f1b"), (2, "interleaved_1f1b"), (3, "gpipe")])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_single_rank_hands_tensors_locally(chunks: int, schedule: str, opt: str) -> None:
    with one_thread():
        got = train_pipeline(0, 1, chunks, schedule, opt, m=4)
    ref = reference(chunks, opt, m=4)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for s, state in got["state"].items():
        torch.testing.assert_close(state, ref["stages"][s].state_dict(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
    assert got["peak"] <= max_in_flight_bound(schedule, 1, 4, chunks, 0)


def local_driver(m: int = 2, **kw: Any) -> PipelineDriver:
    torch.manual_seed(0)
    stages = make_stages(Net(), 2)
    args: dict[str, Any] = dict(
        pp=1, chunks=2, pp_rank=0, pp_group=None, schedule="gpipe", microbatches=m,
        loss_fn=loss_fn, postprocess=postprocess, device="cpu",
    )
    args.update(kw)
    return PipelineDriver(dict(enumerate(stages)), boundary_specs(2), **args)


def test_input_errors_name_the_numbers() -> None:
    driver = local_driver(m=4, input_specs=[TensorSpec((MB_SIZE, IN), torch.float32), TensorSpec((MB_SIZE,), torch.int64)])
    x, ids, y = batch(0, 4)
    with pytest.raises(InputError, match=r"batch size 10 does not split into 4 equal micro-batches .* 8 or 12"):
        driver.train_step((x[:10], ids[:10]), {"y": y[:10]})
    with pytest.raises(InputError, match=r"expected micro-batch \(3, 16\) float32, given \(3, 15\) float32"):
        driver.train_step((x[:, :15], ids), {"y": y})
    with pytest.raises(InputError, match=r"batch size 8 but the inputs have 12"):
        driver.train_step((x, ids), {"y": y[:8]})
    # The driver recovers: with one rank there is no pipeline to break.
    assert driver.train_step((x, ids), {"y": y}).dim() == 0


def test_stage_output_not_matching_plan_is_an_input_error() -> None:
    driver = local_driver(m=2)
    x, ids, y = batch(0, 4)  # 12 rows in 2 micro-batches of 6, but the plan says 3
    with pytest.raises(InputError, match=r"stage 0 returned \[\(6, 32\) float32.*plan says \[\(3, 32\) float32"):
        driver.train_step((x, ids), {"y": y})


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match=r"holds stages \[0, 1\], but was given stages \[0\]"):
        PipelineDriver({0: nn.Identity()}, [[]], pp=1, chunks=2, pp_rank=0, pp_group=None, schedule="gpipe",
                       microbatches=2, loss_fn=loss_fn, postprocess=postprocess, device="cpu")
    with pytest.raises(ScheduleError, match="1f1b runs one model chunk"):
        local_driver(schedule="1f1b")
    with pytest.raises(ScheduleError, match="forward_only' has no backward"):
        local_driver(schedule="forward_only").train_step(batch(0, 2)[:2], None)


def test_train_mode_reaches_every_stage() -> None:
    driver = local_driver()
    assert all(s.training for s in driver.stages.values())
    driver.train(False)
    assert not any(m.training for s in driver.stages.values() for m in s.modules())
    driver.train()
    assert all(m.training for s in driver.stages.values() for m in s.modules())


def shared_links_worker(rank: int, world_size: int) -> list[dict]:
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # one host, as torchrun says
    host_links.SHARED_LINKS = True  # [Note: shared-memory links]
    return [train_pipeline(rank, world_size, chunks, schedule, "sgd", m=4) for chunks, schedule in SHARED]


SHARED = ((1, "gpipe"), (1, "1f1b"), (2, "interleaved_1f1b"))


def test_shared_memory_links_train_the_same() -> None:
    per_rank = run_distributed(shared_links_worker, 2, timeout=120)
    assert_like_one_process(per_rank, SHARED)
    for i, (chunks, schedule) in enumerate(SHARED):
        # 3 train steps (forward and back) and an eval step, every message through the shared
        # links: 4 micro-batches cross 2 * chunks - 1 boundaries each way.
        sent, received = ([runs[i]["shared"][k] for runs in per_rank] for k in ("sent", "received"))
        assert sum(sent) == sum(received) == 7 * 4 * (2 * chunks - 1), (schedule, sent, received)
