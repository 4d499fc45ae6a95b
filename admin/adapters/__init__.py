"""Pure functions from stored spans to training data (no I/O): ``calls`` finds one rollout's LLM calls,
``triplets`` turns them into per-call triplets, ``merged`` chains them into multi-turn rows, ``trainers`` cuts
SLIME samples and verl rows from those."""

from rollway.admin.adapters.calls import LlmCall, SpanLike, llm_calls
from rollway.admin.adapters.merged import MergedRow, merged_rows
from rollway.admin.adapters.triplets import Triplet, dumps, match_rewards, reward_value, triplets

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
