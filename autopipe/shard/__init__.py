"""Megatron-style 1-D tensor parallelism as a graph rewrite: plan (pure data), then apply per rank."""
from .collectives import register_group
from .plan import ShardPlan, collective_bytes
from .planner import plan_sharding
from .rewrite import apply_sharding
from .rng import manual_seed_tp
from .rules import ShardRule, column_parallel_head, register_rule, unregister_rule
from .state import gather_full_state_dict, shard_state_dict

__all__ = [
    "ShardRule",
    "register_rule",
    "unregister_rule",
    "column_parallel_head",
    "ShardPlan",
    "plan_sharding",
    "apply_sharding",
    "collective_bytes",
    "gather_full_state_dict",
    "shard_state_dict",
    "register_group",
    "manual_seed_tp",
]
