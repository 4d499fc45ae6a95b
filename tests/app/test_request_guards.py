"""What every request passes before a route sees it (``rollway/app/guards.py``), against a real uvicorn: a bounded
body on the routes outside the data plane, read no further than the bound even without a token; no request sent
by a web page of another origin (cross-site posts), in every mode; only allowed host names while the Host check is
on (DNS rebinding); and only JSON bodies on the data plane (docs/security.md)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from pydantic import ValidationError

from rollway.app.guards import BodyLimit
from rollway.mock import MockBackendProcess
from rollway.settings import Settings, error_summary
from support.gateway_harness import RunningGateway, claim_one, register, running_gateway, vllm

LIMIT = 4096
TOKEN = "admin-token-for-guards"
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


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
    """DNS rebinding: the page's host name now points at 127.0.0.1; its requests still name that host. Without a
    token not even an address is served: a proxy in front would open the admin API to whoever names one."""
    async with httpx.AsyncClient(base_url=open_gw, timeout=10, headers={"Host": host}) as http:
        for response in (
            await http.get("/admin/v1/rollouts"),
            await http.put("/admin/v1/models/evil", json={"backends": [{"base_url": "http://e/v1", "model": "m"}]}),
            await http.post("/v1/chat/completions", json={"model": "policy", "messages": MESSAGES}),
            await http.get("/v1/agl/rollouts"),
        ):
            assert response.status_code == 403, response.text
            assert response.json()["error"]["type"] == "permission_error"


#: The three ways a server may guard itself: no admin token; a token with the data plane open; a token and
#: gateway keys.
MODES: dict[str, dict[str, Any]] = {
    "no admin token": {},
    "admin token": {"admin_token": TOKEN},
    "admin token, gateway keys": {"admin_token": TOKEN, "gateway_auth": "keys"},
}


class Guarded(NamedTuple):
    """A running gateway, the headers of its data plane's calls (a gateway key, when it asks for one) and of its
    admin API (the token, ignored without one)."""

    gw: RunningGateway
    caller: dict[str, str]
    admin: dict[str, str]

    async def nothing_recorded(self, mock: MockBackendProcess) -> None:
        assert await self.gw.store.query_spans(None) == []
        assert (await self.gw.store.get_model("policy")).paused is False
        assert mock.stats()["requests_total"] == 0


@asynccontextmanager
async def guarded(tmp_path: Path, mock: MockBackendProcess, mode: str, **settings: Any) -> AsyncIterator[Guarded]:
    """A gateway in ``mode`` (``MODES``) serving ``policy`` on the mock backend."""
    async with running_gateway(tmp_path, **MODES[mode], **settings) as gw:
        await register(gw.store, "policy", vllm(mock))
        key = (await gw.store.mint_key("gateway"))[1] if mode.endswith("keys") else TOKEN
        yield Guarded(gw, {"Authorization": f"Bearer {key}"}, {"Authorization": f"Bearer {TOKEN}"})


async def _every_route(http: httpx.AsyncClient, g: Guarded) -> list[httpx.Response]:
    """A request to each kind of route, each with the credentials it needs: the data plane, the admin API (which
    the dashboard reads and acts through), the dashboard's pages, Agent-lightning's routes (0.3 and 1.0's
    controlled proxy), the Osmosis callback and the probes."""
    call = {"model": "policy", "messages": MESSAGES}
    return [
        await http.post("/v1/chat/completions", json=call, headers=g.caller),
        await http.post("/v1/chat/completions", content=orjson.dumps(call), headers={"Content-Type": "text/plain"}),
        await http.get("/v1/models", headers=g.caller),
        await http.get("/admin/v1/stats", headers=g.admin),
        await http.post("/admin/v1/models/policy/pause", headers=g.admin),
        await http.get("/ui"),
        await http.get("/v1/agl/rollouts", headers=g.admin),
        await http.post(f"/proxy/rollout/ro-x/attempt/0/mode/train/openai{CHAT}", json=call, headers=g.admin),
        await http.post("/v1/rollout/completed", json={"rollout_id": "ro-x", "status": "success"}, headers=g.admin),
        await http.get("/healthz"),
    ]


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_web_page_of_another_origin_is_refused_on_every_route(
    tmp_path: Path, mock: MockBackendProcess, mode: str
) -> None:
    """A cross-site post (``text/plain``, no preflight: the answer unread, the effect had) or read, whatever the
    server's mode and whatever credentials come with it: from another host, a sandboxed page (``null``), a name
    made to look like loopback, another loopback port, or the server's own port under another loopback name."""
    async with guarded(tmp_path, mock, mode) as g, g.gw.http(timeout=10) as http:
        port = urlsplit(g.gw.url).port
        for origin in (
            "http://attacker.example",
            "null",
            "https://127.0.0.1.attacker.example",
            "http://127.0.0.1:1",
            f"http://localhost:{port}",
        ):
            http.headers["Origin"] = origin
            for response in await _every_route(http, g):
                assert response.status_code == 403, (origin, response.request.url, response.text)
                error = response.json()["error"]
                assert error["type"] == "permission_error" and "web pages of other origins" in error["message"]
        await g.nothing_recorded(mock)


@pytest.mark.parametrize("mode", list(MODES))
async def test_the_servers_own_pages_and_the_public_urls_are_served(
    tmp_path: Path, mock: MockBackendProcess, mode: str
) -> None:
    """The dashboard's requests (``Origin`` is the origin ``Host`` names, under any loopback name), and a proxy in
    front that rewrites ``Host`` to the server's address while the page is at ``ROLLWAY_PUBLIC_URL``."""
    public = "https://rollway.example"
    async with guarded(tmp_path, mock, mode, public_url=public) as g, g.gw.http(timeout=10) as http:
        port = urlsplit(g.gw.url).port
        for host, origin in (
            (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
            (f"localhost:{port}", f"http://LocalHost:{port}"),
            ("rollway.example", "https://rollway.example"),
            (f"127.0.0.1:{port}", public),
        ):
            http.headers.update({"Host": host, "Origin": origin})
            stats = await http.get("/admin/v1/stats", headers=g.admin)
            assert stats.status_code == 200, (host, origin, stats.text)
            call = await http.post(
                "/v1/chat/completions", json={"model": "policy", "messages": MESSAGES}, headers=g.caller
            )
            assert call.status_code == 200, (host, origin, call.text)


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_browsers_request_from_another_site_without_an_origin_is_refused_unless_a_link_was_followed(
    tmp_path: Path, mock: MockBackendProcess, mode: str
) -> None:
    """An ``<img>`` or ``<script>`` of another site's page sends no ``Origin``; ``Sec-Fetch-Site`` says where it
    comes from. A link to the dashboard followed from another site is a navigation, and is served."""
    async with guarded(tmp_path, mock, mode) as g, g.gw.http(timeout=10) as http:
        for site, fetch_mode, path, status in (
            ("cross-site", "no-cors", "/v1/models", 403),
            ("same-site", "no-cors", "/admin/v1/rollouts", 403),
            ("cross-site", "cors", "/v1/agl/rollouts", 403),
            ("cross-site", "navigate", "/ui", 200),
            ("same-origin", "cors", "/v1/models", 200),
            ("none", "navigate", "/admin/v1/stats", 200),
        ):
            credentials = g.admin if path.startswith(("/admin/", "/v1/agl/")) else g.caller
            headers = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": fetch_mode, **credentials}
            response = await http.get(path, headers=headers)
            assert response.status_code == status, (site, fetch_mode, path, response.text)


async def test_with_an_admin_token_and_no_gateway_auth_only_allowed_host_names_are_served(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """The data plane answers whoever reaches it, so a DNS-rebinding page must not be served: it names a host
    whose DNS its author controls. Addresses (agents that reach ``--host 0.0.0.0`` by the machine's IP) cannot be
    rebound, and the machine's own name and ``ROLLWAY_ALLOWED_HOSTS``' names are the operator's."""
    allowed = ["rollway.internal", ".corp.example"]
    async with guarded(tmp_path, mock, "admin token", allowed_hosts=allowed) as g, g.gw.http(timeout=10) as http:
        call = {"model": "policy", "messages": MESSAGES}
        for host in ("attacker.example", "attacker.example:8080", "127.0.0.1.nip.io", "corp.example", "a.b:1:2"):
            for response in (
                await http.post("/v1/chat/completions", json=call, headers={"Host": host}),
                await http.get("/v1/models", headers={"Host": host}),
                await http.get("/admin/v1/stats", headers={"Host": host, **g.admin}),
            ):
                assert response.status_code == 403, (host, response.text)
                assert "ROLLWAY_ALLOWED_HOSTS" in response.json()["error"]["message"]
        for host in (
            "10.1.2.3:8080",
            "[fd00::7]:8080",
            socket.gethostname(),
            "rollway.internal:8080",
            "ROLLWAY.Internal.",
            "gpu-3.corp.example",
        ):
            response = await http.post("/v1/chat/completions", json=call, headers={"Host": host})
            assert response.status_code == 200, (host, response.text)
        assert mock.stats()["requests_total"] == 6


@pytest.mark.parametrize(("mode", "allowed"), [("admin token, gateway keys", []), ("admin token", ["*"])])
async def test_with_gateway_keys_or_every_host_allowed_any_host_is_served(
    tmp_path: Path, mock: MockBackendProcess, mode: str, allowed: list[str]
) -> None:
    """Behind a name the operator has not listed: with gateway keys the data plane answers no one without a key,
    and the token guards the admin API, so the name is not checked; nor is it once ``*`` is allowed."""
    async with guarded(tmp_path, mock, mode, allowed_hosts=allowed) as g:
        headers = {"Host": "rollway.internal", "Origin": "http://rollway.internal"}
        async with g.gw.http(timeout=10, headers=headers) as http:
            assert (await http.get("/admin/v1/stats")).status_code == 401
            assert (await http.get("/admin/v1/stats", headers=g.admin)).status_code == 200
            call = {"model": "policy", "messages": MESSAGES}
            if mode.endswith("keys"):
                assert (await http.post("/v1/chat/completions", json=call)).status_code == 401
            answered = await http.post("/v1/chat/completions", json=call, headers=g.caller)
            assert answered.status_code == 200, answered.text


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("rollway.internal:8080", "http:// or https://"),
        ("ftp://rollway.internal", "http:// or https://"),
        ("http://:8080", "http:// or https://"),
        ("http://rollway.internal:80a", "port"),
    ],
)
def test_a_public_url_the_guard_cannot_read_is_refused_in_the_settings(url: str, says: str) -> None:
    """Its host is allowed and its origin may call: a value without them would leave its clients refused."""
    with pytest.raises(ValidationError) as info:
        Settings(public_url=url)
    assert says in error_summary(info.value)


REFUSED_TYPES = [
    None,
    "text/plain",
    "text/plain; charset=json",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=json",
    "text/json",
    "application/jsonl",
    "application/json-seq",
    "json",
]


async def test_the_data_plane_takes_only_json_content_types(tmp_path: Path, mock: MockBackendProcess) -> None:
    """Every OpenAI client (the SDKs, LiteLLM, Agent-lightning's and Osmosis' agents) sends ``application/json``.
    A page posting across sites without a preflight can send ``text/plain``, a form's types or none: each is a
    415 in the envelope, on every call path, before the body is read, and nothing is recorded."""
    async with running_gateway(tmp_path) as gw, gw.http(timeout=10) as http:
        await register(gw.store, "policy", vllm(mock))
        rollout_id, attempt_id = await claim_one(gw.store)
        body = orjson.dumps({"model": "policy", "messages": MESSAGES})
        paths = [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/embeddings",
            f"/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions",
            "/proxy/rollout/ro-x/attempt/0/mode/train/openai/v1/chat/completions",
        ]
        for content_type in REFUSED_TYPES:
            headers = {} if content_type is None else {"Content-Type": content_type}
            for path in paths:
                response = await http.post(path, content=body, headers=headers)
                assert response.status_code == 415, (content_type, path, response.text)
                assert response.headers["content-type"] == "application/json"
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error" and "application/json" in error["message"]
        assert await gw.store.query_spans(rollout_id) == [] and await gw.store.query_spans(None) == []
        assert mock.stats()["requests_total"] == 0
        for content_type in ("application/json", "Application/JSON; charset=UTF-8", "application/vnd.test+json"):
            call = await http.post(paths[4], content=body, headers={"Content-Type": content_type})
            assert call.status_code == 200, (content_type, call.text)
        # The controlled proxy, past the content type, checks the rollout next.
        proxied = await http.post(paths[5], content=body, headers={"Content-Type": "application/json"})
        assert proxied.status_code == 404, proxied.text
        assert [s.sequence_id for s in await gw.store.query_spans(rollout_id)] == [1, 2, 3]


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
