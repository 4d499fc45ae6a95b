"""Rollway as the controller of a real Osmosis 0.3.8 agent server: a RolloutServer made with the ``osmosis-ai`` SDK
(``tests/support/osmosis_scripts/rollout_server.py``, in its own Python 3.12 environment), registered through the
admin API like any agent server. Rollway tells it from a v1 server by its ``/health``, admits each attempt with
``POST /rollout``, serves its chat calls on the attempt's own route in front of the mock backend, polls the
result with the lease and records it: the grader's reward, a dropped sample, a failure (never a reward of 0), and
a cancel that reaches the workflow. A workflow calling ``model: "osmosis-rollout"`` (as the SDK's integrations
do) is served by the model the server was registered with."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from support.gateway_harness import RunningGateway, register, replay, running_gateway
from support.osmosis_env import SCRIPTS, osmosis_python, require_osmosis, script_env

require_osmosis()

pytestmark = [pytest.mark.real_component, pytest.mark.slow]

KEY = "osmosis-server-key"
MOCK_BACKEND = {"backend_id": "mock", "kind": "vllm", "model": "mock-model"}
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]


class RolloutServer:
    """The SDK's RolloutServer as a process on a loopback port."""

    def __init__(self, marks: Path, port: int | None = None, **env: str) -> None:
        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.marks = marks
        script = [osmosis_python(), str(SCRIPTS / "rollout_server.py"), str(self.port), KEY]
        env = script_env(MARKS=str(marks), _OSMOSIS_ROLLOUT_ARTIFACT_ROOT=str(marks / "artifacts"), **env)
        self.process = subprocess.Popen(script, env=env, cwd=marks)

    def wait_healthy(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise AssertionError(f"the rollout server exited ({self.process.returncode})")
                try:
                    answer = client.get(f"{self.url}/health", headers={"Authorization": f"Bearer {KEY}"})
                except httpx.TransportError:  # not listening yet: a process's start has no event to await
                    time.sleep(0.1)
                    continue
                answer.raise_for_status()
                health: dict[str, Any] = answer.json()
                return health
        raise AssertionError("the rollout server did not answer /health")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def rollout_server(tmp_path: Path) -> Iterator[RolloutServer]:
    marks = tmp_path / "marks"
    marks.mkdir()
    server = RolloutServer(marks)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


async def enqueue(admin: httpx.AsyncClient, *metadata: dict[str, Any]) -> list[str]:
    tasks = [
        {"input": {"messages": QUESTION}, "metadata": m, "agent": "osm", "config": {"timeout_seconds": 60}}
        for m in metadata
    ]
    answer = await admin.post("/admin/v1/rollouts", json={"tasks": tasks})
    assert answer.status_code == 201, answer.text
    return [r["rollout_id"] for r in answer.json()["rollouts"]]


async def finished(gw: RunningGateway, ids: list[str], timeout: float = 60) -> dict[str, Any]:
    done, pending = await gw.store.wait_for_rollouts(ids, timeout)
    assert not pending, pending
    return {r.rollout_id: r for r in done}


async def test_a_03_server_runs_rollouts_graded_dropped_and_failed(
    tmp_path: Path, mock: MockBackendProcess, rollout_server: RolloutServer
) -> None:
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as admin:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url}, version="v1")
        agent = {"url": rollout_server.url, "api_key": KEY, "completion_params": {"model": "policy"}}
        put = await admin.put("/admin/v1/agents/osm", json=agent)
        assert put.status_code == 200 and KEY not in put.text
        graded, streamed, dropped, failed = await enqueue(
            admin,
            {"reward": 0.5, "model": "osmosis-rollout"},  # as the SDK's integrations call: the server's model
            {"reward": 0.25, "behaviour": "stream"},
            {"behaviour": "remove"},
            {"behaviour": "fail"},
        )
        rollouts = await finished(gw, [graded, streamed, dropped, failed])
        assert {i: r.status for i, r in rollouts.items()} == {
            graded: "succeeded",
            streamed: "succeeded",
            dropped: "succeeded",
            failed: "failed",
        }
        for rollout_id, reward in ((graded, 0.5), (streamed, 0.25)):
            [attempt] = await gw.store.list_attempts(rollout_id)
            meta = attempt.metadata or {}
            assert meta["dispatch"]["protocol"] == "osmosis-0.3"
            assert meta["dispatch"]["osmosis_id"] == attempt.attempt_id  # a fresh id per attempt
            assert meta["completion"]["reward"] == reward
            spans = await gw.store.query_spans(rollout_id)
            [call] = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
            truth = await replay(mock, {**call.attributes["rollway.request"], "stream": False})
            assert call.attributes["rollway.prompt_token_ids"] == truth["prompt_token_ids"]  # the engine's, exactly
            assert call.attributes["rollway.response_token_ids"] == truth["choices"][0]["token_ids"]
            assert call.attributes["rollway.request"]["messages"] == QUESTION
            assert call.attributes["rollway.request"]["model"] == "policy"  # "osmosis-rollout" served as the server's
            assert [s.attributes["rollway.reward.value"] for s in spans if s.name == "rollway.reward"] == [reward]
        [kept] = await gw.store.list_attempts(dropped)
        completion = (kept.metadata or {})["completion"]
        assert completion["reward"] is None and completion["extra_fields"]["remove_sample"] is True
        assert not [s for s in await gw.store.query_spans(dropped) if s.name == "rollway.reward"]
        [lost] = await gw.store.list_attempts(failed)
        assert lost.status == "failed"
        assert (lost.metadata or {})["completion"]["error_message"] == "agent_error: the agent failed on purpose"
        assert not [s for s in await gw.store.query_spans(failed) if s.name == "rollway.reward"]  # never 0
        assert "polling_lease" not in str(await admin.get(f"/admin/v1/rollouts/{graded}/attempts"))


async def test_a_cancel_in_rollway_cancels_the_workflow_at_the_03_server(
    tmp_path: Path, mock: MockBackendProcess, rollout_server: RolloutServer
) -> None:
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as admin:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url}, version="v1")
        (await admin.put("/admin/v1/agents/osm", json={"url": rollout_server.url, "api_key": KEY})).raise_for_status()
        [rollout_id] = await enqueue(admin, {"behaviour": "hang"})
        async with asyncio.timeout(30):
            while not (started := sorted(rollout_server.marks.glob("started-*"))):  # another process: no event
                assert rollout_server.process.poll() is None
                await asyncio.sleep(0.05)
        attempt = await gw.store.get_attempt(rollout_id)
        assert started == [rollout_server.marks / f"started-{attempt.attempt_id}"]  # the attempt's own id
        (await admin.post(f"/admin/v1/rollouts/{rollout_id}/cancel")).raise_for_status()
        cancelled = rollout_server.marks / f"cancelled-{attempt.attempt_id}"
        async with asyncio.timeout(10):
            while not cancelled.exists():
                assert rollout_server.process.poll() is None
                await asyncio.sleep(0.05)
        assert (await gw.store.get_rollout(rollout_id)).status == "cancelled"


async def test_a_restarted_03_server_fails_its_live_attempts_at_once(
    tmp_path: Path, mock: MockBackendProcess, rollout_server: RolloutServer
) -> None:
    """The server restarts with a rollout running: its ``/health`` shows a new ``process_id``, or the next poll gets
    404 for the id (the new process does not know it), whichever Rollway sees first, and the attempt fails then,
    with the reason, not at the rollout's deadline (60 s)."""
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as admin:
        await register(gw.store, "policy", {**MOCK_BACKEND, "base_url": mock.base_url}, version="v1")
        (await admin.put("/admin/v1/agents/osm", json={"url": rollout_server.url, "api_key": KEY})).raise_for_status()
        [rollout_id] = await enqueue(admin, {"behaviour": "hang"})
        async with asyncio.timeout(30):
            while not sorted(rollout_server.marks.glob("started-*")):  # another process: no event to await
                assert rollout_server.process.poll() is None
                await asyncio.sleep(0.05)
        before = rollout_server.wait_healthy()["process_id"]
        rollout_server.stop()
        restarted = RolloutServer(rollout_server.marks, port=rollout_server.port)
        try:
            assert restarted.wait_healthy()["process_id"] != before
            done = await finished(gw, [rollout_id], timeout=30)
            assert done[rollout_id].status == "failed"
            [attempt] = await gw.store.list_attempts(rollout_id)
            message = (attempt.metadata or {})["completion"]["error_message"]
            assert "new process_id" in message or "no longer knows the rollout" in message, message
            assert attempt.end_time is not None and attempt.end_time - attempt.start_time < 30
        finally:
            restarted.stop()


async def dispatch_facts(admin: httpx.AsyncClient, rollout_id: str) -> dict[str, Any]:
    attempts = (await admin.get(f"/admin/v1/rollouts/{rollout_id}")).raise_for_status().json()["attempts"]
    return dict((attempts[0]["metadata"] or {}).get("dispatch") or {}) if attempts else {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_rollway_killed_mid_rollout_resumes_its_polls_within_the_lease(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """``rollway serve`` is killed (SIGKILL) while the server runs a rollout, and started again on the same database
    and port. The lease it kept in the store lets the new process resume the polls (the server's long poll is 2 s
    here, so the lease counts as unpolled after 12 s), within the server's 120 s lease: the workflow then makes its
    call through the new process and the attempt succeeds with the grader's reward."""
    marks = tmp_path / "marks"
    marks.mkdir()
    server = RolloutServer(marks, RESULT_WAIT="2")
    database, port = f"sqlite:///{tmp_path / 'gateway.db'}", free_port()
    try:
        server.wait_healthy()
        first = GatewayProcess(database, port=port).start()
        try:
            async with httpx.AsyncClient(base_url=first.url, timeout=30) as admin:
                backend = {**MOCK_BACKEND, "base_url": mock.base_url}
                (await admin.put("/admin/v1/models/policy", json={"backends": [backend]})).raise_for_status()
                agent = {"url": server.url, "api_key": KEY}
                (await admin.put("/admin/v1/agents/osm", json=agent)).raise_for_status()
                [rollout_id] = await enqueue(admin, {"behaviour": "go", "reward": 0.75})
                async with asyncio.timeout(30):
                    while not (started := sorted(marks.glob("started-*"))):  # another process: no event to await
                        assert server.process.poll() is None
                        await asyncio.sleep(0.05)
                    # The workflow starts before the admission's answer reaches Rollway, and a kill then would take
                    # the lease with the process. The kill comes once the lease is kept, which the attempt's
                    # recorded admission (written just after it) shows.
                    while "osmosis_id" not in await dispatch_facts(admin, rollout_id):  # noqa: ASYNC110 (another process)
                        await asyncio.sleep(0.05)
            assert first.pid is not None
            os.kill(first.pid, signal.SIGKILL)
        finally:
            first.stop()
        with GatewayProcess(database, port=port) as second:
            (marks / started[0].name.replace("started-", "go-")).write_text("")
            async with httpx.AsyncClient(base_url=second.url, timeout=90) as admin:
                waited = await admin.post(
                    "/admin/v1/rollouts/wait", json={"rollout_ids": [rollout_id], "timeout_seconds": 60}
                )
                [rollout] = waited.json()["finished"]
                [attempt] = (await admin.get(f"/admin/v1/rollouts/{rollout_id}")).json()["attempts"]
                assert rollout["status"] == "succeeded", attempt
                assert attempt["metadata"]["completion"]["reward"] == 0.75
                assert started[0].name == f"started-{attempt['attempt_id']}"
                assert "lease" not in str(attempt)
    finally:
        server.stop()
