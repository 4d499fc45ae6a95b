"""The gateway on PostgreSQL, end to end: two ``rollway serve`` processes (replicas) on one database, the
official openai SDK calling both for one attempt, the admin API of either driving the rollout. Skipped when
PostgreSQL is not reachable (``ROLLWAY_TEST_PG_URL``)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from rollway.admin.client import AsyncRollwayClient
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store import Span, Store
from support.gateway_harness import claim_one, serving_policy, vllm
from support.store_helpers import waiting_for_a_lock

pytestmark = [pytest.mark.postgres, pytest.mark.slow]  # two server processes
TOKEN = "admin-secret-token"
CALLS = 32
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def test_two_replicas_on_postgresql_record_one_gap_free_trajectory(pg_url: str, mock: MockBackendProcess) -> None:
    replicas = [GatewayProcess(pg_url, admin_token=TOKEN), GatewayProcess(pg_url, admin_token=TOKEN)]
    # Started together on the empty database: one migrates, the other waits for it (advisory lock).
    await asyncio.gather(*(asyncio.to_thread(r.start) for r in replicas))
    try:
        await _one_trajectory_across(replicas, mock)
    finally:
        for replica in replicas:
            replica.stop()
    for replica in replicas:  # both shut down cleanly (the store closed its pool)
        assert any("Application shutdown complete" in line for line in replica.output), list(replica.output)


async def _one_trajectory_across(replicas: list[GatewayProcess], mock: MockBackendProcess) -> None:
    a, b = (AsyncRollwayClient(r.url, TOKEN) for r in replicas)
    async with a, b:
        backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
        await a.put_model("policy", [backend], version="v1")
        [rollout] = await b.enqueue([{"input": {"task": "add"}}])
        [claim] = await b.claim("worker-1")
        assert claim.rollout.rollout_id == rollout.rollout_id
        rid, aid = rollout.rollout_id, claim.attempt.attempt_id
        # Replica a by path, replica b by the rollout key minted through b's claim (checked by a, too).
        clients = [
            AsyncOpenAI(base_url=f"{replicas[0].url}/rollout/{rid}/attempt/{aid}/v1", api_key="unused"),
            AsyncOpenAI(base_url=f"{replicas[1].url}/v1", api_key=claim.api_key),
        ]

        async def one(i: int) -> tuple[int, str, str]:
            client = clients[i % 2]
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"question {i}"}]
            if i % 4 < 2:
                raw = await client.chat.completions.with_raw_response.create(
                    model="policy", messages=messages, max_tokens=8
                )
                text = raw.parse().choices[0].message.content or ""
                headers = raw.headers
            else:
                streamed = await client.chat.completions.with_raw_response.create(
                    model="policy", messages=messages, max_tokens=8, stream=True
                )
                text = "".join([c.choices[0].delta.content or "" async for c in streamed.parse() if c.choices])
                headers = streamed.headers
            return int(headers["x-rollway-sequence-id"]), f"question {i}", text

        answered = await asyncio.gather(*(one(i) for i in range(CALLS)))
        for client in clients:
            await client.close()
        assert sorted(seq for seq, _, _ in answered) == list(range(1, CALLS + 1))  # across both replicas
        await a.add_reward(rid, 1.0)
        await b.update_attempt(rid, status="succeeded")

        spans = await b.get_spans(rid)
        assert [s.sequence_id for s in spans] == list(range(1, CALLS + 2))
        by_seq = {s.sequence_id: s for s in spans}
        for seq, question, text in answered:
            attributes = by_seq[seq].attributes
            assert attributes["rollway.request"]["messages"][0]["content"] == question
            assert attributes["rollway.model_version"] == "v1" and attributes["rollway.stream"] in (True, False)
            assert len(attributes["rollway.response_token_ids"]) == len(attributes["rollway.response_logprobs"]) > 0
            response = attributes["rollway.response"]["choices"][0]
            assert (response.get("message") or response.get("delta") or {}).get("content") == text

        triplets = [t async for t in a.iter_triplets(rollout_id=rid)]
        assert [t.sequence_id for t in triplets] == list(range(1, CALLS + 1))
        assert [t.reward for t in triplets] == [None] * (CALLS - 1) + [1.0]
        assert all(t.prompt_token_ids and t.response_token_ids for t in triplets)
        assert (await a.get_rollout(rid)).status == "succeeded"


async def test_a_call_the_client_leaves_while_its_span_is_written_keeps_its_span(
    pg_url: str, mock: MockBackendProcess, tmp_path: Path
) -> None:
    """PostgreSQL: a client that leaves cancels its call, and so the store write the call is awaiting. SQLite's
    writer finishes a write its caller stopped waiting for; PostgreSQL's must too, or the span of a call whose
    client left just as it ended is rolled back: its sequence id a hole, the call without its one span."""
    async with serving_policy(tmp_path, vllm(mock), database_url=pg_url) as gw:
        rollout_id, attempt_id = await claim_one(gw.store)
        client = gw.client(default_headers={"X-Rollout-Id": rollout_id})
        await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)  # attempt running
        holder = await asyncpg.connect(pg_url)
        try:
            call = asyncio.create_task(
                client.chat.completions.create(
                    model="policy", messages=MESSAGES, max_tokens=4, extra_body={"mock": {"latency_ms": 300}}
                )
            )
            await until(lambda: bool(gw.store.calls_in_flight.calls))
            async with holder.transaction():  # the span's heartbeat waits for the attempt's row
                await holder.execute("SELECT 1 FROM attempts WHERE attempt_id = $1 FOR UPDATE", attempt_id)
                await until(lambda: waiting_for_a_lock(holder))
                call.cancel()  # the client leaves while the span is being written
                await until(lambda: not gw.store.calls_in_flight.calls)
        finally:
            await holder.close()
        with pytest.raises(asyncio.CancelledError):
            await call
        spans = await until(lambda: _spans_if(gw.store, rollout_id, 2))
        assert [s.sequence_id for s in spans] == [1, 2]
        assert spans[1].attributes.get("rollway.cancelled") is not True  # it ended before the client left


async def until(condition: Callable[[], Any], timeout: float = 10.0) -> Any:
    """The first truthy value of ``condition`` (sync or async), checked every 10 ms; fails after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _spans_if(store: Store, rollout_id: str, count: int) -> list[Span] | None:
    spans = await store.query_spans(rollout_id, "latest")
    return spans if len(spans) >= count else None
