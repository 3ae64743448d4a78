"""A plan's poolings cut by sample, cut finer: the graph a closed loop moves boundaries in.

[Note: finer pieces]
A plan names its pieces merged to one per stage (``coarse_pieces``), so a boundary inside a
pooling cut by sample ([Note: sample pieces]) sits between two pieces, each most of the
pooling; moved by whole nodes it jumps by a piece. On an H200 under CUDA graphs, ResNet-50 at
128 images in 8 stages, the closed loop stopped at 1.063 with its second stage, 48 of the
max-pool's 128 samples and layer1.0, 0.2 ms over the first, 80 samples and the stem
(benchmarks/results/2026-11-28-h200-measured-balance-recut-resnet50-graphs-128.json): only a
few samples had to move, and no move could give them.
So boundaries move in the graph whose poolings are cut into ``FINER`` pieces (the plan's own
bounds among them, so that the plan is a plan of that graph): a move shifts a boundary by
1/``FINER`` of the micro-batch. Each moved plan is merged back to one piece per stage, the
plan that runs and is timed; MLPs cut by hidden unit stay as the plan cut them. A stage start
in one graph is found in the other by what it is: a pooling's piece by its first sample (and
a pooling not cut there by the pooling node itself), the concatenation by the pooling's last
sample, any other node by its name.
A plan cut between whole nodes moves the same way: its poolings that could be cut by sample
(``whole_pools``) are cut finer too, so a boundary at a pooling's start or end can move by a
few samples into it. The profile may price a pooling's pieces as not worth their split and
concatenation when the stages are timed as balanced enough, and still the timed stages are not:
on an H200 under CUDA graphs, ResNet-50 at 128 images in 8 stages, the first plan started its
second stage at the stem's max-pool and no round cut it, so the moves stopped at 1.060 over a
first stage of 2.76 ms against a mean of 3.53 (benchmarks/results/2026-11-30-h200-measured-
balance-resnet50-graphs-128-measured.json).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch.fx as fx

from .mlp_pieces import find_mlps
from .piece_meta import JOIN, PIECE, SAMPLES
from .piece_state import normalise
from .sample_pieces import find_pools

__all__ = ["FINER", "finer", "sample_pieces_only", "startable", "translate", "whole_pools"]

FINER = 16  # pieces a pooling cut by sample is cut into while its boundaries move


def finer(pieces: Mapping[str, Any], parts: int = FINER) -> dict[str, dict[str, Any]]:
    """``pieces`` with each pooling cut by sample cut into about ``parts`` pieces more evenly,
    its own bounds kept; other pieces as they are."""
    out = {}
    for key, spec in normalise(pieces).items():
        if SAMPLES in spec:
            bounds, n = spec[SAMPLES], spec[SAMPLES][-1]
            grid = {round(i * n / parts) for i in range(parts + 1)}
            out[key] = {SAMPLES: sorted(grid | set(bounds))}
        else:
            out[key] = spec
    return out


def whole_pools(gm: fx.GraphModule, pieces: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The poolings of ``gm`` (the graph before any cut) that could be cut by sample and are not
    cut at ``pieces``, nor inside a convolution's run cut there, each as one piece."""
    cut = normalise(pieces)
    inside = {n.name for m in find_mlps(gm) if m.key in cut for n in m.nodes}
    return {p.key: p.spec([0, p.hidden(gm)]) for p in find_pools(gm) if p.key not in cut and p.node.name not in inside}


def sample_pieces_only(pieces: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The poolings cut by sample among ``pieces``."""
    return {k: v for k, v in normalise(pieces).items() if SAMPLES in v}


def _landmarks(gm: fx.GraphModule, pieces: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """Node name -> (pooling, sample) for the pieces of each pooling cut by sample (their first
    sample) and their concatenation (the pooling's last sample)."""
    specs = normalise(pieces)
    out = {}
    for n in gm.graph.nodes:
        if PIECE in n.meta and SAMPLES in specs.get(n.meta[PIECE][0], {}):
            key, i = n.meta[PIECE]
            out[n.name] = (key, specs[key][SAMPLES][i])
        elif n.meta.get(JOIN) and n.args and isinstance(n.args[0], (list, tuple)) and n.args[0] \
                and PIECE in getattr(n.args[0][0], "meta", {}):
            key = n.args[0][0].meta[PIECE][0]
            if SAMPLES in specs.get(key, {}):
                out[n.name] = (key, specs[key][SAMPLES][-1])
    return out


def startable(gm: fx.GraphModule, pieces: Mapping[str, Any], original: set[str]) -> set[str]:
    """The nodes of ``gm`` (cut at ``pieces``) a stage may start at and be found in another graph
    by ``translate``: a pooling's pieces and concatenation, and the nodes of the graph before
    any cut (``original``)."""
    return set(_landmarks(gm, pieces)) | {n.name for n in gm.graph.nodes if n.name in original}


def _last(pieces: Mapping[str, Any], key: str) -> int:
    return int(normalise(pieces)[key][SAMPLES][-1])


def translate(names: Sequence[str], source: fx.GraphModule, source_pieces: Mapping[str, Any],
              target: fx.GraphModule, target_pieces: Mapping[str, Any], original: set[str]) -> list[str] | None:
    """Stage starts ``names`` of a plan of ``source`` (the graph cut at ``source_pieces``) as
    node names of ``target`` (cut at ``target_pieces``); see [Note: finer pieces]. ``original``:
    the node names of the graph before any cut. None where a start has no counterpart (a
    split's part, say)."""
    mine = _landmarks(source, source_pieces)
    theirs = {place: name for name, place in _landmarks(target, target_pieces).items()}
    cut = normalise(target_pieces)
    order = [n.name for n in target.graph.nodes]
    out = []
    for name in names:
        if name in mine:
            key, sample = mine[name]
            found = theirs.get((key, sample))
            if found is None and key not in cut and key in order and sample in (0, _last(source_pieces, key)):
                # The pooling is whole there: a start at its first sample is the pooling, at its
                # end the node after it.
                found = order[order.index(key) + (sample > 0)]
            if found is None:
                return None
            out.append(found)
        elif name in original and name in order:
            out.append(name)
        elif name in cut and (name, 0) in theirs:  # a whole pooling there, cut here: its first piece
            out.append(theirs[(name, 0)])
        else:
            return None
    return out
