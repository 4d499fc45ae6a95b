"""A group that cannot teach anything is flagged (``GET /admin/v1/groups/{id}``, ``health``): four members of a
GRPO group each ask the same question through dspy's ``LM`` (the real library, through LiteLLM, on a real uvicorn
in front of the mock backend), each with its own rollout key. With dspy's cache on (its default), its cache key
ignores the address and the key, so only the first member's call reaches Rollway: the other three finish with a
reward and no call. With the cache off, every member calls, and the deterministic mock gives them all the same
answer, which is flagged too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from rollway.mock import MockBackendProcess
from support.dspy_group import ask_all
from support.gateway_harness import RunningGateway, serving_policy, vllm


async def run_group(gw: RunningGateway, group_id: str, cache: bool) -> dict[str, Any]:
    await gw.store.enqueue([{"input": {"q": "2+2"}, "group_id": group_id, "group_size": 4}])
    claimed = await gw.store.claim_with_keys("dspy-runner", limit=4)
    answers = await asyncio.to_thread(ask_all, f"{gw.url}/v1", [key for _, key in claimed], cache)
    assert len(set(answers)) == 1  # the same answer for every member, cached or not
    for attempted, _ in claimed:
        reward = {"rollout_id": attempted.rollout.rollout_id, "trace_id": "0" * 32, "span_id": "1" * 16}
        await gw.store.add_span(reward | {"name": "rollway.reward", "attributes": {"rollway.reward.value": 1.0}})
        await gw.store.update_attempt(attempted.rollout.rollout_id, attempted.attempt.attempt_id, status="succeeded")
    async with gw.http("/admin/v1", timeout=30) as admin:
        view: dict[str, Any] = (await admin.get(f"/groups/{group_id}")).json()
    assert view["complete"] is True
    return view


async def test_a_dspy_group_with_its_cache_on_is_flagged(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with serving_policy(tmp_path, vllm(mock)) as gw:
        cached = await run_group(gw, "g-cached", cache=True)
        members = [r["rollout_id"] for r in cached["rollouts"]]
        calls = {rid: len([s for s in await gw.store.query_spans(rid) if s.name.startswith("chat")]) for rid in members}
        assert sorted(calls.values()) == [0, 0, 0, 1]
        health = cached["health"]
        assert sorted(health["without_calls"]) == sorted(rid for rid, n in calls.items() if n == 0)
        assert health["degenerate"] is True and health["identical_answers"] is False  # one member answered

        uncached = (await run_group(gw, "g-uncached", cache=False))["health"]
        assert uncached == {"without_calls": [], "identical_answers": True, "degenerate": True}

        # A trainer's pull of the two groups counts each by its health; pulled one by one, none is counted.
        async with gw.http(timeout=30) as http:
            assert (await http.get("/admin/v1/triplets", params={"partial": "true"})).status_code == 200
            assert exported(await http.get("/metrics")) == {}
            assert len((await http.get("/admin/v1/triplets")).json()["items"]) == 1 + 4  # the calls made
            assert exported(await http.get("/metrics")) == {"without_calls": 1.0, "identical_answers": 1.0}


def exported(metrics: httpx.Response) -> dict[str, float]:
    """``rollway_groups_exported_total`` by health."""
    out = {}
    for line in metrics.text.splitlines():
        if line.startswith("rollway_groups_exported_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('health="', 1)[1].split('"', 1)[0]] = float(value)
    return out
