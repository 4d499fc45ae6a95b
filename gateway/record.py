"""One call's record, filled in as the call goes, and the span it becomes (its attributes are listed in
docs/gateway.md): the prompt's and the response's token ids and logprobs read from whichever shape the engine
answered in (vLLM's, SGLang's, the Responses API's), and the W3C trace context the call carries."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from rollway.store import Backend, Span, SpanStatus

#: Operations whose completions carry token ids when the engine gives them (embeddings never do).
TRAINABLE_OPERATIONS = frozenset({"chat", "text_completion", "responses"})


def choice_token_ids(choice: dict[str, Any]) -> Any:
    """A choice's generated token ids: vLLM's ``token_ids``, or SGLang's chat ``response_token_ids``."""
    ids = choice.get("token_ids")
    return choice.get("response_token_ids") if ids is None else ids


def response_logprobs(operation: str, choice: dict[str, Any]) -> list[float] | None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    if operation == "chat":
        content = logprobs.get("content")
        return None if content is None else [float(item.get("logprob", 0.0)) for item in content]
    values = logprobs.get("token_logprobs")
    if values is None:
        return None
    token_ids = choice_token_ids(choice)
    if isinstance(token_ids, list) and len(values) > len(token_ids):
        # ``echo``: vLLM puts the prompt's logprobs (the first one null) before the generated tokens' while
        # ``token_ids`` holds only the generated ones: the response's logprobs are the last of them.
        values = values[len(values) - len(token_ids) :]
    return [float(v) if v is not None else 0.0 for v in values]


def aligned_logprobs(operation: str, choice: dict[str, Any]) -> list[float] | None:
    """The response's logprobs when there is one per token id (or no ids to align with); None when they do not
    line up (SGLang's streamed chat leaves out the logprobs of tokens that add no text): a list that is not one
    per token would pair each token with another's logprob."""
    values = response_logprobs(operation, choice)
    ids = choice_token_ids(choice)
    if values is not None and isinstance(ids, list) and len(values) != len(ids):
        return None
    return values


@dataclass
class CallRecord:
    """Everything known about one call, filled in as it goes; ``span()`` turns it into the stored span."""

    operation: str
    alias: str | None
    request: Any
    stream: bool
    start_time: float
    rollout_id: str | None = None
    attempt_id: str | None = None
    sequence_id: int | None = None
    trace_id: str = field(default_factory=lambda: secrets.token_hex(16))
    parent_id: str | None = None
    trace_flags: str = "01"  # the caller's, when it sent a trace context (sampled by default)
    trace_state: str | None = None  # the caller's ``tracestate``, passed on
    span_id: str = field(default_factory=lambda: secrets.token_hex(8))
    backend: Backend | None = None
    model_version: str | None = None
    response: dict[str, Any] | None = None
    status_code: int | None = None
    error: str | None = None
    error_type: str | None = None
    retry_count: int = 0
    failovers: int = 0  # retries that went to another backend than the try before
    ttft_seconds: float | None = None
    end_time: float | None = None
    cancelled: bool = False
    deadline: float | None = None
    osmosis: bool = False  # the body named its rollout (Osmosis): answer with TrainGate's token fields
    tags: dict[str, str] = field(default_factory=dict)  # span attributes its route adds
    accumulator: Any = None  # the stream accumulator while streaming (partial response on abort)
    trainable: bool = False  # set by ``span``: its response carries the prompt's and the output's token ids
    logprobs_complete: bool = False  # set by ``span``: trainable, with one logprob for every output token
    #: The output's logprobs as the engine scored them after the call (``gateway.scoring``), when it gave ids
    #: without every logprob.
    scored_logprobs: list[float] | None = None

    @property
    def completed(self) -> bool:
        """A completion the backend gave whole that should be trainable: not an embedding, an error, a stream that
        broke off, nor a call that asks for what comes without token ids (``by_design_untrainable``)."""
        return (
            self.operation in TRAINABLE_OPERATIONS
            and self.response is not None
            and self.error is None
            and self.error_type is None
            and not self.cancelled
            and (self.status_code or 0) < 400
            and not by_design_untrainable(self.operation, self.request)
        )

    def span(self) -> Span:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": self.alias,
            "http.response.status_code": self.status_code,
            "rollway.request": self.request,
            "rollway.stream": self.stream,
            "rollway.retry_count": self.retry_count,
            "rollway.ttft_seconds": self.ttft_seconds,
            "rollway.latency_seconds": None if self.end_time is None else self.end_time - self.start_time,
            "rollway.backend_id": self.backend.backend_id if self.backend else None,
            "rollway.model_version": self.model_version,
        }
        if self.tags:
            attributes.update(self.tags)
        if self.backend is not None:
            attributes["gen_ai.system"] = self.backend.kind
            attributes["server.address"] = _host(self.backend.base_url)
        trainable = False
        response = self.response
        if response is not None:
            attributes["rollway.response"] = response
            trainable = self._response_attributes(attributes, response)
        attributes["rollway.trainable"] = self.trainable = trainable
        if trainable:  # whether an importance ratio can be had for every output token, said apart from the ids
            complete, source = _logprobs_complete(attributes, self.scored_logprobs)
            attributes["rollway.logprobs_complete"] = self.logprobs_complete = complete
            attributes["rollway.logprobs_source"] = source
        if self.cancelled:
            attributes["rollway.cancelled"] = True
        if self.error is not None or self.error_type is not None:  # a cancelled call has a type, no message
            attributes["error.type"] = self.error_type or "error"
        if self.error is not None:
            attributes["rollway.error"] = self.error
        ok = self.error is None and not self.cancelled and (self.status_code or 0) < 400
        description = None if ok else (self.error or ("cancelled by client" if self.cancelled else "error"))
        return Span(
            rollout_id=self.rollout_id,
            attempt_id=self.attempt_id,
            sequence_id=self.sequence_id,
            trace_id=self.trace_id,
            span_id=self.span_id,
            parent_id=self.parent_id,
            name=f"{self.operation} {self.alias}" if self.alias else self.operation,
            status=SpanStatus(status_code="OK" if ok else "ERROR", description=description),
            start_time=self.start_time,
            end_time=self.end_time,
            attributes=attributes,
            resource={"attributes": {"service.name": "rollway"}, "schema_url": ""},
        )

    def tokens(self) -> tuple[Any, Any, list[float] | None]:
        """The recorded answer's prompt ids, output ids and output logprobs (aligned with the ids, else None), as
        its span holds them (the first choice's, for several)."""
        response = self.response or {}
        if self.operation == "responses":
            return _responses_tokens(response)
        choices = response.get("choices") or []
        if not choices:
            return None, None, None
        first = choices[0]
        prompt_ids = response.get("prompt_token_ids")
        if prompt_ids is None:  # vLLM's completions carry them per choice
            prompt_ids = first.get("prompt_token_ids")
        return prompt_ids, choice_token_ids(first), aligned_logprobs(self.operation, first)

    def _response_attributes(self, attributes: dict[str, Any], response: dict[str, Any]) -> bool:
        attributes["gen_ai.response.model"] = response.get("model")
        attributes["gen_ai.response.id"] = response.get("id")
        usage = response.get("usage") or {}
        input_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
        output_tokens = usage.get("completion_tokens", usage.get("output_tokens"))
        if input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = input_tokens
        if output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = output_tokens
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            attributes["rollway.usage.cached_tokens"] = details["cached_tokens"]
        if self.operation == "responses":
            attributes["gen_ai.response.finish_reasons"] = [_responses_finish_reason(response)]
            prompt_ids, response_ids, logprobs = _responses_tokens(response)
            attributes["rollway.prompt_token_ids"] = prompt_ids
            attributes["rollway.response_token_ids"] = response_ids
            attributes["rollway.response_logprobs"] = logprobs
            return prompt_ids is not None and response_ids is not None
        choices = response.get("choices") or []
        if not choices:
            return False
        attributes["gen_ai.response.finish_reasons"] = [c.get("finish_reason") for c in choices]
        prompt_ids, response_ids, logprobs = self.tokens()
        attributes["rollway.prompt_token_ids"] = prompt_ids
        attributes["rollway.response_token_ids"] = response_ids
        attributes["rollway.response_logprobs"] = logprobs
        if len(choices) > 1:
            attributes["rollway.choices"] = [_choice_record(self.operation, c, i) for i, c in enumerate(choices)]
        return prompt_ids is not None and response_ids is not None


def _logprobs_complete(attributes: dict[str, Any], scored: list[float] | None) -> tuple[bool, str | None]:
    """Whether a trainable span has a logprob for every output token, and where they come from: ``sampled`` (the
    engine's answer), ``scored`` (the engine scored the ids after the call, ``scored``; they replace the missing
    ones in ``attributes``) or None. With several choices (``n > 1``) each choice says so of itself
    (``logprobs_complete``), and the span is complete only if every choice is."""
    logprobs, output = attributes.get("rollway.response_logprobs"), attributes.get("rollway.response_token_ids")
    complete = isinstance(logprobs, list) and isinstance(output, list) and len(logprobs) == len(output)
    source = "sampled" if complete else None
    if not complete and scored is not None and isinstance(output, list) and len(scored) == len(output):
        attributes["rollway.response_logprobs"], complete, source = scored, True, "scored"
    choices = attributes.get("rollway.choices")
    if isinstance(choices, list) and choices:
        if source == "scored":  # scoring fills the first choice, which the span's own fields hold
            choices[0]["logprobs"] = scored
        for choice in choices:
            values, ids = choice.get("logprobs"), choice.get("token_ids")
            choice["logprobs_complete"] = isinstance(values, list) and isinstance(ids, list) and len(values) == len(ids)
        complete = complete and all(choice["logprobs_complete"] for choice in choices)
    return complete, source


def _responses_tokens(response: dict[str, Any]) -> tuple[Any, Any, list[float] | None]:
    prompt_ids = _raw_tokens(response.get("input_messages"))
    response_ids = _raw_tokens(response.get("output_messages"))
    logprobs = _output_logprobs(response.get("output"))
    if logprobs is not None and (response_ids is None or len(logprobs) != len(response_ids)):
        logprobs = None  # (some output tokens, a function call's, have none: not aligned with the ids)
    return prompt_ids, response_ids, logprobs


def by_design_untrainable(operation: str, request: Any) -> bool:
    """A call whose answer has no token ids whatever the engine: a text completion's ``echo`` (vLLM leaves the
    prompt's text out of an echo asked for ids, so they are not asked) and a ``background`` response (vLLM gives
    one no messages)."""
    if not isinstance(request, dict):
        return False
    if operation == "text_completion":
        return bool(request.get("echo")) and not request.get("return_token_ids")
    return operation == "responses" and bool(request.get("background"))


def _choice_record(operation: str, choice: dict[str, Any], position: int) -> dict[str, Any]:
    """One choice of a call with several, for ``rollway.choices``; a text completion's choice keeps its own
    prompt's token ids (vLLM gives them per choice: a request may hold several prompts)."""
    record = {
        "index": choice.get("index", position),
        "token_ids": choice_token_ids(choice),
        "logprobs": aligned_logprobs(operation, choice),
        "finish_reason": choice.get("finish_reason"),
    }
    if choice.get("prompt_token_ids") is not None:
        record["prompt_token_ids"] = choice["prompt_token_ids"]
    return record


#: The Responses API's ends in the chat API's words (``incomplete_details.reason``, when it is one of these).
_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}


def _raw_tokens(messages: Any) -> list[int] | None:
    """The token ids of vLLM's ``input_messages`` / ``output_messages`` (``enable_response_messages``), joined;
    None unless every message is a ``raw_message_tokens`` entry (other shapes carry no token ids)."""
    if not isinstance(messages, list) or not messages:
        return None
    ids: list[int] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("type") != "raw_message_tokens":
            return None
        tokens = message.get("tokens")
        if not isinstance(tokens, list):
            return None
        ids.extend(tokens)
    return ids


def _output_logprobs(output: Any) -> list[float] | None:
    """The logprobs of a Responses API answer's output text, in order; None when any output text has none."""
    if not isinstance(output, list):
        return None
    values: list[float] = []
    for item in output:
        if not isinstance(item, dict) or not isinstance(item.get("content"), list):
            continue
        for part in item["content"]:
            if not isinstance(part, dict) or part.get("type") != "output_text":
                continue
            logprobs = part.get("logprobs")
            if not isinstance(logprobs, list):
                return None
            values.extend(float(entry.get("logprob", 0.0)) for entry in logprobs if isinstance(entry, dict))
    return values or None


def _responses_finish_reason(response: dict[str, Any]) -> str | None:
    """Why a Responses API answer ended, as chat's ``finish_reason``: ``stop``, ``tool_calls`` (it ends with
    a function call), ``length``, ``content_filter``, ``error`` (failed); None when it did not end (no end
    status, or cut off without a reason), as a chat stream that broke off records it."""
    status = response.get("status")
    if status == "completed":
        output = response.get("output") or []
        calls = any(isinstance(item, dict) and item.get("type") == "function_call" for item in output)
        return "tool_calls" if calls else "stop"
    if status == "incomplete":  # without a reason: a stream that broke off (the gateway's partial response)
        reason = (response.get("incomplete_details") or {}).get("reason")
        return _INCOMPLETE.get(reason, reason) if isinstance(reason, str) else None
    if status == "failed":
        return "error"
    return None


def _host(url: str) -> str:
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0]


@dataclass(frozen=True)
class Trace:
    """The caller's W3C trace context: the call's span continues its trace under its span, with its flags
    (sampled or not) and its ``tracestate``, both passed on to the backend unchanged."""

    trace_id: str
    parent_id: str
    flags: str = "01"
    state: str | None = None


def parse_traceparent(value: str | None, state: str | None = None) -> Trace | None:
    """The trace context of a W3C ``traceparent`` header (and ``tracestate``), or None when absent or invalid."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    trace_id, span_id, flags = parts[1].lower(), parts[2].lower(), parts[3][:2].lower()
    if len(trace_id) != 32 or len(span_id) != 16 or len(flags) != 2 or not _hex(trace_id + span_id + flags):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    state = state.strip() if state else None
    return Trace(trace_id, span_id, flags, state if state and len(state) <= 512 else None)


_HEX_DIGITS = frozenset("0123456789abcdef")


def _hex(text: str) -> bool:
    """Lower-case hex digits only (``int(text, 16)`` also takes ``_`` between digits, a sign, spaces)."""
    return _HEX_DIGITS.issuperset(text)


def traceparent(trace_id: str, span_id: str, flags: str = "01") -> str:
    return f"00-{trace_id}-{span_id}-{flags}"
