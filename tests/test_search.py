"""The layout search (autopipe/search): replay, enumeration, prediction, errors, CLI, pp="auto"."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import autopipe
from autopipe.errors import ConfigError, ScheduleError
from autopipe.partition.device import get_profile
from autopipe.runtime.schedule import all_rank_actions, simulate, theoretical_bubble
from autopipe.search import Layout, LinkModel, Pricing, plan_layout, replay, search_layouts
from autopipe.search.costs import GraphCosts, scaled
from autopipe.search.layouts import layouts
from autopipe.search.predict import FRAGMENTATION, GRAPH_POOL_SCALE, GRAPH_POOL_WEIGHT_BYTES, predict
from autopipe.search.search import _estimate
from autopipe.shard import plan_sharding
from autopipe.tracer import trace
from tests.distributed import run_distributed
from tests.models import timm_vit


@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 6, 1), ("gpipe", 3, 5, 1), ("interleaved_1f1b", 2, 4, 2),
                                             ("interleaved_1f1b", 4, 8, 2), ("1f1b", 1, 3, 1)])
def test_replay_with_unit_times_is_the_schedules_own_timetable(schedule, pp, m, v):
    stages = pp * v
    run = replay(schedule, pp, m, v, [1.0] * stages, [1.0] * stages)
    sim = simulate(all_rank_actions(schedule, pp, m, v), pp, v)
    assert run.makespan == sim.steps
    assert run.bubble == pytest.approx(theoretical_bubble(schedule, pp, m, v))


def test_replay_waits_for_transfers_and_serialises_a_link():
    fast = replay("1f1b", 2, 4, 1, [1.0, 1.0], [1.0, 1.0])
    slow = replay("1f1b", 2, 4, 1, [1.0, 1.0], [1.0, 1.0], send_act=[0.5, 0.0], send_grad=[0.0, 0.5])
    assert slow.makespan > fast.makespan
    # A link busier than the compute paces the pipeline: four 3 s sends back to back.
    paced = replay("gpipe", 2, 4, 1, [1.0, 1.0], [1.0, 1.0], send_act=[3.0, 0.0])
    assert paced.makespan >= 1 + 4 * 3.0 + 1
    with pytest.raises(ScheduleError, match="one forward and one backward time per stage"):
        replay("1f1b", 2, 4, 1, [1.0], [1.0, 1.0])


def test_replay_charges_the_host_time_of_each_transfer_to_both_ends():
    free = replay("1f1b", 2, 4, 1, [1.0, 1.0], [1.0, 1.0])
    hosted = replay("1f1b", 2, 4, 1, [1.0, 1.0], [1.0, 1.0], host_act=[0.25, 0.0], host_grad=[0.0, 0.25])
    assert hosted.busy == free.busy  # compute only
    # Each rank posts 4 sends and takes 4 receives, 0.25 s each, beside its 8 s of compute.
    assert hosted.makespan >= 8 + 8 * 0.25 and hosted.makespan > free.makespan


def test_tensors_crossing_each_cut_are_counted():
    from autopipe.partition.cuts import cut_dag

    graph = GraphCosts(_vit_graph(), 2)
    dag = cut_dag(graph.traced, dict(zip(graph.order, graph.costs)), None)
    sent = {name for name, nbytes in zip(dag.order, dag.out_bytes) if nbytes > 0}
    for k in range(len(graph.cut_tensors)):
        assert graph.cut_tensors[k] == len([n for n in dag.crossing[k] if n in sent]), k
    assert graph.cut_tensors.max() >= 2  # inside a block: the residual and the branch


def test_transfer_overhead_is_paid_per_tensor_in_the_pipeline():
    graph = GraphCosts(_vit_graph(), 2)
    layout = Layout(2, 1, 1, 4, 1, "1f1b", False, False, "eager")
    base = predict(graph, layout, _pricing(8))
    taxed = predict(graph, layout, dataclasses.replace(_pricing(8), transfer_overhead=1e-3))
    crossing = graph.cut_tensors[taxed.starts[1] - 1]
    # Each rank sends or receives the cut's tensors twice per micro-batch (activations, gradients).
    assert taxed.parts["pipeline"] - base.parts["pipeline"] >= 4 * 2 * crossing * 1e-3 * 0.99


def test_an_interleaved_schedule_pays_its_own_transfer_overhead():
    graph = GraphCosts(_vit_graph(), 2)
    plain, interleaved = (Layout(2, 1, 1, 4, chunks, schedule, False, False, "eager")
                          for chunks, schedule in ((1, "1f1b"), (2, "interleaved_1f1b")))
    same = dataclasses.replace(_pricing(8), transfer_overhead=1e-3)
    apart = dataclasses.replace(same, interleaved_transfer_overhead=3e-3)
    assert predict(graph, plain, apart).step_seconds == predict(graph, plain, same).step_seconds
    assert predict(graph, interleaved, apart).step_seconds > predict(graph, interleaved, same).step_seconds + 4 * 2e-3
    unset = dataclasses.replace(same, interleaved_transfer_overhead=None)
    assert predict(graph, interleaved, unset).step_seconds == predict(graph, interleaved, same).step_seconds


def test_replayed_stages_pay_their_boundary_copies():
    """[Note: boundary copies]: with CUDA graphs each stage beside a cut spends the table's
    seconds per byte of it; eager stages do not; and the balancer sees the copies."""
    graph = GraphCosts(_vit_graph(), 2)
    plain = _pricing(8)
    cal = dataclasses.replace(plain.profile.calibration, boundary={"graphs": 1e-9})
    copying = dataclasses.replace(plain, profile=dataclasses.replace(plain.profile, calibration=cal))
    for mode, paid in (("graphs", True), ("eager", False)):
        layout = Layout(2, 1, 1, 4, 1, "1f1b", False, False, mode)
        cuts: dict = {}  # the same cuts for both (the copies would move them)
        base, taxed = predict(graph, layout, plain, cuts=cuts), predict(graph, layout, copying, cuts=cuts)
        nbytes = float(graph.cut_bytes_ref[base.starts[1] - 1]) * plain.activation_bytes
        extra = [t - b for t, b in zip(taxed.stage_seconds, base.stage_seconds)]
        assert extra == pytest.approx([1e-9 * nbytes] * 2 if paid else [0.0, 0.0], rel=0.01, abs=1e-12)
    layout = Layout(2, 1, 1, 4, 1, "1f1b", False, False, "graphs")
    assert predict(graph, layout, copying).starts != predict(graph, layout, plain).starts


def test_a_layout_is_built_where_the_search_priced_its_cuts():
    # [Note: priced cuts]: parallelize's own plan may cut MLPs into pieces (other boundaries,
    # three tensors each); the layout's arguments make the plan the search priced.
    import inspect

    from autopipe.planning import plan_pipeline

    torch.manual_seed(0)
    model, batch = timm_vit(depth=4), 16
    result = plan_layout(model, devices=2, batch=batch, device="cpu", example_inputs=(torch.randn(1, 3, 32, 32),),
                         mixed_precision=None, modes=("eager",), recompute_options=(False,),
                         sequence_parallel=False, exact=10**6, timeline=False)
    priced = next(p for p in result.ranked if str(p.layout) == "pp2 tp1 dp1 m1 v2 interleaved_1f1b eager")
    wanted = set(inspect.signature(plan_pipeline).parameters)
    kwargs = {k: v for k, v in priced.layout.parallelize_kwargs().items() if k in wanted}
    example = (torch.randn(priced.layout.microbatch_size(batch), 3, 32, 32),)
    pieces = plan_pipeline(model, example, profile="cpu", **{**kwargs, "split_mlps": True}).plan
    assert pieces.mlp_pieces  # this model's plan would cut MLPs, were it let
    plan = plan_pipeline(model, example, profile="cpu", **kwargs).plan
    assert not plan.mlp_pieces
    sizes = [len(stage.nodes) for stage in plan.stages]
    assert [sum(sizes[:k]) for k in range(len(sizes))] == priced.starts


def test_checkpointed_layouts_take_a_checkpointed_profile_and_rerun_the_collectives():
    from autopipe.measure import RunSetup, profile_graph
    from autopipe.search.predict import _node_seconds

    traced = _vit_graph()
    cpu = get_profile("cpu")
    plain = profile_graph(traced, RunSetup("cpu", reps=2, warmup=1), segments=2)
    again = profile_graph(traced, RunSetup("cpu", reps=2, warmup=1, recompute=True), segments=2)
    only_plain, both = GraphCosts(traced, 2, measured={2: plain}), GraphCosts(traced, 2, measured=[plain, again])
    f, b = only_plain.node_times(2, cpu)
    f_r, b_r = only_plain.node_times(2, cpu, recompute=True)
    assert (f_r == f).all() and b_r == pytest.approx(b + f)  # no checkpointed profile: the forward again
    f_m, b_m = both.node_times(2, cpu, recompute=True)
    assert float((f_m + b_m).sum()) == pytest.approx(again.total, rel=1e-6)
    assert float((f_m + b_m).sum()) != pytest.approx(float((f + b + f).sum()), rel=1e-3)
    # Under tensor parallelism the recomputation runs the forward's collectives again.
    shard = GraphCosts(traced, 2, shard_plan=plan_sharding(traced, 2))
    layout = Layout(1, 2, 1, 1, 1, "1f1b", False, False, "eager")
    pricing = _pricing(2, "cpu")
    fwd, bwd = _node_seconds(shard, layout, 2, pricing)
    fwd_r, bwd_r = _node_seconds(shard, dataclasses.replace(layout, recompute=True), 2, pricing)
    assert shard.calls.sum() > 0 and fwd_r == pytest.approx(fwd) and bwd_r == pytest.approx(bwd + fwd)


def test_a_sharded_node_keeps_its_fixed_time_whole():
    """[Note: fixed time of a sharded node]: with profiles at two sizes, a node's time a + b x size
    splits into its fixed part a, which every tp rank pays whole, and the part that grows with
    the batch, which sharding divides; from one profile, the whole time is divided."""
    from autopipe.measure import RunSetup, profile_graph

    traced = _vit_graph()
    cpu = get_profile("cpu")
    timed = profile_graph(traced, RunSetup("cpu", reps=1, warmup=1), segments=2)
    fixed, per_sample = 2e-4, 1e-4

    def at(size: int):
        return dataclasses.replace(timed, input_shapes=[[size, 3, 32, 32]],
                                   node_seconds={n: fixed + per_sample * size for n in timed.node_seconds})

    plan = plan_sharding(traced, 2)
    one = GraphCosts(traced, 2, shard_plan=plan, measured=[at(4)])
    two = GraphCosts(traced, 2, shard_plan=plan, measured=[at(1), at(4)])
    f1, b1 = one.node_times(4, cpu)
    f2, b2 = two.node_times(4, cpu)
    sharded = [i for i, c in enumerate(two.costs) if c is not two.unsharded[i] and two.order[i] in timed.node_seconds]
    assert sharded
    for i in sharded:
        share = (f1[i] + b1[i]) / (fixed + 4 * per_sample)  # this rank's share of the node's work
        assert share < 0.75
        assert f2[i] + b2[i] == pytest.approx(fixed + 4 * per_sample * share, rel=1e-6)
    whole = [i for i in range(len(two.order)) if i not in sharded and two.order[i] in timed.node_seconds]
    assert (f2 + b2)[whole] == pytest.approx((f1 + b1)[whole])
    plain1, plain2 = GraphCosts(traced, 2, measured=[at(4)]), GraphCosts(traced, 2, measured=[at(1), at(4)])
    assert sum(plain2.node_times(4, cpu)) == pytest.approx(sum(plain1.node_times(4, cpu)))


def test_a_sharded_node_divides_the_fixed_time_its_weights_take():
    """[Note: fixed time of a sharded node]: the part of the nodes' fixed time that grows with
    their parameter bytes (oneDNN's weight reorders, the gradients' writes) is divided by the
    shards; the rest is kept whole. Nodes without parameters keep their whole intercept."""
    from autopipe.measure import RunSetup, profile_graph

    traced = _vit_graph()
    cpu = get_profile("cpu")
    timed = profile_graph(traced, RunSetup("cpu", reps=1, warmup=1), segments=2)
    fixed, per_byte, per_sample = 2e-4, 4e-10, 1e-4
    plan = plan_sharding(traced, 2)
    plain = GraphCosts(traced, 2)
    weights = {n: float(c.param_bytes) for n, c in zip(plain.order, plain.unsharded)}

    def at(size: int):
        return dataclasses.replace(timed, input_shapes=[[size, 3, 32, 32]], node_seconds={
            n: fixed + per_byte * weights[n] + per_sample * size for n in timed.node_seconds})

    one = GraphCosts(traced, 2, shard_plan=plan, measured=[at(4)])
    two = GraphCosts(traced, 2, shard_plan=plan, measured=[at(1), at(4)])
    f1, b1 = one.node_times(4, cpu)
    f2, b2 = two.node_times(4, cpu)
    sharded = [i for i, c in enumerate(two.costs) if c is not two.unsharded[i] and two.order[i] in timed.node_seconds
               and weights[two.order[i]] > 0]
    assert len(sharded) >= 4
    for i in sharded:
        whole = fixed + per_byte * weights[two.order[i]] + 4 * per_sample
        share = (f1[i] + b1[i]) / whole
        assert share < 0.75
        assert f2[i] + b2[i] == pytest.approx(fixed + (whole - fixed) * share, rel=1e-6)
    assert all(two.fixed[False][n] == pytest.approx(fixed) for n in timed.node_seconds)


def test_layouts_cover_the_degrees_and_say_why_others_cannot_run():
    found, refused = [], []
    for layout, what, why in layouts(4, 6, modes=("eager",), recompute_options=(False,)):
        (found if layout is not None else refused).append(layout or (what, why))
    degrees = {(l.pp, l.tp, l.dp) for l in found}
    assert degrees == {(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2)}  # dp=4 does not divide 6
    assert any("batch 6 does not split over dp=4" in why for _, why in refused)
    assert all(l.microbatch_size(6) * l.microbatches * l.dp == 6 for l in found)
    assert all(l.schedule == "interleaved_1f1b" for l in found if l.chunks > 1)


def _vit_graph():
    torch.manual_seed(0)
    return trace(timm_vit(depth=4), (torch.randn(2, 3, 32, 32),))


def _pricing(batch: int, device: str = "h100") -> Pricing:
    profile = get_profile(device)
    return Pricing(profile, LinkModel.from_profile(profile), batch)


def test_scaled_costs_match_a_trace_at_that_size():
    small = GraphCosts(_vit_graph(), 2)
    torch.manual_seed(0)
    big = trace(timm_vit(depth=4), (torch.randn(8, 3, 32, 32),))
    direct = GraphCosts(big, 8)
    profile = get_profile("h100").with_mode("graphs")
    f1, b1 = small.node_times(8, profile)
    f2, b2 = direct.node_times(8, profile)
    assert f1.sum() == pytest.approx(f2.sum(), rel=0.02) and b1.sum() == pytest.approx(b2.sum(), rel=0.02)
    c = small.costs[5]
    assert scaled(c, 4.0).fwd_flops == pytest.approx(4 * c.fwd_flops)


def test_predictions_grow_with_work_and_memory_with_held_activations():
    graph = GraphCosts(_vit_graph(), 2)
    pricing = _pricing(64)
    base = Layout(2, 1, 1, 4, 1, "1f1b", False, False, "eager")
    p = predict(graph, base, pricing, timeline=True)
    assert p.step_seconds > p.parts["pipeline"] > 0 and 0 < p.bubble < 1
    assert p.samples_per_second == pytest.approx(64 / p.step_seconds)
    gpipe = predict(graph, dataclasses.replace(base, schedule="gpipe"), pricing)
    assert gpipe.memory_bytes > p.memory_bytes  # GPipe holds every micro-batch
    ckpt = predict(graph, dataclasses.replace(base, recompute=True), pricing)
    assert ckpt.step_seconds > p.step_seconds and ckpt.memory_bytes < p.memory_bytes
    assert {r for r, *_ in p.spans} == {0, 1}


def test_captured_stages_hold_a_pool_per_slot_and_checkpointing_saves_them_nothing():
    """[Note: graph pools]: one captured stage holds its pool (saved activations x the pool
    scale, and its parameters' gradients before they are added into .grad; under autocast also,
    per parameter, the bf16 weight its forward saved and that weight's bf16 gradient); an interleaved
    rank holds a pool per stage and micro-batch its stage holds (12 on rank 0 at pp=2, 4 chunks,
    4 micro-batches, where eager holds 9 at once); a slot's backward recomputes into its pool."""
    graph = GraphCosts(_vit_graph(), 2)
    pricing = _pricing(64)
    state, saved = float(graph.state_bytes.sum()), float(graph.saved_ref.sum()) * 64 / graph.reference_size
    one = Layout(1, 1, 1, 1, 1, "1f1b", False, False, "graphs")
    params = float(graph.param_bytes.sum())  # fp32: 4 bytes a parameter
    expected = state + GRAPH_POOL_SCALE * saved + params
    assert predict(graph, one, pricing).memory_bytes == pytest.approx(FRAGMENTATION * expected)
    bf16 = dataclasses.replace(pricing, activation_bytes=0.5)
    autocast = state + GRAPH_POOL_SCALE * saved / 2 + params + GRAPH_POOL_WEIGHT_BYTES * params / 4
    assert GRAPH_POOL_WEIGHT_BYTES > 0
    assert predict(graph, one, bf16).memory_bytes == pytest.approx(FRAGMENTATION * autocast)
    checkpointed = predict(graph, dataclasses.replace(one, recompute=True), pricing)
    assert checkpointed.memory_bytes == pytest.approx(FRAGMENTATION * expected)
    interleaved = Layout(2, 1, 1, 4, 4, "interleaved_1f1b", False, False, "graphs")
    graphs, eager = (predict(graph, dataclasses.replace(interleaved, mode=mode), pricing) for mode in ("graphs", "eager"))
    assert graphs.memory_bytes > 12 / 9 * eager.memory_bytes - FRAGMENTATION * state


def test_activations_kept_for_backward_are_priced_in_the_compute_dtype():
    """Under bf16 autocast the saved activations take half their fp32 bytes, in the exact
    prediction and in the first pass alike (the measured peaks on 2 x H100: the fp32 bytes gave
    1.4-2.6x them)."""
    graph = GraphCosts(_vit_graph(), 2)
    layout = Layout(1, 1, 1, 1, 1, "1f1b", False, False, "eager")
    fp32, bf16 = _pricing(64), dataclasses.replace(_pricing(64), activation_bytes=0.5)
    state = float(graph.state_bytes.sum())
    full, half = (predict(graph, layout, p).memory_bytes / FRAGMENTATION - state for p in (fp32, bf16))
    assert half == pytest.approx(full / 2) and full > 0
    first = {p.activation_bytes: _estimate(graph, layout, p, {})[1] / FRAGMENTATION - state for p in (fp32, bf16)}
    assert first[0.5] == pytest.approx(first[1.0] / 2) and first[1.0] == pytest.approx(full)


def test_a_tp_rank_keeps_the_whole_input_of_its_column_layers_and_its_share_of_the_rest():
    """Memory of a tp rank: a column-parallel layer keeps its replicated input for backward (the
    measured tp=2 peaks on 2 x H100 were 11-13% over the prediction that divided it by tp)."""
    traced = _vit_graph()
    plan = plan_sharding(traced, 2)
    whole, shard = GraphCosts(traced, 2), GraphCosts(traced, 2, shard_plan=plan)
    kinds = {"column": 0, "row": 0}
    for i, name in enumerate(shard.order):
        label = plan.nodes[name].sharding if name in plan.nodes else ""
        kind = "column" if label.startswith(("column", "heads:")) else "row" if label == "row" else None
        if kind is None or not whole.saved_ref[i]:
            continue
        kinds[kind] += 1
        expected = whole.saved_ref[i] if kind == "column" else whole.saved_ref[i] / 2
        assert shard.saved_ref[i] == pytest.approx(expected, rel=0.01), (name, label)
    assert kinds["column"] >= 4 and kinds["row"] >= 4  # qkv and fc1; proj and fc2 of each block


def test_search_ranks_fits_memory_and_explains_refusals():
    traced = _vit_graph()
    result = search_layouts(traced, devices=4, batch=32, pricing=_pricing(32), modes=("eager", "graphs"))
    steps = [p.step_seconds for p in result.ranked]
    assert steps == sorted(steps) and result.best.step_seconds == steps[0]
    text = str(result)
    assert "chosen:" in text and "refused" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["ranked"][0]["name"] == str(result.best.layout)
    tight = result.best.memory_bytes * 0.99
    small = search_layouts(traced, devices=4, batch=32, pricing=_pricing(32), modes=("graphs",), memory=tight)
    assert all(p.memory_bytes <= tight for p in small.ranked)
    assert any("budget" in r.reason for r in small.rejected)


def test_no_layout_is_a_typed_error_naming_what_would_fit():
    traced = _vit_graph()
    with pytest.raises(ConfigError, match=r"fits 0.0 GiB per device; the least memory, about .* GiB, is pp"):
        search_layouts(traced, devices=2, batch=8, pricing=_pricing(8), modes=("graphs",), memory=1e3)
    # 997 devices: tp=997 cannot split 4 heads, 997 replicas cannot split 8 samples, and the
    # graph has far fewer places to cut than 997 stages.
    with pytest.raises(ConfigError, match=r"no layout runs a batch of 8 on 997 devices:\n- .*\n(.|\n)*run on \d+ "):
        search_layouts(traced, devices=997, batch=8, pricing=_pricing(8), modes=("graphs",),
                       recompute_options=(False,))
    with pytest.raises(ConfigError, match="devices must be a positive integer"):
        search_layouts(traced, devices=0, batch=8, pricing=_pricing(8), modes=("graphs",))


def test_cli_plan_writes_json_and_figure(tmp_path, capsys):
    from autopipe.cli import main

    assert main(["plan", "timm:vit_tiny_patch16_224", "--gpus", "2", "--batch", "16", "--image-size", "32",
                 "--top", "3", "--json", str(tmp_path / "s.json"), "--figure", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "chosen: pp" in out and "samples/s" in out
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["devices"] == 2 and data["ranked"]
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert main(["plan", "timm:vit_tiny_patch16_224", "--gpus", "2", "--batch", "16", "--image-size", "32",
                 "--memory", "0.000001"]) == 2
    assert "fits" in capsys.readouterr().err


def test_link_model_round_trips_and_checks(tmp_path):
    links = LinkModel(1e-5, 1e10, 2e-5, 5e9, "measured")
    links.save(tmp_path / "l.json")
    assert LinkModel.load(tmp_path / "l.json") == links
    assert links.all_reduce(1e9, 4) == pytest.approx(2e-5 + 1.5e9 / 5e9)
    with pytest.raises(ConfigError, match="positive bandwidths"):
        LinkModel(0.0, 0.0, 0.0, 1.0)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="autopipe links"):
        LinkModel.load(tmp_path / "bad.json")
    in_step = dataclasses.replace(links, tp_latency=1e-3, tp_bandwidth=2e8)
    in_step.save(tmp_path / "t.json")
    assert LinkModel.load(tmp_path / "t.json") == in_step
    with pytest.raises(ConfigError, match="tp_bandwidth"):
        dataclasses.replace(links, tp_bandwidth=0.0)


def test_link_latency_is_no_more_than_the_smallest_transfer_takes():
    from autopipe.search.links import _fit

    sizes = [1 << 12, 1 << 18, 1 << 22, 1 << 24, 1 << 25]
    exact = [1e-4 + s / 2e9 for s in sizes]
    assert _fit(sizes, exact) == pytest.approx((1e-4, 2e9), rel=1e-6)
    # Bandwidth that grows with size bends the line: its intercept lands above the 4 KB time.
    bent = [3e-4, 5e-4, 4e-3, 1.1e-2, 1.6e-2]
    latency, bandwidth = _fit(sizes, bent)
    assert latency == pytest.approx(3e-4)
    assert all(abs(latency + s / bandwidth - t) / t < 0.35 for s, t in zip(sizes, bent))  # a line through a bend


def test_tensor_parallel_collectives_are_priced_at_their_in_step_figures():
    """[Note: collectives in a step]: where the links carry in-step figures for the tensor-parallel
    collectives, those price them (calls x latency + bytes / bandwidth per micro-batch), and
    the data-parallel all-reduce keeps the idle ones."""
    graph = GraphCosts(_vit_graph(), 2, shard_plan=plan_sharding(_vit_graph(), 2))
    pricing = _pricing(8, "cpu")
    tp = Layout(1, 2, 1, 2, 1, "1f1b", False, False, "eager")
    idle = predict(graph, tp, pricing)
    slow = dataclasses.replace(pricing.links, tp_latency=pricing.links.collective_latency + 1e-3,
                               tp_bandwidth=pricing.links.collective_bandwidth / 2)
    in_step = predict(graph, tp, dataclasses.replace(pricing, links=slow))
    size = tp.microbatch_size(8)
    moved = float(graph.moved_ref.sum()) * size / graph.reference_size
    extra = tp.microbatches * (graph.calls.sum() * 1e-3 + moved / pricing.links.collective_bandwidth)
    assert graph.calls.sum() > 0
    assert in_step.step_seconds - idle.step_seconds == pytest.approx(extra, rel=1e-6)
    dp = Layout(1, 1, 2, 1, 1, "1f1b", False, False, "eager")
    plain = GraphCosts(_vit_graph(), 2)
    assert predict(plain, dp, dataclasses.replace(pricing, links=slow)).parts["dp_all_reduce"] == \
        pytest.approx(predict(plain, dp, pricing).parts["dp_all_reduce"])


def test_a_sequence_parallel_collective_waits_once_and_follows_once():
    """[Note: collectives in a step]: of each reduce-scatter's and all-gather's two calls, one is
    priced at the in-step latency and one, following another collective, at the idle one; a
    plain layout's all-reduces are all in-step."""
    from autopipe.shard.collectives import COLLECTIVES

    traced = _vit_graph()
    shard = plan_sharding(traced, 2, sequence_parallel=True)
    graph = GraphCosts(traced, 2, shard_plan=shard)
    edges = [c for c in shard.collectives if COLLECTIVES[c.kind].forward in ("reduce-scatter", "all-gather")
             and c.fwd_bytes > 0 and c.bwd_bytes > 0]  # not the model's last gather: that is one call
    assert edges and graph.follow_calls.sum() == len(edges)
    plain = GraphCosts(traced, 2, shard_plan=plan_sharding(traced, 2))
    assert plain.follow_calls.sum() == 0 and plain.calls.sum() > 0
    # Every sequence-parallel collective is reached after compute once: as many waits as calls of
    # collectives that are not region edges, plus one per edge.
    assert graph.calls.sum() == len(edges) + sum((c.fwd_bytes > 0) + (c.bwd_bytes > 0)
                                                 for c in shard.collectives if c not in edges)
    pricing = _pricing(8, "cpu")
    sp = Layout(1, 2, 1, 2, 1, "1f1b", True, False, "eager")
    idle = predict(graph, sp, pricing)
    slow = dataclasses.replace(pricing.links, tp_latency=pricing.links.collective_latency + 1e-3,
                               tp_bandwidth=pricing.links.collective_bandwidth)
    in_step = predict(graph, sp, dataclasses.replace(pricing, links=slow))
    assert in_step.step_seconds - idle.step_seconds == pytest.approx(sp.microbatches * graph.calls.sum() * 1e-3,
                                                                     rel=1e-6)


def test_a_following_collective_is_priced_at_its_measured_latency(tmp_path):
    """[Note: collectives in a step]: where the links carry a measured latency for a collective
    that follows another closely (``tp_follow_latency``), the sequence-parallel layouts' following
    calls cost it, and nothing else moves: not their calls reached after compute, not a plain
    layout, not the data-parallel all-reduce; without it they keep the idle latency."""
    traced = _vit_graph()
    sp_graph = GraphCosts(traced, 2, shard_plan=plan_sharding(traced, 2, sequence_parallel=True))
    plain_graph = GraphCosts(traced, 2, shard_plan=plan_sharding(traced, 2))
    pricing = _pricing(8, "cpu")
    links = dataclasses.replace(pricing.links, tp_latency=2e-3, tp_bandwidth=pricing.links.collective_bandwidth)
    waits = dataclasses.replace(links, tp_follow_latency=links.collective_latency + 1e-3)
    assert links.collectives(0.0, 3, 5) == pytest.approx(3 * 2e-3 + 5 * links.collective_latency)
    assert waits.collectives(0.0, 3, 5) == pytest.approx(3 * 2e-3 + 5 * (links.collective_latency + 1e-3))
    sp = Layout(1, 2, 1, 2, 1, "1f1b", True, False, "eager")
    base = predict(sp_graph, sp, dataclasses.replace(pricing, links=links))
    slow = predict(sp_graph, sp, dataclasses.replace(pricing, links=waits))
    assert sp_graph.follow_calls.sum() > 0
    assert slow.step_seconds - base.step_seconds == pytest.approx(sp.microbatches * sp_graph.follow_calls.sum() * 1e-3,
                                                                  rel=1e-6)
    plain = Layout(1, 2, 1, 2, 1, "1f1b", False, False, "eager")
    assert predict(plain_graph, plain, dataclasses.replace(pricing, links=waits)).step_seconds == \
        pytest.approx(predict(plain_graph, plain, dataclasses.replace(pricing, links=links)).step_seconds)
    waits.save(tmp_path / "w.json")
    assert LinkModel.load(tmp_path / "w.json") == waits


class _TwoMLPs(torch.nn.Module):
    """Two branches, each an MLP whose output feeds another: tp=2 shards all four, and between
    the two MLPs of a branch the first's all-reduce (g) is followed by the second's f."""

    def __init__(self) -> None:
        super().__init__()
        mlp = lambda i, o: torch.nn.Sequential(torch.nn.Linear(i, 64), torch.nn.GELU(), torch.nn.Linear(64, o))  # noqa: E731
        self.a = torch.nn.ModuleList(mlp(32, 48) for _ in range(2))
        self.b = torch.nn.ModuleList(mlp(48, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b(a(x)) for a, b in zip(self.a, self.b))


def _counted_rank(rank: int, world: int) -> tuple[int, int]:
    """(calls, bytes) of the tensor-parallel all-reduces in one train step of ``_TwoMLPs`` at tp=2."""
    import torch.distributed as dist

    counted = [0, 0]
    original = dist.all_reduce

    def all_reduce(t, *args, **kwargs):
        counted[0], counted[1] = counted[0] + 1, counted[1] + t.numel() * t.element_size()
        return original(t, *args, **kwargs)

    torch.manual_seed(0)
    pm = autopipe.parallelize(_TwoMLPs(), (torch.randn(4, 8, 32),), tp=2, loss_fn=F.mse_loss, device="cpu")
    x, y = torch.randn(4, 8, 32), torch.randn(4, 8, 16)
    pm.train_step(x, y)
    dist.all_reduce = all_reduce
    try:
        pm.train_step(x, y)
    finally:
        dist.all_reduce = original
    pm.close()
    return counted[0], counted[1]


def test_collectives_are_priced_as_they_run():
    """A collective on another's output (f after g between two MLPs) is priced, at the node the
    first follows; one on a graph input calls nothing backward (no gradient flows into the
    input): the priced calls and bytes are those a tp=2 train step makes."""
    traced = trace(_TwoMLPs(), (torch.randn(4, 8, 32),))
    graph = GraphCosts(traced, 4, shard_plan=plan_sharding(traced, 2))
    calls, nbytes = run_distributed(_counted_rank, 2, timeout=120)[0]
    assert calls == 6  # per branch: g after each MLP forward, f between them backward
    assert graph.calls.sum() + graph.follow_calls.sum() == calls and graph.follow_calls.sum() == 0
    assert graph.moved_ref.sum() == nbytes  # an all-reduce over 2 ranks moves its bytes once


def _auto_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = timm_vit()
    pm = autopipe.parallelize(model, (torch.randn(1, 3, 32, 32),), pp="auto", batch=8, loss_fn=F.cross_entropy,
                              device="cpu")
    layout = pm.search.best.layout
    per_replica = 8 // layout.dp
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    mine = slice(pm.dp_rank * per_replica, (pm.dp_rank + 1) * per_replica)
    loss = pm.train_step(x[mine], y[mine])
    return {"layout": str(layout), "loss": float(loss), "dp": layout.dp}


def test_parallelize_auto_chooses_alike_on_every_rank_and_trains_as_one_process():
    results = run_distributed(_auto_rank, 2, timeout=240)
    assert results[0]["layout"] == results[1]["layout"]
    torch.manual_seed(0)
    model = timm_vit()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    with torch.no_grad():
        reference = [float(F.cross_entropy(model(x[i * 4:(i + 1) * 4]), y[i * 4:(i + 1) * 4])) for i in range(2)] \
            if results[0]["dp"] == 2 else [float(F.cross_entropy(model(x), y))] * 2
    for r, want in zip(results, reference):
        assert r["loss"] == pytest.approx(want, rel=1e-5)


def test_auto_needs_a_batch():
    with pytest.raises(ConfigError, match="pp='auto' needs batch="):
        autopipe.parallelize(timm_vit(), (torch.randn(1, 3, 32, 32),), pp="auto", loss_fn=F.cross_entropy,
                             device="cpu")
    with pytest.raises(ConfigError, match="batch=8 is for pp='auto'"):
        autopipe.parallelize(timm_vit(), (torch.randn(1, 3, 32, 32),), batch=8, loss_fn=F.cross_entropy,
                             device="cpu")


def test_costs_priced_in_one_pass_equal_the_profiles_node_time():
    from autopipe.partition.device import PROFILES

    graph = GraphCosts(_vit_graph(), 2)
    # A host time per node and kernels counted by kind, besides the table's own host terms.
    counted = dataclasses.replace(PROFILES["h200"].calibration, host_kernels={"gemm": (2.0, 5.0), "norm:row": (1.0, 3.0)},
                                  node_host=(20e-6, 3e-6), view_host=(7e-6, 1e-6))
    # h100's eager nodes are priced alone, h200's through the launch queue.
    for profile in (PROFILES["h100"].with_mode("eager"), PROFILES["h100"].with_mode("compiled"),
                    PROFILES["h100"].with_mode("graphs"), PROFILES["h200"].with_mode("eager"),
                    dataclasses.replace(PROFILES["h200"].with_mode("eager"), calibration=counted),
                    dataclasses.replace(PROFILES["h100"], calibration=None), PROFILES["cpu"]):
        for size in (2, 16):
            fwd, bwd = graph.node_times(size, profile)
            want_f, want_b = zip(*profile.node_times([scaled(c, size / 2) for c in graph.costs]))
            assert fwd.tolist() == pytest.approx(want_f, rel=1e-9, abs=1e-15)
            assert bwd.tolist() == pytest.approx(want_b, rel=1e-9, abs=1e-15)


def test_micro_batches_too_small_for_batch_norm_are_refused_with_the_norm_named():
    # A batch norm after the pooling sees one value per channel per sample: in train() a
    # micro-batch of one sample would raise inside torch, so no such layout is offered.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.BatchNorm2d(8), torch.nn.Flatten(), torch.nn.Linear(8, 10))
    traced = trace(model, (torch.randn(4, 3, 32, 32),))
    result = search_layouts(traced, devices=2, batch=4, pricing=_pricing(4, "cpu"), modes=("eager",), timeline=False)
    assert result.ranked and all(p.layout.microbatch_size(4) >= 2 for p in result.ranked)
    refused = [r for r in result.rejected if "BatchNorm 2 would normalise 1 value per channel" in r.reason]
    assert refused and all(" m2" in r.layout or " m4" in r.layout for r in refused)
    # Without the pooling the norm sees a whole map per sample: one sample is enough.
    conv_bn = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                                  torch.nn.Linear(8 * 30 * 30, 10))
    traced = trace(conv_bn, (torch.randn(4, 3, 32, 32),))
    result = search_layouts(traced, devices=2, batch=4, pricing=_pricing(4, "cpu"), modes=("eager",), timeline=False)
    assert any(p.layout.microbatch_size(4) == 1 for p in result.ranked)


def test_sequence_parallel_layouts_are_priced_as_such_from_a_one_sample_trace():
    """A graph traced on fewer samples than tp ranks has no sequence-parallel region: the search
    traces a micro-batch that splits, so an "sp" layout pays its reduce-scatters and
    all-gathers (more calls than the plain layout's all-reduces)."""
    torch.manual_seed(0)
    links = LinkModel(1e-4, 1e9, 1e-3, 1e9)
    result = plan_layout(timm_vit(depth=2), devices=2, batch=8, device="cpu", links=links,
                         example_inputs=(torch.randn(1, 3, 32, 32),), mixed_precision=None, modes=("eager",),
                         exact=10**6, timeline=False)
    steps = {str(p.layout): p.step_seconds for p in result.ranked}
    assert steps["pp1 tp2 dp1 m1 sp eager"] > steps["pp1 tp2 dp1 m1 eager"] * 1.05


def test_the_dp_all_reduce_pays_for_dividing_the_gradients_where_they_lie():
    graph = GraphCosts(_vit_graph(), 2)
    pricing = _pricing(8, "cpu")
    p = predict(graph, Layout(1, 1, 2, 1, 1, "1f1b", False, False, "eager"), pricing)
    grads = float(graph.param_bytes.sum())
    copies = 2 * grads / pricing.profile.mem_bandwidth  # read and written once: no copies in or out
    assert p.parts["dp_all_reduce"] == pytest.approx(pricing.links.all_reduce(grads, 2) + copies)
    one = predict(graph, Layout(1, 1, 1, 1, 1, "1f1b", False, False, "eager"), dataclasses.replace(pricing, batch=4))
    assert one.parts["dp_all_reduce"] == 0.0


def test_the_optimizer_step_is_priced_by_its_bytes_per_parameter():
    graph = GraphCosts(_vit_graph(), 2)
    layout = Layout(1, 1, 1, 1, 1, "1f1b", False, False, "eager")
    fused = predict(graph, layout, _pricing(2, "cpu"))
    unfused = predict(graph, layout, dataclasses.replace(_pricing(2, "cpu"), optimizer_bytes=96.0))
    params = float(graph.param_count.sum())
    bandwidth = get_profile("cpu").mem_bandwidth
    assert unfused.parts["optimizer"] - fused.parts["optimizer"] == pytest.approx(params * (96.0 - 32.0) / bandwidth)


def test_measured_node_times_are_kept_at_their_size_under_a_queued_table():
    """A measured profile's node prices already hold the launch queue; the analytic model only
    scales them to another size, so at the size they were timed they are what was measured, on a
    table that prices eager stages through the queue (h200) as on one that does not (cpu)."""
    from autopipe.measure import RunSetup, profile_graph
    from autopipe.partition.device import PROFILES

    traced = _vit_graph()
    timed = profile_graph(traced, RunSetup("cpu", reps=1, warmup=1), segments=2)
    timed = dataclasses.replace(timed, input_shapes=[[4, 3, 32, 32]])
    costs = GraphCosts(traced, 2, measured=[timed])
    for profile in (get_profile("cpu"), PROFILES["h200"].with_mode("eager")):
        fwd, bwd = costs.node_times(4, profile)
        for i, name in enumerate(costs.order):
            if name in timed.node_seconds:
                assert fwd[i] + bwd[i] == pytest.approx(timed.node_seconds[name], rel=1e-9, abs=1e-15)


def test_prices_follow_each_table_even_one_made_after_another_was_dropped():
    # The graph keeps its per-table work by the table's id: a table made after another was
    # dropped may be given the dropped one's id, and must not be priced by its factors.
    graph = GraphCosts(_vit_graph(), 2)
    base = get_profile("h100").with_mode("graphs")
    for scale in (1.0, 2.0, 4.0, 8.0):
        profile = dataclasses.replace(base, calibration=dataclasses.replace(
            base.calibration, factors={k: (f * scale, b * scale) for k, (f, b) in base.calibration.factors.items()}))
        fwd, _ = graph.node_times(2, profile)
        assert fwd.tolist() == pytest.approx([f for f, _ in profile.node_times(graph.costs)], rel=1e-9, abs=1e-15)
        del profile


def test_a_measured_profile_prices_boundary_copies_at_its_own_rate():
    """[Note: a profile's boundary copies]: a layout priced by a profile under CUDA graphs copies
    what crosses each cut at the profile's fitted rate; the analytic model, at its table's."""
    from autopipe.measure import RunSetup, profile_graph
    from autopipe.search.predict import boundary_copy_rate

    traced = _vit_graph()
    timed = profile_graph(traced, RunSetup("cpu", reps=1, warmup=1), segments=2)
    timed = dataclasses.replace(timed, input_shapes=[[4, 3, 32, 32]], boundary_rate=7e-13)
    layout = Layout(2, 1, 1, 2, 1, "1f1b", False, False, "graphs")
    pricing = Pricing(get_profile("h200"), LinkModel.from_profile(get_profile("h200")), 8)
    assert boundary_copy_rate(pricing, layout, GraphCosts(traced, 2, measured=[timed]), 4) == 7e-13
    base = get_profile("h200")
    copying = dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, boundary={"graphs": 9e-13}))
    pricing = Pricing(copying, LinkModel.from_profile(copying), 8)
    assert boundary_copy_rate(pricing, layout, GraphCosts(traced, 2), 4) == 9e-13
    with_copies = predict(GraphCosts(traced, 2, measured=[timed]), layout, pricing)
    without = predict(GraphCosts(traced, 2, measured=[dataclasses.replace(timed, boundary_rate=0.0)]), layout, pricing)
    assert with_copies.step_seconds > without.step_seconds
