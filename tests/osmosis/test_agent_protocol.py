"""Which Osmosis protocol an agent server is sent its attempts in, against fake servers on loopback
(``support.fake_agents``): the one it is registered with, else the one its ``/health`` tells, asked again while
the answer tells nothing, and never a protocol guessed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from rollway.osmosis import restarts, wire
from rollway.store import AgentServer
from support.fake_agents import finish, one_task, serving
from support.gateway_harness import running_gateway


class V1Inits:
    """A v1 agent server's init route: it records the path, and reports each rollout completed (reward 1.0) to
    Rollway's callback at once, through ``http`` (set once the test's client is open)."""

    def __init__(self, sent: list[str]) -> None:
        self.sent = sent
        self.reports: list[asyncio.Future[httpx.Response]] = []
        self.http: httpx.AsyncClient | None = None

    async def route(self, request: web.Request) -> web.Response:
        self.sent.append(request.path)
        body = await request.json()
        assert self.http is not None
        report = {"rollout_id": body["rollout_id"], "status": "COMPLETED", "reward": 1.0}
        headers = {"Authorization": f"Bearer {body['api_key']}"}
        url = f"{body['server_url']}/v1/rollout/completed"
        self.reports.append(asyncio.ensure_future(self.http.post(url, json=report, headers=headers)))
        return web.json_response({"rollout_id": body["rollout_id"]}, status=202)


pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("status", "health", "spoken", "passing"),
    [
        (200, {"status": "ok", "process_id": "p-1", "lifecycle": {"accepting_rollouts": True}}, "0.3", False),
        (200, {"status": "ok"}, "v1", False),
        (200, {"status": "ok", "process_id": "p-1"}, "v1", False),
        (204, None, "v1", False),
        *((status, {"detail": "no"}, "v1", False) for status in (400, 404, 405, 410, 422)),
        *((status, {"detail": "no"}, None, False) for status in (401, 403, 307)),
        *((status, {"detail": "no"}, None, True) for status in (408, 429, 500, 502, 503)),
    ],
)
async def test_a_protocol_is_told_only_by_a_clear_health_answer(
    status: int, health: dict[str, Any] | None, spoken: str | None, passing: bool
) -> None:
    """``/health`` tells a 0.3 server from a v1 one, and the dispatcher keeps the answer for the registration: a
    4xx no 0.3 server gives (404, 405, 400, 410, 422) is v1's; a 5xx, 401, 403, 408, 429 or redirect (a 0.3
    server failing, busy or refusing the key) tells nothing; a 408, 429 or 5xx may pass, so it is asked again,
    and the answer is kept as text for the attempt's error."""

    async def answer(request: web.Request) -> web.Response:
        if health is None:
            return web.Response(status=status)
        return web.json_response(health, status=status, headers={"Location": "/elsewhere"})

    async with serving(web.get("/health", answer)) as url, aiohttp.ClientSession() as session:
        probed = await wire.probe(session, AgentServer(name="a", url=url))
    assert (probed.spoken, probed.passing) == (spoken, passing)
    refused = " (no api key is registered)" if status in (401, 403) else ""
    assert probed.said == ("" if spoken else f'GET {url}/health answered {status}: {{"detail":"no"}}{refused}')


async def test_a_health_refusing_the_registered_key_says_so() -> None:
    """A 401 from ``/health`` (a 0.3 server's answer to a wrong key) is not taken for v1: the probe sends the
    registered key, and the answer says it was refused, masked."""
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"detail": f"unauthorized: {request.headers['Authorization']}"}, status=401)

    async with serving(web.get("/health", answer)) as url, aiohttp.ClientSession() as session:
        probed = await wire.probe(session, AgentServer(name="a", url=url, api_key="srv-key"))
    assert (probed.spoken, probed.passing, seen) == (None, False, ["Bearer srv-key"])
    refusal = 'answered 401: {"detail":"unauthorized: Bearer ***"} (the registered api key was refused)'
    assert probed.said == f"GET {url}/health {refusal}"


@pytest.mark.parametrize("health", ["none", 400, 410, 422])
async def test_a_v1_server_without_a_usable_health_gets_its_init(tmp_path: Path, health: str | int) -> None:
    """A v1 server registered without a protocol whose ``GET /health`` is no route of its own (aiohttp's 405 to
    a GET on a catch-all POST route) or is refused (400, 410, a strict validator's 422) is sent v1's init, and
    its rollout succeeds: no 0.3 server answers so."""
    inits: list[str] = []
    init = V1Inits(inits)

    async def refused(request: web.Request) -> web.Response:
        return web.json_response({"detail": "refused"}, status=int(health))

    routes = [web.post("/{tail:.*}", init.route)] + ([] if health == "none" else [web.get("/health", refused)])
    async with httpx.AsyncClient() as init.http, serving(*routes) as url:
        rollout, attempt = await one_task(tmp_path, url, "v1-plain")
        assert [(await report).status_code for report in init.reports] == [200]
    assert rollout.status == "succeeded", attempt.metadata
    assert inits == ["/v1/rollout/init"]


async def test_a_health_answer_that_tells_nothing_is_asked_again_before_the_attempt_is_sent(tmp_path: Path) -> None:
    """A 0.3 server whose ``/health`` first answers 503 and then not JSON (a proxy's error page) is asked again,
    with the init's backoff, until it answers clearly; the attempt is then admitted as 0.3, never sent as v1's
    init (which a 0.3 server answers 404)."""
    answers = [web.json_response({"detail": "starting"}, status=503), web.Response(status=502, text="<html>")]
    v1_inits: list[str] = []

    async def health(request: web.Request) -> web.Response:
        if answers:
            return answers.pop(0)
        return web.json_response({"status": "ok", "process_id": "p-1", "lifecycle": {"accepting_rollouts": True}})

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response({"rollout_id": rollout_id, "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        sample = {"reward": 1.0, "messages": []}
        return web.json_response({"rollout_id": request.match_info["id"], "status": "success", "sample": sample})

    async def v1_init(request: web.Request) -> web.Response:
        v1_inits.append(request.path)
        return web.json_response({"detail": "Not Found"}, status=404)

    routes = [
        web.get("/health", health),
        web.post("/rollout", admit),
        web.get("/rollout/{id}/result", result),
        web.post("/v1/rollout/init", v1_init),
    ]
    async with serving(*routes) as url:
        rollout, attempt = await one_task(tmp_path, url, "starting")
    assert rollout.status == "succeeded", attempt.metadata
    assert answers == [] and v1_inits == []
    assert (attempt.metadata or {})["dispatch"]["protocol"] == "osmosis-0.3"


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (503, b'{"detail": "shutting down"}', "answered 503"),
        (500, b"<html>oops</html>", "answered 500"),
        (0, b"", "had no answer within 0.3 s"),  # (0: slower than the read's bound)
    ],
)
async def test_a_health_that_never_tells_the_protocol_fails_the_attempt_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int, body: bytes, said: str
) -> None:
    """A server whose ``/health`` gives no clear answer on any try (an error, a body that is not JSON, no answer
    in time) fails the attempt with an error that names that answer and says the protocol is unknown, rather than
    being sent v1's init and failing with its "not found"."""
    monkeypatch.setattr(restarts, "HEALTH_TIMEOUT", 0.3)
    probes: list[float] = []
    inits: list[str] = []

    async def health(request: web.Request) -> web.Response:
        probes.append(time.monotonic())
        if status == 0:
            await asyncio.sleep(1.0)  # a server too slow to answer: the read gives up at 0.3 s
        return web.Response(status=status or 200, body=body, content_type="application/json")

    async def init(request: web.Request) -> web.Response:
        inits.append(request.path)
        return web.json_response({"detail": "Not Found"}, status=404)

    async with serving(web.get("/health", health), web.post("/{tail:.*}", init)) as url:
        rollout, attempt = await one_task(tmp_path, url, "unclear")
    error = (attempt.metadata or {})["dispatch"]["error"]
    assert rollout.status == "failed" and inits == []
    assert f"{url}/health {said}" in error and "protocol" in error and "after 4 tries" in error, error
    assert len(probes) == 4  # the first try and ROLLWAY_AGENT_INIT_RETRIES (3) more


@pytest.mark.parametrize("protocol", ["v1", "0.3"])
async def test_a_server_registered_with_its_protocol_is_never_asked_its_health(tmp_path: Path, protocol: str) -> None:
    """A server registered with ``protocol`` is sent its attempts in that protocol without a read of its
    ``/health``, which here never tells (503): the rollout succeeds. A 0.3 server's ``/health`` is read only
    once its rollout is polled (for a restart), never before its admission. A protocol Rollway does not speak is
    a 400."""
    health_reads: list[str] = []
    sent: list[str] = []

    async def health(request: web.Request) -> web.Response:
        health_reads.append("after" if sent else "before")
        return web.json_response({"detail": "busy"}, status=503)

    async def admit(request: web.Request) -> web.Response:
        sent.append(request.path)
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response({"rollout_id": rollout_id, "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        sample = {"reward": 1.0, "messages": []}
        return web.json_response({"rollout_id": request.match_info["id"], "status": "success", "sample": sample})

    init = V1Inits(sent)
    routes = [
        web.get("/health", health),
        web.post("/rollout", admit),
        web.get("/rollout/{id}/result", result),
        web.post("/v1/rollout/init", init.route),
    ]
    async with (
        serving(*routes) as url,
        running_gateway(tmp_path) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        init.http = http
        bad = await http.put("/admin/v1/agents/known", json={"url": url, "protocol": "0.2"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "protocol", bad.text
        put = await http.put("/admin/v1/agents/known", json={"url": url, "protocol": protocol})
        assert put.status_code == 200 and put.json()["protocol"] == protocol
        task = {"rollout_id": "ro-known", "input": "x", "agent": "known"}
        await http.post("/admin/v1/rollouts", json={"tasks": [task]})
        [rollout] = await finish(gw, ["ro-known"], timeout=20)
        assert [(await answer).status_code for answer in init.reports] == ([200] if protocol == "v1" else [])
        [attempt] = await gw.store.list_attempts("ro-known")
    assert rollout.status == "succeeded", attempt.metadata
    assert sent == ["/rollout" if protocol == "0.3" else "/v1/rollout/init"]
    assert "before" not in health_reads
