"""MLPs cut by hidden unit across stages: the rewrite is exact, the partitioner uses it when it
balances better, and training, full_state_dict and checkpoints keep the model's own numbers."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import autopipe
from autopipe.stages.emit import emit_stages, run_chain
from autopipe.errors import ConfigError, PartitionError
from autopipe.stages.mlp_pieces import cut_mlps
from autopipe.stages.piece_state import merge_pieces, piece_params, take_piece
from autopipe.partition.partitioner import partition
from autopipe.stages.piece_plan import SPLIT_GAIN, plan_stages
from autopipe.partition.plan import PartitionPlan
from autopipe.tracer import trace
from tests.distributed import run_distributed
from tests.models import logits, timm_vit

PIECES = {"blocks.0.mlp.fc1": {"fc2": "blocks.0.mlp.fc2", "hidden": [0, 64, 512]},
          "blocks.1.mlp.fc1": {"fc2": "blocks.1.mlp.fc2", "hidden": [0, 8, 200, 512]}}


# MLPs long enough that whole blocks balance 4 stages to 1.11 on the CPU profile: the
# partitioner cuts them (mlp_ratio 8 balances to 1.08, and cutting gains too little there).
CUT_RATIO = 16


def _model(seed: int = 0, mlp_ratio: int = 8):
    torch.manual_seed(seed)
    return timm_vit(embed_dim=64, mlp_ratio=mlp_ratio).double()


def _x(n: int = 2, seed: int = 1):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_split_mlps_gives_the_same_outputs_and_gradients():
    model = _model()
    traced = trace(model, (_x(),))
    split = cut_mlps(traced, PIECES)
    assert cut_mlps(split, PIECES) is split  # already cut this way
    names = {n.target for n in split.gm.graph.nodes if n.op == "call_module"}
    assert {"blocks.1.mlp.fc1_piece2", "blocks.1.mlp.fc2_piece2"} <= names and "blocks.0.mlp.fc1" not in names
    assert "blocks.0.mlp.fc1" in {n.target for n in traced.gm.graph.nodes if n.op == "call_module"}  # untouched

    x = _x()
    ref, out = traced.gm(x)[0], split.gm(x)[0]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    ref.square().sum().backward()
    out.square().sum().backward()
    grads = merge_pieces({k: p.grad for k, p in split.gm.named_parameters()}, PIECES)
    want = {k: p.grad for k, p in traced.gm.named_parameters()}
    assert grads.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(grads[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_piece_state_round_trips_through_the_full_names():
    full = _model().state_dict()
    keys = piece_params(PIECES)
    local = {k: take_piece(full, k, PIECES) for k in keys if k.rpartition(".")[2] == "weight" or "fc1" in k}
    local["blocks.0.mlp.fc2_piece0.bias"] = take_piece(full, "blocks.0.mlp.fc2_piece0.bias", PIECES)
    local["blocks.1.mlp.fc2_piece0.bias"] = take_piece(full, "blocks.1.mlp.fc2_piece0.bias", PIECES)
    assert local["blocks.0.mlp.fc2_piece1.weight"].shape == (64, 448)  # columns of fc2
    assert local["blocks.1.mlp.fc1_piece1.weight"].shape == (192, 64)  # rows of fc1
    merged = merge_pieces(local, PIECES)
    for k, v in merged.items():
        assert torch.equal(v, full[k]), k
    del local["blocks.1.mlp.fc1_piece1.weight"]
    with pytest.raises(autopipe.errors.CheckpointError, match="blocks.1.mlp.fc1_piece1.weight"):
        merge_pieces(local, PIECES)


def test_the_partitioner_cuts_an_mlp_when_that_balances_better():
    model = _model(mlp_ratio=CUT_RATIO)
    traced = trace(model, (_x(),))
    plain = partition(traced, 4, device="cpu")
    plan = plan_stages(traced, 4, device="cpu")
    assert plan.mlp_pieces and not plain.mlp_pieces
    assert max(s.cost for s in plan.stages) < max(s.cost for s in plain.stages) * (1 - SPLIT_GAIN)
    assert plan.imbalance < plain.imbalance
    # A boundary falls inside each kept MLP: its pieces are in different stages.
    stage_of = plan.stage_of()
    for fc1, spec in plan.mlp_pieces.items():
        fc2 = spec["fc2"].replace(".", "_")
        assert len({stage_of[f"{fc2}_piece{i}"] for i in range(len(spec["hidden"]) - 1)}) > 1
    # The chained stages are the model.
    x = _x()
    out = run_chain(list(emit_stages(traced, plan).values()), x)
    torch.testing.assert_close(out[0], traced.gm(x)[0], rtol=1e-12, atol=1e-12)
    # The plan says so in JSON and in its table.
    assert PartitionPlan.from_dict(plan.to_dict()).mlp_pieces == plan.mlp_pieces
    assert "MLP cut across stages: blocks." in str(plan)


def test_a_plan_with_mlp_pieces_is_timed_stage_by_stage():
    from autopipe.measure import RunSetup, time_plan

    traced = trace(_model(mlp_ratio=CUT_RATIO).float(), (_x().float(),))
    plan = plan_stages(traced, 4, device="cpu")
    assert plan.mlp_pieces and any(c.name.endswith(tuple(f"_piece{i}" for i in range(8)))
                                   for s in plan.stages for c in s.outputs)  # a piece's partial sum crosses
    times = time_plan(traced, plan, RunSetup("cpu", reps=1, warmup=1))
    assert len(times) == 4 and all(t > 0 for t in times)


class _Stacked(torch.nn.Module):
    """Branches of linear stacks: in Linear-GELU-Linear-Linear-GELU-Linear the middle pair
    of linears would also look like an MLP (no ops between them)."""

    def __init__(self, width: int = 64, k: int = 3):
        super().__init__()
        block = lambda out: torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),  # noqa: E731
                                                torch.nn.Linear(width, out))
        self.a = torch.nn.ModuleList(block(width) for _ in range(k))
        self.b = torch.nn.ModuleList(block(10) for _ in range(k))

    def forward(self, x):
        return sum(b(a(x)) for a, b in zip(self.a, self.b))


def test_mlps_sharing_a_linear_are_cut_once(recwarn):
    from autopipe.stages.mlp_pieces import find_mlps

    torch.manual_seed(0)
    model = _Stacked().double()
    x = torch.randn(2, 64, dtype=torch.float64)
    traced = trace(model, (x,))
    found = [(m.fc1.target, m.fc2.target) for m in find_mlps(traced.gm)]
    assert sorted(found) == sorted((f"{s}.{i}.0", f"{s}.{i}.2") for i in range(3) for s in "ab")
    # Cut into many stages, the pieces' plan balances better than whole MLPs, and runs the model.
    plain = partition(traced, 6, device="cpu")
    plan = plan_stages(traced, 3, chunks=2, device="cpu")
    assert plan.num_stages == 6 and plan.imbalance <= plain.imbalance
    out = run_chain(list(emit_stages(traced, plan).values()), x)
    torch.testing.assert_close(out, traced.gm(x), rtol=1e-12, atol=1e-12)
    assert not [w for w in recwarn if "erase_node" in str(w.message)]


def test_bad_pieces_are_refused():
    traced = trace(_model(), (_x(),))
    with pytest.raises(PartitionError, match="'blocks.0.attn.qkv'"):
        cut_mlps(traced, {"blocks.0.attn.qkv": {"fc2": "blocks.0.attn.proj", "hidden": [0, 8, 192]}})
    with pytest.raises(PartitionError, match="hidden boundaries"):
        cut_mlps(traced, {"blocks.0.mlp.fc1": {"fc2": "blocks.0.mlp.fc2", "hidden": [0, 600, 512]}})
    with pytest.raises(ConfigError, match="before any MLP pieces"):
        plan_stages(cut_mlps(traced, PIECES), 2)


# ----------------------------------------------------------------------------- on 4 processes
def _loss(out, y):
    return F.cross_entropy(logits(out), y)


def _data(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g)


def _pm(seed: int, split: bool):
    pm = autopipe.parallelize(_model(seed, CUT_RATIO).eval(), (_x(2),), pp=4, microbatches=4, loss_fn=_loss,
                              split_mlps=split).eval()
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.1)


def _step(pm, opt, step):
    x, y = _data(step)
    opt.zero_grad()
    loss = pm.train_step(x, y)
    pm.step(opt)
    return float(loss)


def _train_and_checkpoint(rank, world, root):
    # The single-process reference.
    ref = _model(0, CUT_RATIO).eval()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    ref_losses = []
    for step in range(3):
        x, y = _data(step)
        ref_opt.zero_grad()
        loss = _loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    pm, opt = _pm(0, split=True)
    pieces = pm.plan.mlp_pieces
    names = [n for n, _ in pm.named_parameters()]
    losses = [_step(pm, opt, step) for step in range(2)]
    split_dir = os.path.join(root, "split")
    pm.save_checkpoint(split_dir, opt)
    saved = pm.full_state_dict()
    losses.append(_step(pm, opt, 2))
    final = pm.full_state_dict()

    # The pieces load into a layout without them, optimizer state included...
    plain, plain_opt = _pm(1, split=False)
    plain.load_checkpoint(split_dir, plain_opt)
    plain_saved = plain.full_state_dict()
    plain_loss = _step(plain, plain_opt, 2)
    plain_final = plain.full_state_dict()
    # ...and a checkpoint without pieces into one with them.
    plain_dir = os.path.join(root, "plain")
    plain.save_checkpoint(plain_dir, plain_opt)
    again, again_opt = _pm(2, split=True)
    again.load_checkpoint(plain_dir, again_opt)
    return dict(pieces=pieces, names=names, losses=losses, ref_losses=ref_losses, ref=ref.state_dict(),
                saved=saved, final=final, plain_saved=plain_saved, plain_loss=plain_loss,
                plain_final=plain_final, plain_pieces=plain.plan.mlp_pieces, again=again.full_state_dict())


def test_training_with_mlp_pieces_equals_one_process_and_checkpoints_cross_layouts(tmp_path):
    results = run_distributed(_train_and_checkpoint, 4, str(tmp_path), timeout=400)
    r0 = results[0]
    assert r0["pieces"] and not r0["plain_pieces"]
    assert any("_piece" in n for r in results for n in r["names"])
    for r in results:
        assert r["losses"] == pytest.approx(r0["ref_losses"], rel=1e-6)  # losses come back in fp32
        for k, v in r0["ref"].items():
            torch.testing.assert_close(r["final"][k], v, rtol=1e-9, atol=1e-12, msg=k)
            assert torch.equal(r["plain_saved"][k], r0["saved"][k]), k
            torch.testing.assert_close(r["plain_final"][k], v, rtol=1e-9, atol=1e-12, msg=k)
            assert torch.equal(r["again"][k], r["plain_final"][k]), k
        assert r["plain_loss"] == pytest.approx(r0["ref_losses"][2], rel=1e-6)


def test_boundary_moves_keep_a_plan_in_mlp_pieces(monkeypatch):
    """A plan cut inside MLPs is moved in the graph cut into its pieces: the pieces stay as they
    are, the boundaries move, the slowest stage gets faster, and the moved plan is the model."""
    import autopipe.measure as measure
    from autopipe.measure import MeasureOptions, RunSetup, measured_plan
    from autopipe.partition.measured import MeasuredCosts, Segment, fingerprint
    from autopipe.partition.partitioner import analytic_seconds
    from autopipe.stages.mlp_pieces import JOIN, PIECE_OF

    traced = trace(_model(mlp_ratio=CUT_RATIO), (_x(),))
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    base = {k: v for k, v in analytic_seconds(traced, "cpu").items() if k != "output"}
    setup = RunSetup("cpu", reps=1, warmup=1)
    measured = MeasuredCosts(fingerprint(traced.gm), [list(s) for s in traced.input_shapes], "float32", "eager",
                             "cpu", torch.__version__, [Segment(0, len(order), sum(base.values()), 0.0)], base)
    weight = {n: 1.0 + 1.5 * k / len(order) for k, n in enumerate(order)}  # later nodes slower than profiled

    def true(plan):
        share = {n.name: n.meta.get(PIECE_OF, (n.name, 0.0 if n.meta.get(JOIN) else 1.0))
                 for n in (cut_mlps(traced, plan.mlp_pieces) if plan.mlp_pieces else traced).gm.graph.nodes}
        return [sum(share[n][1] * base.get(share[n][0], 0.0) * weight.get(share[n][0], 1.0) for n in s.nodes)
                for s in plan.stages]

    def fake_time_plan(traced_, plan, setup_, group=None, stages=None):
        times = true(plan)
        return times if stages is None else [times[i] for i in stages]

    monkeypatch.setattr(measure, "time_plan", fake_time_plan)
    monkeypatch.setattr(measure, "_time_both", lambda traced_, p, q, setup_, scale: (true(p), true(q)))
    first = measured_plan(traced, setup, dict(pp=4, device="cpu"), measured=measured, options=MeasureOptions(moves=0))
    plan = measured_plan(traced, setup, dict(pp=4, device="cpu"), measured=measured,
                         options=MeasureOptions(rounds=0, moves=8, target=1.0))
    assert first.mlp_pieces and plan.mlp_pieces == first.mlp_pieces
    assert any(r.get("kept") for r in plan.refinement if "move" in r)
    assert max(true(plan)) < max(true(first)) * 0.97
    assert [s.measured_time for s in plan.stages] == pytest.approx(true(plan))
    x = _x()
    out = run_chain(list(emit_stages(traced, plan).values()), x)
    torch.testing.assert_close(out[0], traced.gm(x)[0], rtol=1e-12, atol=1e-12)


def _ratio(times):
    return max(times) / (sum(times) / len(times))


def test_the_loop_keeps_the_faster_of_plans_cut_into_different_pieces():
    """Pieces add work, so the round of least max/mean need not be the fastest: where the two
    rounds are cut into different pieces, the judge times both and the faster is kept."""
    from autopipe.measure.closed_loop import refine

    traced = trace(_model(mlp_ratio=CUT_RATIO), (_x(),))
    pieces, plain = plan_stages(traced, 4, device="cpu"), partition(traced, 4, device="cpu")

    def device(plan):  # the pieces run 40% over their price, in every stage
        return [(1.4 if plan.mlp_pieces else 1.0) * s.compute_time for s in plan.stages]

    assert _ratio(device(pieces)) < _ratio(device(plain)) and max(device(pieces)) > max(device(plain))
    judged = []

    def judge(a, b):
        judged.append((a, b))
        return a if max(device(a)) <= max(device(b)) else b

    kwargs = dict(groups=1, planned=lambda p: [{0: s.compute_time} for s in p.stages], measure=device,
                  replan=lambda factors: plain, target=1.0, rounds=1)
    assert refine(pieces, **kwargs) is pieces  # without a judge: the least max/mean
    kept = refine(pieces, judge=judge, **kwargs)
    assert kept is plain and judged == [(pieces, plain)] and "judged" in kept.refinement[-1]
    # Plans cut into the same pieces are not judged: their max/mean decides, as before.
    judged.clear()
    assert refine(pieces, **dict(kwargs, replan=lambda factors: pieces), judge=judge) is pieces and not judged


def test_measured_plans_keep_the_faster_of_plans_cut_into_different_pieces(monkeypatch):
    """Through measured_plan: the first plan is cut inside MLPs, the re-cut between nodes, and
    on a device where pieces run 40% over their price the plan between nodes is kept, judged
    in one paired timing."""
    import autopipe.measure as measure
    from autopipe.measure import MeasureOptions, RunSetup, measured_plan
    from autopipe.partition.measured import MeasuredCosts, Segment, fingerprint
    from autopipe.partition.partitioner import analytic_seconds

    traced = trace(_model(mlp_ratio=CUT_RATIO), (_x(),))
    order = [n.name for n in traced.gm.graph.nodes if n.op != "output"]
    base = {k: v for k, v in analytic_seconds(traced, "cpu").items() if k != "output"}
    measured = MeasuredCosts(fingerprint(traced.gm), [list(s) for s in traced.input_shapes], "float32", "eager",
                             "cpu", torch.__version__, [Segment(0, len(order), sum(base.values()), 0.0)], base)
    calls = []

    def cut(traced_, **kwargs):  # the first plan in pieces, the re-cuts between nodes
        calls.append(1)
        return plan_stages(traced_, **dict(kwargs, split_mlps=len(calls) == 1))

    def device(plan):
        return [(1.4 if plan.mlp_pieces else 1.0) * s.compute_time for s in plan.stages]

    paired = []
    monkeypatch.setattr(measure, "plan_stages", cut)
    monkeypatch.setattr(measure, "time_plan", lambda t, plan, s, group=None, stages=None: device(plan))
    monkeypatch.setattr(measure, "_time_both", lambda t, p, q, s, scale: paired.append(1) or (device(p), device(q)))
    plan = measured_plan(traced, RunSetup("cpu", reps=1, warmup=1), dict(pp=4, device="cpu"), measured=measured,
                         options=MeasureOptions(rounds=1, moves=0, target=1.0))
    rounds = [r for r in plan.refinement if "round" in r]
    assert len(rounds) == 2 and rounds[0]["measured_imbalance"] < rounds[1]["measured_imbalance"]
    assert not plan.mlp_pieces and paired == [1] and any("judged" in r for r in plan.refinement)
    assert [s.measured_time for s in plan.stages] == pytest.approx(device(plan))
