"""One rollout's spans → triplets, following Agent-lightning's proxy adapter (``LlmProxyTraceToTriplet`` in
agentlightning 0.3.0) on the attributes the gateway records (docs/gateway.md). Pure functions, no I/O.

The rules, in the order they apply:

1. Only the spans of the rollout's latest attempt count. They are ordered by sequence id alone, never by
   time (spans may come from machines whose clocks disagree).
2. An LLM call is a span whose ``gen_ai.operation.name`` is ``chat`` or ``text_completion`` and whose
   ``rollway.prompt_token_ids`` and ``rollway.response_token_ids`` are non-empty lists (taken as stored),
   unless ``rollway.trainable`` is false or the span's status is ``ERROR``: a call that did not complete —
   cancelled by the client (``rollway.cancelled``), a stream broken off, a timeout, an upstream 4xx/5xx, a call
   the gateway refused — is not a training sample, even when it holds the tokens that arrived before it ended.
   Other spans (embeddings, calls to OpenAI-kind backends that return no token ids, the agent's own spans) are
   not calls. Everything below sees calls only.
3. Calls the agent retried with an identical prompt (equal prompt token ids) are de-duplicated: the last one
   is kept (so a complete call is never dropped for a later retry that did not complete: that one is not a
   call). (Agent-lightning de-duplicates by response id; a retry has a new response id, so Rollway compares
   prompts.) De-duplication comes before reward matching, as in Agent-lightning. Every row says how many of its
   rollout's calls this removed (``deduped_calls``); ``dedupe=False`` keeps them all (a framework that asks the
   same prompt again on purpose, a best-of-n loop say, is not retrying).
4. A reward is a ``rollway.reward`` span named ``primary`` (the API's default name) with a numeric
   ``rollway.reward.value``; or a span with Agent-lightning's ``agentlightning.reward.0.value`` (its primary
   reward); or, older, an ``agentlightning.annotation`` span with a numeric ``reward`` attribute. Rewards with
   other names are auxiliary dimensions and match no call; a reward whose value is null matches no call
   (Agent-lightning skips a ``None`` reward the same way).
5. Rewards, in sequence order, each go to the latest still unmatched call with a smaller sequence id, so the
   final reward goes to the last call. A call no reward reached has ``reward: None``, never 0.

6. A call with several choices (``n > 1``, ``rollway.choices``) is one call per choice (``choice_index``),
   all with the call's prompt and sequence id: they are de-duplicated and rewarded as one call (a reward matched
   to the call goes to each of its choices). A text completion that asked for several prompts at once is the
   same, each choice with its own prompt (its token ids from ``rollway.choices``, its text ``n`` choices per
   prompt, in order).

7. Every row says how its logprobs were had (``logprobs_source``) and whether there is one for every response
   token (``logprobs_complete``): ``sampled`` when the engine gave them with its answer, ``scored`` when it gave
   the ids without every logprob and the gateway had the same engine score the output right after the call
   (``gateway.scoring``; the span's ``rollway.logprobs_source``, which speaks of a call's first choice), None
   (and ``logprobs_complete`` false) when some are missing: ``response_logprobs`` is then null, or as the span
   holds them, fewer than the tokens.

Rules 1-3, 6 and 7 (which spans are calls, their choices, retries, logprobs) are ``admin.adapters.calls``'s;
merged rows are ``admin.adapters.merged``'s.

Token ids and logprobs stay JSON text from end to end: the store hands them over undecoded
(``store.exports.RawJson``; lists, as in ``store.Span``, are serialized once), prompts are compared and
chained as compact JSON text, and the rows carry them as ``RawJson``, which ``dumps`` writes into the
output as they are (``orjson.loads(dumps(row))`` gives plain lists).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import orjson

from rollway.admin.adapters.calls import (
    LlmCall,
    LogprobsSource,
    SpanLike,
    all_calls,
    batch_prompts,
    without_retries,
)
from rollway.store.exports import RawJson
from rollway.store.exports import reward_value as stored_reward_value


class Triplet(TypedDict):
    """One LLM call with its reward (a row of ``GET /admin/v1/triplets``); arrays are pre-serialized JSON."""

    rollout_id: str
    attempt_id: str
    group_id: str | None
    sequence_id: int
    choice_index: int
    prompt_token_ids: RawJson
    response_token_ids: RawJson
    response_logprobs: RawJson | None
    reward: float | None
    messages: list[Any] | None
    prompt: Any
    response: Any
    model_version: str | None
    sampling: dict[str, Any]
    finish_reason: str | None
    deduped_calls: int  # calls of the rollout's latest attempt the de-duplication removed (rule 3)
    logprobs_source: LogprobsSource  # how ``response_logprobs`` were had (rule 7); None when they are incomplete
    logprobs_complete: bool  # one logprob for every response token
    remove_sample: bool  # the agent server asked to drop the rollout's sample (``ExportRollout.remove_sample``)


#: The request fields a trainer needs to know how a sample was drawn (importance ratios under a temperature, a
#: top-p or top-k truncation): those of them the call's recorded request set.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
)


def sampling(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters the call's recorded request (``rollway.request``) set; {} when none."""
    request = attributes.get("rollway.request")
    if not isinstance(request, dict):
        return {}
    return {name: request[name] for name in SAMPLING_FIELDS if request.get(name) is not None}


def reward_value(span: SpanLike) -> float | None:
    """The primary reward a span carries, or None when it is not a reward span (or its value is null)."""
    return stored_reward_value(span.name, span.attributes)


def match_rewards(calls: list[LlmCall], spans: Sequence[SpanLike], attempt_id: str | None) -> list[LlmCall]:
    """Give each reward of attempt ``attempt_id`` to the latest unmatched call before it (sets ``reward`` on each
    of the call's choices)."""
    rewards: list[tuple[int, float]] = []
    for span in spans:
        if span.attempt_id != attempt_id:
            continue
        value = reward_value(span)
        if value is not None:
            rewards.append((span.sequence_id or 0, value))
    rewards.sort(key=lambda r: r[0])
    by_call: dict[int, list[LlmCall]] = {}
    for call in calls:
        by_call.setdefault(call.sequence_id, []).append(call)
    unmatched = sorted(by_call)
    for sequence_id, value in rewards:
        for position in range(len(unmatched) - 1, -1, -1):
            if unmatched[position] < sequence_id:
                for choice in by_call[unmatched.pop(position)]:
                    choice.reward = value
                break
    return calls


def response_choice(call: LlmCall) -> Mapping[str, Any] | None:
    """The choice of the response body that the call is (by its ``index``, else its position)."""
    body = call.span.attributes.get("rollway.response")
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list):
        return None
    for position, choice in enumerate(choices):
        if isinstance(choice, Mapping) and choice.get("index", position) == call.choice_index:
            return choice
    return None


def finish_reason(call: LlmCall) -> str | None:
    """Why the call's choice ended (``gen_ai.response.finish_reasons``, one per choice)."""
    reasons = call.span.attributes.get("gen_ai.response.finish_reasons")
    if isinstance(reasons, list) and call.choice_index < len(reasons):
        reason = reasons[call.choice_index]
        return reason if isinstance(reason, str) else None
    return None


def request_prompt(call: LlmCall) -> tuple[list[Any] | None, Any]:
    """What the call was asked, from its request: (``messages`` of a chat call, ``prompt`` of a text
    completion); the other one is None."""
    request = call.span.attributes.get("rollway.request")
    if not isinstance(request, Mapping):
        return None, None
    if call.span.attributes.get("gen_ai.operation.name") == "text_completion":
        prompts = batch_prompts(call.span.attributes)
        if prompts is None:
            return None, request.get("prompt")
        n = request.get("n")
        at = call.choice_index // (n if isinstance(n, int) and n > 0 else 1)
        return None, prompts[at] if at < len(prompts) else None
    if call.span.attributes.get("gen_ai.operation.name") == "responses":
        return _response_messages(request), None
    messages = request.get("messages")
    return (messages if isinstance(messages, list) else None), None


def _response_messages(request: Mapping[str, Any]) -> list[Any] | None:
    """A Responses API request as chat messages: its ``instructions`` as the system message, then its ``input``
    (a text is the user's message; a list of input items is kept as it is)."""
    given = request.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list):
        return None
    instructions = request.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    return system + items


def _triplet(
    call: LlmCall, rollout_id: str, attempt_id: str, group_id: str | None, removed: int, remove_sample: bool
) -> Triplet:
    attributes = call.span.attributes
    messages, prompt = request_prompt(call)
    choice = response_choice(call)
    response: Any = None
    if choice is not None:
        chat = attributes.get("gen_ai.operation.name") == "chat"
        response = choice.get("message") if chat else choice.get("text")
    return Triplet(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        group_id=group_id,
        sequence_id=call.sequence_id,
        choice_index=call.choice_index,
        prompt_token_ids=RawJson(call.prompt),
        response_token_ids=RawJson(call.response),
        response_logprobs=None if call.logprobs is None else RawJson(call.logprobs),
        reward=call.reward,
        messages=messages,
        prompt=prompt,
        response=response,
        model_version=attributes.get("rollway.model_version"),
        sampling=sampling(attributes),
        finish_reason=finish_reason(call),
        deduped_calls=removed,
        logprobs_source=call.logprobs_source,
        logprobs_complete=call.logprobs_source is not None,
        remove_sample=remove_sample,
    )


def triplets(
    rollout_id: str,
    attempt_id: str | None,
    spans: Sequence[SpanLike],
    *,
    group_id: str | None = None,
    dedupe: bool = True,
    remove_sample: bool = False,
) -> list[Triplet]:
    """One triplet per choice of each LLM call of the latest attempt ``attempt_id``, in sequence order, then
    choice order (rules: module doc); each says ``remove_sample`` (the agent server asked to drop the sample)."""
    if attempt_id is None:
        return []
    every = all_calls(spans, attempt_id)
    kept = without_retries(every) if dedupe else every
    calls = match_rewards(kept, spans, attempt_id)
    removed = len(every) - len(kept)
    return [_triplet(call, rollout_id, attempt_id, group_id, removed, remove_sample) for call in calls]


def _fragment(value: Any) -> orjson.Fragment:
    if isinstance(value, RawJson):
        return orjson.Fragment(value.text)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _decoded(value: Any) -> Any:
    if isinstance(value, RawJson):
        return json.loads(value.text)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(row: Mapping[str, Any]) -> bytes:
    """A row as one JSON document, its ``RawJson`` arrays written as they are."""
    try:
        return orjson.dumps(row, default=_fragment, option=orjson.OPT_PASSTHROUGH_DATACLASS)
    except TypeError:  # what orjson refuses (integers beyond 64 bits in messages) the standard library writes
        return json.dumps(row, default=_decoded).encode()
