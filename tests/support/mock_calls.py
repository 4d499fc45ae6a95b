"""Calls to a mock backend served in process (an ``httpx`` client over ``ASGITransport``), shared by the tests of
its vLLM and SGLang shapes: a whole answer's body, or a stream's events."""

from __future__ import annotations

from typing import Any

import httpx

from support.gateway_harness import sse_events

MODEL = "tiny"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    },
}


async def post(client: httpx.AsyncClient, path: str, **body: Any) -> Any:
    """A whole answer's body."""
    response = await client.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def stream(
    client: httpx.AsyncClient, path: str, headers: dict[str, str] | None = None, **body: Any
) -> list[tuple[str | None, Any]]:
    """A stream's events as (``event:`` name or None, the data parsed; ``[DONE]`` as is)."""
    response = await client.post(path, json={"model": MODEL, "stream": True, **body}, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return sse_events(response.text)
