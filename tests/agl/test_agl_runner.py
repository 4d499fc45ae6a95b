"""A real Agent-lightning 0.3 runner (``LitAgentRunner`` + ``OtelTracer``) working batches against Rollway: its
LLM is a ``proxy_llm`` resource pointing at Rollway's gateway (backed by ``rollway mock-backend``), its rewards
are ``emit_reward`` spans exported over OTLP, and Agent-lightning's ``LlmProxyTraceToTriplet`` turns the spans
it reads back into triplets. Then the same with Rollway killed (``SIGKILL``) in the middle of the batch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from support.agl_env import SCRIPTS, agl_python, require_agl, run_script, script_env

require_agl()  # the whole module skips, with one line, without the Agent-lightning environment

pytestmark = [pytest.mark.real_component, pytest.mark.slow]
TOKEN = "agl-runner-admin-token-42"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def agl_py() -> str:
    return agl_python()


def serve(db: Path, port: int = 0) -> GatewayProcess:
    return GatewayProcess(f"sqlite:///{db}", admin_token=TOKEN, port=port)


def register_model(server: GatewayProcess, mock: MockBackendProcess) -> None:
    backend = {"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    response = httpx.put(f"{server.url}/admin/v1/models/mock-model", json={"backends": [backend]}, headers=AUTH)
    assert response.status_code == 200, response.text


def backend_answer(mock: MockBackendProcess, task: dict[str, int]) -> dict[str, Any]:
    """What the backend itself answers the agent's request (the mock is deterministic)."""
    body = {
        "model": "mock-model",
        "messages": [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}],
        "max_tokens": 16,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    data: dict[str, Any] = httpx.post(f"{mock.base_url}/chat/completions", json=body, timeout=30).json()
    choice = data["choices"][0]
    numbers = [int(n) for n in re.findall(r"-?\d+", choice["message"]["content"] or "")]
    reward = 1.0 if task["a"] + task["b"] in numbers else 0.0
    return {"prompt": data["prompt_token_ids"], "response": choice["token_ids"], "reward": reward}


def test_runner_completes_a_batch_and_its_adapter_gets_the_backends_token_ids(
    agl_py: str, tmp_path: Path, mock: MockBackendProcess
) -> None:
    with serve(tmp_path / "rollway.db") as server:
        register_model(server, mock)
        address = f"{server.url}/t/{TOKEN}"
        ids = run_script(agl_py, "runner_batch.py", "enqueue", address, server.url, "4")
        run_script(agl_py, "runner_batch.py", "run", address, json.dumps(ids), timeout=120)
        results = run_script(agl_py, "runner_batch.py", "collect", address, json.dumps(ids))

    assert list(results) == ids
    for result in results.values():
        assert result["status"] == "succeeded" and result["attempts"] == ["succeeded"]
        # The gateway's span of the call (in the proxy's form), then the agent's reward span that came over OTLP.
        assert result["span_names"] == [["raw_gen_ai_request", 1], ["agentlightning.annotation", 2]]
        assert result["triplets"] == [backend_answer(mock, result["input"])]


def test_rollway_killed_mid_batch_restarts_on_its_file_and_the_runner_carries_on(
    agl_py: str, tmp_path: Path, mock: MockBackendProcess
) -> None:
    db = tmp_path / "rollway.db"
    n = 10
    server = serve(db).start()
    port = int(server.url.rsplit(":", 1)[1])
    runner: subprocess.Popen[str] | None = None
    try:
        register_model(server, mock)
        address = f"{server.url}/t/{TOKEN}"
        ids = run_script(agl_py, "runner_batch.py", "enqueue", address, server.url, str(n))
        runner = subprocess.Popen(
            [agl_py, str(SCRIPTS / "runner_batch.py"), "run", address, json.dumps(ids)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=script_env(),
            cwd=str(SCRIPTS),
        )
        deadline = time.monotonic() + 90
        done_before: list[str] = []
        while len(done_before) < 3:
            assert time.monotonic() < deadline and runner.poll() is None, "the batch did not progress"
            page = httpx.get(f"{server.url}/admin/v1/rollouts", params={"status": "succeeded"}, headers=AUTH).json()
            done_before = [r["rollout_id"] for r in page["items"]]
            time.sleep(0.05)  # poll interval
        assert len(done_before) < n  # mid-batch
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        server.stop()
        # The outage lasts long enough for the runner's client to give up on the attempt it was reporting.
        time.sleep(2.0)
        server = serve(db, port=port).start()
        _, err = runner.communicate(timeout=120)
        assert runner.returncode == 0, err[-4000:]
        results = run_script(agl_py, "runner_batch.py", "collect", address, json.dumps(ids))
    finally:
        if runner is not None and runner.poll() is None:
            runner.kill()
            runner.communicate()
        server.stop()

    assert list(results) == ids  # every rollout is still there
    assert all(r["status"] == "succeeded" for r in results.values()), {k: v["attempts"] for k, v in results.items()}
    for rollout_id in done_before:  # finished before the crash: unchanged, one attempt
        assert results[rollout_id]["attempts"] == ["succeeded"]
    # The attempt that was running when the process died was declared unresponsive and retried.
    retried = [r["attempts"] for r in results.values() if len(r["attempts"]) > 1]
    assert retried and all(a[-1] == "succeeded" and "unresponsive" in a[:-1] for a in retried), retried
    for result in results.values():
        assert result["triplets"] and result["triplets"][-1]["reward"] is not None
