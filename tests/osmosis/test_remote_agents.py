"""Remote agent servers end to end (Osmosis protocol, docs/remote-agents.md): the example agent server runs as its own
process on loopback, the gateway (real uvicorn) dispatches tasks to it and serves its chat calls in front of
the mock backend process; completions, rewards, retries and faults are checked in the store. A few run fake
servers of both protocols instead (``support.fake_agents``); the 0.3 controller's own cases are in
``test_osmosis_03_controller.py``, how the protocol is chosen in ``test_agent_protocol.py``."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from rollway.mock import MockBackendProcess
from rollway.store import AgentServer, Span
from support.agent_server import AgentServerProcess
from support.fake_agents import finish, health_route, one_task, serving
from support.gateway_harness import register, replay, running_gateway

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
