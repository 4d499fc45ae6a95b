"""Agent-lightning 1.0.2's own clients against ``rollway serve``, changed in nothing but the URL and the key: the
trainer's ``AglRolloutManager`` (``support/agl1_scripts/trainer.py``), its ``agl-controller`` (local runner)
and the agents it spawns (``support/agl1_scripts/agent.py``), in their own Python 3.12 environment, with the mock
backend as the engine. A training iteration's rollouts: models registered, rollouts created, run and ended by the
controller, their raw and triplet events read with the engine's token ids and logprobs, and deleted; a stream,
which Agent-lightning's own server refuses, recorded with exact ids; the trainer's pause and drain; and
``rollway serve`` killed between two iterations, with nothing lost."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from support.agl1_env import require_agl1
from support.agl1_run import Controller, run_trainer

require_agl1()  # the whole module skips, with one line, without the Agent-lightning 1.0 environment

pytestmark = [pytest.mark.real_component, pytest.mark.slow]

KEY = "agl1-clients-key"
MODEL = "/models/policy"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def letters(text: str) -> float:
    """The agents' reward (``agent.reward_of``): the fraction of the answer's characters that are letters."""
    return round(sum(c.isalpha() for c in text) / len(text), 6) if text else 0.0


def direct(mock: MockBackendProcess, request: dict[str, Any]) -> dict[str, Any]:
    """The engine's answer to a forwarded request, asked again straight (the mock answers alike each time)."""
    body = {**request, "model": "mock-model", "stream": False}
    body.pop("stream_options", None)
    answer = httpx.post(f"{mock.base_url}/chat/completions", json=body, timeout=30)
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


def admin(server: GatewayProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def test_a_training_iterations_rollouts_run_through_rollway(tmp_path: Path, mock: MockBackendProcess) -> None:
    inputs = [
        {"prompt": "Say hello.", "behaviour": "go"},
        {"prompt": "Count to three.", "behaviour": "two_calls", "note": "thinking"},
        {"prompt": "Stream a greeting.", "behaviour": "stream"},
        {"prompt": "Give up.", "behaviour": "fail"},
    ]
    with GatewayProcess(f"sqlite:///{tmp_path / 'rollway.db'}", admin_token=KEY) as server:
        with Controller(server.url, KEY, tmp_path) as controller:
            result = run_trainer(
                server.url, KEY, model=MODEL, endpoints=[mock.base_url], inputs=inputs, hooks=True, drain=True
            )
        by_prompt = {r["input"]["prompt"]: r for r in result["rollouts"]}
        assert len(by_prompt) == 4, controller.log()[-3000:]
        with admin(server) as client:
            assert result["registered"] == [{"model": MODEL, "endpoint": mock.base_url, "version": 0}]
            # Every rollout deleted by the manager after reading it: gone from its API, kept for Rollway's.
            for rollout in result["rollouts"]:
                assert client.get(f"/api/rollouts/{rollout['rollout_id']}").status_code == 404
                assert client.get(f"/admin/v1/rollouts/{rollout['rollout_id']}").status_code == 200
            spans = {
                r["rollout_id"]: client.get(f"/admin/v1/rollouts/{r['rollout_id']}/spans").json()["items"]
                for r in result["rollouts"]
            }

    # The drain: pause, nothing in flight, resume (the trainer's weight sync goes in between).
    assert result["drain"]["paused"]["paused"] is True and result["drain"]["state"]["inflight"] == 0
    assert result["resumed_after"]["paused"] is False

    failed = by_prompt["Give up."]
    assert failed["rollout_state"] == "failed" and "code 3" in failed["error_message"]
    assert failed["final_reward"] is None and failed["metadata"]["hooked"] is True  # the enqueue hook's extra
    assert [e["data"]["on"] for e in failed["events"] if e["event_type"] == "hook"] == ["failed"]

    for prompt in ("Say hello.", "Count to three.", "Stream a greeting."):
        rollout = by_prompt[prompt]
        assert rollout["rollout_state"] == "succeeded", rollout
        calls = [e["data"] for e in rollout["events"] if e["event_type"] == "model_request"]
        assert len(calls) == (2 if prompt == "Count to three." else 1)
        for call, triplet in zip(calls, rollout["triplets"], strict=True):
            engine = direct(mock, call["request"])
            choice = engine["choices"][0]
            assert call["model"] == MODEL and call["request"]["model"] == MODEL
            assert call["request"]["temperature"] == 1.0 and call["request"]["return_token_ids"] is True
            assert triplet["prompt"]["token_ids"] == engine["prompt_token_ids"]
            assert triplet["response"]["token_ids"] == choice["token_ids"]
            assert triplet["response"]["log_probs"] == [t["logprob"] for t in choice["logprobs"]["content"]]
            assert triplet["metadata"]["server"] == {"model": MODEL, "version": 0}
        answer = calls[-1]["response"]["choices"][0]["message"]["content"]
        assert rollout["final_reward"] == letters(answer) and rollout["triplets"][-1]["reward"] == letters(answer)
        assert [e["data"]["on"] for e in rollout["events"] if e["event_type"] == "hook"] == ["succeeded"]
        # Rollway's own records: every call a span with its sequence id, the stream's marked as one.
        ours = spans[rollout["rollout_id"]]
        llm = [s for s in ours if s["attributes"].get("gen_ai.operation.name") == "chat"]
        assert [s["attributes"]["rollway.stream"] for s in llm] == [prompt == "Stream a greeting."] * len(calls)
        assert sorted(s["sequence_id"] for s in ours) == list(range(1, len(ours) + 1))
    notes = [e for e in by_prompt["Count to three."]["events"] if e["event_type"] == "note"]
    assert [n["data"] for n in notes] == [{"text": "thinking"}]


def test_rollway_killed_between_iterations_loses_nothing(tmp_path: Path, mock: MockBackendProcess) -> None:
    """``rollway serve`` is killed (SIGKILL) after an iteration, with the controller stopped and one rollout
    created and left queuing, and started again on the same database and port: a new controller runs the queued
    rollout through the new process, the next iteration runs, and the first one's records are all there."""
    database, port = f"sqlite:///{tmp_path / 'rollway.db'}", free_port()
    first = GatewayProcess(database, port=port, admin_token=KEY).start()
    controller = Controller(first.url, KEY, tmp_path).start()
    try:
        try:
            before = run_trainer(first.url, KEY, model=MODEL, endpoints=[mock.base_url], inputs=[{"behaviour": "go"}])
            with admin(first) as client:
                [done] = before["rollouts"]
                kept = client.get(f"/admin/v1/rollouts/{done['rollout_id']}/spans").json()["items"]
                local = {"agent_class": "agent:Agent", "env_map": {"AGL_INPUT": "input"}}
                waiting = {"input": {"behaviour": "go"}, "rollout_id": "waiting", "config": {"local": local}}
                controller.stop()  # the next rollout waits, queued, across the kill
                created = client.post("/api/rollouts", json=[waiting])
                assert created.status_code == 201
            assert first.pid is not None
            os.kill(first.pid, signal.SIGKILL)
        finally:
            first.stop()
        with GatewayProcess(database, port=port, admin_token=KEY) as second, admin(second) as client:
            controller = Controller(second.url, KEY, tmp_path).start()
            after = run_trainer(second.url, KEY, model=MODEL, endpoints=[mock.base_url], inputs=[{"behaviour": "go"}])
            assert [r["rollout_state"] for r in after["rollouts"]] == ["succeeded"]
            assert client.get(f"/admin/v1/rollouts/{done['rollout_id']}/spans").json()["items"] == kept
            # The rollout created before the kill was run by the controller through the new process.
            waited = client.get("/api/rollouts/waiting").json()["rollout"]["status"]
            assert waited["state"] == "succeeded", controller.log()[-3000:]
            triplets = client.get("/api/rollouts/waiting/events", params={"format": "triplet"}).json()
            assert [e["event_type"] for e in triplets] == ["model_request", "reward"]
    finally:
        controller.stop()
