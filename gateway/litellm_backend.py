"""Backends of kind ``litellm``: providers that do not speak OpenAI's API (Anthropic, Bedrock, Vertex, ...),
reached through LiteLLM's translation.

LiteLLM is heavy (seconds and ~165 MB to import), so it is imported here, lazily, the first time such a
backend serves a call — never at start-up and never on the path of an OpenAI-compatible backend. Its answers
are turned back into OpenAI JSON and handed to the proxy behind the small part of aiohttp's response
interface the proxy uses, so retries, streaming capture and spans work the same for every kind.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator
from typing import Any

import orjson

from store import Backend

CALLS = {"chat/completions": "acompletion", "completions": "atext_completion", "embeddings": "aembedding"}


class _Content:
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._chunks


class LiteLLMResponse:
    """Looks like the unread ``aiohttp.ClientResponse`` the proxy expects."""

    def __init__(self, status: int, body: bytes | None = None, stream: Any = None) -> None:
        self.status = status
        self.headers = {"Content-Type": "text/event-stream" if stream is not None else "application/json"}
        self._body = body or b""
        self._stream = stream
        self.content = _Content(self._events())

    async def read(self) -> bytes:
        return self._body

    async def _events(self) -> AsyncIterator[bytes]:
        if self._stream is None:
            return
        async for chunk in self._stream:
            yield b"data: " + orjson.dumps(_plain(chunk)) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def release(self) -> None:
        return None

    def close(self) -> None:
        closer = getattr(self._stream, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                coro = closer()
                coro.close()


def _plain(obj: Any) -> Any:
    dump = getattr(obj, "model_dump", None)
    return dump() if dump is not None else obj


async def call(backend: Backend, path: str, body: dict[str, Any], timeout: float | None) -> LiteLLMResponse:
    """Run the call through LiteLLM; provider errors come back as responses with their status and an
    OpenAI-style error body, so the proxy's retry rules apply unchanged."""
    litellm = importlib.import_module("litellm")
    function_name = CALLS.get(path)
    if function_name is None:
        body_bytes = orjson.dumps(
            {
                "error": {
                    "message": f"/v1/{path} is not available for litellm backends",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
        )
        return LiteLLMResponse(400, body_bytes)
    params = {k: v for k, v in body.items() if k not in ("model", "rollout_id")}
    params.update(model=backend.model, api_base=backend.base_url, timeout=timeout)
    if backend.api_key is not None:
        params["api_key"] = backend.api_key.get_secret_value()
    try:
        result = await getattr(litellm, function_name)(**params)
    except Exception as exc:
        status = int(getattr(exc, "status_code", 500) or 500)
        message = str(getattr(exc, "message", exc))
        error = {"error": {"message": message, "type": type(exc).__name__, "param": None, "code": None}}
        return LiteLLMResponse(status, orjson.dumps(error))
    if body.get("stream"):
        return LiteLLMResponse(200, stream=result)
    return LiteLLMResponse(200, orjson.dumps(_plain(result)))
