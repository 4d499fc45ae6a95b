"""Remote agent servers end to end (Osmosis protocol, docs/remote-agents.md): the example agent server runs as its own
process on loopback, the gateway (real uvicorn) dispatches tasks to it and serves its chat calls in front of
the mock backend process; completions, rewards, retries and faults are checked in the store."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from rollway.mock import MockBackendProcess
from rollway.osmosis import dispatcher, restarts, v03, wire
from rollway.osmosis.dispatcher import Dispatcher
from rollway.settings import Settings
from rollway.store import AgentServer, Attempt, Rollout, Span, UnavailableError
from support.agent_server import AgentServerProcess
from support.gateway_harness import RunningGateway, register, replay, running_gateway

pytestmark = pytest.mark.slow

MOCK_BACKEND = {"backend_id": "mock", "kind": "vllm", "model": "mock-model"}
PARAMS = {"model": "policy", "max_tokens": 24, "temperature": 1.0}


@pytest.fixture
def agent_server(request: pytest.FixtureRequest) -> Iterator[AgentServerProcess]:
    marker = request.node.get_closest_marker("agent_args")
    with AgentServerProcess(*(marker.args if marker else ())) as process:
        yield process


def problems(count: int, seed: int = 3) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        out.append((f"What is {a} + {b}? Reply 'The answer is N.'", a + b))
    return out


async def finish(gw: RunningGateway, ids: list[str], timeout: float = 90) -> list[Rollout]:
    deadline = time.monotonic() + timeout
    while True:
        done, pending = await gw.store.wait_for_rollouts(ids, min(20.0, max(deadline - time.monotonic(), 0.1)))
        if not pending:
            by_id = {r.rollout_id: r for r in done}
            return [by_id[i] for i in ids]
        assert time.monotonic() < deadline, f"{len(pending)} rollouts still running, e.g. {pending[:3]}"


def llm_spans(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


@pytest.mark.agent_args("--chat-auth", "none")
async def test_32_tasks_for_a_remote_agent_server_are_dispatched_answered_and_recorded(
    tmp_path: Path, mock: MockBackendProcess, agent_server: AgentServerProcess
) -> None:
    async with running_gateway(tmp_path, watchdog_interval=0.2) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url}, version="v1")
        put = await admin.put(
            "/admin/v1/agents/math",
            json={"url": agent_server.url, "max_concurrent": 8, "completion_params": PARAMS, "api_key": "srv-key"},
        )
        assert put.status_code == 200 and put.json()["has_api_key"] is True and "srv-key" not in put.text
        tasks = [
            {"input": {"question": q}, "metadata": {"answer": a}, "agent": "math", "config": {"timeout_seconds": 60}}
            for q, a in problems(8)
        ]
        # 8 prompts x 4 samples, plus 24 more single tasks = 32 rollouts
        enqueued = await admin.post("/admin/v1/rollouts", json={"tasks": [t | {"group_size": 4} for t in tasks]})
        assert enqueued.status_code == 201
        rollouts = enqueued.json()["rollouts"]
        assert len(rollouts) == 32 and {r["agent"] for r in rollouts} == {"math"}
        ids = [r["rollout_id"] for r in rollouts]
        assert await gw.store.claim("a-runner", limit=100) == []  # runners never get agent tasks

        finished = await finish(gw, ids)
        failed = [r.rollout_id for r in finished if r.status != "succeeded"]
        assert not failed, [await gw.store.list_attempts(r) for r in failed[:2]]
        health = agent_server.health()
        assert health["completed"] == 32 and health["inits"] == 32, health  # dispatched once, completed once

        intervals, rewards_seen = [], []
        expected = {r["rollout_id"]: r["metadata"]["answer"] for r in rollouts}
        question = {r["rollout_id"]: r["input"]["question"] for r in rollouts}
        triplets = (await admin.get("/admin/v1/triplets", params={"rollout_id": ids, "limit": 100})).json()["items"]
        by_rollout: dict[str, list[dict[str, Any]]] = {}
        for t in triplets:
            by_rollout.setdefault(t["rollout_id"], []).append(t)
        for rollout_id in ids:
            [attempt] = await gw.store.list_attempts(rollout_id)
            assert attempt.worker_id == "agent:math" and attempt.end_time is not None
            intervals.append((attempt.start_time, attempt.end_time))
            meta = attempt.metadata or {}
            assert meta["dispatch"]["tools"][0]["function"]["name"] == "calculator"
            completion = meta["completion"]
            assert completion["status"] == "COMPLETED" and completion["metrics"]["num_llm_calls"] == 2

            spans = await gw.store.query_spans(rollout_id, "latest")
            calls = llm_spans(spans)
            assert len(calls) == 2, spans  # routed by the body's rollout_id alone (no key on chat calls)
            assert all(c.attributes["rollway.request"]["messages"][0]["content"] == question[rollout_id] for c in calls)
            assert all("rollout_id" not in c.attributes["rollway.request"] for c in calls)  # not forwarded
            rewards = [s.attributes["rollway.reward.value"] for s in spans if s.name == "rollway.reward"]
            assert rewards == [completion["reward"]] and spans[-1].name == "rollway.reward"
            rewards_seen.append(completion["reward"])
            last_text = calls[-1].attributes["rollway.response"]["choices"][0]["message"]["content"]
            assert completion["reward"] == (1.0 if f"answer is {expected[rollout_id]}." in last_text else 0.0)
            # The agent got TrainGate's token fields: its token counts are the spans'.
            metrics = completion["metrics"]
            assert metrics["response_tokens"] == sum(len(c.attributes["rollway.response_token_ids"]) for c in calls)
            assert metrics["prompt_tokens"] == sum(len(c.attributes["rollway.prompt_token_ids"]) for c in calls)

            rows = by_rollout[rollout_id]
            assert [t["reward"] for t in rows] == [None, completion["reward"]]
            for row, call in zip(rows, calls, strict=True):
                truth = await replay(mock, call.attributes["rollway.request"])
                assert row["prompt_token_ids"] == truth["prompt_token_ids"]
                assert row["response_token_ids"] == truth["choices"][0]["token_ids"]
                assert row["response_logprobs"] == [t["logprob"] for t in truth["choices"][0]["logprobs"]["content"]]
        assert 1 < max_overlap(intervals) <= 8  # concurrent, within the server's limit
        assert set(rewards_seen) == {0.0, 1.0}  # the mock gets some sums right, some wrong


async def test_a_body_routed_call_gets_traingate_token_fields(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url})
        [claimed] = await gw.store.enqueue([{"input": "x", "rollout_id": "ro-osmosis"}])
        await gw.store.claim("w")
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.post(
                f"{gw.url}/v1/chat/completions",
                json={"model": "policy", "messages": messages, "rollout_id": claimed.rollout_id, "max_tokens": 16},
            )
            plain = await client.post(
                f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": messages, "max_tokens": 16}
            )
        body = answer.json()
        [span] = await gw.store.query_spans("ro-osmosis", "latest")
        assert body["token_ids"] == span.attributes["rollway.response_token_ids"] and body["token_ids"]
        assert body["prompt_token_ids"] == span.attributes["rollway.prompt_token_ids"]
        assert body["logprobs"] == span.attributes["rollway.response_logprobs"] and len(body["logprobs"]) == len(
            body["token_ids"]
        )
        assert body["choices"][0]["logprobs"] is None  # the OpenAI-shaped parts stay as the client asked
        assert "token_ids" not in plain.json() and plain.json().get("prompt_token_ids") is None


@pytest.mark.agent_args("--api-key", "srv-key")
async def test_faults_init_retry_timeout_retry_duplicate_and_unknown_completion(
    tmp_path: Path, mock: MockBackendProcess, agent_server: AgentServerProcess
) -> None:
    async with running_gateway(tmp_path, watchdog_interval=0.2) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url})
        await admin.put(
            "/admin/v1/agents/math",
            json={"url": agent_server.url, "api_key": "srv-key", "completion_params": PARAMS},
        )
        (q1, a1), (q2, a2) = problems(2, seed=11)
        tasks = [
            {"rollout_id": "ro-init", "input": q1, "metadata": {"answer": a1, "fault": "init_500_once"}},
            {
                "rollout_id": "ro-silent",
                "input": q2,
                "metadata": {"answer": a2, "fault": "no_callback_once"},
                "config": {"timeout_seconds": 2, "max_attempts": 2, "retry_condition": ["timeout"]},
            },
        ]
        await admin.post("/admin/v1/rollouts", json={"tasks": [t | {"agent": "math"} for t in tasks]})
        init_fault, silent = await finish(gw, ["ro-init", "ro-silent"], timeout=60)

        # init answered 500 once: retried within the same attempt, which then succeeded
        assert init_fault.status == "succeeded"
        [attempt] = await gw.store.list_attempts("ro-init")
        assert attempt.metadata is not None and attempt.metadata["dispatch"]["init_tries"] == 2
        # never called back: the attempt timed out, the rollout was requeued and dispatched again
        assert silent.status == "succeeded"
        first, second = await gw.store.list_attempts("ro-silent")
        assert (first.status, second.status) == ("timeout", "succeeded")
        assert second.metadata is not None and second.metadata["completion"]["status"] == "COMPLETED"
        assert agent_server.health()["inits"] == 4  # 2 + 1 retried init + 1 re-dispatch

        # a duplicate completion changes nothing
        spans_before = await gw.store.query_spans("ro-init", "all")
        duplicate = {"rollout_id": "ro-init", "status": "ERROR", "reward": -5.0, "error_message": "again"}
        answer = await admin.post("/v1/rollout/completed", json=duplicate)
        assert answer.status_code == 200 and answer.json()["duplicate"] is True
        assert await gw.store.query_spans("ro-init", "all") == spans_before
        assert await gw.store.list_attempts("ro-init") == [attempt]
        assert (await gw.store.get_rollout("ro-init")).status == "succeeded"

        # a completion for an unknown rollout: 404 in the error envelope
        unknown = await admin.post("/v1/rollout/completed", json={"rollout_id": "ro-nope", "status": "COMPLETED"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["type"] == "not_found_error" and "ro-nope" in unknown.json()["error"]["message"]
        bad = await admin.post("/v1/rollout/completed", json={"rollout_id": "ro-init", "status": "DONE"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"
        for reward in (True, "0.5"):  # a reward is a number: not a bool nor a numeric string (as the admin API)
            bad = await admin.post("/v1/rollout/completed", json=duplicate | {"reward": reward})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward", bad.text
        listed = await admin.get("/admin/v1/agents")
        assert listed.json()["items"][0]["has_api_key"] is True and "srv-key" not in listed.text


@pytest.mark.agent_args("--api-key", "srv-key")
async def test_a_repeated_init_starts_one_run(
    tmp_path: Path, mock: MockBackendProcess, agent_server: AgentServerProcess
) -> None:
    """The dispatcher retries an init with the same idempotency key; the server must start the rollout once."""
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(timeout=30) as http:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url})
        started = await gw.store.start_rollout({"input": "x", "rollout_id": "ro-dup"}, worker_id="agent:manual")
        _, key = await gw.store.mint_key("rollout", rollout_id="ro-dup", attempt_id=started.attempt.attempt_id)
        init = {
            "rollout_id": "ro-dup",
            "server_url": gw.url,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "completion_params": PARAMS,
            "metadata": {"answer": 5},
            "api_key": key,
            "idempotency_key": started.attempt.attempt_id,
        }
        headers = {"Authorization": "Bearer srv-key"}
        answers = [await http.post(f"{agent_server.url}/v1/rollout/init", json=init, headers=headers) for _ in "ab"]
        assert [a.status_code for a in answers] == [202, 202] and answers[0].json() == answers[1].json()
        [rollout] = await finish(gw, ["ro-dup"], timeout=30)
        assert rollout.status == "succeeded"
        spans = await gw.store.query_spans("ro-dup", "latest")
        assert len(llm_spans(spans)) == 2 and [s.name for s in spans].count("rollway.reward") == 1
        assert agent_server.health()["completed"] == 1


async def test_an_init_the_agent_server_refuses_fails_the_attempt_and_retries_per_config(tmp_path: Path) -> None:
    """An agent server that answers 4xx (here: a wrong server api key) fails the attempt without init retries;
    the rollout's retry config then decides (here: one retry, failing again)."""
    with AgentServerProcess("--api-key", "right") as server:
        async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
            await admin.put("/admin/v1/agents/math", json={"url": server.url, "api_key": "wrong"})
            config = {"max_attempts": 2, "retry_condition": ["failed"]}
            await admin.post(
                "/admin/v1/rollouts",
                json={"tasks": [{"rollout_id": "ro-1", "input": "x", "agent": "math", "config": config}]},
            )
            [rollout] = await finish(gw, ["ro-1"], timeout=30)
            assert rollout.status == "failed"
            attempts = await gw.store.list_attempts("ro-1")
            assert [a.status for a in attempts] == ["failed", "failed"]
            assert all("401" in (a.metadata or {})["dispatch"]["error"] for a in attempts)
            assert server.health()["inits"] == 2  # no init retries on a 4xx


@pytest.mark.parametrize("protocol", ["v1", "0.3"])
async def test_an_agent_server_that_redirects_is_not_followed(tmp_path: Path, protocol: str) -> None:
    """An agent server whose admission answers a redirect fails the attempt, naming the redirect: the admission
    carries the attempt's rollout key, so it is never sent where the redirect points."""
    reached: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        reached.append(request.path)
        return web.json_response({"rollout_id": "x", "polling_lease_token": "t"}, status=202)

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"{target}{request.path}")

    async with (
        serving(web.post("/{tail:.*}", elsewhere)) as target,
        serving(health_route(protocol), web.post("/{tail:.*}", moved)) as agent_url,
    ):
        rollout, attempt = await one_task(tmp_path, agent_url, "moved")
    assert rollout.status == "failed" and reached == []
    error = (attempt.metadata or {})["dispatch"]["error"]
    assert "answered 307" in error and f"a redirect to {target}" in error and "not followed" in error


@pytest.mark.parametrize("protocol", ["v1", "0.3"])
async def test_a_refusal_that_echoes_the_keys_is_recorded_with_both_masked(tmp_path: Path, protocol: str) -> None:
    """An agent server whose refusal echoes what it was sent (its own api key, the attempt's rollout key) has it
    recorded in the attempt's error with both keys masked: that text is shown by the admin API and logged."""

    async def echo(request: web.Request) -> web.Response:
        return web.Response(status=400, text=f"{request.headers['Authorization']} {await request.text()}")

    async with serving(health_route(protocol), web.post("/{tail:.*}", echo)) as url:
        rollout, attempt = await one_task(tmp_path, url, "echo", api_key="srv-secret-key")
    error = (attempt.metadata or {})["dispatch"]["error"]
    assert rollout.status == "failed" and "answered 400: Bearer ***" in error, error
    assert "srv-secret-key" not in error and "rk-***" in error and "rk-" not in error.replace("rk-***", "")


async def test_a_03_server_holding_the_id_already_has_that_run_cancelled(tmp_path: Path) -> None:
    """A 0.3 server that answers the admission 409 (it holds the id: an admission sent again after its answer was
    lost with its lease) is told to cancel that run, which nothing can poll, and the attempt fails."""
    cancelled: list[Any] = []

    async def held(request: web.Request) -> web.Response:
        return web.json_response({"detail": "rollout id already in use"}, status=409)

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"cancelled": 1})

    async with serving(health_route(), web.post("/rollout", held), web.post("/rollout/cancel", cancel)) as url:
        rollout, attempt = await one_task(tmp_path, url, "held")
    assert rollout.status == "failed"
    assert cancelled == [{"ids": [attempt.attempt_id]}]
    assert "answered 409" in (attempt.metadata or {})["dispatch"]["error"]


@pytest.mark.parametrize("answer", [b"accepted", b"[]", b'{"rollout_id": "x", "status": "queued"}'])
async def test_a_03_admission_answered_202_with_no_lease_is_cancelled_there_and_fails(
    tmp_path: Path, answer: bytes
) -> None:
    """A 202 whose body is not a 0.3 admission (not JSON, not an object, no ``polling_lease_token``) leaves a run at
    the server that nothing can poll: Rollway cancels it there and fails the attempt at once, saying why."""
    cancelled: list[Any] = []

    async def admit(request: web.Request) -> web.Response:
        return web.Response(status=202, body=answer, content_type="application/json")

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"dispositions": {}})

    async with serving(health_route(), web.post("/rollout", admit), web.post("/rollout/cancel", cancel)) as url:
        rollout, attempt = await one_task(tmp_path, url, "odd", timeout=10)
    assert rollout.status == "failed" and cancelled == [{"ids": [attempt.attempt_id]}]
    assert "answered 202 with no polling lease" in (attempt.metadata or {})["dispatch"]["error"]


async def test_a_03_admission_waiting_out_429s_is_not_taken_for_lost_by_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 0.3 server that answers 429 for longer than an init may take (here 2.5 s): the admission marks itself in
    progress meanwhile, so another process's look for lost inits leaves it alone (it would be admitted twice: the
    second admission's 409 would cancel the first one's run), and it is admitted once when the server has room.
    The marks are renewed every 0.3 s here, so a first mark never renewed would be lost by the look at 3.5 s."""
    monkeypatch.setattr(v03, "ADMIT_MARK_EVERY", 0.3)
    monkeypatch.setattr(restarts, "HEALTH_TIMEOUT", 0.5)  # the probe's part of an init's 2.5 s
    first_try: list[float] = []
    admitted: list[str] = []
    past_window = asyncio.Event()  # set once the 429s have gone on for longer than an init may take

    async def admit(request: web.Request) -> web.Response:
        first_try.append(first_try[0] if first_try else time.monotonic())
        if time.monotonic() - first_try[0] >= 3.5:
            past_window.set()
        if time.monotonic() - first_try[0] < 4.5:
            return web.json_response({"detail": "busy"}, status=429, headers={"Retry-After": "0.2"})
        admitted.append((await request.json())["rollout_id"])
        return web.json_response({"rollout_id": admitted[-1], "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        sample: dict[str, Any] = {"reward": None, "messages": []}
        return web.json_response({"rollout_id": request.match_info["id"], "status": "success", "sample": sample})

    routes = [health_route(), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    settings: dict[str, Any] = {"agent_init_timeout": 1.0, "agent_init_retries": 0}  # an init may take 2.5 s
    async with (
        serving(*routes) as url,
        running_gateway(tmp_path, **settings) as gw,
        httpx.AsyncClient(base_url=gw.url) as admin,
    ):
        await admin.put("/admin/v1/agents/busy", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": "ro-busy", "input": "x", "agent": "busy"}]}
        )
        other = Dispatcher(Settings(**settings), gw.store)  # another gateway process on the database
        server = await gw.store.get_agent("busy")
        await asyncio.wait_for(past_window.wait(), 10)
        assert await other.lost_inits(server) == []
        [rollout] = await finish(gw, ["ro-busy"], timeout=20)
        [attempt] = await gw.store.list_attempts("ro-busy")
    assert rollout.status == "succeeded" and admitted == [attempt.attempt_id]
    dispatch = (attempt.metadata or {})["dispatch"]
    assert dispatch["osmosis_id"] == attempt.attempt_id and dispatch["admitting"] is None


async def test_a_03_server_whose_process_id_changes_has_its_polled_rollouts_failed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While rollouts of a 0.3 server are polled, one reader per server re-reads its ``/health``; a new
    ``process_id`` (the server restarted: its rollouts are gone) fails the attempts admitted before it at once,
    though their polls still answer ``running`` (as a new process would only say 404 at the next answer)."""
    monkeypatch.setattr(restarts, "HEALTH_EVERY", 0.3)
    ids = ["ro-r1", "ro-r2"]
    polled: set[str] = set()
    reads: list[float] = []
    process = ["p-1"]
    confirmed: list[float] = []  # the reads that answered p-1 after both rollouts were polled

    async def health(request: web.Request) -> web.Response:
        reads.append(time.monotonic())
        answer = {"status": "ok", "process_id": process[0], "lifecycle": {"accepting_rollouts": True}}
        if len(polled) == len(ids):  # both polled (so watched) before the second such read was sent
            confirmed.append(reads[-1])
            if len(confirmed) == 2:  # the server restarts: the next reads show the new process
                process[0] = "p-2"
        return web.json_response(answer)

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response(
            {"rollout_id": rollout_id, "polling_lease_token": "t", "result_wait_timeout_sec": 0.5}, status=202
        )

    async def result(request: web.Request) -> web.Response:
        polled.add(request.match_info["id"])
        await asyncio.sleep(0.5)
        return web.json_response({"rollout_id": request.match_info["id"], "status": "running"})

    routes = [web.get("/health", health), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    async with (
        serving(*routes) as url,
        running_gateway(tmp_path) as gw,
        httpx.AsyncClient(base_url=gw.url) as admin,
    ):
        await admin.put("/admin/v1/agents/flaky", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": i, "input": "x", "agent": "flaky"} for i in ids]}
        )
        rollouts = await finish(gw, ids, timeout=15)
        attempts = [(await gw.store.list_attempts(i))[0] for i in ids]
    assert [r.status for r in rollouts] == ["failed", "failed"] and process == ["p-2"]
    assert all("new process_id" in (a.metadata or {})["completion"]["error_message"] for a in attempts)
    watched = [t for t in reads if t >= confirmed[0]]  # (not the probes): one reader, never two reads at once
    assert all(later - earlier > 0.25 for earlier, later in itertools.pairwise(watched)), watched


@pytest.mark.parametrize(
    ("status", "health", "spoken", "passing"),
    [
        (200, {"status": "ok", "process_id": "p-1", "lifecycle": {"accepting_rollouts": True}}, "0.3", False),
        (200, {"status": "ok"}, "v1", False),
        (404, {"detail": "Not Found"}, "v1", False),
        *((status, {"detail": "no"}, None, False) for status in (401, 403)),
        *((status, {"detail": "no"}, None, True) for status in (429, 500, 502, 503)),
    ],
)
async def test_a_protocol_is_told_only_by_a_clear_health_answer(
    status: int, health: dict[str, Any], spoken: str | None, passing: bool
) -> None:
    """``/health`` tells a 0.3 server from a v1 one, and the dispatcher keeps the answer for the registration: a
    5xx, 401, 403 or 429 (a 0.3 server failing, busy or refusing the key) tells nothing; a 429 or a 5xx may pass,
    so it is asked again, and the answer is kept as text for the attempt's error."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(health, status=status)

    async with serving(web.get("/health", answer)) as url, aiohttp.ClientSession() as session:
        probed = await wire.probe(session, AgentServer(name="a", url=url))
    assert (probed.spoken, probed.passing) == (spoken, passing)
    assert probed.said == ("" if spoken else f'GET {url}/health answered {status}: {{"detail":"no"}}')


@pytest.mark.parametrize(
    ("lease_timeout", "unpolled", "resumed"),
    [(120.0, 39.0, False), (120.0, 41.0, True), (20.0, 9.0, False), (20.0, 11.0, True), (40.0, 21.0, True)],
)
def test_a_lease_counts_as_unpolled_after_half_its_length(lease_timeout: float, unpolled: float, resumed: bool) -> None:
    """A lease not polled for longer than one poll takes (the server's 30 s wait plus 10 s) is another process's to
    resume, and so is one not polled for half its length when that is shorter: a short lease (20 s) must be
    resumed within it, not 40 s later when the server has let the rollout go."""
    lease = {"osmosis_id": "at-1", "lease": "t", "wait": 30.0, "lease_timeout": lease_timeout, "polled_at": 1000.0}
    assert v03.stale(lease, 1000.0 + unpolled) is resumed


def health_route(protocol: str = "0.3") -> web.RouteDef:
    """``GET /health`` as a server of ``protocol`` answers it (a 0.3 server's names its process and lifecycle)."""
    lifecycle = {"process_id": "p-1", "lifecycle": "ready"} if protocol == "0.3" else {}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **lifecycle})

    return web.get("/health", health)


async def one_task(tmp_path: Path, url: str, name: str, timeout: float = 30, **agent: Any) -> tuple[Rollout, Attempt]:
    """One task (``ro-<name>``) for the agent server at ``url``, registered as ``name`` (with ``agent``'s other
    fields) on a gateway of its own, run to its end: the rollout and its one attempt."""
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        await admin.put(f"/admin/v1/agents/{name}", json={"url": url, **agent})
        task = {"rollout_id": f"ro-{name}", "input": "x", "agent": name}
        await admin.post("/admin/v1/rollouts", json={"tasks": [task]})
        [rollout] = await finish(gw, [f"ro-{name}"], timeout=timeout)
        [attempt] = await gw.store.list_attempts(f"ro-{name}")
    return rollout, attempt


@contextlib.asynccontextmanager
async def serving(*routes: web.RouteDef) -> AsyncIterator[str]:
    """An aiohttp app on a free loopback port with ``routes``: its base URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_completion_auth_pins_the_rollout_and_needs_credentials_with_an_admin_token(
    tmp_path: Path,
) -> None:
    async with running_gateway(tmp_path, admin_token="admin-t") as gw, httpx.AsyncClient(base_url=gw.url) as http:
        await gw.store.enqueue([{"input": "a", "rollout_id": "ro-a"}, {"input": "b", "rollout_id": "ro-b"}])
        claims = await gw.store.claim("w", limit=2)
        _, key_a = await gw.store.mint_key("rollout", rollout_id="ro-a", attempt_id=claims[0].attempt.attempt_id)
        report = {"rollout_id": "ro-b", "status": "COMPLETED", "reward": 1.0}
        anonymous = await http.post("/v1/rollout/completed", json=report)
        assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
        other = await http.post("/v1/rollout/completed", json=report, headers={"Authorization": f"Bearer {key_a}"})
        assert other.status_code == 403
        assert (await gw.store.get_rollout("ro-b")).status == "preparing"
        own = await http.post(
            "/v1/rollout/completed", json=report | {"rollout_id": "ro-a"}, headers={"Authorization": f"Bearer {key_a}"}
        )
        assert own.status_code == 200 and own.json()["status"] == "succeeded"
        admin = await http.post("/v1/rollout/completed", json=report, headers={"Authorization": "Bearer admin-t"})
        assert admin.status_code == 200 and key_a not in own.text + admin.text
        assert [r.status for r in await asyncio.gather(*(gw.store.get_rollout(i) for i in ("ro-a", "ro-b")))] == [
            "succeeded",
            "succeeded",
        ]


async def test_an_init_lost_with_the_gateway_is_sent_again_with_the_same_idempotency_key(
    tmp_path: Path, mock: MockBackendProcess, agent_server: AgentServerProcess
) -> None:
    """A gateway that ends between claiming an agent's task and recording its init (a crash, a restart) leaves
    the attempt ``preparing`` with no init outcome; the next gateway on the database sends the init again (same
    idempotency key), else the rollout would wait for ever and hold a slot of the server."""
    # The first gateway: its dispatcher saw no server at start, so it sleeps; the claim below is the one it
    # would have made just before it died.
    async with running_gateway(tmp_path, agent_poll_interval=60) as gw:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url})
        await gw.store.put_agent(AgentServer(name="math", url=agent_server.url, completion_params=PARAMS))
        await gw.store.enqueue([{"rollout_id": "ro-lost", "input": "What is 2 + 3?", "agent": "math"}])
        [claimed] = await gw.store.claim_for_agent("math")
    assert agent_server.health()["inits"] == 0
    async with running_gateway(tmp_path, agent_init_timeout=1.0, agent_init_retries=0) as gw:
        [rollout] = await finish(gw, ["ro-lost"], timeout=20)
        assert rollout.status == "succeeded"
        [attempt] = await gw.store.list_attempts("ro-lost")
        assert attempt.attempt_id == claimed.attempt.attempt_id
        assert attempt.metadata is not None and attempt.metadata["dispatch"]["init_tries"] == 1
        health = agent_server.health()
        assert (health["inits"], health["completed"]) == (1, 1), health


async def test_a_v1_completion_keeps_its_nan_and_infinite_metrics_as_their_names(tmp_path: Path) -> None:
    """A v1 agent server's report written by Python's json module (``NaN``, ``Infinity``) keeps those metrics as
    the strings "NaN" and "Infinity" in the attempt's completion: not null, which would read as no value."""
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        await gw.store.enqueue([{"input": "x", "rollout_id": "ro-nan"}])
        await gw.store.claim("w")
        report = {"rollout_id": "ro-nan", "status": "COMPLETED", "metrics": {"loss": math.nan, "kl": math.inf}}
        answer = await http.post(
            "/v1/rollout/completed", content=json.dumps(report), headers={"Content-Type": "application/json"}
        )
        assert answer.status_code == 200, answer.text
        [attempt] = await gw.store.list_attempts("ro-nan")
    assert (attempt.metadata or {})["completion"]["metrics"] == {"loss": "NaN", "kl": "Infinity"}


async def test_a_03_result_with_nan_metrics_is_recorded_with_their_names(tmp_path: Path) -> None:
    """A 0.3 result whose sample's metrics hold ``NaN`` and ``-Infinity`` (as Python's json module writes them)
    is a result like any other: the attempt succeeds, and its completion keeps them as "NaN" and "-Infinity"."""

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response({"rollout_id": rollout_id, "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        sample = {"reward": 0.5, "messages": [], "metrics": {"loss": math.nan, "margin": -math.inf, "calls": 2}}
        body = {"rollout_id": request.match_info["id"], "status": "success", "sample": sample}
        return web.Response(text=json.dumps(body), content_type="application/json")

    routes = [health_route(), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    async with serving(*routes) as url:
        rollout, attempt = await one_task(tmp_path, url, "nan")
    assert rollout.status == "succeeded", attempt.metadata
    completion = (attempt.metadata or {})["completion"]
    assert completion["metrics"] == {"loss": "NaN", "margin": "-Infinity", "calls": 2}
    assert completion["reward"] == 0.5


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


class FailingWrites:
    """Makes ``store.<method>`` raise ``UnavailableError`` (the database down) on its next ``times`` calls, then
    pass the calls on; ``passed`` is set at the first call that succeeds after the failures."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: Any, method: str, times: int) -> None:
        self.left, self.failed, self.passed = times, 0, asyncio.Event()
        real = getattr(store, method)

        async def write(*args: Any, **kwargs: Any) -> Any:
            if self.left > 0:
                self.left -= 1
                self.failed += 1
                raise UnavailableError("the database is down")
            answer = await real(*args, **kwargs)
            self.passed.set()
            return answer

        monkeypatch.setattr(store, method, write)


async def test_a_03_admission_accepted_while_the_store_is_down_is_kept_once_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 0.3 server accepts the admission, and the two writes that record it (the lease, the ``dispatch`` record)
    fail twice each: the controller keeps polling from memory and writes them again until they pass, so no
    process would ever take the admission for lost (sending it again would get a 409 and cancel the run), and the
    run's result is recorded. The server's long poll answers only once the test lets it: nothing but the retries
    can write the lease meanwhile."""
    admitted: list[str] = []
    cancelled: list[Any] = []
    finish_run = asyncio.Event()

    async def admit(request: web.Request) -> web.Response:
        admitted.append((await request.json())["rollout_id"])
        return web.json_response({"rollout_id": admitted[-1], "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finish_run.wait(), 25)
        sample: dict[str, Any] = {"reward": 1.0, "messages": []} if finish_run.is_set() else {}
        status = "success" if finish_run.is_set() else "running"
        return web.json_response({"rollout_id": request.match_info["id"], "status": status, "sample": sample})

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"dispositions": {}})

    routes = [
        health_route(),
        web.post("/rollout", admit),
        web.get("/rollout/{id}/result", result),
        web.post("/rollout/cancel", cancel),
    ]
    async with serving(*routes) as url, running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        lease = FailingWrites(monkeypatch, gw.store, "record_lease", 2)
        record = FailingWrites(monkeypatch, gw.store, "record_dispatch", 2)
        await admin.put("/admin/v1/agents/down", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": "ro-down", "input": "x", "agent": "down"}]}
        )
        await asyncio.wait_for(lease.passed.wait(), 10)
        await asyncio.wait_for(record.passed.wait(), 10)
        assert (lease.failed, record.failed) == (2, 2)
        far = gw.store.clock() + 1e6  # however long from now another process looks, it finds nothing lost
        assert await gw.store.undispatched_attempts("down", far, far) == []
        [(kept, _)] = await gw.store.agent_leases("down")
        finish_run.set()
        [rollout] = await finish(gw, ["ro-down"], timeout=20)
        [attempt] = await gw.store.list_attempts("ro-down")
    assert rollout.status == "succeeded" and admitted == [attempt.attempt_id] and cancelled == []
    assert kept.attempt.attempt_id == attempt.attempt_id
    dispatch = (attempt.metadata or {})["dispatch"]
    assert dispatch["osmosis_id"] == attempt.attempt_id and dispatch["admitting"] is None


async def test_a_409_for_an_admission_another_process_keeps_the_lease_of_leaves_its_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admission sent again by a process that took it for lost, while the process that had it accepted was
    keeping its lease (the store came back in between), gets a 409: the run is that process's, so it is neither
    cancelled nor failed here. Here the lease is written as the 409 is answered, not polled since: its polls are
    resumed from it and the run's result is recorded."""
    monkeypatch.setattr(dispatcher, "LEASE_CHECK_INTERVAL", 0.2)
    cancelled: list[Any] = []
    tries: list[str] = []
    polled = asyncio.Event()

    async def admit(request: web.Request) -> web.Response:
        attempt_id = (await request.json())["rollout_id"]
        tries.append(attempt_id)
        lease = {"osmosis_id": attempt_id, "lease": "t", "wait": 1.0, "lease_timeout": 60.0, "polled_at": 0.0}
        assert await store.record_lease("ro-held", attempt_id, lease)  # the other process's, kept meanwhile
        return web.json_response({"detail": "rollout_id is already registered"}, status=409)

    async def result(request: web.Request) -> web.Response:
        assert request.headers[wire.LEASE_HEADER] == "t"
        polled.set()
        sample = {"reward": 1.0, "messages": []}
        return web.json_response({"rollout_id": request.match_info["id"], "status": "success", "sample": sample})

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"dispositions": {}})

    routes = [
        health_route(),
        web.post("/rollout", admit),
        web.get("/rollout/{id}/result", result),
        web.post("/rollout/cancel", cancel),
    ]
    async with serving(*routes) as url, running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        store = gw.store
        await admin.put("/admin/v1/agents/held", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": "ro-held", "input": "x", "agent": "held"}]}
        )
        [rollout] = await finish(gw, ["ro-held"], timeout=20)
        [attempt] = await gw.store.list_attempts("ro-held")
    assert rollout.status == "succeeded" and polled.is_set(), attempt.metadata
    assert tries == [attempt.attempt_id] and cancelled == []


async def test_a_03_attempt_is_running_once_the_server_says_it_runs(tmp_path: Path) -> None:
    """A 0.3 attempt is ``preparing`` until its server's poll answer says the rollout runs: then it (and its
    rollout) is ``running``, before any chat call of its workflow."""
    polls: list[str] = []
    second_poll, finish_run = asyncio.Event(), asyncio.Event()

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response({"rollout_id": rollout_id, "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        polls.append(request.match_info["id"])
        if len(polls) == 1:
            return web.json_response({"rollout_id": polls[0], "status": "running"})
        second_poll.set()
        await asyncio.wait_for(finish_run.wait(), 20)
        sample = {"reward": 1.0, "messages": []}
        return web.json_response({"rollout_id": polls[0], "status": "success", "sample": sample})

    routes = [health_route(), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    async with serving(*routes) as url, running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        await admin.put("/admin/v1/agents/runs", json={"url": url})
        task = {"rollout_id": "ro-runs", "input": "x", "agent": "runs"}
        await admin.post("/admin/v1/rollouts", json={"tasks": [task]})
        await asyncio.wait_for(second_poll.wait(), 10)  # the first answer ("running") was taken in before it
        running = await gw.store.get_attempt("ro-runs")
        assert (running.status, (await gw.store.get_rollout("ro-runs")).status) == ("running", "running")
        finish_run.set()
        [rollout] = await finish(gw, ["ro-runs"], timeout=20)
    assert rollout.status == "succeeded" and running.attempt_id == polls[0]


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

    async def init(request: web.Request) -> web.Response:
        sent.append(request.path)
        body = await request.json()
        report = {"rollout_id": body["rollout_id"], "status": "COMPLETED", "reward": 1.0}
        headers = {"Authorization": f"Bearer {body['api_key']}"}
        reports.append(
            asyncio.ensure_future(http.post(f"{body['server_url']}/v1/rollout/completed", json=report, headers=headers))
        )
        return web.json_response({"rollout_id": body["rollout_id"]}, status=202)

    reports: list[asyncio.Future[httpx.Response]] = []
    routes = [
        web.get("/health", health),
        web.post("/rollout", admit),
        web.get("/rollout/{id}/result", result),
        web.post("/v1/rollout/init", init),
    ]
    async with (
        serving(*routes) as url,
        running_gateway(tmp_path) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        bad = await http.put("/admin/v1/agents/known", json={"url": url, "protocol": "0.2"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "protocol", bad.text
        put = await http.put("/admin/v1/agents/known", json={"url": url, "protocol": protocol})
        assert put.status_code == 200 and put.json()["protocol"] == protocol
        task = {"rollout_id": "ro-known", "input": "x", "agent": "known"}
        await http.post("/admin/v1/rollouts", json={"tasks": [task]})
        [rollout] = await finish(gw, ["ro-known"], timeout=20)
        assert [(await answer).status_code for answer in reports] == ([200] if protocol == "v1" else [])
        [attempt] = await gw.store.list_attempts("ro-known")
    assert rollout.status == "succeeded", attempt.metadata
    assert sent == ["/rollout" if protocol == "0.3" else "/v1/rollout/init"]
    assert "before" not in health_reads
