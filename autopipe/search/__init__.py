"""Automatic layouts: which pp x tp x dp, micro-batches, chunks, schedule, checkpointing and
execution mode to run a model in, chosen from the cost model (or a measured profile), the
schedules replayed in time and a link model. See [Note: layout search] (search.py),
[Note: step prediction] (predict.py), [Note: timed replay] (replay.py), [Note: link model]
(links.py) and [Note: costs at another batch] (costs.py).
"""
from __future__ import annotations

from .layouts import Layout
from .links import LinkModel, measure_links
from .plan import plan_layout
from .predict import Prediction, Pricing
from .replay import Replay, replay
from .search import Rejected, SearchResult, search_layouts

__all__ = ["Layout", "LinkModel", "measure_links", "plan_layout", "Prediction", "Pricing", "Replay", "replay",
           "Rejected", "SearchResult", "search_layouts"]
