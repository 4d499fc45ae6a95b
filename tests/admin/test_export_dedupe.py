"""The exports say what their de-duplication drops: one rollout of 28 calls through the real gateway and the
mock backend, its prompts repeated (an agent asking again, as the openai SDK's own retries and the frameworks'
loops do), exported with the de-duplication on (each row, the page and a header count the calls it removed) and
off (all 28 calls), as triplets, merged rows, SLIME samples and verl rows, JSON and JSON Lines, and through the
Python client, whose iterators keep the total."""

from __future__ import annotations

from pathlib import Path

import orjson

from rollway import AsyncRollwayClient
from rollway.mock import MockBackendProcess
from support.gateway_harness import claim_one, serving_policy, vllm

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three."]
ROUNDS = 7  # each prompt asked this many times: 28 calls


async def test_28_calls_with_repeated_prompts_are_28_rows_without_dedupe(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with serving_policy(tmp_path, vllm(mock), in_process=True) as gw:
        rollout_id, attempt_id = await claim_one(gw.store)
        llm = gw.client(base_url=f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1")
        for _ in range(ROUNDS):
            for prompt in PROMPTS:
                await llm.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=4
                )
        await gw.store.add_span(
            {
                "rollout_id": rollout_id,
                "name": "rollway.reward",
                "trace_id": "0" * 32,
                "span_id": "1" * 16,
                "attributes": {"rollway.reward.value": 1.0},
            }
        )
        await gw.store.update_attempt(rollout_id, attempt_id, status="succeeded")
        removed = len(PROMPTS) * (ROUNDS - 1)
        async with gw.http("/admin/v1", timeout=30) as admin:
            kept = await admin.get("/triplets")
            assert len(kept.json()["items"]) == len(PROMPTS)
            assert kept.json()["deduped_calls"] == removed and kept.headers["x-rollway-deduped-calls"] == str(removed)
            assert {row["deduped_calls"] for row in kept.json()["items"]} == {removed}
            every = await admin.get("/triplets", params={"dedupe": "false"})
            rows = every.json()["items"]
            assert len(rows) == len(PROMPTS) * ROUNDS == 28
            assert [r["sequence_id"] for r in rows] == list(range(1, 29))
            assert every.json()["deduped_calls"] == 0 and {r["deduped_calls"] for r in rows} == {0}
            assert [r["reward"] for r in rows].count(1.0) == 1 and rows[-1]["reward"] == 1.0
            lines = await admin.get("/triplets", params={"dedupe": "false", "format": "jsonl"})
            assert len(lines.text.splitlines()) == 28 and lines.headers["x-rollway-deduped-calls"] == "0"
            jsonl_kept = [
                orjson.loads(line)
                for line in (await admin.get("/triplets", params={"format": "jsonl"})).text.splitlines()
            ]
            assert [r["deduped_calls"] for r in jsonl_kept] == [removed] * len(PROMPTS)
            # Merged rows and the trainer records count the same way. Each repeated prompt breaks the chain, so
            # without the de-duplication every call is a row of its own.
            merged = (await admin.get("/triplets", params={"merge": "true", "dedupe": "false"})).json()
            assert sum(r["n_calls"] for r in merged["items"]) == 28
            merged_kept = (await admin.get("/triplets", params={"merge": "true"})).json()
            assert sum(r["n_calls"] for r in merged_kept["items"]) == len(PROMPTS)
            assert merged_kept["deduped_calls"] == removed
            slime = (await admin.get("/exports/slime", params={"dedupe": "false"})).json()
            assert len(slime["items"]) == 28 and {s["metadata"]["deduped_calls"] for s in slime["items"]} == {0}
            verl = (await admin.get("/exports/verl")).json()
            assert {r["deduped_calls"] for r in verl["items"]} == {removed} and verl["deduped_calls"] == removed
        async with AsyncRollwayClient(gw.url, transport=gw.transport) as client:
            every_call = client.iter_triplets(dedupe=False)
            assert len([t async for t in every_call]) == 28 and every_call.deduped_calls == 0
            assert len([t async for t in client.iter_triplets()]) == len(PROMPTS)
            # The iterator keeps the running total, each rollout once, from JSON pages and JSON Lines alike (which
            # carry no total of their own), of triplets and of SLIME samples (whose count is in their metadata).
            for records in (
                client.iter_triplet_records(jsonl=True),
                client.iter_triplet_records(merge=True),
                client.iter_export("slime", jsonl=True),
                client.iter_export("verl"),
            ):
                assert records.deduped_calls == 0
                assert [r async for r in records] and records.deduped_calls == removed
