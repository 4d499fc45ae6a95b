"""Health, readiness, request ids and structured logs, and metrics across several server processes."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from asyncio.subprocess import PIPE
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store import Store
from support.gateway_harness import closed_port, register, running_gateway, vllm

BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TOKEN = "admin-secret-token-1234"


async def test_readyz_reports_backends_up_and_down(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path, retry_max_wait=0.01) as gw, httpx.AsyncClient(timeout=10) as http:
        dead = {"backend_id": "dead", "base_url": f"http://127.0.0.1:{closed_port()}", "model": "m", "weight": 100}
        await register(gw.store, "policy", dead, vllm(mock))
        ready = await http.get(f"{gw.url}/readyz")
        assert ready.status_code == 200
        assert ready.json() == {
            "status": "ready",
            "store": "ok",
            "backends": {"dead": "up", "mock-a": "up"},
            "calls": {"running": 0, "limit": None, "saturated": False},
        }
        for _ in range(2):  # two connect failures in a row eject the dead backend; the calls fail over
            assert (await http.post(f"{gw.url}/v1/chat/completions", json=BODY)).status_code == 200
        ready = await http.get(f"{gw.url}/readyz")
        assert ready.status_code == 200  # readiness is the store's; backends are reported
        assert ready.json()["backends"] == {"dead": "down", "mock-a": "up"}


async def test_request_ids_are_echoed_or_generated(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(timeout=10) as http:
        await register(gw.store, "policy", vllm(mock))
        url = f"{gw.url}/v1/chat/completions"
        given = await http.post(url, json=BODY, headers={"x-request-id": "req-42.a:b"})
        assert given.status_code == 200 and given.headers["x-request-id"] == "req-42.a:b"
        made = await http.post(url, json=BODY)
        assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
        other = await http.post(url, json=BODY)
        assert other.headers["x-request-id"] != made.headers["x-request-id"]
        unsafe = await http.post(url, json=BODY, headers={"x-request-id": "a b\tc" + "x" * 200})
        assert re.fullmatch(r"[0-9a-f]{32}", unsafe.headers["x-request-id"])  # replaced, never echoed
        refused = await http.post(url, json={**BODY, "model": "nope"}, headers={"x-request-id": "r-404"})
        assert refused.status_code == 404 and refused.headers["x-request-id"] == "r-404"
        stream = await http.post(url, json={**BODY, "stream": True}, headers={"x-request-id": "r-sse"})
        assert stream.headers["x-request-id"] == "r-sse" and stream.text.rstrip().endswith("[DONE]")
        for path in ("/healthz", "/admin/v1/rollouts", "/v1/models"):
            response = await http.get(f"{gw.url}{path}", headers={"x-request-id": "r-other"})
            assert response.status_code == 200 and response.headers["x-request-id"] == "r-other", path
            assert response.headers.get_list("x-request-id") == ["r-other"]


@pytest.mark.slow
def test_logs_are_json_lines_with_the_request_id_and_no_secret(tmp_path: Path, mock: MockBackendProcess) -> None:
    env = {"ROLLWAY_LOG_FORMAT": "json", "ROLLWAY_GATEWAY_AUTH": "keys"}
    with GatewayProcess(f"sqlite:///{tmp_path / 'g.db'}", admin_token=TOKEN, env=env) as process:
        admin = {"authorization": f"Bearer {TOKEN}", "x-request-id": "admin-call-1"}
        model = {"backends": [vllm(mock)]}
        assert httpx.put(f"{process.url}/admin/v1/models/policy", json=model, headers=admin).status_code < 300
        key = httpx.post(f"{process.url}/admin/v1/keys", json={"scope": "gateway"}, headers=admin).json()["key"]
        call = {"authorization": f"Bearer {key}", "x-request-id": "agent-call-7"}
        assert httpx.post(f"{process.url}/v1/chat/completions", json=BODY, headers=call).status_code == 200
        wrong = {"authorization": "Bearer sk-rw-not-a-real-key", "x-request-id": "agent-call-8"}
        assert httpx.post(f"{process.url}/v1/chat/completions", json=BODY, headers=wrong).status_code == 401
        # The admin token as a path prefix opens only the Agent-lightning and OTLP routes; an agent pointed at
        # that address for its LLM calls gets a 404, and a wrong token a 401 -- neither token in the log.
        for path, status, request_id in [
            ("/t/not-the-admin-token-5678/v1/agl/health", 401, "path-token-1"),
            (f"/t/{TOKEN}/v1/chat/completions", 404, "path-token-2"),
            (f"/t/{TOKEN}/admin/v1/stats", 404, "path-token-3"),
        ]:
            sent = httpx.post(f"{process.url}{path}", json=BODY, headers={"x-request-id": request_id})
            assert sent.status_code == status
        lines = _wait_for_lines(process, ["agent-call-7", "agent-call-8", "admin-call-1", "path-token-3"])
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len(lines)  # every line is a JSON object
    assert {"ts", "level", "logger", "msg", "request_id"} <= set(records[0])
    by_id = {r["request_id"]: r for r in records if r["request_id"]}
    call_line = by_id["agent-call-7"]
    assert "/v1/chat/completions" in call_line["msg"] and "200" in call_line["msg"]
    assert (call_line["method"], call_line["path"], call_line["status"]) == ("POST", "/v1/chat/completions", 200)
    assert by_id["agent-call-8"]["status"] == 401
    assert by_id["admin-call-1"]["logger"] == "uvicorn.access"
    text = "\n".join(lines)
    assert TOKEN not in text and key not in text and "sk-rw-not-a-real-key" not in text
    assert "not-the-admin-token-5678" not in text
    assert by_id["path-token-2"]["path"] == "/t/redacted/v1/chat/completions" and by_id["path-token-2"]["status"] == 404
    assert "/t/redacted/v1/agl/health" in text


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_secrets_in_a_query_string_are_redacted_from_the_logs(tmp_path: Path, log_format: str) -> None:
    """The server reads no secret from a URL's query, but a client may wrongly put one there (``?token=``,
    ``?api_key=``): its value is written ``redacted`` in the access line (and its JSON ``path``), whatever route
    it went to and whatever the route answered; other parameters are kept as sent."""
    secrets = {
        "/v1/models?token=qs-secret-1": "/v1/models?token=redacted",
        "/admin/v1/rollouts?limit=5&api_key=qs-secret-2": "/admin/v1/rollouts?limit=5&api_key=redacted",
        "/healthz?key=qs-secret-3&keyword=kept": "/healthz?key=redacted&keyword=kept",
        "/v1/agl/rollouts?Access%5FToken=qs-secret-4": "/v1/agl/rollouts?Access%5FToken=redacted",
        "/no/such/route?X-Amz-Signature=qs-secret-5&apiKey=qs-secret-6": (
            "/no/such/route?X-Amz-Signature=redacted&apiKey=redacted"
        ),
    }
    env = {"ROLLWAY_LOG_FORMAT": log_format}
    with GatewayProcess(f"sqlite:///{tmp_path / 'g.db'}", env=env) as process:
        for n, path in enumerate(secrets):
            httpx.get(f"{process.url}{path}", headers={"x-request-id": f"query-{n}"})
        lines = _wait_for_lines(process, [f"query-{n}" for n in range(len(secrets))])
    text = "\n".join(lines)
    assert "qs-secret" not in text
    access = [line for line in lines if "query-" in line]
    for n, shown in enumerate(secrets.values()):
        [line] = [line for line in access if f"query-{n}" in line]
        assert shown in line, line
        if log_format == "json":
            assert json.loads(line)["path"] == shown


def _wait_for_lines(process: GatewayProcess, needles: list[str], timeout: float = 10.0) -> list[str]:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = list(process.output)
        if all(any(n in line for line in lines) for n in needles):
            return lines
        time.sleep(0.05)  # the child's output is read by a thread; there is no event to wait on
    raise AssertionError(f"log lines with {needles} not seen:\n" + "\n".join(process.output))


@pytest.mark.slow
async def test_metrics_add_up_across_server_processes(tmp_path: Path, mock: MockBackendProcess) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    async with await Store.open(url) as store:
        await register(store, "policy", vllm(mock))
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    with GatewayProcess(url, env=env) as first, GatewayProcess(url, env=env) as second:
        async with httpx.AsyncClient(timeout=10) as http:
            for process, count in ((first, 3), (second, 2)):
                for _ in range(count):
                    assert (await http.post(f"{process.url}/v1/chat/completions", json=BODY)).status_code == 200
            texts = [(await http.get(f"{process.url}/metrics")).text for process in (first, second)]
    assert [_requests_total(text) for text in texts] == [5, 5]  # either process's scrape sees both's calls
    if shutil.which("promtool") is not None:
        promtool = await asyncio.create_subprocess_exec("promtool", "check", "metrics", stdin=PIPE, stdout=PIPE)
        out, _ = await asyncio.wait_for(promtool.communicate(texts[0].encode()), 60)
        assert promtool.returncode == 0, out.decode()


def _requests_total(text: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "rollway_requests_total"
    )
