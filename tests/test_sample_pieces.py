"""Pooling cut by sample across stages (stages/sample_pieces.py): a ResNet's stem max-pool split
along the batch gives the model's values and gradients to the bit, the partitioner cuts it when
that balances better, and training in two stages keeps the numbers of one process."""
from __future__ import annotations

import pytest
import torch

import autopipe
from autopipe.errors import PartitionError
from autopipe.measure import MeasureOptions, RunSetup
from autopipe.measure.profile import profile_key
from autopipe.partition.measured import MeasuredCosts, Segment
from autopipe.partition.partitioner import analytic_seconds, partition
from autopipe.partition.plan import PartitionPlan
from autopipe.stages.emit import emit_stages, run_chain
from autopipe.stages.mlp_pieces import JOIN, PIECE, PIECE_OF, cut_mlps
from autopipe.stages.piece_plan import plan_stages
from autopipe.stages.piece_state import merge_pieces, piece_params
from autopipe.stages.sample_pieces import find_pools, scaled_bounds
from autopipe.tracer import trace
from tests.distributed import run_distributed
from tests.models import logits
from tests.test_batchnorm import _loss, _sgd, batch, excess, micro_batches, reference, resnet18, train

BATCH, M, STEPS = 8, 2, 2
POOL = {"maxpool": {"samples": [0, 1, 4]}}


def _traced(n: int = 4):
    return trace(resnet18(), (batch(0, n)[0],))


def _heavy_pool(traced) -> dict[str, float]:
    """Node seconds on which the stem's max-pool is three times the rest of the model: pp=2
    balances only with a boundary inside it."""
    seconds = {k: v for k, v in analytic_seconds(traced, "cpu").items() if k != "output"}
    seconds["maxpool"] = 3 * sum(seconds.values())
    return seconds


def _costs(traced, segments, seconds) -> MeasuredCosts:
    """A CPU profile of ``traced`` with these segments and node seconds."""
    key = profile_key(traced, RunSetup("cpu", "eager"))
    return MeasuredCosts(key["fingerprint"], key["input_shapes"], key["dtype"], key["mode"], key["device"],
                         key["torch_version"], segments, seconds)


def _device(monkeypatch, traced, measured, hidden):
    """The stage timers replaced by a device on which each profile segment's nodes run at its
    ``hidden`` factor, and a plan's splits and joins at their analytic price (as the fit takes
    them); returns that device's stage times of a plan."""
    import autopipe.measure as measure
    from autopipe.measure import _groups

    group_of, seconds = _groups(traced, measured), measured.node_seconds

    def true(plan):
        split = cut_mlps(traced, plan.mlp_pieces)
        unprofiled = {k: v for k, v in analytic_seconds(split, "cpu").items() if k not in seconds}
        share = {n.name: n.meta.get(PIECE_OF, (n.name, 1.0)) for n in split.gm.graph.nodes}
        return [sum(share[n][1] * seconds[share[n][0]] * hidden[group_of[share[n][0]]]
                    if share[n][0] in seconds else unprofiled.get(n, 0.0) for n in s.nodes) for s in plan.stages]

    monkeypatch.setattr(measure, "time_plan", lambda t, plan, s, group=None, stages=None: [
        true(plan)[i] for i in (range(plan.num_stages) if stages is None else stages)])
    monkeypatch.setattr(measure, "_time_both", lambda t, p, q, s, scale: (true(p), true(q)))
    return true


def test_a_pool_cut_by_sample_gives_the_models_values_and_gradients_to_the_bit():
    traced = _traced()
    assert [p.key for p in find_pools(traced.gm)] == ["maxpool"]
    split = cut_mlps(traced, POOL)
    nodes = list(split.gm.graph.nodes)
    pieces = [n for n in nodes if PIECE in n.meta]
    assert [n.meta[PIECE] for n in pieces] == [("maxpool", 0), ("maxpool", 1)]
    assert [n.meta[PIECE_OF] for n in pieces] == [("maxpool", 0.25), ("maxpool", 0.75)]
    assert [tuple(n.meta["val"].shape[:1]) for n in pieces] == [(1,), (3,)]
    joins = [n for n in nodes if n.meta.get(JOIN)]
    assert len(joins) == 1 and joins[0].target is torch.cat and "maxpool" not in {n.name for n in nodes}
    assert split.gm.state_dict().keys() == traced.gm.state_dict().keys() and not piece_params(POOL)
    x = batch(1, 4)[0]
    ref, out = traced.gm(x)[0], split.gm(x)[0]
    assert torch.equal(out, ref)
    ref.square().sum().backward()
    out.square().sum().backward()
    want = {k: p.grad for k, p in traced.gm.named_parameters()}
    grads = merge_pieces({k: p.grad for k, p in split.gm.named_parameters()}, POOL)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in want)
    with pytest.raises(PartitionError, match="'layer1_0_relu' as a pooling"):
        cut_mlps(traced, {"layer1_0_relu": {"samples": [0, 2, 4]}})
    with pytest.raises(PartitionError, match="increasing pieces"):
        cut_mlps(traced, {"maxpool": {"samples": [0, 3, 3, 4]}})


def test_other_micro_batch_sizes_are_cut_at_the_same_fractions():
    assert scaled_bounds([0, 48, 128], 128) == [0, 48, 128]
    assert scaled_bounds([0, 48, 128], 32) == [0, 12, 32]
    assert scaled_bounds([0, 1, 2, 128], 3) == [0, 1, 2, 3]  # every piece keeps a sample
    assert scaled_bounds([0, 64, 128], 1) == [0, 0, 1]  # fewer samples than pieces: an empty one
    small = _traced(2)
    split = cut_mlps(small, POOL)  # planned at 4 samples (1 | 3), traced at 2: 1 | 1
    assert [tuple(n.meta["val"].shape[:1]) for n in split.gm.graph.nodes if PIECE in n.meta] == [(1,), (1,)]
    x = batch(2, 2)[0]
    assert torch.equal(split.gm(x)[0], small.gm(x)[0])


def test_the_partitioner_cuts_a_pool_by_sample_when_that_balances_better():
    traced = _traced()
    seconds = _heavy_pool(traced)
    plain = partition(traced, 2, device="cpu", node_seconds=seconds)
    plan = plan_stages(traced, 2, device="cpu", node_seconds=seconds)
    assert not plain.mlp_pieces and list(plan.mlp_pieces) == ["maxpool"]
    assert plan.imbalance < plain.imbalance - 0.2
    assert plan_stages(traced, 2, device="cpu", node_seconds=seconds, split_mlps=False).mlp_pieces == {}
    stage_of = plan.stage_of()  # the pool's pieces lie in both stages
    assert {stage_of[n.name] for n in cut_mlps(traced, plan.mlp_pieces).gm.graph.nodes if PIECE in n.meta} == {0, 1}
    x = batch(3, 4)[0]
    out = run_chain(list(emit_stages(traced, plan).values()), x)
    assert torch.equal(out[0], traced.gm(x)[0])
    assert PartitionPlan.from_dict(plan.to_dict()).mlp_pieces == plan.mlp_pieces
    assert "pooling cut across stages by sample: maxpool, samples 0:" in str(plan)


# ----------------------------------------------------------------------------- on 2 processes
def _profile(image: int) -> MeasuredCosts:
    """A profile of ResNet-18 at one micro-batch on which pp=2 cuts inside the max-pool."""
    traced = trace(resnet18(), (batch(0, BATCH // M, image)[0],))
    seconds = _heavy_pool(traced)
    count = sum(1 for n in traced.gm.graph.nodes if n.op != "output")
    return _costs(traced, [Segment(0, count, sum(seconds.values()), 0.0)], seconds)


def _train_pool_in_pieces(rank: int, world: int) -> dict:
    ref = reference(resnet18(), BATCH, micro_batches(BATCH, M), steps=STEPS)
    pm = autopipe.parallelize(resnet18(), (batch(0, BATCH // M)[0],), pp=2, microbatches=M, loss_fn=_loss,
                              deadline=120, costs=_profile(32), measure=MeasureOptions(rounds=0, moves=0))
    train(pm, BATCH, steps=STEPS, optimizer=_sgd(pm.parameters()))
    state, want = pm.full_state_dict(), ref.state_dict()
    out = {"pieces": pm.plan.mlp_pieces, "keys": state.keys() == want.keys(),
           "state": max(excess(v, want[k]) for k, v in state.items())}
    x_eval = batch(99, BATCH)[0]
    pm.eval()
    got = pm.eval_step(x_eval)
    ref.eval()
    with torch.no_grad():
        out["eval"] = None if got is None else excess(logits(got), logits(ref(x_eval)))
    return out


def test_training_with_a_pool_cut_by_sample_equals_one_process():
    """pp=2, 2 micro-batches of 4, 2 SGD steps with momentum, fp64, BatchNorm statistics over the
    whole batch: every parameter and statistic, and the eval() outputs, equal one process."""
    results = run_distributed(_train_pool_in_pieces, 2, timeout=300)
    assert all(list(r["pieces"]) == ["maxpool"] and r["keys"] for r in results), results
    assert all(r["state"] <= 1.0 for r in results), results
    evals = [r["eval"] for r in results if r["eval"] is not None]
    assert len(evals) == 1 and evals[0] <= 1.0, evals


def test_the_closed_loop_prices_a_plan_cut_by_sample_by_its_fit(monkeypatch):
    """A device on which each profile segment runs at its own hidden speed: the plan the loop
    keeps, cut inside the max-pool, is priced by the profile as the loop's timings corrected it
    (each piece at its share of its node), not by the raw profile."""
    import autopipe.measure as measure
    from autopipe.measure import _groups, measured_plan, segment_starts

    traced = _traced()
    seconds = _heavy_pool(traced)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    starts = segment_starts(traced, 4, "cpu")
    segments = [Segment(a, b, sum(seconds[n] for n in order[a:b]), 0.0) for a, b in zip(starts, starts[1:] + [len(order)])]
    key = profile_key(traced, RunSetup("cpu", "eager"))
    measured = MeasuredCosts(key["fingerprint"], key["input_shapes"], key["dtype"], key["mode"], key["device"],
                             key["torch_version"], segments, seconds)
    group_of = _groups(traced, measured)
    hidden = [1.6, 0.7, 1.2, 0.9][:len(segments)]

    def true(plan):
        nodes = cut_mlps(traced, plan.mlp_pieces).gm.graph.nodes
        share = {n.name: n.meta.get(PIECE_OF, (n.name, 0.0 if n.meta.get(JOIN) else 1.0)) for n in nodes}
        return [sum(share[n][1] * seconds.get(share[n][0], 0.0) * hidden[group_of.get(share[n][0], 0)]
                    for n in s.nodes) for s in plan.stages]

    monkeypatch.setattr(measure, "time_plan", lambda t, plan, s, group=None, stages=None: [
        true(plan)[i] for i in (range(plan.num_stages) if stages is None else stages)])
    monkeypatch.setattr(measure, "_time_both", lambda t, p, q, s, scale: (true(p), true(q)))
    plan = measured_plan(traced, RunSetup("cpu", reps=1, warmup=1), dict(pp=2, device="cpu"), measured=measured,
                         options=MeasureOptions(rounds=1, moves=4, target=1.0))
    assert list(plan.mlp_pieces) == ["maxpool"] and "calibrated" in plan.refinement[-1]
    assert any(r.get("mlp_pieces") == plan.mlp_pieces for r in plan.refinement if "round" in r)
    truth = true(plan)
    split = cut_mlps(traced, plan.mlp_pieces).gm.graph.nodes
    share = {n.name: n.meta.get(PIECE_OF, (n.name, 0.0 if n.meta.get(JOIN) else 1.0)) for n in split}
    raw = [sum(share[n][1] * seconds.get(share[n][0], 0.0) for n in s.nodes) for s in plan.stages]
    assert max(abs(r - t) / t for r, t in zip(raw, truth)) > 0.15  # the raw profile is far off
    assert max(abs(s.compute_time - t) / t for s, t in zip(plan.stages, truth)) < 0.05


def test_stages_cut_by_sample_run_micro_batches_of_another_size():
    """The graph cut by sample stays generic in the batch: stages emitted for the planned 4
    samples, re-propagated at 3 and 6 (an uneven last micro-batch), give the model's outputs."""
    from autopipe.stages.variants import emit_variant, repropagate

    traced = _traced()
    plan = plan_stages(traced, 2, device="cpu", node_seconds=_heavy_pool(traced))
    assert list(plan.mlp_pieces) == ["maxpool"]
    split = cut_mlps(traced, plan.mlp_pieces)  # what the runtime holds
    stages = emit_stages(traced, plan)
    for size in (3, 6):
        sized = repropagate(split, size)
        x = batch(4, size)[0]
        out = run_chain(list(emit_variant(sized, plan, stages).values()), x)
        assert torch.equal(out[0], traced.gm(x)[0]), size


def test_the_fit_takes_the_splits_and_joins_at_their_analytic_price():
    """The seconds of nodes no profile timed (a split, a join) enter each timing's equation as
    known: a device on which they cost exactly that and every group runs at its hidden factor
    gives those factors back, where folding them into the groups would not."""
    from autopipe.measure.closed_loop import UNPROFILED, calibrate

    by_stage = {("a",): [{0: 2.0, 1: 1.0, UNPROFILED: 1.5}, {1: 3.0}],
                ("b",): [{0: 1.0, UNPROFILED: 0.5}, {0: 1.0, 1: 3.0, UNPROFILED: 1.0}],
                ("c",): [{0: 3.0}, {1: 1.0, UNPROFILED: 2.0}]}
    hidden, fixed = [1.5, 0.8], 0.25

    def true(stage: dict) -> float:
        return sum(hidden[k] * s for k, s in stage.items() if k != UNPROFILED) + stage.get(UNPROFILED, 0.0) + fixed

    # Timed as under CUDA graphs (moves at the GPU's steady pace), each plan 5 times: the prior's
    # pull weighs little.
    log = [{"round": 0, "stage_starts": ["a"], "times": [true(s) for s in by_stage[("a",)]]}]
    log += [{"move": i, "stage_starts": list(k), "stages": [0, 1], "measured": [true(s) for s in v]}
            for i, (k, v) in enumerate(list(by_stage.items()) * 5)]
    factors, c = calibrate(log, 2, lambda starts, pieces: by_stage[tuple(starts)])
    assert factors == pytest.approx(hidden, rel=0.02) and c == pytest.approx(fixed, rel=0.05)
    folded = {k: [{g: s for g, s in stage.items() if g != UNPROFILED} for stage in v] for k, v in by_stage.items()}
    wrong, _ = calibrate(log, 2, lambda starts, pieces: folded[tuple(starts)])
    assert max(abs(f - h) / h for f, h in zip(wrong, hidden)) > 0.1


def test_boundaries_move_inside_a_pool_by_a_sixteenth_of_its_samples(monkeypatch):
    """A boundary inside the pool moves in the graph whose pool is cut into sixteen pieces (a
    move over its two pieces would move most of the pool): on a device where the stem and its
    pool run at half their profiled time, the moves shift the pool's samples between the
    stages, and each moved plan, merged back to two pieces, runs as the model does."""
    from autopipe.measure import measured_plan

    traced = _traced(16)
    seconds = _heavy_pool(traced)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    cut = order.index("maxpool") + 1  # the pool's segment apart from the rest's
    measured = _costs(traced, [Segment(0, cut, sum(seconds[n] for n in order[:cut]), 0.0),
                               Segment(cut, len(order), sum(seconds[n] for n in order[cut:]), 0.0)], seconds)
    true = _device(monkeypatch, traced, measured, [0.5, 1.0])
    plan = measured_plan(traced, RunSetup("cpu", reps=1, warmup=1), dict(pp=2, device="cpu"), measured=measured,
                         options=MeasureOptions(rounds=0, moves=6, target=1.01))
    first = plan.refinement[0]
    kept = [e for e in plan.refinement if e.get("kept") and "move" in e]
    assert first["measured_imbalance"] > 1.15 and kept
    bounds = [e["mlp_pieces"]["maxpool"]["samples"] for e in kept]
    assert all(len(b) == 3 for b in bounds) and bounds[0] != first["mlp_pieces"]["maxpool"]["samples"]
    assert plan.mlp_pieces["maxpool"]["samples"] == bounds[-1]
    truth = true(plan)
    assert max(truth) / (sum(truth) / 2) < 1.06
    assert max(abs(s.compute_time - t) / t for s, t in zip(plan.stages, truth)) < 0.05
    x = batch(5, 16)[0]
    assert torch.equal(run_chain(list(emit_stages(traced, plan).values()), x)[0], traced.gm(x)[0])


def test_stage_starts_are_found_in_the_pool_cut_finer_and_back():
    """A start at a piece is the piece of the other graph with the same first sample, a start at
    the concatenation is the concatenation (or the node after a whole pool), other nodes keep
    their names, and a start at a split's part has no counterpart."""
    from autopipe.stages.finer_pieces import finer, translate

    traced = _traced(16)
    original = {n.name for n in traced.gm.graph.nodes}
    coarse = {"maxpool": {"samples": [0, 6, 16]}}
    fine = finer(coarse)
    assert fine["maxpool"]["samples"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    a, b = cut_mlps(traced, coarse).gm, cut_mlps(traced, fine).gm
    piece = {n.meta[PIECE][1]: n.name for n in a.graph.nodes if PIECE in n.meta}
    fine_piece = {n.meta[PIECE][1]: n.name for n in b.graph.nodes if PIECE in n.meta}
    join = next(n.name for n in a.graph.nodes if n.meta.get(JOIN))
    after = [n.name for n in traced.gm.graph.nodes][[n.name for n in traced.gm.graph.nodes].index("maxpool") + 1]
    assert translate(["x", piece[1], "layer2_0_conv1"], a, coarse, b, fine, original) == ["x", fine_piece[6],
                                                                                       "layer2_0_conv1"]
    assert translate(["x", fine_piece[6]], b, fine, a, coarse, original) == ["x", piece[1]]
    assert translate(["x", fine_piece[0]], b, fine, traced.gm, {}, original) == ["x", "maxpool"]
    assert translate(["x", join], a, coarse, traced.gm, {}, original) == ["x", after]
    assert translate(["x", fine_piece[3]], b, fine, a, coarse, original) is None  # no piece of a starts there
    split_part = next(n.name for n in a.graph.nodes if n.op == "call_function" and "getitem" in n.name
                      and n.name not in original)
    assert translate(["x", split_part], a, coarse, b, fine, original) is None


def test_a_recut_is_timed_beside_the_plan_and_kept_only_when_faster():
    """``_recut``: the candidate is timed (paired with the current plan at the host's pace) and
    kept when its slowest stage is faster; a candidate the loop timed before is not timed again;
    the log's timings hold both plans of a paired re-cut, each with its own pieces."""
    from autopipe.measure.loop_moves import recut as _recut
    from autopipe.measure.closed_loop import timings

    traced = _traced(16)
    seconds = _heavy_pool(traced)
    current = partition(traced, 2, device="cpu", node_seconds=seconds)
    candidate = plan_stages(traced, 2, device="cpu", node_seconds=seconds)
    assert candidate.mlp_pieces and not current.mlp_pieces
    for stage, t in zip(current.stages, [3.0, 1.0]):
        stage.measured_time = t
    current.refinement = [{"round": 0, "times": [3.0, 1.0], "stage_starts": [s.nodes[0] for s in current.stages]}]
    calls = []

    def timed(plan):
        calls.append(plan)
        return [2.0, 2.1]

    kept, won = _recut(current, candidate, timed, None)
    assert won and kept is candidate and [s.measured_time for s in kept.stages] == [2.0, 2.1]
    entry = kept.refinement[-1]
    assert entry["recut"] == 1 and entry["kept"] and entry["mlp_pieces"] == candidate.mlp_pieces
    again, won = _recut(kept, candidate, timed, None)  # timed before: not again
    assert not won and again is kept and len(calls) == 1
    slower = partition(traced, 2, device="cpu", node_seconds={**seconds, "maxpool": 0.0})
    current.refinement = [dict(current.refinement[0])]
    paired = lambda a, b: ([3.3, 1.1], [3.5, 0.2])  # noqa: E731
    same, won = _recut(current, slower, timed, paired)
    assert not won and same is current and [s.measured_time for s in current.stages] == [3.3, 1.1]
    logged = timings(current.refinement)
    assert [t[0] for t in logged[1:]] == [[s.nodes[0] for s in current.stages], [s.nodes[0] for s in slower.stages]]
    assert logged[1][4] == pytest.approx(4.0 / 4.4)  # the current plan's pace, both plans' times at it


def test_boundaries_inside_a_pool_cut_finer_start_only_where_the_merged_plan_can():
    """In the graph with the pool cut finer, a stage may start at a piece, the concatenation or a
    node of the model, never at a split's part, which the merged plan does not have."""
    from autopipe.stages.finer_pieces import finer, startable

    traced = _traced(16)
    fine = finer({"maxpool": {"samples": [0, 6, 16]}})
    gm = cut_mlps(traced, fine).gm
    can = startable(gm, fine, {n.name for n in traced.gm.graph.nodes})
    pieces = {n.name for n in gm.graph.nodes if PIECE in n.meta}
    parts = {n.name for n in gm.graph.nodes if n.op == "call_function" and n.name not in pieces
             and not n.meta.get(JOIN) and n.name not in {m.name for m in traced.gm.graph.nodes}}
    assert len(pieces) == 16 and pieces <= can and parts and not parts & can
    assert next(n.name for n in gm.graph.nodes if n.meta.get(JOIN)) in can


def test_boundaries_of_a_plan_between_whole_nodes_move_into_a_pool(monkeypatch):
    """A plan cut between whole nodes, its second stage starting at the pool: the profile
    balances it (so no round cuts the pool), but the stem runs faster than profiled. The moves
    cut the pool finer anyway and shift some of its samples into the first stage, where a move
    by whole nodes would take the whole pool and overshoot."""
    from autopipe.measure import measured_plan

    traced = _traced(16)
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    pool = order.index("maxpool")
    analytic = analytic_seconds(traced, "cpu")

    def scaled(names, total):
        s = sum(analytic[n] for n in names)
        return {n: total * analytic[n] / s for n in names}

    seconds = {**scaled(order[:pool], 1.0), "maxpool": 0.2, **scaled(order[pool + 1:], 0.8)}
    measured = _costs(traced, [Segment(0, pool, 1.0, 0.0), Segment(pool, pool + 1, 0.2, 0.0),
                               Segment(pool + 1, len(order), 0.8, 0.0)], seconds)
    true = _device(monkeypatch, traced, measured, [0.7, 1.0, 1.0])
    plan = measured_plan(traced, RunSetup("cpu", reps=1, warmup=1), dict(pp=2, device="cpu"), measured=measured,
                         options=MeasureOptions(rounds=0, moves=3, target=1.01))
    first = plan.refinement[0]
    assert first["stage_starts"][1] == "maxpool" and "mlp_pieces" not in first
    kept = [e for e in plan.refinement if e.get("kept") and "move" in e]
    assert kept and "maxpool" in kept[0].get("mlp_pieces", {})
    assert list(plan.mlp_pieces) == ["maxpool"] and 0 < plan.mlp_pieces["maxpool"]["samples"][1] < 16
    assert max(true(plan)) < 0.88  # the whole pool in either stage: 0.9 or 1.0
    x = batch(5, 16)[0]
    assert torch.equal(run_chain(list(emit_stages(traced, plan).values()), x)[0], traced.gm(x)[0])


def test_a_recut_as_fast_as_the_plan_within_noise_does_not_replace_it():
    """A re-cut whose slowest stage is faster by less than RECUT_GAIN leaves the plan (and the
    moves it holds) in place; faster by more, it replaces it."""
    from autopipe.measure.loop_moves import RECUT_GAIN, recut

    traced = _traced(16)
    seconds = _heavy_pool(traced)
    candidate = plan_stages(traced, 2, device="cpu", node_seconds=seconds)
    for slower_by, won in ((0.1 * RECUT_GAIN, False), (2 * RECUT_GAIN, True)):
        current = partition(traced, 2, device="cpu", node_seconds=seconds)
        for stage, t in zip(current.stages, [3.0, 1.0]):
            stage.measured_time = t
        current.refinement = [{"round": 0, "times": [3.0, 1.0], "stage_starts": [s.nodes[0] for s in current.stages]}]
        kept, replaced = recut(current, candidate, lambda plan: [3.0 * (1 - slower_by), 2.9], None)
        assert replaced is won and (kept is candidate) is won and current.refinement[-1]["kept"] is won
