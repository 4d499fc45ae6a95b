"""One scenario through Agent-lightning's real ``LightningStoreClient``; prints every result as JSON.

Usage: ``store_scenario.py URL`` (a Rollway server) or ``store_scenario.py agl`` (Agent-lightning's own
``LightningStoreServer`` over ``InMemoryLightningStore``, started here).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agentlightning import LightningStoreClient
from agentlightning.types import LLM, EnqueueRolloutRequest, PromptTemplate, ProxyLLM, RolloutConfig, Span
from common import agl_server, dump  # type: ignore[import-not-found]  # a sibling: run from its folder


def span(rollout_id: str, attempt_id: str, sequence_id: int, n: int, name: str = "work") -> Span:
    return Span.model_validate(
        {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "sequence_id": sequence_id,
            "trace_id": f"{n:032x}",
            "span_id": f"{n:016x}",
            "parent_id": None,
            "name": name,
            "status": {"status_code": "OK", "description": None},
            "attributes": {"step": n, "tags": ["a", "b"]},
            "events": [{"name": "tick", "attributes": {"i": 1}, "timestamp": 1.5}],
            "links": [],
            "start_time": 100.0 + n,
            "end_time": 100.5 + n,
            "context": None,
            "parent": None,
            "resource": {"attributes": {"service.name": "agent"}, "schema_url": ""},
        }
    )


async def scenario(client: LightningStoreClient) -> dict[str, Any]:
    out: dict[str, Any] = {}
    res = await client.add_resources(
        {
            "main_llm": ProxyLLM(endpoint="http://127.0.0.1:9/v1", model="m", sampling_parameters={"temperature": 0.7}),
            "prompt": PromptTemplate(template="Q: {q}", engine="f-string"),
        }
    )
    out["add_resources"] = res
    out["update_resources"] = await client.update_resources(
        res.resources_id, {"main_llm": LLM(endpoint="http://127.0.0.1:9/v1", model="m2")}
    )
    out["latest_resources"] = await client.get_latest_resources()
    out["resources_by_id"] = await client.get_resources_by_id(res.resources_id)
    out["resources_missing"] = await client.get_resources_by_id("rs-missing")
    out["query_resources"] = await client.query_resources()

    retry = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    enq = await client.enqueue_many_rollouts(
        [
            EnqueueRolloutRequest(input={"q": "1+1"}, mode="train", config=retry, metadata={"data_id": "d1"}),
            EnqueueRolloutRequest(input={"q": "2+2"}),
            EnqueueRolloutRequest(input={"q": "3+3"}, mode="val"),
        ]
    )
    out["enqueue"] = enq
    r1, r2, r3 = (r.rollout_id for r in enq)
    out["enqueue_one"] = await client.enqueue_rollout(input={"q": "4+4"}, mode="test")

    first = await client.dequeue_rollout(worker_id="w1")
    out["dequeue_1"] = first
    assert first is not None
    out["fail_attempt_1"] = await client.update_attempt(r1, first.attempt.attempt_id, status="failed")
    out["after_retryable_failure"] = await client.get_rollout_by_id(r1)

    # FIFO: the requeued rollout 1 is behind the three rollouts still queued.
    batch = await client.dequeue_many_rollouts(limit=4, worker_id="w2")
    out["dequeue_many"] = batch
    by_rollout = {r.rollout_id: r for r in batch}
    a1 = by_rollout[r1].attempt.attempt_id if r1 in by_rollout else None
    out["retried_is_second_attempt"] = r1 in by_rollout and by_rollout[r1].attempt.sequence_id == 2
    out["dequeue_empty"] = await client.dequeue_rollout(worker_id="w1")

    if a1 is not None:
        seq = await client.get_next_span_sequence_id(r1, a1)
        out["next_seq_1"] = seq
        out["add_span_1"] = await client.add_span(span(r1, a1, seq, 1))
        out["add_span_dup"] = await client.add_span(span(r1, a1, seq, 1))
        out["next_seq_2"] = await client.get_next_span_sequence_id(r1, a1)
        out["add_span_2"] = await client.add_span(span(r1, a1, out["next_seq_2"], 2, name="reward"))
        out["heartbeat"] = (await client.update_attempt(r1, a1, last_heartbeat_time=123.0)).status
        out["running_after_span"] = await client.get_rollout_by_id(r1)
        out["spans_latest"] = await client.query_spans(r1, "latest")
        out["spans_all"] = await client.query_spans(r1)
        out["spans_by_name"] = await client.query_spans(r1, name="reward")
        out["succeed_1"] = await client.update_attempt(r1, a1, status="succeeded", metadata={"score": 1})

    if r2 in by_rollout:
        out["fail_2"] = await client.update_attempt(r2, by_rollout[r2].attempt.attempt_id, status="failed")

    started = await client.start_rollout(input={"q": "direct"}, mode="val", worker_id="w3")
    out["start_rollout"] = started
    out["start_attempt"] = await client.start_attempt(started.rollout_id, worker_id="w3")
    out["latest_attempt"] = await client.get_latest_attempt(started.rollout_id)
    out["query_attempts"] = await client.query_attempts(started.rollout_id)
    out["update_rollout"] = await client.update_rollout(r3, metadata={"x": 1}, mode="train")
    out["cancel_rollout"] = await client.update_rollout(r3, status="cancelled")

    out["rollout_missing"] = await client.get_rollout_by_id("ro-missing")
    out["latest_attempt_missing"] = await client.get_latest_attempt(out["enqueue_one"].rollout_id)
    out["query_rollouts_all"] = await client.query_rollouts()
    out["query_rollouts_succeeded"] = await client.query_rollouts(status_in=["succeeded"])
    out["query_rollouts_ids"] = await client.query_rollouts(rollout_id_in=[r2, r3], sort_by="status", sort_order="desc")
    out["query_rollouts_page"] = await client.query_rollouts(limit=2, offset=1)
    out["wait"] = await client.wait_for_rollouts(rollout_ids=[r1, r2, r3, started.rollout_id], timeout=0.05)
    out["update_worker"] = await client.update_worker("w1", heartbeat_stats={"cpu": 1})
    out["workers"] = await client.query_workers()
    out["worker_missing"] = await client.get_worker_by_id("w-missing")
    stats = await client.statistics()
    out["statistics"] = {k: v for k, v in stats.items() if k.startswith("total_") and k != "total_span_bytes"}
    return {k: dump(v) for k, v in out.items()}


async def main(target: str) -> None:
    if target == "agl":
        async with agl_server() as url:
            client = LightningStoreClient(url)
            result = await scenario(client)
            await client.close()
    else:
        client = LightningStoreClient(target)
        result = await scenario(client)
        await client.close()
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
