"""Agent-lightning's own ``LLMProxy`` (LiteLLM) in front of a vLLM-style backend, with a store as its span sink.

Usage: ``llm_proxy.py ADDRESS BACKEND_URL CALLS`` (a Rollway server, or ``agl`` for Agent-lightning's own
``LightningStoreServer`` over ``InMemoryLightningStore``, started here).

A rollout is enqueued and dequeued; the agent makes CALLS chat completions through the proxy's per-attempt URL
(the proxy allocates a sequence id per call, at arrival, with ``get_next_span_sequence_id``, and exports every
span LiteLLM records for the call under that one id, over OTLP to the store's ``/v1/traces``), then sends its
reward the runner's way (``/spans/next`` + ``POST /spans``) and finishes the attempt. Prints the spans of the
attempt as ``LightningStoreClient.query_spans`` returns them, and ``LlmProxyTraceToTriplet``'s triplets.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from agentlightning import LightningStoreClient, LLMProxy
from agentlightning.adapter import LlmProxyTraceToTriplet
from agentlightning.types import Span
from common import agl_server, free_port  # type: ignore[import-not-found]  # a sibling: run from its folder
from openai import OpenAI
from openai.types.chat import ChatCompletion


def reward_span(rollout_id: str, attempt_id: str, sequence_id: int, value: float) -> Span:
    """A reward as ``emit_reward`` records it."""
    now = time.time()
    return Span.model_validate(
        {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "sequence_id": sequence_id,
            "trace_id": "ab" * 16,
            "span_id": "cd" * 8,
            "parent_id": None,
            "name": "agentlightning.annotation",
            "status": {"status_code": "OK", "description": None},
            "attributes": {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
            "events": [],
            "links": [],
            "start_time": now,
            "end_time": now,
            "context": None,
            "parent": None,
            "resource": {"attributes": {}, "schema_url": ""},
        }
    )


async def scenario(address: str, backend: str, calls: int) -> dict[str, Any]:
    store = LightningStoreClient(address)
    model = {"model_name": "mock-model", "litellm_params": {"model": "hosted_vllm/mock-model", "api_base": backend}}
    proxy = LLMProxy(port=free_port(), model_list=[model], store=store, launch_mode="thread")
    await proxy.start()
    try:
        (rollout,) = await store.enqueue_many_rollouts([{"input": {"q": 1}}])
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None and claimed.rollout_id == rollout.rollout_id
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        base_url = proxy.as_resource(rid, aid).get_base_url(rid, aid)
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)

        def ask(i: int) -> ChatCompletion:  # the SDK's blocking call, run in a thread
            return client.chat.completions.create(
                model="mock-model",
                messages=[{"role": "user", "content": f"What is {i} + {i}?"}],
                max_tokens=8,
                temperature=0.0,
            )

        for i in range(calls):
            await asyncio.to_thread(ask, i)
        # The proxy exports a call's spans when LiteLLM ends them, after the response: wait for every call's
        # LLM span to be in the store (or the deadline) before the reward, as a runner's agent would be later.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            spans = await store.query_spans(rid, aid)
            if sum(1 for s in spans.items if s.name == "raw_gen_ai_request") >= calls:
                break
            await asyncio.sleep(0.1)  # poll interval
        seq = await store.get_next_span_sequence_id(rid, aid)
        await store.add_span(reward_span(rid, aid, seq, 1.0))
        await store.update_attempt(rid, aid, status="succeeded")
        spans = await store.query_spans(rid, aid)
        triplets = LlmProxyTraceToTriplet().adapt(list(spans.items))
        return {
            "rollout_id": rid,
            "spans": [[s.name, s.sequence_id] for s in spans.items],
            "triplets": [{"response": t.response["token_ids"], "reward": t.reward} for t in triplets],
        }
    finally:
        await proxy.stop()
        await store.close()


async def main(target: str, backend: str, calls: int) -> None:
    if target == "agl":
        async with agl_server() as url:
            result = await scenario(url, backend, calls)
    else:
        result = await scenario(target, backend, calls)
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
