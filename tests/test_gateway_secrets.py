"""Secrets a gateway holds for others — a backend's API key, an agent server's key — are shown to no one: not when
the server they belong to echoes them back in an error, and not as part of a URL."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import register, running_gateway, serving, vllm
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollway.mock import MockBackendProcess

BACKEND_KEY = "sk-backend-4f1c9a7e2b"
AGENT_KEY = "agent-key-8d2e6b0c93"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("status", "times", "retries"), [(401, 1, 0), (500, None, 1)])
async def test_a_backend_that_echoes_its_key_in_an_error_shows_it_to_no_one(
    tmp_path: Path, mock: MockBackendProcess, status: int, times: int | None, retries: int
) -> None:
    """An answered error (401, passed on) and a retried one (500, the last passed on) each echo the key."""
    async with running_gateway(tmp_path, upstream_retries=retries, retry_max_wait=0.05) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": BACKEND_KEY})
        echoed = {"error": {"message": f"bad key: you sent Authorization: Bearer {BACKEND_KEY}", "type": "auth"}}
        mock.add_faults({"kind": "status", "status": status, "body": echoed, "times": times})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert response.status_code == status
        assert response.json()["error"]["message"] == "bad key: you sent Authorization: Bearer ***"
        assert await gw.state.registry.drain("policy", 10)
        [span] = await gw.store.query_spans(None)
        assert "Bearer ***" in span.attributes["rollway.error"]
        assert BACKEND_KEY not in span.model_dump_json()


async def test_a_backend_that_echoes_its_key_in_an_answer_shows_it_to_no_one(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A 200 answer quoting the request's key (a debugging proxy, a model told to repeat its headers): masked in
    what the client gets and in the span, the rest of the answer as the backend sent it."""
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": BACKEND_KEY})
        message = {"role": "assistant", "content": f"your header was Bearer {BACKEND_KEY}"}
        answer = {"id": "chatcmpl-echo", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
        mock.add_faults({"kind": "status", "status": 200, "body": answer, "times": 1})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "your header was Bearer ***"
        assert await gw.state.registry.drain("policy", 10)
        [span] = await gw.store.query_spans(None)
        assert span.status.status_code == "OK" and BACKEND_KEY not in span.model_dump_json()
        assert "Bearer ***" in span.model_dump_json()


async def test_a_url_holding_credentials_is_refused_without_showing_them(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as admin:
        backend = {"base_url": "http://user:hunter2-secret@127.0.0.1:9/v1", "kind": "vllm", "model": "m"}
        refused = await admin.put("/admin/v1/models/policy", json={"backends": [backend]})
        assert refused.status_code == 400, refused.text
        assert "credentials" in refused.json()["error"]["message"] and "hunter2" not in refused.text
        refused = await admin.put("/admin/v1/agents/a", json={"url": "http://u:hunter2-secret@127.0.0.1:9"})
        assert refused.status_code == 400, refused.text
        assert "credentials" in refused.json()["error"]["message"] and "hunter2" not in refused.text
        assert (await admin.get("/admin/v1/models")).json()["items"] == []


@asynccontextmanager
async def echoing_agent_server() -> AsyncIterator[str]:
    """An agent server that refuses every init with a 401 repeating the headers it got."""

    async def init(request: Request) -> Response:
        return JSONResponse({"detail": f"refused, headers were {dict(request.headers)}"}, status_code=401)

    async with serving(Starlette(routes=[Route("/v1/rollout/init", init, methods=["POST"])])) as url:
        yield url


async def test_an_agent_server_that_echoes_its_key_gets_it_neither_stored_nor_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        echoing_agent_server() as url,
        running_gateway(tmp_path) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as admin,
    ):
        assert (await admin.put("/admin/v1/agents/echo", json={"url": url, "api_key": AGENT_KEY})).status_code == 200
        task: dict[str, Any] = {"rollout_id": "ro-echo", "input": {"messages": MESSAGES}, "agent": "echo"}
        assert (await admin.post("/admin/v1/rollouts", json={"tasks": [task]})).status_code in (200, 201)
        done, pending = await gw.store.wait_for_rollouts(["ro-echo"], 20)
        assert not pending and done[0].status == "failed"
        [attempt] = await gw.store.list_attempts("ro-echo")
        error = (attempt.metadata or {})["dispatch"]["error"]
        assert "401" in error and "Bearer ***" in error  # the echo is there, the key is not
        rollout = await admin.get("/admin/v1/rollouts/ro-echo")
        assert AGENT_KEY not in rollout.text and AGENT_KEY not in error
    assert "refused rollout ro-echo" in caplog.text and AGENT_KEY not in caplog.text


async def test_a_placeholder_key_is_not_masked_in_error_bodies(tmp_path: Path, mock: MockBackendProcess) -> None:
    """Keyless vLLM servers get placeholder keys ("null", "x"): masking them would break the JSON around them."""
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": "null"})
        refusal = {"error": {"message": "bad request", "type": "invalid_request_error", "param": None, "code": None}}
        mock.add_faults({"kind": "status", "status": 400, "body": refusal, "times": 1})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert response.status_code == 400 and response.json() == refusal


async def test_a_backend_that_echoes_its_key_mid_stream_shows_it_to_no_one(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """An error event (``{"error": ...}``, recorded as the span's error) and an event that is not JSON (passed on
    as it came), each echoing the key in the middle of a stream: masked in the stream and in the span."""
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": BACKEND_KEY})
        for echo in (f'{{"error": {{"message": "you sent Bearer {BACKEND_KEY}"}}}}', f"not json: {BACKEND_KEY}"):
            mock.add_faults({"kind": "garbage_event", "after_chunks": 2, "body": echo, "times": 1})
            body = {"model": "policy", "messages": MESSAGES, "stream": True}
            async with httpx.AsyncClient(timeout=10) as http:
                response = await http.post(f"{gw.url}/v1/chat/completions", json=body)
            assert response.status_code == 200 and "data: [DONE]" in response.text
            assert "Bearer ***" in response.text or "not json: ***" in response.text
            assert BACKEND_KEY not in response.text
        assert await gw.state.registry.drain("policy", 10)
        spans = await gw.store.query_spans(None)
        assert len(spans) == 2 and "Bearer ***" in spans[0].attributes["rollway.error"]
        assert all(BACKEND_KEY not in span.model_dump_json() for span in spans)
