"""From a plan to stage modules: the graph rewrites a plan names (MLP pieces, the eval-mode
graph's cuts, other micro-batch sizes), stage emission, and the map from stage state to the
model's. See docs/architecture.md."""
from .emit import emit_stage, emit_stages, run_chain, share_state
from .mlp_pieces import cut_mlps
from .mode_plan import follow_plan
from .piece_plan import plan_stages

__all__ = ["plan_stages", "emit_stage", "emit_stages", "run_chain", "share_state", "cut_mlps", "follow_plan"]
