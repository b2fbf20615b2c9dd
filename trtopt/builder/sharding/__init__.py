"""Tensor-parallel sharding of a fused paged plan (docs/architecture.md §7b): ``analysis`` finds and rewrites the
rank graph (which projections split which way, and why the others stay whole); ``writer`` writes the rank plan
dirs."""

from trtopt.builder.sharding.analysis import (
    LM_HEAD_MODES,
    SHARD_SUFFIX,
    AttentionShard,
    Join,
    LmHeadSplit,
    MlpShard,
    ParallelLayout,
    ReplicatedProjection,
    ShardResult,
    WeightSplit,
    join_fused,
    lm_head_reason,
    rank_weights,
    shard_structure,
    unsharded_reasons,
)
from trtopt.builder.sharding.writer import parallel_config, write_rank_plans

__all__ = [
    "LM_HEAD_MODES",
    "SHARD_SUFFIX",
    "AttentionShard",
    "Join",
    "LmHeadSplit",
    "MlpShard",
    "ParallelLayout",
    "ReplicatedProjection",
    "ShardResult",
    "WeightSplit",
    "join_fused",
    "lm_head_reason",
    "parallel_config",
    "rank_weights",
    "shard_structure",
    "unsharded_reasons",
    "write_rank_plans",
]
