"""Megatron's conjugate operators as autograd Functions, called from ``call_function`` nodes,
and the table of what each one communicates (see [Note: collective table]).

A node names its process group by a string looked up here at run time, so a sharded
GraphModule stays printable and picklable; an unset name (``None``) makes every operator
the identity, which is what a planning graph (no processes, meta device) runs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.distributed_c10d import _resolve_process_group

from ..errors import ConfigError
from ..failure.monitor import FailureMonitor, active

__all__ = [
    "COLLECTIVES",
    "BY_FUNCTION",
    "Collective",
    "TPGroup",
    "register_group",
    "resolve_group",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "reduce_scatter_tp",
    "all_gather_tp",
    "split_to_tp",
]


@dataclass(frozen=True)
class TPGroup:
    """What the collectives need of a tensor-parallel process group, as plain values: a compiled
    stage reads them as constants (see [Note: traceable collectives])."""

    name: str  # the process group's own name, which functional collectives look it up by
    size: int
    rank: int
    gloo: bool  # gloo has no reduce-scatter, nor an all-gather into one tensor for CUDA tensors


_GROUPS: dict[str, TPGroup] = {}


def register_group(name: str, group: Any) -> None:
    """Make ``name`` resolve to ``group`` (a ProcessGroup, or ``dist.group.WORLD``) in this process."""
    _GROUPS[name] = TPGroup(group.group_name, dist.get_world_size(group), dist.get_rank(group),
                            dist.get_backend(group) == "gloo")


def resolve_group(name: str | None) -> TPGroup | None:
    """The group registered under ``name``; ``None`` for an unset name (collectives are identity)."""
    if name is None:
        return None
    try:
        return _GROUPS[name]
    except KeyError:
        raise ConfigError(
            f"tensor-parallel group {name!r} is not registered in this process; call "
            f"autopipe.shard.collectives.register_group({name!r}, group) before running the model"
        ) from None


# [Note: traceable collectives]
# The collectives are functional (``torch.ops._c10d_functional``: a new output, then
# ``wait_tensor``), and everything they read of their group is a plain value (TPGroup), so
# torch.compile traces a tensor-parallel stage as one graph, custom backwards included, and
# inductor may move the waits past independent work. Eagerly, ``wait_tensor`` makes the
# current CUDA stream wait (NCCL) or blocks until done (gloo), as ``async_op=False`` would.
# Eagerly on gloo, where waits block the host, they go through the step's failure monitor
# instead (see [Note: collective waits] in failure/monitor.py).
_C10D = torch.ops._c10d_functional
_PROCESS_GROUPS: dict[str, tuple[dist.ProcessGroup, str]] = {}


def _watched(group: TPGroup) -> tuple[FailureMonitor, dist.ProcessGroup, str] | None:
    """The active monitor, the process group and its description, for an eager gloo collective."""
    if not group.gloo or torch.compiler.is_compiling():
        return None
    monitor = active()
    if monitor is None:
        return None
    if group.name not in _PROCESS_GROUPS:
        pg = _resolve_process_group(group.name)
        _PROCESS_GROUPS[group.name] = (pg, f"over the tp ranks {dist.get_process_group_ranks(pg)}")
    return (monitor, *_PROCESS_GROUPS[group.name])


def _all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    watched = _watched(group)
    if watched is not None:
        monitor, pg, where = watched
        out = x.clone(memory_format=torch.contiguous_format)
        monitor.wait_collective([dist.all_reduce(out, group=pg, async_op=True)],
                                f"tensor-parallel all-reduce {where}", host=True)
        return out
    return _C10D.wait_tensor(_C10D.all_reduce(x.contiguous(), "sum", group.name))


def _gather(x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
    if group.gloo and x.is_cuda:  # gloo's all-gather into one tensor fails on CUDA: sum zero-padded slots
        return _all_reduce(torch.cat([x if i == group.rank else torch.zeros_like(x)
                                      for i in range(group.size)], dim=dim), group)
    # Gathered along dim 0 (contiguous chunks, no copies), then laid out along ``dim``.
    watched = _watched(group)
    if watched is not None:
        monitor, pg, where = watched
        x = x.contiguous()
        out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
        monitor.wait_collective([dist.all_gather_into_tensor(out, x, group=pg, async_op=True)],
                                f"tensor-parallel all-gather {where}", host=True)
    else:
        out = _C10D.wait_tensor(_C10D.all_gather_into_tensor(x.contiguous(), group.size, group.name))
    return out if dim == 0 else torch.cat(out.chunk(group.size, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
    if group.gloo:  # gloo has no reduce-scatter: all-reduce, keep a slice
        return _all_reduce(x, group).chunk(group.size, dim=dim)[group.rank].contiguous()
    if dim != 0:
        x = torch.cat(x.chunk(group.size, dim=dim), dim=0)
    return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(x.contiguous(), "sum", group.size, group.name))


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (a replicated input feeding a sharded region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (partial sums leaving a sharded region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along ``dim`` forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        g = ctx.group
        return grad.chunk(g.size, dim=ctx.dim)[g.rank].contiguous(), None, None


class _ReduceScatterTP(torch.autograd.Function):
    """Partial sums leaving a sharded region into a batch-split one: reduce-scatter along ``dim``
    forward, all-gather backward (see [Note: sequence parallelism] in layout.py)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllGatherTP(torch.autograd.Function):
    """A batch-split tensor entering a sharded region: all-gather forward; backward, each rank
    holds a partial gradient of the whole tensor: reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _SplitToTP(torch.autograd.Function):
    """A replicated tensor meeting a split one (entering a batch-split region, a bias over the
    heads): keep this rank's slice forward, all-gather the slices' gradients backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return x.chunk(group.size, dim=dim)[group.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


F = TypeVar("F", bound=Callable[..., Any])


def fx_leaf(fn: F) -> F:
    """Keep ``fn`` one call_function node when a graph is traced again (GraphModule unpickling
    re-traces its code symbolically): with a Proxy argument, record the call, do not run it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _shapes_only(x: torch.Tensor) -> bool:
    # Shape propagation runs the graph on fake or meta tensors: nothing to communicate. The
    # fake tensors torch.compile traces with are the exception: it traces the collectives.
    return not torch.compiler.is_compiling() and (x.device.type == "meta" or is_fake(x))


@fx_leaf
def copy_to_tp(x: torch.Tensor, group_name: str | None = None) -> torch.Tensor:
    group = None if _shapes_only(x) else resolve_group(group_name)
    if group is None or group.size == 1:
        return x
    return _CopyToTP.apply(x, group)


@fx_leaf
def reduce_from_tp(x: torch.Tensor, group_name: str | None = None) -> torch.Tensor:
    group = None if _shapes_only(x) else resolve_group(group_name)
    if group is None or group.size == 1:
        return x
    return _ReduceFromTP.apply(x, group)


@fx_leaf
def gather_from_tp(x: torch.Tensor, dim: int, group_name: str | None = None, tp: int = 1) -> torch.Tensor:
    """All-gather ``x`` along ``dim``. Without a group it stands in for the gather on one rank:
    the result has the full shape (``tp`` copies of the local shard), so planning graphs keep
    the shapes every later step expects."""
    group = None if _shapes_only(x) else resolve_group(group_name)
    if group is None:
        return torch.cat([x] * tp, dim=dim) if tp > 1 else x
    if group.size == 1:
        return x
    return _GatherFromTP.apply(x, dim, group)


def _split_collective(fn: Callable[..., Any], op: type, shapes_only: Callable[[torch.Tensor, int, int], torch.Tensor]
                      ) -> Callable[..., Any]:
    """A batch-split collective node: ``fn(x, dim, group_name, tp)``. Without a group it stands
    in for rank 0 with the shapes the real one gives (planning graphs, one-GPU measurements)."""

    @functools.wraps(fn)
    def run(x: torch.Tensor, dim: int, group_name: str | None = None, tp: int = 1) -> torch.Tensor:
        group = None if _shapes_only(x) else resolve_group(group_name)
        if group is None:
            return shapes_only(x, dim, tp) if tp > 1 else x
        if group.size == 1:
            return x
        return op.apply(x, dim, group)

    return fx_leaf(run)


def _first_slice(x: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    return x.chunk(tp, dim=dim)[0]


def reduce_scatter_tp(x: torch.Tensor, dim: int, group_name: str | None = None, tp: int = 1) -> torch.Tensor:
    """Sum partial ``x`` over the tp ranks, keep this rank's slice along ``dim``."""


def all_gather_tp(x: torch.Tensor, dim: int, group_name: str | None = None, tp: int = 1) -> torch.Tensor:
    """Concatenate every rank's slice along ``dim``; backward reduce-scatters the gradient."""


def split_to_tp(x: torch.Tensor, dim: int, group_name: str | None = None, tp: int = 1) -> torch.Tensor:
    """This rank's slice of a replicated ``x`` along ``dim``; backward all-gathers the gradient."""


reduce_scatter_tp = _split_collective(reduce_scatter_tp, _ReduceScatterTP, _first_slice)
all_gather_tp = _split_collective(all_gather_tp, _AllGatherTP, lambda x, dim, tp: torch.cat([x] * tp, dim=dim))
split_to_tp = _split_collective(split_to_tp, _SplitToTP, _first_slice)

# [Note: collective table]
# Everything autopipe knows of a tensor-parallel collective is its row here: how a node calls
# it (the rewrite), what it communicates each way (the shard plan's payload bytes) and what that
# moves per rank (the partitioner's and the search's prices). Ring algorithms: an all-reduce of
# a tensor moves 2 (tp - 1) / tp of it per rank, an all-gather or a reduce-scatter (tp - 1) / tp
# of the whole (gathered) tensor; ``RING_UNITS`` counts those in units of (tp - 1) / tp.
RING_UNITS = {"": 0, "all-reduce": 2, "all-gather": 1, "reduce-scatter": 1}


@dataclass(frozen=True)
class Collective:
    """One tensor-parallel collective; see [Note: collective table]."""

    name: str
    fn: Callable[..., torch.Tensor]
    takes_dim: bool  # called as fn(x, dim, group_name, tp); else as fn(x, group_name)
    forward: str  # what it communicates forward: a key of RING_UNITS ("" for nothing)
    backward: str  # and backward
    scatters: bool = False  # its output is 1/tp of the whole tensor (else the whole one)

    def args(self, x: Any, dim: int | None, group_name: str | None, tp: int) -> tuple[Any, ...]:
        """The arguments of a node calling it on ``x``."""
        return (x, dim, group_name, tp) if self.takes_dim else (x, group_name)

    def payload(self, nbytes: int) -> tuple[int, int]:
        """(forward, backward) bytes it communicates of a whole tensor of ``nbytes``."""
        return (nbytes if self.forward else 0), (nbytes if self.backward else 0)

    @property
    def units(self) -> int:
        """Its forward and backward ring traffic, in units of (tp - 1) / tp of the whole tensor."""
        return RING_UNITS[self.forward] + RING_UNITS[self.backward]

    def moved(self, whole_bytes: float, tp: int) -> float:
        """Bytes it moves per rank, forward and backward, for a whole tensor of ``whole_bytes``."""
        return self.units * (tp - 1) / tp * whole_bytes

    def moved_by_output(self, out_bytes: float, tp: int) -> float:
        """Bytes it moves per rank, forward and backward, given its output's bytes on one rank."""
        return self.units * (tp - 1) * out_bytes if self.scatters else self.units * (tp - 1) / tp * out_bytes


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("copy_to_tp", copy_to_tp, False, "", "all-reduce"),
    Collective("reduce_from_tp", reduce_from_tp, False, "all-reduce", ""),
    Collective("gather_from_tp", gather_from_tp, True, "all-gather", ""),
    Collective("reduce_scatter_tp", reduce_scatter_tp, True, "reduce-scatter", "all-gather", scatters=True),
    Collective("all_gather_tp", all_gather_tp, True, "all-gather", "reduce-scatter"),
    Collective("split_to_tp", split_to_tp, True, "", "all-gather", scatters=True),
)}
BY_FUNCTION: dict[Callable[..., torch.Tensor], Collective] = {c.fn: c for c in COLLECTIVES.values()}
