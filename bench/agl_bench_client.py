"""The measuring side of ``bench/agl_bench.py``; runs in the Agent-lightning 0.3.0 environment, not Rollway's.

``agl_bench_client.py serve PORT``  Agent-lightning's own LightningStoreServer + InMemoryLightningStore
``agl_bench_client.py measure ADDRESS SPANS ROLLOUTS CONCURRENCY``  prints one JSON line of rates
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from agentlightning import LightningStoreClient
from agentlightning.types import Span


def _span(rollout_id: str, attempt_id: str, i: int) -> Span:
    return Span.model_validate(
        {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "sequence_id": i + 1,
            "trace_id": f"{i:032x}",
            "span_id": f"{i:016x}",
            "parent_id": None,
            "name": "raw_gen_ai_request",
            "status": {"status_code": "OK", "description": None},
            "attributes": {
                "llm.hosted_vllm.prompt_token_ids": str(list(range(100 + i % 50))),
                "llm.hosted_vllm.choices": str([{"token_ids": list(range(50))}]),
                "gen_ai.request.model": "m",
            },
            "events": [],
            "links": [],
            "start_time": 1.0 + i,
            "end_time": 1.5 + i,
            "context": None,
            "parent": None,
            "resource": {"attributes": {"service.name": "bench"}, "schema_url": ""},
        }
    )


async def _pool(n: int, concurrency: int, make: Any) -> float:
    """Run ``make(i)`` for i < n with ``concurrency`` workers; seconds taken."""
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await make(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


async def measure(address: str, spans: int, rollouts: int, concurrency: int) -> dict[str, Any]:
    client = LightningStoreClient(address)
    targets = []
    for _ in range(concurrency):
        started = await client.start_rollout(input={"bench": True})
        targets.append((started.rollout_id, started.attempt.attempt_id))
    payloads = [_span(*targets[i % concurrency], i) for i in range(spans)]

    async def add(i: int) -> None:
        assert await client.add_span(payloads[i]) is not None

    span_seconds = await _pool(spans, concurrency, add)

    async def enqueue(i: int) -> None:
        await client.enqueue_rollout(input={"i": i})

    enqueue_seconds = await _pool(rollouts, concurrency, enqueue)
    got: list[int] = []

    async def dequeue(i: int) -> None:
        claimed = await client.dequeue_rollout(worker_id=f"w{i % concurrency}")
        assert claimed is not None
        got.append(1)

    dequeue_seconds = await _pool(rollouts, concurrency, dequeue)
    await client.close()
    return {
        "span_writes_per_s": spans / span_seconds,
        "enqueues_per_s": rollouts / enqueue_seconds,
        "dequeues_per_s": rollouts / dequeue_seconds,
        "enqueue_dequeue_per_s": 2 * rollouts / (enqueue_seconds + dequeue_seconds),
    }


async def serve(port: int) -> None:
    from agentlightning.store.client_server import LightningStoreServer
    from agentlightning.store.memory import InMemoryLightningStore

    server = LightningStoreServer(InMemoryLightningStore(thread_safe=True), host="127.0.0.1", port=port)
    await server.start()
    print("READY", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    if sys.argv[1] == "serve":
        asyncio.run(serve(int(sys.argv[2])))
    else:
        address, spans, rollouts, concurrency = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(asyncio.run(measure(address, spans, rollouts, concurrency))))


if __name__ == "__main__":
    main()
