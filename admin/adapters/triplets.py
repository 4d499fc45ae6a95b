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
   prompts.) De-duplication comes before reward matching, as in Agent-lightning.
4. A reward is a ``rollway.reward`` span named ``primary`` (the API's default name) with a numeric
   ``rollway.reward.value``; or a span with Agent-lightning's ``agentlightning.reward.0.value`` (its primary
   reward); or, older, an ``agentlightning.annotation`` span with a numeric ``reward`` attribute. Rewards with
   other names are auxiliary dimensions and match no call; a reward whose value is null matches no call
   (Agent-lightning skips a ``None`` reward the same way).
5. Rewards, in sequence order, each go to the latest still unmatched call with a smaller sequence id, so the
   final reward goes to the last call. A call no reward reached has ``reward: None``, never 0.

Merged rows (``merged_rows``) chain the calls of one attempt while each call's prompt token ids start with
everything before it (the previous prompt + response, and so on back to the segment's first prompt): one row
per run of such calls. ``loss_mask`` is 1 on sampled response tokens, 0 on prompt, tool and observation
tokens. ``logprobs`` is aligned with ``token_ids``: the sampled logprob on response tokens, ``0.0`` on tokens
that were not sampled (so it converts to a tensor directly; ``loss_mask`` says which positions are real); it is
``None`` for the whole row when a call of the row has no logprobs or fewer/more than its response tokens. A
call whose prompt does not extend the row (the agent rewrote or truncated history) starts a new row;
``prefix_breaks`` — the number of such breaks in the attempt — is the same on every row of the rollout. A
row's ``reward`` is the last reward matched to a call of that row (``None`` when no call of it got one).

Token ids and logprobs stay JSON text from end to end: the store hands them over undecoded
(``store.exports.RawJson``; lists, as in ``store.Span``, are serialized once), prompts are compared and
chained as compact JSON text, and the rows carry them as ``RawJson``, which ``dumps`` writes into the
output as they are (``orjson.loads(dumps(row))`` gives plain lists).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import orjson

from store.exports import RawJson
from store.exports import reward_value as stored_reward_value

CALL_OPERATIONS = frozenset({"chat", "text_completion"})


class StatusLike(Protocol):
    @property
    def status_code(self) -> str: ...


class SpanLike(Protocol):
    """What the adapter reads from a span (``store.Span`` and the store's export spans both fit)."""

    @property
    def status(self) -> StatusLike: ...

    @property
    def attempt_id(self) -> str | None: ...

    @property
    def sequence_id(self) -> int | None: ...

    @property
    def name(self) -> str: ...

    @property
    def attributes(self) -> Mapping[str, Any]: ...


class Triplet(TypedDict):
    """One LLM call with its reward (PRODUCT.md §4a); arrays are pre-serialized JSON."""

    rollout_id: str
    attempt_id: str
    group_id: str | None
    sequence_id: int
    prompt_token_ids: RawJson
    response_token_ids: RawJson
    response_logprobs: RawJson | None
    reward: float | None
    messages: list[Any] | None
    prompt: Any
    response: Any
    model_version: str | None
    finish_reason: str | None


class MergedRow(TypedDict):
    """One rollout segment: calls whose prompts extend each other by token prefix, as one sequence."""

    rollout_id: str
    attempt_id: str
    group_id: str | None
    token_ids: RawJson
    loss_mask: RawJson
    logprobs: RawJson | None
    reward: float | None
    n_calls: int
    prefix_breaks: int


@dataclass(slots=True)
class LlmCall:
    """A call; ``prompt``, ``response`` and ``logprobs`` are compact JSON arrays (``"[1,2,3]"``)."""

    span: SpanLike
    sequence_id: int
    prompt: str
    response: str
    logprobs: str | None
    reward: float | None = None


def _array(value: Any) -> str | None:
    """A stored array as compact JSON text (``RawJson`` as it is, a list serialized), else None."""
    if isinstance(value, RawJson):
        return value.text
    if isinstance(value, list):
        return orjson.dumps(value).decode()
    return None


def _count(array: str) -> int:
    """The number of items in a compact JSON array of numbers."""
    return 0 if array == "[]" else array.count(",") + 1


def reward_value(span: SpanLike) -> float | None:
    """The primary reward a span carries, or None when it is not a reward span (or its value is null)."""
    return stored_reward_value(span.name, span.attributes)


def _as_call(span: SpanLike) -> LlmCall | None:
    attributes = span.attributes
    if attributes.get("gen_ai.operation.name") not in CALL_OPERATIONS:
        return None
    if attributes.get("rollway.trainable") is False or span.status.status_code == "ERROR":
        return None
    prompt = _array(attributes.get("rollway.prompt_token_ids"))
    response = _array(attributes.get("rollway.response_token_ids"))
    if prompt is None or response is None or prompt == "[]" or response == "[]":
        return None
    return LlmCall(
        span=span,
        sequence_id=span.sequence_id or 0,
        prompt=prompt,
        response=response,
        logprobs=_array(attributes.get("rollway.response_logprobs")),
    )


def _without_retries(calls: list[LlmCall]) -> list[LlmCall]:
    """Drop every call whose prompt a later call repeats exactly (compared as text, only within a length)."""
    keep = [True] * len(calls)
    by_length: dict[int, list[int]] = {}
    for index, call in enumerate(calls):
        same_length = by_length.setdefault(len(call.prompt), [])
        for earlier in same_length:
            if keep[earlier] and calls[earlier].prompt == call.prompt:
                keep[earlier] = False
        same_length.append(index)
    return [call for call, kept in zip(calls, keep, strict=True) if kept]


def llm_calls(spans: Sequence[SpanLike], attempt_id: str | None) -> list[LlmCall]:
    """The trainable LLM calls of attempt ``attempt_id`` in sequence order, retried prompts de-duplicated."""
    if attempt_id is None:
        return []
    calls = [call for span in spans if span.attempt_id == attempt_id and (call := _as_call(span)) is not None]
    calls.sort(key=lambda c: c.sequence_id)
    return _without_retries(calls)


def match_rewards(calls: list[LlmCall], spans: Sequence[SpanLike], attempt_id: str | None) -> list[LlmCall]:
    """Give each reward of attempt ``attempt_id`` to the latest unmatched call before it (sets ``reward``)."""
    rewards: list[tuple[int, float]] = []
    for span in spans:
        if span.attempt_id != attempt_id:
            continue
        value = reward_value(span)
        if value is not None:
            rewards.append((span.sequence_id or 0, value))
    rewards.sort(key=lambda r: r[0])
    matched: set[int] = set()
    for sequence_id, value in rewards:
        for index in range(len(calls) - 1, -1, -1):
            if index not in matched and calls[index].sequence_id < sequence_id:
                matched.add(index)
                calls[index].reward = value
                break
    return calls


def _first_choice(body: Any) -> Mapping[str, Any] | None:
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0]
    return None


def request_prompt(call: LlmCall) -> tuple[list[Any] | None, Any]:
    """What the call was asked, from its request: (``messages`` of a chat call, ``prompt`` of a text
    completion); the other one is None."""
    request = call.span.attributes.get("rollway.request")
    if not isinstance(request, Mapping):
        return None, None
    if call.span.attributes.get("gen_ai.operation.name") == "text_completion":
        return None, request.get("prompt")
    messages = request.get("messages")
    return (messages if isinstance(messages, list) else None), None


def _triplet(call: LlmCall, rollout_id: str, attempt_id: str, group_id: str | None) -> Triplet:
    attributes = call.span.attributes
    messages, prompt = request_prompt(call)
    choice = _first_choice(attributes.get("rollway.response"))
    response: Any = None
    if choice is not None:
        chat = attributes.get("gen_ai.operation.name") == "chat"
        response = choice.get("message") if chat else choice.get("text")
    reasons = attributes.get("gen_ai.response.finish_reasons")
    finish_reason = reasons[0] if isinstance(reasons, list) and reasons else None
    return Triplet(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        group_id=group_id,
        sequence_id=call.sequence_id,
        prompt_token_ids=RawJson(call.prompt),
        response_token_ids=RawJson(call.response),
        response_logprobs=None if call.logprobs is None else RawJson(call.logprobs),
        reward=call.reward,
        messages=messages,
        prompt=prompt,
        response=response,
        model_version=attributes.get("rollway.model_version"),
        finish_reason=finish_reason,
    )


def triplets(
    rollout_id: str, attempt_id: str | None, spans: Sequence[SpanLike], *, group_id: str | None = None
) -> list[Triplet]:
    """One triplet per LLM call of the latest attempt ``attempt_id``, in sequence order (rules: module doc)."""
    if attempt_id is None:
        return []
    calls = match_rewards(llm_calls(spans, attempt_id), spans, attempt_id)
    return [_triplet(call, rollout_id, attempt_id, group_id) for call in calls]


@dataclass(slots=True)
class _Segment:
    """A row being built, as the items of its JSON arrays (``"1,2,3"``) in pieces."""

    tokens: str  # every token id so far, comma-separated: what the next prompt must start with
    mask: list[str]
    logprobs: list[str] | None
    n_calls: int = 0
    reward: float | None = None

    @classmethod
    def start(cls, prompt: str) -> _Segment:
        segment = cls(tokens="", mask=[], logprobs=[])
        segment.add_context(prompt[1:-1])
        return segment

    def extension(self, prompt: str) -> str | None:
        """The items ``prompt`` adds after this row's tokens, or None when it does not start with them."""
        end = len(self.tokens) + 1
        if not prompt.startswith(self.tokens, 1) or prompt[end] not in ",]":
            return None
        return prompt[end + 1 : -1]

    def add_context(self, items: str) -> None:
        if not items:
            return
        n = items.count(",") + 1
        self.tokens = f"{self.tokens},{items}" if self.tokens else items
        self.mask.append(",".join("0" * n))
        if self.logprobs is not None:
            self.logprobs.append(",".join(["0.0"] * n))

    def add_response(self, call: LlmCall) -> None:
        items = call.response[1:-1]
        n = _count(call.response)
        self.tokens = f"{self.tokens},{items}"
        self.mask.append(",".join("1" * n))
        if self.logprobs is not None:
            if call.logprobs is not None and _count(call.logprobs) == n:
                self.logprobs.append(call.logprobs[1:-1])
            else:
                self.logprobs = None
        self.n_calls += 1
        if call.reward is not None:
            self.reward = call.reward


def _joined(items: list[str]) -> RawJson:
    return RawJson(f"[{','.join(items)}]")


def merged_rows(
    rollout_id: str, attempt_id: str | None, spans: Sequence[SpanLike], *, group_id: str | None = None
) -> list[MergedRow]:
    """The calls of the latest attempt chained by token prefix: one row per segment (rules: module doc)."""
    if attempt_id is None:
        return []
    segments: list[_Segment] = []
    for call in match_rewards(llm_calls(spans, attempt_id), spans, attempt_id):
        extension = segments[-1].extension(call.prompt) if segments else None
        if extension is None:
            segments.append(_Segment.start(call.prompt))
        else:
            segments[-1].add_context(extension)
        segments[-1].add_response(call)
    breaks = max(len(segments) - 1, 0)
    return [
        MergedRow(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            group_id=group_id,
            token_ids=RawJson(f"[{s.tokens}]"),
            loss_mask=_joined(s.mask),
            logprobs=None if s.logprobs is None else _joined(s.logprobs),
            reward=s.reward,
            n_calls=s.n_calls,
            prefix_breaks=breaks,
        )
        for s in segments
    ]


def _fragment(value: Any) -> orjson.Fragment:
    if isinstance(value, RawJson):
        return orjson.Fragment(value.text)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _decoded(value: Any) -> Any:
    if isinstance(value, RawJson):
        return json.loads(value.text)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(row: Triplet | MergedRow) -> bytes:
    """A row as one JSON document, its ``RawJson`` arrays written as they are."""
    try:
        return orjson.dumps(row, default=_fragment, option=orjson.OPT_PASSTHROUGH_DATACLASS)
    except TypeError:  # what orjson refuses (integers beyond 64 bits in messages) the standard library writes
        return json.dumps(row, default=_decoded).encode()
