"""The gateway on PostgreSQL, end to end: two ``rollway serve`` processes (replicas) on one database, the
official openai SDK calling both for one attempt, the admin API of either driving the rollout. Skipped when
PostgreSQL is not reachable (``ROLLWAY_TEST_PG_URL``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai import AsyncOpenAI

from admin.client import AsyncRollwayClient
from gateway.mock import MockBackendProcess
from gateway.process import GatewayProcess

pytestmark = pytest.mark.postgres
TOKEN = "admin-secret-token"
CALLS = 32


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
            messages: Any = [{"role": "user", "content": f"question {i}"}]
            if i % 4 < 2:
                raw = await client.chat.completions.with_raw_response.create(
                    model="policy", messages=messages, max_tokens=8
                )
                text = raw.parse().choices[0].message.content or ""
            else:
                raw = await client.chat.completions.with_raw_response.create(
                    model="policy", messages=messages, max_tokens=8, stream=True
                )
                text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
            return int(raw.headers["x-rollway-sequence-id"]), f"question {i}", text

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
