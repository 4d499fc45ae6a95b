"""A real Agent-lightning runner (``LitAgentRunner`` + ``OtelTracer``) working a batch of rollouts from a store.

Usage:
  runner_batch.py enqueue ADDRESS GATEWAY_URL N   add a proxy_llm resource (the gateway) and N math tasks
  runner_batch.py run ADDRESS IDS_JSON            run the runner until every rollout in IDS_JSON has finished
  runner_batch.py collect ADDRESS IDS_JSON        statuses, attempts and LlmProxyTraceToTriplet's triplets

The agent calls its LLM through the per-attempt URL of the ``proxy_llm`` resource, emits its reward with
``emit_reward`` (a span that the tracer exports over OTLP to the store's ``/v1/traces``) and takes a moment
per task, so that a batch lasts a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

import agentlightning as agl
from agentlightning import LightningStoreClient
from agentlightning.adapter import LlmProxyTraceToTriplet
from agentlightning.execution.events import ThreadingEvent
from agentlightning.types import EnqueueRolloutRequest, ProxyLLM, RolloutConfig
from openai import AsyncOpenAI

FINISHED = {"succeeded", "failed", "cancelled"}


class MathAgent(agl.LitAgent[dict[str, Any]]):  # type: ignore[misc]  # agentlightning: Any where not installed
    async def rollout_async(self, task: dict[str, Any], resources: Any, rollout: Any) -> None:
        llm = resources["main_llm"]
        base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
            response = await client.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}],
                max_tokens=16,
                temperature=0.0,
            )
        answer = response.choices[0].message.content or ""
        await asyncio.sleep(task.get("work_seconds", 0.3))  # the agent's own work after the call
        numbers = [int(n) for n in re.findall(r"-?\d+", answer)]
        agl.emit_reward(1.0 if task["a"] + task["b"] in numbers else 0.0)


async def enqueue(address: str, gateway: str, n: int) -> list[str]:
    client = LightningStoreClient(address)
    await client.add_resources({"main_llm": ProxyLLM(endpoint=f"{gateway}/v1", model="mock-model")})
    config = RolloutConfig(unresponsive_seconds=3.0, max_attempts=3, retry_condition=["unresponsive", "failed"])
    rollouts = await client.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input={"a": i, "b": 2 * i}, mode="train", config=config) for i in range(1, n + 1)]
    )
    await client.close()
    return [r.rollout_id for r in rollouts]


async def run(address: str, ids: list[str]) -> dict[str, Any]:
    store = LightningStoreClient(address)
    tracer = agl.OtelTracer()
    runner = agl.LitAgentRunner(tracer, poll_interval=0.2, heartbeat_interval=0.5, heartbeat_launch_mode="asyncio")
    runner.init(MathAgent())
    runner.init_worker(0, store)
    event = ThreadingEvent()
    work = asyncio.create_task(runner.iter(event=event))
    polls = 0
    try:
        while not work.done():
            await asyncio.sleep(0.2)
            polls += 1
            try:
                found = await store.query_rollouts(rollout_id_in=ids)
            except Exception:  # the server is down (a crash test): keep going, the runner retries
                continue
            if len(found.items) == len(ids) and all(r.status in FINISHED for r in found.items):
                break
    finally:
        event.set()
        await work
        runner.teardown_worker(0)
        runner.teardown()
        await store.close()
    return {"polls": polls}


async def collect(address: str, ids: list[str]) -> dict[str, Any]:
    store = LightningStoreClient(address)
    adapter = LlmProxyTraceToTriplet()
    out: dict[str, Any] = {}
    for rollout_id in ids:
        rollout = await store.get_rollout_by_id(rollout_id)
        attempts = await store.query_attempts(rollout_id)
        spans = await store.query_spans(rollout_id, "latest")
        triplets = adapter.adapt(list(spans.items))
        out[rollout_id] = {
            "input": rollout.input if rollout else None,
            "status": rollout.status if rollout else None,
            "attempts": [a.status for a in attempts.items],
            "span_names": [(s.name, s.sequence_id) for s in spans.items],
            "triplets": [
                {"prompt": t.prompt["token_ids"], "response": t.response["token_ids"], "reward": t.reward}
                for t in triplets
            ],
        }
    await store.close()
    return out


def main() -> None:
    command, address = sys.argv[1], sys.argv[2]
    if command == "enqueue":
        result: Any = asyncio.run(enqueue(address, sys.argv[3], int(sys.argv[4])))
    elif command == "run":
        result = asyncio.run(run(address, json.loads(sys.argv[3])))
    else:
        result = asyncio.run(collect(address, json.loads(sys.argv[3])))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
