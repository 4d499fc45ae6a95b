"""A GRPO group's members asking one question through dspy's ``LM`` (the real library, through LiteLLM), each
member with its own rollout key, as a runner of dspy agents asks it. dspy's cache key ignores the address and the
key, so with the cache on (dspy's default) only the first member's call reaches the gateway."""

from __future__ import annotations

import dspy  # type: ignore[import-untyped]  # dspy ships no type information

QUESTION = "What is 2 + 2?"


def ask_all(url: str, keys: list[str], cache: bool) -> list[str]:
    """Each member's call through dspy, in turn, against the gateway's ``/v1`` at ``url``."""
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=True)  # a fresh cache, in memory only
    answers = []
    for key in keys:
        lm = dspy.LM("openai/policy", api_base=url, api_key=key, cache=cache, max_tokens=8, num_retries=0)
        answers.append(lm(QUESTION)[0])  # a plain prompt: the user message
    return answers
