"""What the gateway asks the backend for beyond the client's request, what it strips from the answer, and
the span it records for each call (its attributes are listed in docs/gateway.md)."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rollway.gateway.litellm_backend import ALLOWED_FIELDS
from rollway.store import Backend, Span, SpanStatus

OPERATIONS = {
    "chat/completions": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "responses",
}
TOKEN_ID_KINDS = frozenset({"vllm", "sglang"})


@dataclass
class Injected:
    """What the gateway added to the request that the client did not ask for (and so strips)."""

    token_ids: bool = False
    logprobs: bool = False
    usage: bool = False
    #: The backend writes ``"usage": null`` into stream chunks whatever was asked (vLLM's text completions):
    #: a null usage is then its own, not the gateway's, and stays.
    null_usage_is_native: bool = False

    @property
    def any(self) -> bool:
        return self.token_ids or self.logprobs or self.usage


log = logging.getLogger("rollway.gateway")
#: Backends (ids) that refused the ``stream_options`` the gateway added (an OpenAI-compatible server that does not
#: know it): not sent to them again by this process.
NO_STREAM_OPTIONS: set[str] = set()


async def refused_stream_options(response: Any, backend: Backend) -> bool:
    """Whether ``response`` is a 400 that names ``stream_options``, from an ``openai``-kind backend (vLLM and
    SGLang know it): the response is then released, and the call asked again without it (``asked_again``)."""
    if backend.kind != "openai" or response.status != 400:
        return False
    try:
        body = await response.read()  # kept by the response: read again when it is passed on
    except (aiohttp.ClientError, TimeoutError):
        return False
    if b"stream_options" not in body:
        return False
    response.release()
    return True


def asked_again(backend: Backend, status: int) -> None:
    """The answer to a call asked again without ``stream_options``: if the backend took it, it is the one that
    does not know them (remembered); if it refused that too, the first refusal was about something else (a
    client's own ``stream_options``, an error message that quotes the request) and nothing is remembered."""
    if status < 400 and backend.backend_id not in NO_STREAM_OPTIONS:
        NO_STREAM_OPTIONS.add(backend.backend_id)
        log.warning("backend '%s' refused stream_options: its streams' spans have no usage", backend.backend_id)


def prepare(
    operation: str, body: dict[str, Any], backend: Backend, sampling: dict[str, Any] | None, usage: bool = True
) -> tuple[dict[str, Any], Injected]:
    """The body sent upstream: upstream model name, alias sampling defaults, capture fields (stream usage only
    when ``usage``). A ``litellm`` backend gets only the defaults it takes (``litellm_backend.ALLOWED_FIELDS``):
    an alias's vLLM defaults would otherwise fail every call it serves."""
    upstream = dict(body)
    upstream.pop("rollout_id", None)
    upstream["model"] = backend.model
    for key, value in (sampling or {}).items():
        if backend.kind != "litellm" or key in ALLOWED_FIELDS:
            upstream.setdefault(key, value)
    injected = Injected()
    if operation not in ("chat", "text_completion") or backend.kind == "litellm":
        return upstream, injected
    options = upstream.get("stream_options") or {}
    usage = usage and backend.backend_id not in NO_STREAM_OPTIONS
    if upstream.get("stream") and isinstance(options, dict) and usage:
        # Usage (tokens, cached tokens) for the span, from every OpenAI-compatible kind; a ``stream_options``
        # that is not an object goes as it came (the backend refuses it, as it would a direct call).
        options = dict(options)
        if not options.get("include_usage"):
            options["include_usage"] = True
            upstream["stream_options"] = options
            injected.usage = True
            injected.null_usage_is_native = backend.kind in TOKEN_ID_KINDS
    if backend.kind not in TOKEN_ID_KINDS:
        return upstream, injected
    if operation == "text_completion" and upstream.get("echo") and not upstream.get("return_token_ids"):
        # vLLM leaves the prompt's text out of an echo that asked for token ids, and logprobs make it compute
        # (and answer) the prompt's: the client's echo gets neither, and its span no token ids (not trainable).
        return upstream, injected
    if not upstream.get("return_token_ids"):
        upstream["return_token_ids"] = True
        injected.token_ids = True
    if operation == "chat":
        # A client's ``top_logprobs`` without ``logprobs`` goes as it came (the backend refuses it, as it would
        # a direct call): asking for logprobs here would overwrite it and answer what the backend refuses.
        if not upstream.get("logprobs") and upstream.get("top_logprobs") is None:
            upstream["logprobs"] = True
            upstream["top_logprobs"] = 0
            injected.logprobs = True
    elif upstream.get("logprobs") is None:
        upstream["logprobs"] = 0
        injected.logprobs = True
    return upstream, injected


def stripped(body: dict[str, Any], injected: Injected) -> dict[str, Any]:
    """A copy of a response (or one stream chunk) without what the client did not ask for.

    Fields are reset to ``null``, the way vLLM answers a request that did not ask for them."""
    out = dict(body)
    if injected.token_ids and "prompt_token_ids" in out:
        out["prompt_token_ids"] = None
    if injected.usage and (out.get("usage") is not None or not injected.null_usage_is_native):
        out.pop("usage", None)
    choices = out.get("choices")
    if choices and (injected.token_ids or injected.logprobs):
        new_choices = []
        for choice in choices:
            choice = dict(choice)
            if injected.token_ids and "token_ids" in choice:
                choice["token_ids"] = None
            if injected.token_ids and "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
            if injected.logprobs and "logprobs" in choice:
                choice["logprobs"] = None
            new_choices.append(choice)
        out["choices"] = new_choices
    return out


def shown(chunk: dict[str, Any], injected: Injected) -> dict[str, Any] | None:
    """A stream chunk as the client gets it (``stripped``), or None when the backend sent it only for what the
    gateway asked: the usage chunk, and a chat chunk for tokens its parser holds back (a tool call's markup):
    vLLM sends those, as ``delta: {}``, only to a request with ``return_token_ids`` -- with or without
    ``logprobs`` -- and skips them otherwise, so a client that did not ask for token ids gets none of them."""
    if injected.usage and is_usage_only_chunk(chunk):
        return None
    if injected.token_ids and _held_back(chunk):
        return None
    return stripped(chunk, injected)


def _held_back(chunk: dict[str, Any]) -> bool:
    """A chat chunk whose every choice has an empty delta and no finish reason (what else it carries -- token ids,
    logprobs, continuous usage -- a request without ``return_token_ids`` would not have been sent)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, dict) and c.get("delta") == {} and c.get("finish_reason") is None for c in choices)


def with_traingate_fields(out: dict[str, Any], full: dict[str, Any], operation: str) -> dict[str, Any]:
    """``out`` (the answer as the client gets it) plus the top-level ``token_ids``, ``logprobs`` (a flat list of
    floats) and ``prompt_token_ids`` that Osmosis's TrainGate returns, taken from ``full`` (the backend's
    answer, with what the gateway asked for). Null when the backend gave none (an OpenAI-kind backend)."""
    choices = full.get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    prompt_ids = full.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = first.get("prompt_token_ids")
    return out | {
        "token_ids": first.get("token_ids"),
        "logprobs": response_logprobs(operation, first),
        "prompt_token_ids": prompt_ids,
    }


def is_usage_only_chunk(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and chunk.get("usage") is not None


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
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list) and len(values) > len(token_ids):
        # ``echo``: vLLM puts the prompt's logprobs (the first one null) before the generated tokens' while
        # ``token_ids`` holds only the generated ones: the response's logprobs are the last of them.
        values = values[len(values) - len(token_ids) :]
    return [float(v) if v is not None else 0.0 for v in values]


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
    accumulator: Any = None  # the stream accumulator while streaming (partial response on abort)

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
        if self.backend is not None:
            attributes["gen_ai.system"] = self.backend.kind
            attributes["server.address"] = _host(self.backend.base_url)
        trainable = False
        response = self.response
        if response is not None:
            attributes["rollway.response"] = response
            trainable = self._response_attributes(attributes, response)
        attributes["rollway.trainable"] = trainable
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
            return False  # the Responses API returns no token ids
        choices = response.get("choices") or []
        if not choices:
            return False
        attributes["gen_ai.response.finish_reasons"] = [c.get("finish_reason") for c in choices]
        first = choices[0]
        prompt_ids = response.get("prompt_token_ids")
        if prompt_ids is None:  # vLLM's completions carry them per choice
            prompt_ids = first.get("prompt_token_ids")
        attributes["rollway.prompt_token_ids"] = prompt_ids
        attributes["rollway.response_token_ids"] = first.get("token_ids")
        attributes["rollway.response_logprobs"] = response_logprobs(self.operation, first)
        if len(choices) > 1:
            attributes["rollway.choices"] = [_choice_record(self.operation, c, i) for i, c in enumerate(choices)]
        return prompt_ids is not None and first.get("token_ids") is not None


def _choice_record(operation: str, choice: dict[str, Any], position: int) -> dict[str, Any]:
    """One choice of a call with several, for ``rollway.choices``; a text completion's choice keeps its own
    prompt's token ids (vLLM gives them per choice: a request may hold several prompts)."""
    record = {
        "index": choice.get("index", position),
        "token_ids": choice.get("token_ids"),
        "logprobs": response_logprobs(operation, choice),
        "finish_reason": choice.get("finish_reason"),
    }
    if choice.get("prompt_token_ids") is not None:
        record["prompt_token_ids"] = choice["prompt_token_ids"]
    return record


#: The Responses API's ends in the chat API's words (``incomplete_details.reason``, when it is one of these).
_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}


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
