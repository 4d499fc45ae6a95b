"""Logprobs for the output tokens an engine gave ids for but no logprobs.

vLLM's Responses API gives no logprob for the tokens of a function call, and its stream leaves out the logprob of
any token that adds no text; the ids are all there. PPO and GRPO need the old policy's logprob of every output
token, so such a span is not a full training sample. ``Scorer.fill`` has the same engine score the output: one
``/v1/completions`` call whose prompt is the prompt's ids followed by the output's, with ``prompt_logprobs: 0``
and one token to generate. vLLM returns the logprob of each prompt token given the ones before it, computed from
the raw logits as its sampled logprobs are (``--logprobs-mode`` left at ``raw_logprobs``), so the last
``len(output)`` of them are the output's logprobs under the weights that produced it: the alias's lease is still
held, so no weight update runs between the call and its scoring. The span then says
``rollway.logprobs_source: "scored"`` (``"sampled"`` when the engine gave them all).

An SGLang backend (its streamed chat leaves out the logprob of a token without text too) is asked for an echo of
prompt and output with ``logprobs: 1``, whose logprobs lead with the prompt's.

It runs after the answer has reached the client and before the span is written (a trainer never reads the span
without them), only for vLLM and SGLang backends, and only when some logprob is missing. A scoring that fails
(the engine refuses it, a prompt and output at the model's length limit, no answer) leaves the span as it was:
incomplete, and counted as such. ``ROLLWAY_SCORE_MISSING_LOGPROBS=false`` turns it off.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import orjson

from rollway.gateway.record import CallRecord, traceparent
from rollway.gateway.upstream import Upstream
from rollway.store import Backend

log = logging.getLogger("rollway.gateway")

#: The largest scoring answer read: a logprob entry per prompt token, about 100 bytes each.
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class ScoringFailed(Exception):
    """The engine did not give a logprob for every output token."""


class Scorer:
    def __init__(self, upstream: Upstream, *, enabled: bool) -> None:
        self.upstream = upstream
        self.enabled = enabled
        self._failures: set[str] = set()  # backends whose scoring failure was logged (once each)

    async def fill(self, record: CallRecord) -> None:
        """Score the output of ``record`` when its engine left logprobs out (``scored_logprobs``); never raises
        but for cancellation."""
        backend = record.backend
        if not self.enabled or backend is None or backend.kind not in ("vllm", "sglang") or not record.completed:
            return
        prompt_ids, output_ids, logprobs = record.tokens()
        if not (_ids(prompt_ids) and _ids(output_ids)) or logprobs is not None:
            return
        try:
            record.scored_logprobs = await self.score(record, backend, prompt_ids, output_ids)
        except Exception as exc:  # (refused, no answer, a transport error): the span stays as it was
            if backend.backend_id not in self._failures:
                self._failures.add(backend.backend_id)
                log.warning("could not score the missing logprobs of backend '%s': %s", backend.backend_id, exc)

    async def score(
        self, record: CallRecord, backend: Backend, prompt_ids: list[int], output_ids: list[int]
    ) -> list[float]:
        """The engine's logprob of each output token after the prompt (one scoring call, in the call's trace)."""
        body: dict[str, Any] = {"model": backend.model, "prompt": [*prompt_ids, *output_ids], "max_tokens": 1}
        if backend.kind == "vllm":
            body |= {"prompt_logprobs": 0, "temperature": 0}
        else:  # SGLang: an echo with logprobs leads with the prompt's (the first one null)
            body |= {"echo": True, "logprobs": 1, "temperature": 0}
        trace = (traceparent(record.trace_id, secrets.token_hex(8), record.trace_flags), record.trace_state)
        answer = await self.upstream.send(
            backend, "completions", orjson.dumps(body), trace=trace, deadline=record.deadline
        )
        try:
            raw = await answer.read(MAX_ANSWER_BYTES)
        finally:
            answer.release()
        if answer.status != 200:
            raise ScoringFailed(f"the engine answered {answer.status}: {raw[:200].decode(errors='replace')}")
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ScoringFailed("the engine's answer is not JSON") from None
        if backend.kind == "sglang":
            return echoed_logprobs(parsed, prompt_ids, output_ids)
        return output_logprobs(parsed, prompt_ids, output_ids)


def echoed_logprobs(answer: Any, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """The output's logprobs from an echo's ``logprobs.token_logprobs`` (the prompt's first, then one generated)."""
    try:
        values = answer["choices"][0]["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ScoringFailed("the answer has no logprobs") from None
    if not isinstance(values, list) or len(values) < len(prompt_ids) + len(output_ids):
        raise ScoringFailed("the answer's logprobs do not cover the prompt and the output")
    out = values[len(prompt_ids) : len(prompt_ids) + len(output_ids)]
    if not all(isinstance(v, (int, float)) for v in out):
        raise ScoringFailed("an output token has no logprob")
    return [float(v) for v in out]


def output_logprobs(answer: Any, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """The output's logprobs from a scoring answer's ``prompt_logprobs`` (one entry per prompt token, the first
    null; each keyed by token id)."""
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ScoringFailed("the answer has no prompt_logprobs") from None
    if not isinstance(entries, list) or len(entries) != len(prompt_ids) + len(output_ids):
        raise ScoringFailed("the answer's prompt_logprobs do not cover the prompt and the output")
    out: list[float] = []
    for token_id, entry in zip(output_ids, entries[len(prompt_ids) :], strict=True):
        value = (entry or {}).get(str(token_id)) if isinstance(entry, dict) else None
        logprob = value.get("logprob") if isinstance(value, dict) else None
        if not isinstance(logprob, (int, float)):
            raise ScoringFailed(f"no logprob for output token {token_id}")
        out.append(float(logprob))
    return out


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) for i in value)
