"""Pure functions from stored spans to training data (no I/O): ``triplets`` turns one rollout's spans into
per-call triplets or merged multi-turn rows."""

from admin.adapters.triplets import (
    LlmCall,
    MergedRow,
    SpanLike,
    Triplet,
    dumps,
    llm_calls,
    match_rewards,
    merged_rows,
    reward_value,
    triplets,
)

__all__ = [
    "LlmCall",
    "MergedRow",
    "SpanLike",
    "Triplet",
    "dumps",
    "llm_calls",
    "match_rewards",
    "merged_rows",
    "reward_value",
    "triplets",
]
