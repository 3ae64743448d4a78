import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import PartitionError
from autopipe.partition.balance import solve
from autopipe.partition.dag import Crossing, linearize, stage_io


@st.composite
def dags(draw, max_nodes=24):
    """A chain with skip edges of random length, fan-out, side branches and several sinks."""
    n = draw(st.integers(1, max_nodes))
    # One seed instead of a draw per node and edge keeps generation quick.
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    names = [f"v{i}" for i in rng.permutation(n)]  # name order != position order
    graph = nx.DiGraph()
    for name in names:
        graph.add_node(
            name,
            cost=float(rng.uniform(0, 10)),
            out_bytes=int(rng.integers(0, 1000)),
            mem=float(rng.uniform(0, 10)),
            params=int(rng.integers(0, 100)),
        )
    for i in range(1, n):
        # Mostly the chain; sometimes a branch off an earlier node, or a fresh source.
        kind = rng.choice(["chain"] * 4 + ["branch", "source"])
        if kind == "chain":
            graph.add_edge(names[i - 1], names[i])
        elif kind == "branch":
            graph.add_edge(names[rng.integers(0, i)], names[i])
        for _ in range(rng.integers(0, 3)):  # skips (residuals) of any length
            graph.add_edge(names[rng.integers(0, i)], names[i])
    # Any topological order, not only the one the names were built in.
    priority = {v: int(rng.integers(0, 4)) for v in names}
    order = list(nx.lexicographical_topological_sort(graph, key=priority.__getitem__))
    return graph, order


@st.composite
def splits(draw):
    graph, order = draw(dags())
    n = len(order)
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set()
    return graph, order, [0, *sorted(cuts)]


def crosses(graph, position, name, k):
    return position[name] <= k and any(position[c] > k for c in graph.successors(name))


@settings(max_examples=200, deadline=None)
@given(dags())
def test_crossing_sets_are_complete_and_minimal(case):
    graph, order = case
    dag = linearize(graph, order)
    position = {v: p for p, v in enumerate(order)}
    assert len(dag.crossing) == len(order) - 1 == len(dag.cut_bytes)
    for k in range(len(order) - 1):
        want = tuple(v for v in order if crosses(graph, position, v, k))
        assert dag.crossing[k] == want
        assert dag.cut_bytes[k] == sum(graph.nodes[v]["out_bytes"] for v in want)
    assert list(dag.crossing) == [dag.crossing[k] for k in range(len(order) - 1)]


@settings(max_examples=200, deadline=None)
@given(dags())
def test_arrays_follow_the_order(case):
    graph, order = case
    dag = linearize(graph, order)
    assert dag.order == tuple(order) and len(dag) == len(order)
    for p, v in enumerate(order):
        assert dag.index[v] == p
        assert dag.cost[p] == graph.nodes[v]["cost"]
        assert dag.mem[p] == graph.nodes[v]["mem"]
        assert dag.params[p] == graph.nodes[v]["params"]
        readers = [dag.index[c] for c in graph.successors(v)]
        assert dag.last_use[p] == max(readers, default=p)


@settings(max_examples=200, deadline=None)
@given(splits())
def test_stage_io(case):
    graph, order, starts = case
    dag = linearize(graph, order)
    stages = stage_io(dag, starts)
    stage_of = {v: s for s, io in enumerate(stages) for v in io.nodes}
    # Every node in exactly one stage, in order.
    assert [v for io in stages for v in io.nodes] == order
    for u, v in graph.edges:
        # No edge runs backwards, and a value read s stages later travels through each cut.
        assert stage_of[u] <= stage_of[v]
        for s in range(stage_of[u], stage_of[v]):
            assert u in stages[s].outputs and u in stages[s + 1].inputs
    for s, io in enumerate(stages):
        assert io.inputs == (dag.crossing[io.start - 1] if s > 0 else ())
        assert io.outputs == (dag.crossing[io.stop - 1] if s < len(stages) - 1 else ())
        if s + 1 < len(stages):
            assert io.outputs == stages[s + 1].inputs and io.out_bytes == stages[s + 1].in_bytes
        # Minimal: whatever comes in was made earlier and is read here or later.
        for v in io.inputs:
            assert stage_of[v] < s
            assert any(stage_of[c] >= s for c in graph.successors(v))


def residual_block():
    #   x -> norm -> attn -> add(x, attn) -> mlp -> add2(add, mlp) -> head
    #   x -> mask ----------^ (a second input read by attn only)
    graph = nx.DiGraph()
    sizes = dict(x=100, mask=10, norm=100, attn=100, add=100, mlp=100, add2=100, head=5)
    for name, size in sizes.items():
        graph.add_node(name, cost=1.0, out_bytes=size, mem=2.0, params=3)
    graph.add_edges_from(
        [("x", "norm"), ("x", "mask"), ("norm", "attn"), ("mask", "attn"), ("x", "add"),
         ("attn", "add"), ("add", "mlp"), ("add", "add2"), ("mlp", "add2"), ("add2", "head")]
    )
    return graph, list(sizes)


def test_residual_block_by_hand():
    graph, order = residual_block()
    dag = linearize(graph, order)
    assert dag.crossing[:] == [
        ("x",),  # after x
        ("x", "mask"),  # after mask
        ("x", "mask", "norm"),  # after norm
        ("x", "attn"),  # after attn: the residual x is still live
        ("add",),  # after add
        ("add", "mlp"),  # after mlp
        ("add2",),  # after add2
    ]
    assert dag.cut_bytes.tolist() == [100, 110, 210, 200, 100, 200, 100]
    first, second, third = stage_io(dag, [0, 2, 6])
    assert (first.nodes, first.inputs, first.outputs) == (("x", "mask"), (), ("x", "mask"))
    assert (second.inputs, second.outputs, second.in_bytes, second.out_bytes) == (
        ("x", "mask"), ("add", "mlp"), 110, 200)
    assert (third.nodes, third.outputs, third.out_bytes) == (("add2", "head"), (), 0)


def test_a_value_read_two_stages_later_passes_through():
    graph = nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")])
    dag = linearize(graph, ["a", "b", "c"])
    _, middle, _ = stage_io(dag, [0, 1, 2])
    assert middle.inputs == ("a",) and middle.outputs == ("a", "b")


def test_crossing_indexing():
    graph, order = residual_block()
    crossing = linearize(graph, order).crossing
    assert isinstance(crossing, Crossing) and len(crossing) == 7
    assert crossing[-1] == crossing[6] == ("add2",)
    assert crossing[1:3] == [crossing[1], crossing[2]]
    with pytest.raises(IndexError, match="cut 7 out of range: 8 nodes have cuts 0..6"):
        crossing[7]
    with pytest.raises(IndexError):
        crossing[-8]


def test_missing_attributes_count_as_zero_and_arrays_are_frozen():
    dag = linearize(nx.DiGraph([("a", "b")]), ["a", "b"])
    assert dag.cost.tolist() == [0.0, 0.0] and dag.cut_bytes.tolist() == [0]
    with pytest.raises(ValueError):
        dag.cost[0] = 1.0
    single = linearize(_one_node(), ["a"])
    assert len(single.crossing) == 0 and single.cut_bytes.shape == (0,)
    assert [io.nodes for io in stage_io(single, [0])] == [("a",)]


def _one_node():
    graph = nx.DiGraph()
    graph.add_node("a", cost=1.0)
    return graph


def test_order_that_is_not_topological_names_the_edge():
    graph, order = residual_block()
    order[2], order[3] = order[3], order[2]  # attn before norm
    with pytest.raises(PartitionError, match="'norm' -> 'attn' goes from position 3 back to 2"):
        linearize(graph, order)


def test_order_problems_are_gathered():
    graph, order = residual_block()
    bad = ["x", "x", "ghost", *order[1:-1]]  # repeated x, unknown ghost, no head
    with pytest.raises(PartitionError) as caught:
        linearize(graph, bad)
    message = str(caught.value)
    assert "repeated: 'x' at positions 0 and 1" in message
    assert "not in the graph: 'ghost'" in message
    assert "missing from the order: 'head'" in message
    chain = nx.path_graph(12, create_using=nx.DiGraph)
    with pytest.raises(PartitionError, match=r"\.\.\. and 6 more edges going backwards"):
        linearize(nx.relabel_nodes(chain, str), [str(i) for i in reversed(range(12))])


def test_stage_io_rejects_bad_bounds():
    graph, order = residual_block()
    dag = linearize(graph, order)
    with pytest.raises(PartitionError, match="must start at 0"):
        stage_io(dag, [1, 4])
    with pytest.raises(PartitionError, match="empty stage"):
        stage_io(dag, [0, 4, 4])
    with pytest.raises(PartitionError, match="past the last node 7"):
        stage_io(dag, [0, 8])


def test_wide_graph_and_balanced_split():
    # One input read by every node (an attention mask) crosses all 2999 cuts: the sets add
    # up to ~n^2/2 names if built eagerly; here they come one cut at a time.
    n = 3000
    names = [f"n{i}" for i in range(n)]
    graph = nx.DiGraph()
    for i, name in enumerate(names):
        graph.add_node(name, cost=1.0 + (i % 7), out_bytes=8, mem=1.0, params=i)
    graph.add_edges_from(zip(names, names[1:]))
    graph.add_edges_from(("n0", v) for v in names[2:])
    dag = linearize(graph, names)
    assert (dag.cut_bytes[1:] == 16).all() and dag.cut_bytes[0] == 8
    assert dag.crossing[1500] == ("n0", "n1500")
    starts = solve(dag.cost, 16, cut_cost=dag.cut_bytes * 1e-3)
    stages = stage_io(dag, starts)
    assert [io.inputs[0] for io in stages[1:]] == ["n0"] * 15
    assert sum(len(io.nodes) for io in stages) == n
    assert np.isclose(sum(dag.cost), sum(sum(dag.cost[io.start:io.stop]) for io in stages))
