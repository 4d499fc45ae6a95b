"""``ROLLWAY_MAX_CALLS_IN_FLIGHT``: a process running its limit of calls refuses the next one at once, with 503 and
``Retry-After`` in the OpenAI envelope and nothing recorded, instead of queueing it; the calls it took on are
answered and recorded; an SDK's retries of a refused call succeed once there is room."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess
from support.gateway_harness import Alias, RunningGateway, claim_one, vllm

LIMIT = 2
ASK: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"max_calls_in_flight": LIMIT, "body_timeout": 120}


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    return [Alias("policy", [vllm(mock)], version="v1")]


async def test_a_call_past_the_limit_is_refused_at_once_and_retried(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    route = f"/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"
    mock.add_faults({"kind": "delay", "ms": 1500, "times": LIMIT})
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        taken = [asyncio.create_task(http.post(route, json=ASK)) for _ in range(LIMIT)]
        await asyncio.to_thread(mock.stats, wait_requests=LIMIT, timeout=30)  # both are at the backend
        refused = await http.post(route, json=ASK)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "overloaded"
        assert "ROLLWAY_MAX_CALLS_IN_FLIGHT" in error["message"]
        ready = (await http.get("/readyz")).json()
        assert ready["status"] == "ready" and ready["calls"] == {"running": LIMIT, "limit": LIMIT, "saturated": True}
        # An SDK's call while the process is full: it waits out Retry-After and retries until there is room.
        retried = gw.client(f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1", max_retries=5)
        answer = await retried.chat.completions.create(**ASK)
        assert answer.choices[0].message.content
        assert [r.status_code for r in await asyncio.gather(*taken)] == [200, 200]
        metrics = (await http.get("/metrics")).text
        assert (await http.get("/readyz")).json()["calls"]["saturated"] is False
    spans = await gw.store.query_spans(rollout_id, attempt_id)
    assert len(spans) == LIMIT + 1 and all(s.status.status_code == "OK" for s in spans)  # no span of a refusal
    assert [s.sequence_id for s in spans] == [1, 2, 3]
    [shed] = [line for line in metrics.splitlines() if line.startswith("rollway_calls_shed_total ")]
    assert float(shed.split()[1]) >= 2  # the raw call, and the SDK's first try at least


async def test_a_call_past_the_limit_is_refused_before_its_body_is_read(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    """The refusal comes on the headers alone: a caller that has not sent its body yet (here: never, until it has
    read the answer) gets its 503 without the gateway waiting the body timeout (120 s) for it. The body it sends
    afterwards is read past, and the connection serves its next request."""
    rollout_id, attempt_id = await claim_one(gw.store)
    route = f"/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"
    mock.configure(hold=True)  # the calls taken on stay in flight until released, however slow this machine is
    body = json.dumps(ASK).encode()
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        taken = [asyncio.create_task(http.post(route, json=ASK)) for _ in range(LIMIT)]
        await asyncio.to_thread(mock.stats, wait_requests=LIMIT, timeout=30)
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            head = f"POST {route} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode())
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 503 "), status
            length = 0
            while (line := await asyncio.wait_for(reader.readline(), 10)) != b"\r\n":
                name, _, value = line.decode().partition(":")
                length = int(value) if name.lower() == "content-length" else length
            refusal = json.loads(await asyncio.wait_for(reader.readexactly(length), 10))
            assert refusal["error"]["code"] == "overloaded"
            writer.write(body + f"GET /healthz HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
            await writer.drain()
            assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 200 ")
        finally:
            writer.close()
            mock.configure(hold=False)
        assert [r.status_code for r in await asyncio.gather(*taken)] == [200, 200]
    spans = await gw.store.query_spans(rollout_id, attempt_id)
    assert len(spans) == LIMIT and all(s.status.status_code == "OK" for s in spans)
