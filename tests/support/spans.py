"""Spans shaped like the gateway's records of LLM calls and rewards, for the triplet and export tests."""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from rollway.admin.adapters import dumps
from rollway.store import Span

_ids = itertools.count(1)

A1, A2 = "at-1", "at-2"


def call(
    seq: int,
    prompt: list[int],
    response: list[int],
    *,
    attempt: str = A1,
    logprobs: list[float] | None = None,
    operation: str = "chat",
    trainable: bool = True,
    messages: list[dict[str, Any]] | None = None,
) -> Span:
    """A span shaped like the gateway's record of one LLM call."""
    n = next(_ids)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "token_ids": response}
    if operation == "chat":
        choice["message"] = {"role": "assistant", "content": f"answer {n}"}
    else:
        choice["text"] = f"answer {n}"
    return Span(
        rollout_id="ro-1",
        attempt_id=attempt,
        sequence_id=seq,
        trace_id=f"{n:032x}",
        span_id=f"{n:016x}",
        name=f"{operation} policy",
        attributes={
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": "policy",
            "gen_ai.response.finish_reasons": ["stop"],
            "rollway.request": {"model": "policy", "messages": messages or [{"role": "user", "content": "hi"}]}
            if operation == "chat"
            else {"model": "policy", "prompt": "hi"},
            "rollway.response": {"id": f"cmpl-{n}", "choices": [choice]},
            "rollway.prompt_token_ids": prompt,
            "rollway.response_token_ids": response,
            "rollway.response_logprobs": [-0.5] * len(response) if logprobs is None else logprobs,
            "rollway.model_version": "v7",
            "rollway.trainable": trainable,
        },
    )


def reward(seq: int, value: float | None, *, attempt: str = A1, name: str = "primary") -> Span:
    n = next(_ids)
    return Span(
        rollout_id="ro-1",
        attempt_id=attempt,
        sequence_id=seq,
        trace_id=f"{n:032x}",
        span_id=f"{n:016x}",
        name="rollway.reward",
        attributes={"rollway.reward.name": name, "rollway.reward.value": value},
    )


def other(seq: int, name: str, attributes: dict[str, Any], *, attempt: str = A1) -> Span:
    n = next(_ids)
    return Span(
        rollout_id="ro-1",
        attempt_id=attempt,
        sequence_id=seq,
        trace_id=f"{n:032x}",
        span_id=f"{n:016x}",
        name=name,
        attributes=attributes,
    )


def plain(rows: list[Any]) -> list[Any]:
    """Rows as a client reads them (the adapter's arrays are undecoded JSON text)."""
    return [orjson.loads(dumps(row)) for row in rows]


def conversation(rollout_id: str, attempt_id: str, turns: int = 2, *, tag: int = 0) -> list[Span]:
    """LLM-call spans of a multi-turn conversation whose prompts extend each other."""
    spans, prompt = [], [100 + tag, 101]
    for turn in range(turns):
        response = [200 + 10 * turn + tag, 201 + 10 * turn]
        span = call(turn + 1, prompt, response, attempt=attempt_id)
        spans.append(span.model_copy(update={"rollout_id": rollout_id, "sequence_id": None}))
        prompt = [*prompt, *response, 300 + turn]
    return spans
