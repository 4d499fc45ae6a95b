"""What the gateway asks the backend for beyond the client's request (token ids, logprobs, usage), and what it
strips from the answer so that the client gets what a direct call would answer (``gateway.record`` reads the
span's token ids from the backend's full answer)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rollway.gateway.errors import UpstreamFailure
from rollway.gateway.litellm_backend import ALLOWED_FIELDS
from rollway.gateway.record import choice_token_ids, response_logprobs
from rollway.gateway.upstream import Answer
from rollway.store import Backend

OPERATIONS = {
    "chat/completions": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "responses",
}
TOKEN_ID_KINDS = frozenset({"vllm", "sglang"})
#: Kinds whose streams are not asked for their usage chunk: vLLM moves ``system_fingerprint`` from each choice's
#: last chunk onto it, so a client that did not ask for usage would lose it. The span's usage is counted from the
#: stream's token ids instead (``StreamAccumulator``).
NO_USAGE_ASKED = frozenset({"vllm"})
#: The parts of SGLang's ``sglext`` stream chunk: the prompt's token ids and each choice's.
SGLEXT_PARTS = ("input_ids", "output_ids")
#: What the Responses API is asked for to include the output's logprobs.
RESPONSE_LOGPROBS = "message.output_text.logprobs"


@dataclass
class Injected:
    """What the gateway added to the request that the client did not ask for (and so strips)."""

    token_ids: bool = False
    logprobs: bool = False
    usage: bool = False
    #: The backend writes ``"usage": null`` into stream chunks whatever was asked (SGLang's text completions):
    #: a null usage is then its own, not the gateway's, and stays.
    null_usage_is_native: bool = False
    #: Responses API: ``enable_response_messages`` (the prompt's and output's token ids) and ``top_logprobs``.
    messages: bool = False
    top_logprobs: bool = False
    #: SGLang: fields not asked for are left out of its answers (not ``null``); a streamed chat's token ids come
    #: in one extra chunk (``sglext``) after the last choice's.
    absent: bool = False
    #: The parts of SGLang's ``sglext`` chunk the gateway asked for (``input_ids``, ``output_ids``).
    sglext: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return self.token_ids or self.logprobs or self.usage or self.messages


log = logging.getLogger("rollway.gateway")


class StreamOptionsRefusals:
    """The backends (ids) that refused the ``stream_options`` the gateway added (an OpenAI-compatible server that
    does not know it): not sent to them again by this gateway, whose streams' spans then have no usage."""

    def __init__(self) -> None:
        self._backends: set[str] = set()

    def __contains__(self, backend_id: object) -> bool:
        return backend_id in self._backends

    async def refused(self, answer: Answer, backend: Backend, limit: int) -> bool:
        """Whether ``answer`` is a 400 that names ``stream_options``, from an ``openai``-kind backend (vLLM and
        SGLang know it): the answer is then released, and the call asked again without it (``remember``)."""
        if backend.kind != "openai" or answer.status != 400:
            return False
        try:
            body = await answer.read(limit)  # kept by the answer: read again when it is passed on
        except UpstreamFailure:
            return False
        if b"stream_options" not in body:
            return False
        answer.release()
        return True

    def remember(self, backend: Backend, status: int) -> None:
        """Take the answer to a call asked again without ``stream_options``: if the backend took it, it is one
        that does not know them (remembered); if it refused that too, the first refusal was about something
        else (a client's own ``stream_options``, an error message that quotes the request): nothing is kept."""
        if status < 400 and backend.backend_id not in self._backends:
            self._backends.add(backend.backend_id)
            log.warning("backend '%s' refused stream_options: its streams' spans have no usage", backend.backend_id)


def prepare(
    operation: str, body: dict[str, Any], backend: Backend, sampling: dict[str, Any] | None, usage: bool = True
) -> tuple[dict[str, Any], Injected]:
    """The body sent upstream: upstream model name, alias sampling defaults, capture fields (stream usage only
    when ``usage``: not for a backend that refused ``stream_options``). A ``litellm`` backend gets only the
    defaults it takes (``litellm_backend.ALLOWED_FIELDS``): an alias's vLLM defaults would otherwise fail every
    call it serves."""
    upstream = dict(body)
    upstream.pop("rollout_id", None)
    upstream["model"] = backend.model
    for key, value in (sampling or {}).items():
        if backend.kind != "litellm" or key in ALLOWED_FIELDS:
            upstream.setdefault(key, value)
    injected = Injected()
    if operation == "responses" and backend.kind == "vllm":
        _ask_response_tokens(upstream, injected)
        return upstream, injected
    if operation not in ("chat", "text_completion") or backend.kind == "litellm":
        return upstream, injected
    # vLLM leaves the prompt's text out of an echo that asked for token ids, and logprobs make it compute (and
    # answer) the prompt's: the client's echo gets neither, and its span no token ids (not trainable).
    echo = operation == "text_completion" and upstream.get("echo") and not upstream.get("return_token_ids")
    token_ids = backend.kind in TOKEN_ID_KINDS and not echo
    options = upstream.get("stream_options") or {}
    usage = usage and backend.kind not in NO_USAGE_ASKED
    if upstream.get("stream") and isinstance(options, dict) and usage:
        # Usage (tokens, cached tokens) for the span, from every OpenAI-compatible kind; a ``stream_options``
        # that is not an object goes as it came (the backend refuses it, as it would a direct call).
        options = dict(options)
        if not options.get("include_usage"):
            options["include_usage"] = True
            upstream["stream_options"] = options
            injected.usage = True
            injected.null_usage_is_native = backend.kind == "sglang"
    if not token_ids:
        return upstream, injected
    injected.absent = backend.kind == "sglang"
    if injected.absent and operation == "chat" and upstream.get("stream"):
        # SGLang refuses ``return_token_ids`` on a streamed chat (400, as a direct call); its ids come in an
        # ``sglext`` chunk, whose parts the client did not ask for are taken out again.
        if not upstream.get("return_token_ids"):
            for part in SGLEXT_PARTS:
                if not upstream.get(f"return_{part}_in_sglext"):
                    upstream[f"return_{part}_in_sglext"] = True
                    injected.sglext += (part,)
            injected.token_ids = bool(injected.sglext)
    elif not upstream.get("return_token_ids"):
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


def _ask_response_tokens(upstream: dict[str, Any], injected: Injected) -> None:
    """A Responses API call to vLLM: ask for the prompt's and output's token ids (``enable_response_messages``,
    which vLLM does not give to a ``background`` response) and the output's logprobs (``include``)."""
    if upstream.get("background"):
        return
    if not upstream.get("enable_response_messages"):
        upstream["enable_response_messages"] = True
        injected.messages = True
    include = upstream.get("include")
    if include is None or (isinstance(include, list) and RESPONSE_LOGPROBS not in include):
        upstream["include"] = [*(include or []), RESPONSE_LOGPROBS]
        injected.logprobs = True
        if upstream.get("top_logprobs") is None:
            upstream["top_logprobs"] = 0
            injected.top_logprobs = True


def stripped(body: dict[str, Any], injected: Injected) -> dict[str, Any]:
    """A copy of a response (or one stream chunk) without what the client did not ask for.

    Fields are reset to ``null``, the way vLLM answers a request that did not ask for them."""
    out = dict(body)
    if injected.token_ids and "prompt_token_ids" in out:
        _reset(out, "prompt_token_ids", injected.absent)
    if injected.usage and (out.get("usage") is not None or not injected.null_usage_is_native):
        out.pop("usage", None)
    choices = out.get("choices")
    if choices and (injected.token_ids or injected.logprobs):
        new_choices = []
        for choice in choices:
            choice = dict(choice)
            if injected.token_ids:
                for key in _CHOICE_ID_KEYS:
                    if key in choice:
                        _reset(choice, key, injected.absent)
            if injected.logprobs and "logprobs" in choice:
                choice["logprobs"] = None
            new_choices.append(choice)
        out["choices"] = new_choices
    return out


#: Where a choice carries token ids: vLLM's ``token_ids`` (and a completion's ``prompt_token_ids``), SGLang's
#: chat ``response_token_ids`` and ``prompt_token_ids``.
_CHOICE_ID_KEYS = ("token_ids", "prompt_token_ids", "response_token_ids")


def _reset(data: dict[str, Any], key: str, absent: bool) -> None:
    """A field the client did not ask for, as the backend answers without it: left out, or ``null``."""
    if absent:
        del data[key]
    else:
        data[key] = None


def stripped_response(response: dict[str, Any], injected: Injected) -> dict[str, Any]:
    """A Responses API response object without what the gateway asked for and the client did not: its token
    messages and top_logprobs reset to ``null``, and its output text's logprobs too (as vLLM answers a request
    that did not include them)."""
    out = dict(response)
    if injected.messages:
        for key in ("input_messages", "output_messages"):
            if key in out:
                out[key] = None
    if injected.top_logprobs and "top_logprobs" in out:
        out["top_logprobs"] = None
    if injected.logprobs and isinstance(out.get("output"), list):
        out["output"] = [_item_without_logprobs(item) for item in out["output"]]
    return out


def _item_without_logprobs(item: Any) -> Any:
    if not isinstance(item, dict) or not isinstance(item.get("content"), list):
        return item
    return item | {"content": [_part_without_logprobs(part, None) for part in item["content"]]}


def _part_without_logprobs(part: Any, empty: list[Any] | None) -> Any:
    if not isinstance(part, dict) or part.get("type") != "output_text" or "logprobs" not in part:
        return part
    return part | {"logprobs": empty}


def shown_event(event: dict[str, Any], injected: Injected) -> dict[str, Any]:
    """A Responses API stream event as the client gets it: text deltas' logprobs empty (``[]``), finished parts'
    and items' logprobs ``null``, and the response objects stripped (``stripped_response``)."""
    response = event.get("response")
    if isinstance(response, dict):
        return event | {"response": stripped_response(response, injected)}
    if not injected.logprobs:
        return event
    kind = event.get("type")
    if kind == "response.output_text.delta" and "logprobs" in event:
        return event | {"logprobs": []}
    if kind == "response.content_part.done" and "part" in event:
        return event | {"part": _part_without_logprobs(event["part"], None)}
    if kind == "response.output_item.done" and "item" in event:
        return event | {"item": _item_without_logprobs(event["item"])}
    return event


def answer(body: dict[str, Any], injected: Injected, operation: str) -> dict[str, Any]:
    """A whole answer as the client gets it: without what the gateway asked for and the client did not."""
    return stripped_response(body, injected) if operation == "responses" else stripped(body, injected)


def shown(chunk: dict[str, Any], injected: Injected) -> dict[str, Any] | None:
    """A stream chunk as the client gets it (``stripped``), or None when the backend sent it only for what the
    gateway asked: the usage chunk, and a chat chunk for a token whose delta says nothing (a tool call's markup
    its parser holds back, part of a UTF-8 character): vLLM sends those, as ``delta: {}``, only to a request that
    asked for token ids or logprobs, so a client that asked for neither gets none of them."""
    if injected.usage and is_usage_only_chunk(chunk):
        return None
    if injected.sglext and isinstance(chunk.get("sglext"), dict) and not chunk.get("choices"):
        ext = {k: v for k, v in chunk["sglext"].items() if k not in injected.sglext}
        return (chunk | {"sglext": ext}) if ext else None
    if injected.token_ids and injected.logprobs and _held_back(chunk):
        return None
    return stripped(chunk, injected)


def _held_back(chunk: dict[str, Any]) -> bool:
    """A chat chunk whose every choice has a delta that says nothing (``{}``, or only nulls: SGLang's
    ``{"reasoning_content": null}``) and no finish reason: what else it carries -- token ids, logprobs,
    continuous usage -- a request that asked for neither token ids nor logprobs would not have been sent."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:  # (loops, not ``all``/``any`` over generators: this runs for every chunk)
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return False
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return False
        for value in delta.values():
            if value is not None:
                return False
    return True


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
        "token_ids": choice_token_ids(first),
        "logprobs": response_logprobs(operation, first),
        "prompt_token_ids": prompt_ids,
    }


def is_usage_only_chunk(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and chunk.get("usage") is not None
