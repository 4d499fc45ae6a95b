"""Which spans of a rollout are LLM calls, and which of them count: rules 1-3, 6 and 7 of
``admin.adapters.triplets`` (the latest attempt's spans in sequence order; a call is a completed ``chat``,
``text_completion`` or ``responses`` span with prompt and response token ids; one call per choice; retries of an
identical prompt de-duplicated; how each choice's logprobs were had). Pure functions, no I/O.

Triplets, merged rows and the trainer records are all built on ``llm_calls`` (``admin.adapters.triplets``,
``merged``, ``trainers``); prompts, responses and logprobs stay compact JSON text (``store.exports.RawJson``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson

from rollway.store.exports import RawJson

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
    prompts = batch_prompts(attributes)
    return prompts if prompts is not None and len(prompts) > 1 else None


def batch_prompts(attributes: Mapping[str, Any]) -> list[Any] | None:
    """The prompts of a text completion whose ``prompt`` is a list of them (of texts or token-id lists; maybe
    of one, as LangChain's ``OpenAI`` sends it), else None (one text, or one prompt's token ids)."""
    request = attributes.get("rollway.request")
    prompt = request.get("prompt") if isinstance(request, Mapping) else None
    if isinstance(prompt, list) and prompt and not any(isinstance(p, int) for p in prompt):
        return prompt
    return None


def without_retries(calls: list[LlmCall]) -> list[LlmCall]:
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
    return without_retries(calls) if dedupe else calls


def deduped(spans: Sequence[SpanLike], attempt_id: str | None) -> int:
    """How many of attempt ``attempt_id``'s calls (choices counted one by one) the de-duplication removes."""
    calls = all_calls(spans, attempt_id)
    return len(calls) - len(without_retries(calls))
