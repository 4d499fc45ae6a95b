"""What every request passes before a route sees it (``rollway/app/guards.py``): a bounded body on the routes outside
the data plane, read no further than the bound even without a token; and, with no admin token, only requests
addressed to loopback and not sent by a web page of another host (DNS rebinding, cross-site posts)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from rollway.app.guards import BodyLimit
from rollway.mock import MockBackendProcess
from support.gateway_harness import register, running_gateway, vllm

LIMIT = 4096
TOKEN = "admin-token-for-guards"
MESSAGES = [{"role": "user", "content": "hi"}]


def _chunks(size: int) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        yield b'{"tasks": [{"input": "'
        for _ in range(size // 1024):
            yield b"x" * 1024
        yield b'"}]}'

    return gen()


@pytest.mark.parametrize("path", ["/admin/v1/rollouts", "/v1/agl/rollouts", "/v1/rollout/completed"])
async def test_a_body_over_the_limit_is_a_413_before_the_token_is_checked(tmp_path: Path, path: str) -> None:
    """Declared (``Content-Length``) or not (chunked), with no token, a wrong one or the right one."""
    async with (
        running_gateway(tmp_path, admin_token=TOKEN, max_body_bytes=LIMIT) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}"}):
            headers |= {"Content-Type": "application/json"}
            declared = await http.post(path, content=b'{"x": "' + b"x" * 2 * LIMIT + b'"}', headers=headers)
            assert declared.status_code == 413, (headers, declared.text)
            assert declared.json()["error"]["message"] == f"the request body is larger than {LIMIT} bytes"
            chunked = await http.post(path, content=_chunks(2 * LIMIT), headers=headers)
            assert chunked.status_code == 413, (headers, chunked.text)
            assert chunked.json()["error"]["type"] == "invalid_request_error"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        enqueued = await http.post("/admin/v1/rollouts", json={"tasks": [{"input": 1}]}, headers=auth)
        assert enqueued.status_code == 201, enqueued.text
        assert len((await http.get("/admin/v1/rollouts", headers=auth)).json()["items"]) == 1  # only that one


@pytest.fixture
async def open_gw(tmp_path: Path, mock: MockBackendProcess) -> AsyncIterator[str]:
    """A gateway with no admin token (loopback only), serving an alias."""
    async with running_gateway(tmp_path, public_url="http://rollway.test:9999") as gw:
        await register(gw.store, "policy", vllm(mock))
        yield gw.url


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:80", "127.0.0.1.nip.io", "10.0.0.1"])
async def test_without_an_admin_token_a_request_for_another_host_is_refused(open_gw: str, host: str) -> None:
    """DNS rebinding: the page's host name now points at 127.0.0.1; its requests still name that host."""
    async with httpx.AsyncClient(base_url=open_gw, timeout=10, headers={"Host": host}) as http:
        for response in (
            await http.get("/admin/v1/rollouts"),
            await http.put("/admin/v1/models/evil", json={"backends": [{"base_url": "http://e/v1", "model": "m"}]}),
            await http.post("/v1/chat/completions", json={"model": "policy", "messages": MESSAGES}),
            await http.get("/v1/agl/rollouts"),
        ):
            assert response.status_code == 403, response.text
            assert response.json()["error"]["type"] == "permission_error"


@pytest.mark.parametrize("origin", ["http://attacker.example", "null", "https://127.0.0.1.attacker.example"])
async def test_without_an_admin_token_a_web_page_of_another_host_is_refused(open_gw: str, origin: str) -> None:
    """A cross-site post (``text/plain`` and no preflight; the answer unread, the effect had)."""
    async with httpx.AsyncClient(base_url=open_gw, timeout=10, headers={"Origin": origin}) as http:
        paused = await http.post("/admin/v1/models/policy/pause")
        assert paused.status_code == 403, paused.text
        call = await http.post(
            "/v1/chat/completions",
            content=b'{"model": "policy", "messages": [{"role": "user", "content": "hi"}]}',
            headers={"Content-Type": "text/plain; x=json"},
        )
        assert call.status_code == 403, call.text
    async with httpx.AsyncClient(base_url=open_gw, timeout=10) as http:
        assert (await http.get("/admin/v1/models/policy")).json()["state"]["paused"] is False


@pytest.mark.parametrize(
    ("host", "origin"),
    [
        (None, None),
        ("localhost:8080", "http://localhost:3000"),
        ("[::1]:8080", "http://127.0.0.1:8888"),
        ("rollway.test:9999", "http://app.localhost"),
    ],
)
async def test_without_an_admin_token_loopback_names_and_the_public_url_pass(
    open_gw: str, host: str | None, origin: str | None
) -> None:
    headers = {k: v for k, v in (("Host", host), ("Origin", origin)) if v is not None}
    async with httpx.AsyncClient(base_url=open_gw, timeout=10, headers=headers) as http:
        assert (await http.get("/admin/v1/stats")).status_code == 200
        call = await http.post("/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert call.status_code == 200, call.text


async def test_with_an_admin_token_any_host_is_served_as_usual(tmp_path: Path, mock: MockBackendProcess) -> None:
    """Beyond loopback, behind a name: the token guards the admin API; the host is not checked."""
    async with running_gateway(tmp_path, admin_token=TOKEN) as gw:
        await register(gw.store, "policy", vllm(mock))
        headers = {"Host": "rollway.internal", "Origin": "http://dashboard.internal"}
        async with httpx.AsyncClient(base_url=gw.url, timeout=10, headers=headers) as http:
            assert (await http.get("/admin/v1/stats")).status_code == 401
            stats = await http.get("/admin/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
            assert stats.status_code == 200
            call = await http.post("/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
            assert call.status_code == 200, call.text


async def test_the_body_timeout_bounds_the_body_not_the_wait_for_the_client_to_leave() -> None:
    """``ROLLWAY_BODY_TIMEOUT`` is the time the body has to arrive. A route that answers for longer (a streamed
    triplet export: Starlette's ``StreamingResponse`` waits on ``receive()`` for ``http.disconnect`` the whole
    time under ASGI 2.3, as uvicorn speaks it) still hears its client leave, not a 408 in the middle of it."""
    settings = SimpleNamespace(max_body_bytes=LIMIT, body_timeout=0.1)
    scope = {"type": "http", "headers": []}
    body = [{"type": "http.request", "body": b"{}", "more_body": False}]
    left = asyncio.Event()
    heard: list[str] = []

    async def receive() -> dict[str, Any]:
        if body:
            return body.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def route(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        asyncio.get_running_loop().call_later(0.3, left.set)  # the client leaves after the body's bound
        heard.append((await receive())["type"])

    async def send(message: Any) -> None:
        raise AssertionError(message)

    await asyncio.wait_for(BodyLimit(route, settings)(scope, receive, send), 5)  # type: ignore[arg-type]
    assert heard == ["http.disconnect"]
