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

Merged rows are ``admin.adapters.merged``'s.

Token ids and logprobs stay JSON text from end to end: the store hands them over undecoded
(``store.exports.RawJson``; lists, as in ``store.Span``, are serialized once), prompts are compared and
chained as compact JSON text, and the rows carry them as ``RawJson``, which ``dumps`` writes into the
output as they are (``orjson.loads(dumps(row))`` gives plain lists).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypedDict

import orjson

from rollway.store.exports import RawJson
from rollway.store.exports import reward_value as stored_reward_value

#: The operations whose spans are LLM calls (a Responses API call is one when the engine gave its token ids).
CALL_OPERATIONS = frozenset({"chat", "text_completion", "responses"})


#: How a call's logprobs were had (rule 7): ``sampled`` with its answer, ``scored`` by the same engine after it;
#: None when they do not cover every response token.
LogprobsSource = Literal["sampled", "scored"] | None


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


@dataclass(slots=True)
class LlmCall:
    """One choice of a call (``choice_index`` 0 unless the call asked for ``n > 1``); ``prompt``, ``response``
    and ``logprobs`` are compact JSON arrays (``"[1,2,3]"``). The choices of a call share its span, sequence
    id, prompt and reward."""

    span: SpanLike
    sequence_id: int
    prompt: str
    response: str
    logprobs: str | None
    reward: float | None = None
    choice_index: int = 0
    logprobs_source: LogprobsSource = None  # rule 7


def items_in(array: str) -> int:
    """The number of items in a compact JSON array of numbers."""
    return 0 if array == "[]" else array.count(",") + 1


def logprobs_source(logprobs: str | None, response: str, recorded: Any = None) -> LogprobsSource:
    """How a choice's ``logprobs`` were had, given what its span recorded (``rollway.logprobs_source``, of the
    first choice): None unless there is one for each token of ``response``."""
    if logprobs is None or items_in(logprobs) != items_in(response):
        return None
    return "scored" if recorded == "scored" else "sampled"


def _array(value: Any) -> str | None:
    """A stored array as compact JSON text (``RawJson`` as it is, a list serialized), else None."""
    if isinstance(value, RawJson):
        return value.text
    if isinstance(value, list):
        return orjson.dumps(value).decode()
    return None


def reward_value(span: SpanLike) -> float | None:
    """The primary reward a span carries, or None when it is not a reward span (or its value is null)."""
    return stored_reward_value(span.name, span.attributes)


def _as_calls(span: SpanLike) -> list[LlmCall]:
    """The call's choices with sampled tokens (rule 2); none when the span is not a call."""
    attributes = span.attributes
    if attributes.get("gen_ai.operation.name") not in CALL_OPERATIONS:
        return []
    if attributes.get("rollway.trainable") is False or span.status.status_code == "ERROR":
        return []
    prompt = _array(attributes.get("rollway.prompt_token_ids"))
    response = _array(attributes.get("rollway.response_token_ids"))
    if prompt is None or response is None or prompt == "[]" or response == "[]":
        return []
    sequence_id = span.sequence_id or 0
    logprobs = _array(attributes.get("rollway.response_logprobs"))
    source = logprobs_source(logprobs, response, attributes.get("rollway.logprobs_source"))
    calls = [LlmCall(span, sequence_id, prompt, response, logprobs, logprobs_source=source)]
    choices = attributes.get("rollway.choices")
    if not isinstance(choices, list) or len(choices) < 2:
        return calls
    batched = _batched(attributes) is not None
    for position, choice in enumerate(choices[1:], start=1):
        if not isinstance(choice, Mapping):
            continue
        tokens = _array(choice.get("token_ids"))
        own_prompt = _array(choice.get("prompt_token_ids"))
        if tokens is None or tokens == "[]" or (batched and own_prompt in (None, "[]")):
            continue  # a batched request's choice needs its own prompt ids (older spans held the first only)
        index = choice.get("index")
        index = index if isinstance(index, int) and not isinstance(index, bool) else position
        logprobs = _array(choice.get("logprobs"))
        source = logprobs_source(logprobs, tokens)  # the gateway scores the first choice only
        own_call = LlmCall(
            span, sequence_id, own_prompt or prompt, tokens, logprobs, choice_index=int(index), logprobs_source=source
        )
        calls.append(own_call)
    return calls


def _batched(attributes: Mapping[str, Any]) -> list[Any] | None:
    """The prompts of a text completion that asked for several at once (texts, or token-id lists), else None:
    its choices answer different prompts (``n`` choices each, in order)."""
    prompts = _batch(attributes)
    return prompts if prompts is not None and len(prompts) > 1 else None


def _batch(attributes: Mapping[str, Any]) -> list[Any] | None:
    """The prompts of a text completion whose ``prompt`` is a list of them (of texts or token-id lists; maybe
    of one, as LangChain's ``OpenAI`` sends it), else None (one text, or one prompt's token ids)."""
    request = attributes.get("rollway.request")
    prompt = request.get("prompt") if isinstance(request, Mapping) else None
    if isinstance(prompt, list) and prompt and not any(isinstance(p, int) for p in prompt):
        return prompt
    return None


def _without_retries(calls: list[LlmCall]) -> list[LlmCall]:
    """Drop every call whose prompt a later call repeats exactly (compared as text, only within a length); the
    choices of one call do not drop each other."""
    keep = [True] * len(calls)
    by_length: dict[int, list[int]] = {}
    for index, call in enumerate(calls):
        same_length = by_length.setdefault(len(call.prompt), [])
        for earlier in same_length:
            other = calls[earlier]
            if keep[earlier] and other.sequence_id != call.sequence_id and other.prompt == call.prompt:
                keep[earlier] = False
        same_length.append(index)
    return [call for call, kept in zip(calls, keep, strict=True) if kept]


def all_calls(spans: Sequence[SpanLike], attempt_id: str | None) -> list[LlmCall]:
    """The trainable LLM calls of attempt ``attempt_id`` in sequence order, retries included."""
    if attempt_id is None:
        return []
    calls = [call for span in spans if span.attempt_id == attempt_id for call in _as_calls(span)]
    calls.sort(key=lambda c: (c.sequence_id, c.choice_index))
    return calls


def llm_calls(spans: Sequence[SpanLike], attempt_id: str | None, *, dedupe: bool = True) -> list[LlmCall]:
    """The trainable LLM calls of attempt ``attempt_id`` in sequence order, retried prompts de-duplicated (unless
    ``dedupe`` is False)."""
    calls = all_calls(spans, attempt_id)
    return _without_retries(calls) if dedupe else calls


def deduped(spans: Sequence[SpanLike], attempt_id: str | None) -> int:
    """How many of attempt ``attempt_id``'s calls (choices counted one by one) the de-duplication removes."""
    calls = all_calls(spans, attempt_id)
    return len(calls) - len(_without_retries(calls))


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
        prompts = _batch(call.span.attributes)
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
    kept = _without_retries(every) if dedupe else every
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
