"""``partition()``: price every node of a traced model and cut it into balanced stages.

Cuts are made over the graph's own topological order (fx keeps nodes in execution order), at
node granularity: a cut may fall inside a block when that balances better. Communication at a
cut is the bytes of every tensor live across it, residual streams included; how it enters a
stage's time is [Note: communication in the stage cost].
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from ..errors import ConfigError, PartitionError, positive_int
from ..graph import is_tensor_node, owning_module, value_of
from ..tracer import TracedModel
from . import balance as balancer
from .cost import NodeCost, graph_costs, training_state_bytes
from .cuts import allowed_cuts, cut_dag, layer_groups, split_positions
from .device import SLOW_PACE, DeviceProfile, get_profile
from .measured import MeasuredCosts, fingerprint
from .plan import CutTensor, PartitionPlan, StagePlan
from .launch_queue import stage_replays
from .replayed_cuts import replayed_cut
from .transfers import boundary_copy_seconds, cut_latency_seconds, cut_seconds, tp_collective_seconds

__all__ = ["partition", "partition_at", "analytic_seconds", "BALANCE_MODES"]

BALANCE_MODES = ("cost", "params", "uniform")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Element size -> a dtype of that size, for training_state_bytes (which reads only the size).
_DTYPE_OF_SIZE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _param_dtype(cost: NodeCost) -> torch.dtype:
    """A dtype as wide as the node's parameters: ``param_bytes / param_count`` bytes each.

    A node mixing dtypes gets the nearest size; one without parameters fp32 (it holds none).
    """
    if cost.param_count == 0:
        return torch.float32
    width = cost.param_bytes / cost.param_count
    return _DTYPE_OF_SIZE[min(_DTYPE_OF_SIZE, key=lambda size: abs(size - width))]


def _check_activation_dtype(dtype: object) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    raise ConfigError(f"activation_dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None, "
                      f"got {dtype!r}")


def partition(
    traced: TracedModel,
    pp: int,
    chunks: int = 1,
    *,
    tp: int = 1,
    microbatches: int = 1,
    balance: str | Sequence[str] = "cost",
    device: str | DeviceProfile = "h100",
    schedule: str = "1f1b",
    mem_cap: float | None = None,
    model_name: str = "",
    activation_dtype: torch.dtype | None = None,
    measured: MeasuredCosts | None = None,
    node_seconds: Mapping[str, float] | None = None,
    stage_scale: Sequence[float] | None = None,
    pace_hedge: float = 0.0,
) -> PartitionPlan:
    """Cut ``traced`` into ``pp * chunks`` stages at node granularity; ``balance`` is a mode or
    split-point modules. (:func:`autopipe.stages.plan_stages` may also cut inside MLPs.)

    ``measured`` prices the nodes by a profile timed on the device ([Note: measured costs]),
    in place of the analytic model of ``device`` (which still prices the links); it must have
    been made for this graph at these input shapes (a ProfileError says what differs).
    ``node_seconds`` prices the nodes it names by these forward + backward seconds instead (the
    others analytically; ``measured`` then gives only the stage's fixed time and the source):
    what a rewritten graph, which no profile timed, is cut by.

    ``activation_dtype`` is the dtype floating tensors cross stage boundaries in, when it is
    not the traced one: ``torch.bfloat16`` under bf16 autocast, where activations travel in
    bf16 while the model was traced in fp32. It prices the cuts and names the plan's tensors.

    ``stage_scale`` (one factor per stage, balance="cost") says how much slower each stage runs
    in the pipeline than its parts sum to ([Note: stage scale] in autopipe/measure/pipeline_scale.py):
    the cut balances the scaled times, and the plan's stage times are the scaled ones.

    ``pace_hedge`` (eager stages priced at a probed host pace, balance="cost"): the max/mean the
    cut may give up at that pace for the least worst of it and the host's slow pace ([Note: a
    cut hedged over paces] in replayed_cuts.py); 0, the default, cuts for the probed pace alone.
    """
    if not (isinstance(pace_hedge, (int, float)) and not isinstance(pace_hedge, bool) and 0 <= pace_hedge < 1):
        raise ConfigError(f"pace_hedge={pace_hedge!r}: give the max/mean an eager cut may give up at the probed "
                          "host pace, a number in [0, 1), e.g. 0.03 (0 turns it off)")
    pp, chunks, tp = (positive_int(n, v) for n, v in (("pp", pp), ("chunks", chunks), ("tp", tp)))
    microbatches = positive_int("microbatches", microbatches)
    activation_dtype = _check_activation_dtype(activation_dtype)
    if node_seconds is None and measured is not None:
        node_seconds = _measured_seconds(traced, measured)
    return _partition(traced, pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, balance=balance,
                      device=device, schedule=schedule, mem_cap=mem_cap, model_name=model_name,
                      activation_dtype=activation_dtype, node_seconds=node_seconds, measured=measured,
                      stage_scale=_check_stage_scale(stage_scale, pp * chunks, balance, mem_cap), pace_hedge=pace_hedge)


def _check_stage_scale(scale: Sequence[float] | None, n_stages: int, balance: Any,
                       mem_cap: float | None) -> tuple[float, ...] | None:
    if scale is None:
        return None
    try:
        factors = tuple(float(f) for f in scale)
    except (TypeError, ValueError):
        raise ConfigError(f"stage_scale {scale!r} must be a sequence of numbers, one per stage") from None
    if len(factors) != n_stages:
        raise ConfigError(f"stage_scale has {len(factors)} factors for {n_stages} stages; give one per stage "
                          "(pp x chunks, in stage order)")
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ConfigError(f"stage_scale {list(factors)} must hold positive finite factors")
    if balance != "cost" or mem_cap is not None:
        raise ConfigError(f"stage_scale balances costs (balance='cost', no mem_cap); got balance={balance!r}, "
                          f"mem_cap={mem_cap!r}")
    return factors


def _measured_seconds(traced: TracedModel, measured: MeasuredCosts) -> dict[str, float]:
    measured.check({"fingerprint": fingerprint(traced.gm),
                    "input_shapes": [list(s) for s in traced.input_shapes]})
    return dict(measured.node_seconds)


def partition_at(traced: TracedModel, starts: Sequence[int], *, device: str | DeviceProfile = "h100",
                 node_seconds: Mapping[str, float] | None = None, measured: MeasuredCosts | None = None,
                 **kwargs) -> PartitionPlan:
    """The plan whose stages start at the given positions of the node order (placeholders first,
    the output node left out): what a profile's segments and a closed loop's re-cuts emit.
    ``kwargs`` as for :func:`partition` (pp defaults to one stage per start, chunks to 1);
    ``node_seconds``, where given, prices the nodes in place of ``measured``'s, as there."""
    args = dict(pp=len(starts), chunks=1, tp=1, microbatches=1, balance="cost", schedule="1f1b",
                mem_cap=None, model_name="", activation_dtype=None)
    args.update(kwargs)
    args["stage_scale"] = _check_stage_scale(args.pop("stage_scale", None), len(starts), args["balance"],
                                             args["mem_cap"])
    if node_seconds is None and measured is not None:
        node_seconds = _measured_seconds(traced, measured)
    return _partition(traced, device=device, node_seconds=node_seconds, measured=measured,
                      starts=list(starts), **args)


def analytic_seconds(traced: TracedModel, device: str | DeviceProfile) -> dict[str, float]:
    """Forward + backward seconds of every node by the analytic model of ``device``."""
    profile = get_profile(device)
    costs = graph_costs(traced.gm)
    return {name: f + b for name, (f, b) in zip(costs, profile.node_times(list(costs.values())))}


def _partition(
    traced: TracedModel,
    *,
    pp: int,
    chunks: int,
    tp: int,
    microbatches: int,
    balance: str | Sequence[str],
    device: str | DeviceProfile,
    schedule: str,
    mem_cap: float | None,
    model_name: str,
    activation_dtype: torch.dtype | None,
    node_seconds: Mapping[str, float] | None = None,
    measured: MeasuredCosts | None = None,
    starts: list[int] | None = None,
    stage_scale: tuple[float, ...] | None = None,
    price_slow_pace: bool = True,
    pace_hedge: float = 0.0,
) -> PartitionPlan:
    n_stages = pp * chunks
    profile = get_profile(device)
    gm = traced.gm
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    costs = graph_costs(gm)

    # In-flight micro-batches bound activation memory: m for GPipe, about pp for 1F1B.
    in_flight = microbatches if schedule == "gpipe" else min(microbatches, pp * chunks)
    order = [n.name for n in nodes]
    launches = profile.launches([costs[n] for n in order])  # eager: [Note: cuts on stage replays]
    analytic = [f + b for f, b in profile.node_times([costs[n] for n in order], launches)]
    compute = analytic if node_seconds is None else [node_seconds.get(n, t) for n, t in zip(order, analytic)]
    if tp > 1:  # the tensor-parallel collectives the shard rewrite inserted
        for i, node in enumerate(nodes):
            compute[i] += tp_collective_seconds(node, costs[node.name], tp, profile)
    state = [training_state_bytes(costs[n].param_bytes, param_dtype=_param_dtype(costs[n])) for n in order]
    mem = [held + costs[n].saved_bytes * in_flight for held, n in zip(state, order)]

    dag = cut_dag(traced, costs, activation_dtype)
    # See [Note: communication in the stage cost].
    cut_bytes = [int(b) for b in dag.cut_bytes[: len(order) - 1]]
    cut_time = [cut_seconds(b, profile) for b in cut_bytes]
    # The device copies of what crosses a cut ([Note: boundary copies] in calibration.py): work
    # on each stage beside it that no node owns; a measured profile's at its own rate.
    copies = [boundary_copy_seconds(b, profile) if measured is None else b * measured.boundary_rate for b in cut_bytes]
    cut_latency = [cut_latency_seconds(b, profile) + c for b, c in zip(cut_bytes, copies)]
    cut_cost = [t + lat for t, lat in zip(cut_time, cut_latency)]
    allowed = _parameters_at_both_ends(allowed_cuts(nodes, gm), [costs[n].param_count for n in order], n_stages)
    _check_cut_count(allowed, pp, chunks)
    recut = starts is None and balance == "cost"  # [Note: cuts on stage replays]

    # What running a stage costs beyond its nodes (see [Note: segments] in measure/profile.py).
    overhead = measured.stage_overhead if measured is not None else \
        profile.calibration.stage.get(profile.mode, 0.0) if profile.calibration is not None else 0.0
    if starts is not None:
        balancer.check_starts(starts, len(order))
        mode = balance if isinstance(balance, str) else "split_points:" + ",".join(balance)
        if stage_scale is not None:
            mode += ":stage_scale=" + ",".join(f"{f:.3g}" for f in stage_scale)
    elif stage_scale is not None:
        starts, mode = balancer.solve_scaled(compute, stage_scale, allowed_cuts=allowed, stage_overhead=overhead,
                                             cut_cost=cut_cost), \
            "cost:stage_scale=" + ",".join(f"{f:.3g}" for f in stage_scale)
    else:
        starts, mode = _solve(balance, n_stages, nodes, traced, compute, cut_time, cut_latency, mem, mem_cap,
                              allowed, overhead, [costs[n].param_count for n in order])

    factors, slow = stage_scale, None
    if launches is not None and node_seconds is None and stage_scale is None:  # where nothing else prices them
        paced = profile.calibration is not None and profile.calibration.host_probe > 0
        slow = profile.at_host_pace(profile.calibration.host_probe * SLOW_PACE).launches([costs[n] for n in order]) \
            if recut and pace_hedge > 0 and paced else None
        starts, factors = replayed_cut(launches, compute, analytic, starts, recut=recut, allowed=allowed,
                                       overhead=overhead, cut_time=cut_time, cut_latency=cut_latency,
                                       mem=mem, mem_cap=mem_cap, slow=slow, hedge=pace_hedge)
    times = _copies_as_compute(balancer.overlapped_stage_times(compute, starts, cut_time, cut_latency, overhead),
                               starts, copies)
    if factors is not None:  # as the stages run: replayed, or in the pipeline ([Note: stage scale])
        times = [balancer.StageTime(t.compute * f, t.comm, t.latency, max(t.compute * f, t.comm) + t.latency)
                 for t, f in zip(times, factors)]
    plan = _build_plan(traced, nodes, costs, times, dag, starts, state, profile, activation_dtype,
                       pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, mode=mode,
                       schedule=schedule, in_flight=in_flight, model_name=model_name)
    ends = list(starts[1:]) + [len(order)]
    replays = stage_replays(launches, starts) if launches else [sum(analytic[i:j]) for i, j in zip(starts, ends)]
    for stage, seconds in zip(plan.stages, replays):
        stage.analytic_time = float(seconds)
    plan.cost_source = _cost_source(profile, measured) | ({"pace_hedge": pace_hedge} if slow is not None else {})
    if price_slow_pace and measured is None and node_seconds is None and "host_probe_us" in plan.cost_source:
        plan.cost_source["slow_pace"] = _at_slow_pace(traced, starts, profile, pp=pp, chunks=chunks, tp=tp,
                                                      microbatches=microbatches, schedule=schedule, mem_cap=mem_cap,
                                                      model_name=model_name, activation_dtype=activation_dtype)
    plan.floor = balancer.least_imbalance(compute, n_stages, stage_overhead=overhead, allowed_cuts=allowed)
    return plan


def _at_slow_pace(traced: TracedModel, starts: list[int], profile: DeviceProfile, **args: Any) -> dict[str, float]:
    """The probe of the host's slow pace and the max/mean this cut of eager stages would have at
    it ([Note: a cut at another pace])."""
    probe = (profile.calibration.host_probe if profile.calibration is not None else 0.0) * SLOW_PACE
    plan = _partition(traced, device=profile.at_host_pace(probe), balance="cost", starts=list(starts),
                      price_slow_pace=False, **args)
    return {"host_probe_us": probe * 1e6, "imbalance": float(plan.imbalance)}


def _check_cut_count(allowed: Sequence[bool], pp: int, chunks: int) -> None:
    if sum(allowed) + 1 < pp * chunks:
        raise PartitionError(
            f"cannot cut {len(allowed) + 1} nodes into {pp * chunks} stages (pp={pp} x chunks={chunks}): "
            f"at most {sum(allowed) + 1} stages are possible; lower pp or chunks"
        )


def _parameters_at_both_ends(allowed: list[bool], params: Sequence[int], n_stages: int) -> list[bool]:
    """``allowed`` without the cuts that leave the first or the last stage no node that owns
    parameters, where enough cuts remain for ``n_stages`` stages. A pipeline rank without
    parameters fails (an optimizer over none), and a stage of the input's parameterless first
    nodes is what a cut by noisy times (a stage scale read in a stand-in pipeline) can make."""
    owners = [i for i, p in enumerate(params) if p > 0]
    if not owners:
        return allowed
    kept = [a and owners[0] <= k < owners[-1] for k, a in enumerate(allowed)]
    return kept if sum(kept) + 1 >= n_stages else allowed


def _copies_as_compute(times: list[balancer.StageTime], starts: Sequence[int],
                       copies: Sequence[float]) -> list[balancer.StageTime]:
    """The stages' times with their boundary copies (balanced as latency, which overlap does not
    hide) moved to their compute, where the device spends them; ``cost`` is unchanged."""
    ends = list(starts[1:]) + [len(copies) + 1]
    out = []
    for t, i, j in zip(times, starts, ends):
        c = (copies[i - 1] if i > 0 else 0.0) + (copies[j - 1] if j <= len(copies) else 0.0)
        out.append(balancer.StageTime(t.compute + c, t.comm, t.latency - c, t.cost))
    return out


def _solve(balance: str | Sequence[str], n_stages: int, nodes: list[fx.Node], traced: TracedModel,
           compute: list[float], cut_time: list[float], cut_latency: list[float], mem: list[float],
           mem_cap: float | None, allowed: list[bool], overhead: float, params: list[int]) -> tuple[list[int], str]:
    """The stages' first positions by ``balance``, and the plan's name for how they were chosen."""
    if not isinstance(balance, str):
        return balancer.solve_split_points(split_positions(list(balance), nodes), n_stages), \
            "split_points:" + ",".join(balance)
    if balance == "cost":
        starts = balancer.solve_overlapped(compute, n_stages, cut_time=cut_time, cut_latency=cut_latency,
                                           mem=mem, mem_cap=mem_cap, allowed_cuts=allowed,
                                           stage_overhead=overhead)
    elif balance == "params":
        starts = balancer.solve_params(params, n_stages, allowed_cuts=allowed)
    elif balance == "uniform":
        starts = balancer.solve_uniform(layer_groups(nodes, traced.gm), n_stages)
    else:
        raise ConfigError(
            f"balance={balance!r} is not a mode; use one of {', '.join(BALANCE_MODES)} "
            "or a list of module names to cut before"
        )
    return starts, balance


def _cost_source(profile: DeviceProfile, measured: MeasuredCosts | None) -> dict[str, object]:
    """Which numbers priced a plan's compute (the plan's JSON carries it)."""
    if measured is None:
        paced = profile.mode == "eager" and profile.calibration is not None and profile.calibration.host_probe > 0
        return {"source": "analytic", "profile": profile.name, "mode": profile.mode,
                "calibrated": profile.calibration is not None,
                # the host pace its eager host terms are at ([Note: host pace] in measure/host_pace.py)
                **({"host_probe_us": profile.calibration.host_probe * 1e6} if paced else {})}
    return {"source": "measured", "device": measured.device, "mode": measured.mode, "dtype": measured.dtype,
            "fingerprint": measured.fingerprint, "torch_version": measured.torch_version,
            "segments": len(measured.segments), "link_profile": profile.name}


def _cut_tensors(names: Sequence[str], by_name: Mapping[str, fx.Node],
                 activation_dtype: torch.dtype | None) -> list[CutTensor]:
    out = []
    for name in names:
        node = by_name.get(name)
        if node is None or node.op == "get_attr" or not is_tensor_node(node):
            continue
        v = value_of(node)
        dtype = activation_dtype if activation_dtype is not None and v.is_floating_point() else v.dtype
        out.append(CutTensor(name, tuple(v.shape), _dtype_name(dtype), v.numel() * dtype.itemsize))
    return out


def _build_plan(traced, nodes, costs, times, dag, starts, state, profile, activation_dtype, *, pp, chunks, tp,
                microbatches, mode, schedule, in_flight, model_name) -> PartitionPlan:
    by_name = {n.name: n for n in nodes}
    n = len(nodes)
    ends = list(starts[1:]) + [n]
    stages: list[StagePlan] = []
    for s, (i, j) in enumerate(zip(starts, ends)):
        names = [nodes[k].name for k in range(i, j)]
        cs = [costs[x] for x in names]
        inputs = _cut_tensors(dag.crossing[i - 1], by_name, activation_dtype) if i > 0 else []
        outputs = _cut_tensors(dag.crossing[j - 1], by_name, activation_dtype) if j < n else []
        owned = [owning_module(nodes[k]) for k in range(i, j) if owning_module(nodes[k])]
        param_bytes = sum(c.param_bytes for c in cs)
        saved = sum(c.saved_bytes for c in cs)
        stages.append(
            StagePlan(
                index=s,
                pp_rank=s % pp,
                chunk=s // pp,
                nodes=names,
                modules=(owned[0], owned[-1]) if owned else ("", ""),
                params=sum(c.param_count for c in cs),
                param_bytes=param_bytes,
                flops=sum(c.fwd_flops + c.bwd_flops for c in cs),
                compute_time=times[s].compute,
                comm_time=times[s].comm,
                cost=times[s].cost,
                activation_bytes=saved,
                memory_bytes=int(sum(state[i:j]) + saved * in_flight),
                inputs=inputs,
                outputs=outputs,
                cut_bytes=sum(t.nbytes for t in outputs),
            )
        )
    return PartitionPlan(
        model=model_name or type(traced.gm).__name__,
        route=traced.route,
        pp=pp,
        chunks=chunks,
        tp=tp,
        microbatches=microbatches,
        microbatch_size=traced.input_shapes[0][0] if traced.input_shapes and traced.input_shapes[0] else 1,
        balance=mode,
        device=profile.name,
        schedule=schedule,
        stages=stages,
        imbalance=balancer.imbalance([st.cost for st in stages]),
        total_params=sum(st.params for st in stages),
    )
