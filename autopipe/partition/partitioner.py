"""``partition()``: price every node of a traced model and cut it into balanced stages.

Cuts are made over the graph's own topological order (fx keeps nodes in execution order), at
node granularity: a cut may fall inside a block when that balances better. Communication at a
cut is the bytes of every tensor live across it, residual streams included; how it enters a
stage's time is [Note: communication in the stage cost].
"""
from __future__ import annotations

import difflib
from typing import Mapping, Sequence

import networkx as nx
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import ConfigError, PartitionError
from ..graph import is_tensor_node, owning_module, value_of
from ..tracer import TracedModel
from . import balance as balancer
from .cost import NodeCost, graph_costs, training_state_bytes
from .dag import LinearDag, linearize
from .device import DeviceProfile, get_profile
from . import mlp_pieces as pieces
from .measured import MeasuredCosts, fingerprint
from .mlp_pieces import PIECES_META
from .plan import CutTensor, PartitionPlan, StagePlan

__all__ = ["partition", "partition_at", "cut_candidates", "cut_dag", "analytic_seconds", "BALANCE_MODES",
           "layer_groups", "tp_collective_seconds"]

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


def _sent_bytes(node: fx.Node, nbytes: int, activation_dtype: torch.dtype | None) -> int:
    """Bytes of ``node``'s value on the wire: a floating tensor travels in ``activation_dtype``.

    Scaled from ``nbytes`` (the node's priced output, which a sharded costing may have cut)
    rather than recomputed from the traced value.
    """
    value = value_of(node)
    if activation_dtype is None or not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return nbytes
    return nbytes * activation_dtype.itemsize // value.element_size()


def _check_degree(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def layer_of(module_path: str, root: torch.nn.Module) -> str:
    """The top-level layer a module belongs to: ``blocks.3`` inside a ModuleList, else ``head``."""
    if not module_path:
        return ""
    parts = module_path.split(".")
    child = getattr(root, parts[0], None)
    if _is_layer_list(child) and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _is_layer_list(module: object) -> bool:
    # A GraphModule rebuilds the containers on a target's path as plain nn.Module, so a
    # ModuleList/Sequential of the original model is recognised by its indexed children too.
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        return True
    names = [name for name, _ in module.named_children()] if isinstance(module, torch.nn.Module) else []
    return bool(names) and all(name.isdigit() for name in names)


def layer_groups(nodes: Sequence[fx.Node], root: torch.nn.Module) -> list[int]:
    """Non-decreasing layer index of each node, for the equal-layers ("uniform") split."""
    groups: list[int] = []
    current, gid = None, -1
    for node in nodes:
        layer = layer_of(owning_module(node), root)
        if layer and layer != current:
            current, gid = layer, gid + 1
        groups.append(max(gid, 0))
    return groups


def _allowed_cuts(nodes: Sequence[fx.Node], gm: fx.GraphModule) -> list[bool]:
    """Where a cut may fall: ``allowed[k]`` says whether stages may split after node k.

    Two users of one parameter stay in one stage.

    A parameter used by two stages would need its gradient summed across them; keeping its
    users together avoids that (vision models rarely share weights, so this costs nothing).
    """
    allowed = [True] * max(len(nodes) - 1, 0)
    users: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        owned: list[torch.Tensor] = []
        if node.op == "call_module":
            owned = list(gm.get_submodule(node.target).parameters())
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                t = _resolve_attr(gm, arg.target)
                if isinstance(t, torch.Tensor):
                    owned.append(t)
        for t in owned:
            users.setdefault(id(t), []).append(i)
    for positions in users.values():
        for k in range(min(positions), max(positions)):
            allowed[k] = False
    position = {n: i for i, n in enumerate(nodes)}
    for i, node in enumerate(nodes):
        # Inputs all belong to stage 0, and a stage of inputs alone would do nothing.
        if node.op == "placeholder" and i < len(allowed):
            allowed[i] = False
        # A tuple of tensors cannot be sent: keep it with the nodes that unpack it.
        value = value_of(node)
        if not isinstance(value, torch.Tensor) and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value)):
            last = max((position[u] for u in node.users if u in position), default=i)
            for k in range(i, last):
                allowed[k] = False
    return allowed


def _resolve_attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _split_positions(names: Sequence[str], nodes: Sequence[fx.Node]) -> list[int]:
    """Cut positions (after index k) for explicit split points named by module."""
    modules = sorted({owning_module(n) for n in nodes if owning_module(n)})
    positions = []
    for name in names:
        first = next(
            (i for i, n in enumerate(nodes) if owning_module(n) == name or owning_module(n).startswith(name + ".")),
            None,
        )
        if first is None:
            close = difflib.get_close_matches(name, modules, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise PartitionError(f"split point {name!r} names no module of the traced graph{hint}")
        if first == 0:
            raise PartitionError(f"split point {name!r} is the first module: a stage before it would be empty")
        positions.append(first - 1)
    return positions


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
    optimizer: str = "adamw",
    costs: Mapping[str, NodeCost] | None = None,
    model_name: str = "",
    activation_dtype: torch.dtype | None = None,
    split_mlps: bool = True,
    measured: MeasuredCosts | None = None,
) -> PartitionPlan:
    """Cut ``traced`` into ``pp * chunks`` stages; ``balance`` is a mode or split-point modules.

    ``measured`` prices the nodes by a profile timed on the device ([Note: measured costs]),
    in place of the analytic model of ``device`` (which still prices the links); it must have
    been made for this graph at these input shapes (a ProfileError says what differs).

    ``costs`` overrides the per-node costs (tensor parallelism passes its sharded costs here).
    ``activation_dtype`` is the dtype floating tensors cross stage boundaries in, when it is
    not the traced one: ``torch.bfloat16`` under bf16 autocast, where activations travel in
    bf16 while the model was traced in fp32. It prices the cuts and names the plan's tensors.
    ``split_mlps`` lets a stage boundary fall inside a large MLP (balance="cost", tp=1) when
    that balances better; the plan then names the graph with those MLPs cut into pieces of
    hidden units (``plan.mlp_pieces``; see [Note: MLP pieces]), which ``emit_stages`` builds.
    """
    pp, chunks, tp = (_check_degree(n, v) for n, v in (("pp", pp), ("chunks", chunks), ("tp", tp)))
    microbatches = _check_degree("microbatches", microbatches)
    activation_dtype = _check_activation_dtype(activation_dtype)
    if traced.gm.meta.get(PIECES_META):
        raise ConfigError("partition() takes the traced model before any MLP pieces were cut; "
                          "pass the traced model itself (the plan names the pieces it needs)")
    node_seconds = _measured_seconds(traced, measured) if measured is not None else None
    args = dict(pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, balance=balance, device=device,
                schedule=schedule, mem_cap=mem_cap, optimizer=optimizer, model_name=model_name,
                activation_dtype=activation_dtype, measured=measured)
    plan = _partition(traced, costs=costs, node_seconds=node_seconds, **args)
    if not (split_mlps and balance == "cost" and tp == 1 and costs is None
            and plan.imbalance > 1.0 + SPLIT_ABOVE):
        return plan
    return _with_mlp_pieces(traced, plan, args, node_seconds)


def _measured_seconds(traced: TracedModel, measured: MeasuredCosts) -> dict[str, float]:
    measured.check({"fingerprint": fingerprint(traced.gm),
                    "input_shapes": [list(s) for s in traced.input_shapes]})
    return dict(measured.node_seconds)


def cut_dag(traced: TracedModel, costs: Mapping[str, NodeCost], activation_dtype: torch.dtype | None) -> LinearDag:
    """The graph's node order as a linear DAG whose ``cut_bytes[k]`` are the bytes crossing a cut
    after position k (every live tensor, residuals included; floating ones in ``activation_dtype``)."""
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    output_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    graph = nx.DiGraph()
    for node in nodes:
        # get_attr and non-tensor values are never sent: the emitter copies or bakes them.
        sent = node.op != "get_attr" and is_tensor_node(node)
        nbytes = _sent_bytes(node, costs[node.name].out_bytes, activation_dtype) if sent else 0
        graph.add_node(node.name, cost=0.0, out_bytes=nbytes, mem=0.0, params=0)
    for node in nodes:
        for user in node.users:
            if user.op != "output":
                graph.add_edge(node.name, user.name)
    # Model outputs must reach the last stage: a sink after everything keeps them live.
    sink = "__output__"
    graph.add_node(sink, cost=0.0, out_bytes=0, mem=0.0, params=0)
    for leaf in output_node.all_input_nodes:
        graph.add_edge(leaf.name, sink)
    return linearize(graph, [n.name for n in nodes] + [sink])


def partition_at(traced: TracedModel, starts: Sequence[int], *, device: str | DeviceProfile = "h100",
                 node_seconds: Mapping[str, float] | None = None, measured: MeasuredCosts | None = None,
                 **kwargs) -> PartitionPlan:
    """The plan whose stages start at the given positions of the node order (placeholders first,
    the output node left out): what a profile's segments and a closed loop's re-cuts emit.
    ``kwargs`` as for :func:`partition` (pp defaults to one stage per start, chunks to 1)."""
    args = dict(pp=len(starts), chunks=1, tp=1, microbatches=1, balance="cost", schedule="1f1b",
                mem_cap=None, optimizer="adamw", model_name="", activation_dtype=None)
    args.update(kwargs)
    if measured is not None:
        node_seconds = _measured_seconds(traced, measured)
    return _partition(traced, costs=None, device=device, node_seconds=node_seconds, measured=measured,
                      starts=list(starts), **args)


def cut_candidates(traced: TracedModel) -> list[bool]:
    """``allowed[k]``: whether a stage boundary may fall after position k of the node order."""
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    return _allowed_cuts(nodes, traced.gm)


def analytic_seconds(traced: TracedModel, device: str | DeviceProfile) -> dict[str, float]:
    """Forward + backward seconds of every node by the analytic model of ``device``."""
    profile = get_profile(device)
    return {name: profile.node_time(c) + profile.node_time(c, backward=True)
            for name, c in graph_costs(traced.gm).items()}


# [Note: when MLP pieces are tried]
# Only for a plan whose imbalance exceeds SPLIT_ABOVE (a balanced plan gains nothing, and
# planning stays one pass), by one refinement: every MLP slower than two granules (GRANULE of
# the mean stage's compute) is cut into pieces of about a granule, the graph is balanced
# again, and the MLPs a boundary fell inside are kept, merged to one piece per stage; the
# graph with only those is balanced a last time (the cuts it took are still there). The pieces
# are kept when the largest stage gets faster by at least SPLIT_GAIN; otherwise the node-level
# plan stands.
SPLIT_ABOVE = 0.01
GRANULE = 0.01
SPLIT_GAIN = 0.002


def _with_mlp_pieces(traced: TracedModel, plan: PartitionPlan, args: dict,
                     node_seconds: Mapping[str, float] | None) -> PartitionPlan:
    profile = get_profile(args["device"])
    costs = graph_costs(traced.gm)
    granule = GRANULE * sum(s.compute_time for s in plan.stages) / plan.num_stages
    traced_nodes = {n.name: n for n in traced.gm.graph.nodes}

    def seconds(node: fx.Node) -> float:
        if node_seconds is not None and node.name in node_seconds:
            return node_seconds[node.name]
        return profile.node_time(costs[node.name]) + profile.node_time(costs[node.name], backward=True)

    fine = {}
    for mlp in pieces.find_mlps(traced.gm):
        hidden = traced.gm.get_submodule(mlp.fc1.target).out_features
        k = pieces.pieces_for(sum(seconds(n) for n in (mlp.fc1, *mlp.chain, mlp.fc2)), hidden, granule)
        if k > 1:
            fine[mlp.fc1.target] = {"fc2": mlp.fc2.target, "hidden": pieces.fine_hidden(hidden, k)}
    if not fine:
        return plan
    # Where the boundaries would go if cutting were free: each piece takes its share of the
    # unsplit nodes' time, the partial sums none. The plan made from real costs follows.
    fine_traced = pieces.split_mlps(traced, fine)
    ideal = {}
    for node in fine_traced.gm.graph.nodes:
        if node.meta.get(pieces.PARTIAL_SUM):
            ideal[node.name] = 0.0
        elif pieces.PIECE_OF in node.meta:
            whole, share = node.meta[pieces.PIECE_OF]
            ideal[node.name] = share * seconds(traced_nodes[whole])
    fine_plan = _partition(fine_traced, costs=None, node_seconds=ideal, **args)  # measured or not: ideal
    kept = pieces.coarse_pieces(fine, fine_plan.stage_of(), fine_traced.gm)
    if not kept:
        return plan
    split_traced = pieces.split_mlps(traced, kept)
    split_seconds = None
    if node_seconds is not None:  # a piece takes its share of the measured node; the rest as measured
        split_seconds = {}
        for node in split_traced.gm.graph.nodes:
            if pieces.PIECE_OF in node.meta:
                whole, share = node.meta[pieces.PIECE_OF]
                split_seconds[node.name] = share * seconds(traced_nodes[whole])
            elif node.name in node_seconds and not node.meta.get(pieces.PARTIAL_SUM):
                split_seconds[node.name] = node_seconds[node.name]
    split = _partition(split_traced, costs=None, node_seconds=split_seconds, **args)
    split.mlp_pieces = kept
    largest = max(s.cost for s in plan.stages)
    return split if max(s.cost for s in split.stages) < largest * (1.0 - SPLIT_GAIN) else plan


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
    optimizer: str,
    costs: Mapping[str, NodeCost] | None,
    model_name: str,
    activation_dtype: torch.dtype | None,
    node_seconds: Mapping[str, float] | None = None,
    measured: MeasuredCosts | None = None,
    starts: list[int] | None = None,
) -> PartitionPlan:
    n_stages = pp * chunks
    profile = get_profile(device)
    gm = traced.gm
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    costs = dict(costs) if costs is not None else graph_costs(gm)

    # In-flight micro-batches bound activation memory: m for GPipe, about pp for 1F1B.
    in_flight = microbatches if schedule == "gpipe" else min(microbatches, pp * chunks)
    order = [n.name for n in nodes]
    analytic = [profile.node_time(costs[n]) + profile.node_time(costs[n], backward=True) for n in order]
    compute = analytic if node_seconds is None else [node_seconds.get(n, t) for n, t in zip(order, analytic)]
    if tp > 1:  # the tensor-parallel collectives the shard rewrite inserted
        for i, node in enumerate(nodes):
            compute[i] += tp_collective_seconds(node, costs[node.name], tp, profile)
    state = [training_state_bytes(costs[n].param_bytes, optimizer, param_dtype=_param_dtype(costs[n]))
             for n in order]
    mem = [held + costs[n].saved_bytes * in_flight for held, n in zip(state, order)]
    params = [costs[n].param_count for n in order]

    dag = cut_dag(traced, costs, activation_dtype)
    # See [Note: communication in the stage cost].
    cut_bytes = [int(b) for b in dag.cut_bytes[: len(order) - 1]]
    cut_time = [cut_seconds(b, profile) for b in cut_bytes]
    cut_latency = [cut_latency_seconds(b, profile) for b in cut_bytes]
    allowed = _allowed_cuts(nodes, gm)
    if sum(allowed) + 1 < n_stages:
        raise PartitionError(
            f"cannot cut {len(order)} nodes into {n_stages} stages (pp={pp} x chunks={chunks}): "
            f"at most {sum(allowed) + 1} stages are possible; lower pp or chunks"
        )

    # What running a stage costs beyond its nodes (see [Note: segments] in measure/profile.py).
    overhead = measured.stage_overhead if measured is not None else \
        profile.calibration.stage.get(profile.mode, 0.0) if profile.calibration is not None else 0.0
    if starts is not None:
        balancer.check_starts(starts, len(order))
        mode = balance if isinstance(balance, str) else "split_points:" + ",".join(balance)
    elif isinstance(balance, str):
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
        mode = balance
    else:
        starts = balancer.solve_split_points(_split_positions(list(balance), nodes), n_stages)
        mode = "split_points:" + ",".join(balance)

    times = balancer.overlapped_stage_times(compute, starts, cut_time, cut_latency, overhead)
    plan = _build_plan(traced, nodes, costs, times, dag, starts, state, profile, activation_dtype,
                       pp=pp, chunks=chunks, tp=tp, microbatches=microbatches, mode=mode,
                       schedule=schedule, in_flight=in_flight, model_name=model_name)
    ends = list(starts[1:]) + [len(order)]
    for stage, i, j in zip(plan.stages, starts, ends):
        stage.analytic_time = float(sum(analytic[i:j]))
    plan.cost_source = _cost_source(profile, measured)
    return plan


def _cost_source(profile: DeviceProfile, measured: MeasuredCosts | None) -> dict[str, object]:
    """Which numbers priced a plan's compute (the plan's JSON carries it)."""
    if measured is None:
        return {"source": "analytic", "profile": profile.name, "mode": profile.mode,
                "calibrated": profile.calibration is not None}
    return {"source": "measured", "device": measured.device, "mode": measured.mode, "dtype": measured.dtype,
            "fingerprint": measured.fingerprint, "torch_version": measured.torch_version,
            "segments": len(measured.segments), "link_profile": profile.name}


# [Note: communication in the stage cost]
# The runtime posts sends without waiting and receives ahead of the compute that needs them
# (NCCL runs them on its own stream), so in the steady state of a schedule a stage's
# transfers overlap its compute. A stage [i, j) therefore takes
#     max(compute, comm) + latency
# - compute: its nodes' forward + backward seconds;
# - comm: seconds the link is busy with the bytes of its input cut and of its output cut.
#   Each cut moves its bytes twice, activations forward and their gradients back, but in
#   opposite directions, and links (NVLink, PCIe, InfiniBand, Ethernet) are full duplex:
#   a stage receives its inputs and its outputs' gradients (in + out bytes inbound) while it
#   sends its outputs and its inputs' gradients (as many outbound). So comm is
#   (in + out) / link_bandwidth: bytes / link_bandwidth per cut (``cut_seconds``);
# - latency: link_latency per transfer, so 2 per cut, which overlap does not hide
#   (``cut_latency_seconds``).
# The balancer (balance.solve_overlapped) minimises the largest such time exactly, so it
# avoids a cut at a huge activation only where that would make a stage link-bound; the plan's
# StagePlan.cost and imbalance come from balance.overlapped_stage_times, the same formula to
# the bit. Floating tensors are priced in activation_dtype when one is given.
# The largest stage time sets the pipeline's step time, so that is what is minimised. The
# plan's imbalance (largest over mean) is not: latencies and link-bound excess move the
# mean with the cuts, and a split with a slower largest stage can show a lower ratio.


def cut_seconds(nbytes: float, profile: DeviceProfile) -> float:
    """Link seconds a cut of ``nbytes`` adds to each stage beside it; see
    [Note: communication in the stage cost]."""
    return float(nbytes) / profile.link_bandwidth


def cut_latency_seconds(nbytes: float, profile: DeviceProfile) -> float:
    """Latency a cut adds to each stage beside it: two transfers (activations, gradients)."""
    return 2.0 * profile.link_latency if nbytes > 0 else 0.0


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


def tp_collective_seconds(node: fx.Node, cost: NodeCost, tp: int, profile: DeviceProfile) -> float:
    """Time of the collective a sharded graph's ``node`` runs over ``tp`` ranks, per micro-batch
    (forward + backward): ring all-reduce moves 2 (tp - 1) / tp of the tensor per rank (f in
    backward, g in forward), all-gather and reduce-scatter (tp - 1) / tp of the whole tensor.
    0 for other nodes."""
    from ..shard import collectives as c

    # Ring collectives: reduce-scatter and all-gather each move (tp - 1) / tp of the whole tensor.
    whole_moves = {c.copy_to_tp: 2 * (tp - 1) / tp, c.reduce_from_tp: 2 * (tp - 1) / tp,
                   c.gather_from_tp: (tp - 1) / tp,
                   c.all_gather_tp: 2 * (tp - 1) / tp,  # all-gather forward, reduce-scatter backward
                   c.reduce_scatter_tp: 2 * (tp - 1),  # its output is 1/tp of the whole: both ways
                   c.split_to_tp: tp - 1}  # all-gather backward, of a whole tp times its output
    if node.op != "call_function" or node.target not in whole_moves:
        return 0.0
    return profile.transfer_time(whole_moves[node.target] * cost.out_bytes)


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
