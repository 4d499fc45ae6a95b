"""Backends of kind ``litellm``: providers that do not speak OpenAI's API (Anthropic, Bedrock, Vertex, ...),
reached through LiteLLM's translation.

LiteLLM is heavy (seconds and ~165 MB to import), so it is imported here, lazily, the first time such a
backend serves a call — never at start-up and never on the path of an OpenAI-compatible backend. Its answers
are turned back into OpenAI JSON and handed to the call as an ``upstream.Answer`` (``LiteLLMAnswer``), the
same seam aiohttp's answers come through, so retries, streaming capture and spans work the same for every kind.
One ``LiteLLMBackend`` per gateway holds the imported module and the provider streams being closed.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from rollway.gateway.errors import UpstreamFailure
from rollway.gateway.upstream import redirected
from rollway.store import Backend

CALLS = {"chat/completions": "acompletion", "completions": "atext_completion", "embeddings": "aembedding"}
STREAM_BROKE = {
    "error": {
        "message": "the backend stream broke",
        "type": "upstream_error",
        "param": None,
        "code": "stream_interrupted",
    }
}
log = logging.getLogger("rollway.gateway")
TRACEBACK = "Traceback (most recent call last):"


class LiteLLMAnswer:
    """``upstream.Answer`` over LiteLLM's result: a whole answer's JSON, or the provider's stream as events."""

    def __init__(
        self, status: int, body: bytes | None = None, stream: Any = None, closing: set[asyncio.Task[Any]] | None = None
    ) -> None:
        self.status = status
        self.headers: Mapping[str, str] = {
            "Content-Type": "text/event-stream" if stream is not None else "application/json"
        }
        self._body = body or b""
        self._stream = stream
        self._closing = closing if closing is not None else set()

    async def read(self, limit: int) -> bytes:
        return self._body

    async def read_error(self) -> bytes:
        return self._body

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._stream is None:
            return
        try:
            async for chunk in self._stream:
                yield b"data: " + orjson.dumps(_plain(chunk)) + b"\n\n"
        except Exception:  # the provider's stream broke: end it with an error event, as for other backends
            log.warning("the stream of a litellm backend broke", exc_info=True)
            yield b"data: " + orjson.dumps(STREAM_BROKE) + b"\n\n"
            return
        yield b"data: [DONE]\n\n"

    def failure(self, exc: Exception) -> UpstreamFailure | None:
        return None  # a provider's stream that breaks ends in an error event instead (``chunks``)

    def release(self) -> None:
        return None

    def close(self) -> None:
        """Stop the provider's stream, and with it the provider's request (the call closes its answer when the
        client went away or the call failed). ``aclose`` is a coroutine: it runs as a task of the running loop,
        held by its backend until done."""
        closer = getattr(self._stream, "aclose", None)
        if closer is not None:
            task = asyncio.get_running_loop().create_task(closer())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None) -> LiteLLMAnswer:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return LiteLLMAnswer(status, orjson.dumps(body))


#: The request fields a ``litellm`` backend takes: OpenAI's parameters of chat completions, completions and
#: embeddings, and provider parameters LiteLLM maps into the provider's request (Anthropic's ``top_k`` and
#: ``thinking``, Gemini's ``safety_settings``, ...). Any other field is refused (400 ``field_not_allowed``):
#: LiteLLM reads every other keyword as a setting of its own — where the call goes (``base_url``), with which
#: credentials (``api_key``, ``aws_*``), its headers, callbacks that post the call to a URL
#: (``success_callback``), a made-up answer (``mock_response``) — and it adds such settings release after
#: release, so only a list of what may pass keeps them the operator's (the backend's) alone.
ALLOWED_FIELDS = frozenset(
    (
        *("messages", "functions", "function_call", "tools", "tool_choice", "parallel_tool_calls", "stream"),
        *("stream_options", "temperature", "top_p", "n", "stop", "max_tokens", "max_completion_tokens", "seed"),
        *("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format"),
        *("user", "modalities", "prediction", "audio", "reasoning_effort", "verbosity", "safety_identifier"),
        *("service_tier", "store", "prompt_cache_key", "web_search_options", "extra_body"),
        *("prompt", "suffix", "echo", "best_of", "input", "dimensions", "encoding_format"),
        *("top_k", "thinking", "safety_settings", "min_p", "repetition_penalty"),
    )
)
#: Accepted and not handed on: the alias (the backend's model is sent), Osmosis's ``rollout_id``, and OpenAI's
#: ``metadata`` (tags for stored completions), where LiteLLM reads per-call logging settings
#: (``langsmith_base_url``, ...).
DROPPED_FIELDS = frozenset({"model", "rollout_id", "metadata"})


def _without_traceback(message: str) -> str:
    """A LiteLLM error's message up to the traceback it appends for a failure of its own code (the server's
    file paths and source lines: not for the client, nor for the span)."""
    cut = message.find(TRACEBACK)
    return message if cut < 0 else message[:cut].rstrip()


def _not_following_redirects(litellm: Any) -> None:
    """Make LiteLLM's HTTP clients (``AsyncHTTPHandler``: the clients of its Anthropic, Bedrock, Vertex, ...
    adapters) not follow redirects unless asked to: they follow them by default, and following one re-posts the
    call, with the provider's key in its headers, to wherever the 3xx points (a loop is retried, tens of times).
    Once this has run, the handler's ``follow_redirects`` parameter defaults to False in this process."""
    init = litellm.llms.custom_httpx.http_handler.AsyncHTTPHandler.__init__
    names = init.__code__.co_varnames[: init.__code__.co_argcount]
    defaults = list(init.__defaults__ or ())
    if "follow_redirects" not in names[len(names) - len(defaults) :]:
        log.warning("LiteLLM's AsyncHTTPHandler has no follow_redirects default: its clients may follow redirects")
        return
    defaults[names.index("follow_redirects") - (len(names) - len(defaults))] = False
    init.__defaults__ = tuple(defaults)


def _redirect(exc: BaseException) -> tuple[int, str | None] | None:
    """The status and ``Location`` of the provider's redirect that ``exc`` reports, or None. LiteLLM wraps the
    provider's 3xx (an ``httpx.HTTPStatusError``) in errors of its own, one of them a 500 with no message, some
    with a copy of the answer without its headers: the answer is found on the chain of causes."""
    status: int | None = None
    location: str | None = None
    seen: BaseException | None = exc
    for _ in range(8):  # (a chain of LiteLLM's wrappers: three deep in 1.110)
        if seen is None:
            break
        response = getattr(seen, "response", None)
        code = getattr(response, "status_code", None)
        if isinstance(code, int) and 300 <= code < 400:
            status = status or code
            location = getattr(response, "headers", {}).get("location")
            if location:
                break
        seen = seen.__cause__ or seen.__context__
    return None if status is None else (status, location)


def _plain(obj: Any) -> Any:
    dump = getattr(obj, "model_dump", None)
    return dump() if dump is not None else obj


class LiteLLMBackend:
    """The calls of this gateway's ``litellm`` backends: LiteLLM imported on the first one, and the provider streams
    being closed (a task needs a reference until it is done)."""

    def __init__(self) -> None:
        self._litellm: Any = None
        self._closing: set[asyncio.Task[Any]] = set()

    async def _load(self) -> Any:
        """LiteLLM, imported once and off the event loop: its import takes seconds, during which every other call
        of the gateway would stall. Its model cost map is read from the installed package (by default LiteLLM
        fetches it from GitHub at import, with retries: a network call, and seconds more, on the serving path);
        both settings are environment variables LiteLLM reads as it is imported."""
        if self._litellm is None:
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            os.environ.setdefault("LITELLM_DISABLE_BUG_REPORT_LINK", "True")  # its errors reach clients and spans
            module: Any = await asyncio.to_thread(importlib.import_module, "litellm")
            module.suppress_debug_info = True  # no banners printed to stdout on provider errors
            _not_following_redirects(module)
            self._litellm = module
        return self._litellm

    async def close(self) -> None:
        """Wait for the provider streams still being closed."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def call(self, backend: Backend, path: str, body: dict[str, Any], timeout: float | None) -> LiteLLMAnswer:
        """Run the call through LiteLLM; provider errors come back as answers with their status and an
        OpenAI-style error body, so the call's retry rules apply unchanged."""
        function_name = CALLS.get(path)
        if function_name is None:
            return _error(400, f"/v1/{path} is not available for litellm backends", "invalid_request_error")
        try:
            litellm = await self._load()
        except ModuleNotFoundError:
            message = "backend kind 'litellm' needs LiteLLM, which is not installed: pip install 'rollway[litellm]'"
            return _error(501, message, "server_error", "litellm_not_installed")
        refused = next((k for k in body if k not in ALLOWED_FIELDS and k not in DROPPED_FIELDS), None)
        if refused is not None:
            message = (
                f"'{refused}' is not accepted by this model (a LiteLLM backend takes OpenAI's parameters and "
                "top_k, thinking, safety_settings, min_p, repetition_penalty; how it is called is the gateway's "
                "setting)"
            )
            return _error(400, message, "invalid_request_error", "field_not_allowed", refused)
        params = {k: v for k, v in body.items() if k not in DROPPED_FIELDS}
        params.update(model=backend.model, api_base=backend.base_url, timeout=timeout)
        if backend.api_key is not None:
            params["api_key"] = backend.api_key.get_secret_value()
        try:
            result = await getattr(litellm, function_name)(**params)
        except litellm.Timeout as exc:  # no answer within the timeout: a 504, like an aiohttp backend's
            raise UpstreamFailure("timeout", f"backend '{backend.backend_id}' timed out") from exc
        except Exception as exc:
            redirect = _redirect(exc)
            if redirect is not None:
                raise UpstreamFailure("redirect", redirected(backend, *redirect)) from exc
            status = int(getattr(exc, "status_code", 500) or 500)
            message = _without_traceback(str(getattr(exc, "message", exc)))
            error = {"error": {"message": message, "type": type(exc).__name__, "param": None, "code": None}}
            return LiteLLMAnswer(status, orjson.dumps(error))
        if body.get("stream"):
            return LiteLLMAnswer(200, stream=result, closing=self._closing)
        return LiteLLMAnswer(200, orjson.dumps(_plain(result)))
