"""What counts as a training sample in every export (triplets, merged rows, SLIME, verl), end to end: the
official openai SDK → a real gateway → the mock backend (with scripted faults), rewards through the admin API,
then the exports read over HTTP."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rollway.admin.adapters import triplets
from rollway.mock import MockBackendProcess
from rollway.store import ExportQuery, RolloutConfig, Span, Store, TaskSpec
from support.examples import load_example
from support.gateway_harness import RunningGateway, claim_one, register, running_gateway, vllm
from support.spans import conversation, plain

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 17 + 25?"}]
OTHER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story about a dragon."}]
LONG = {"ignore_eos": True}  # the mock then answers exactly max_tokens tokens


@asynccontextmanager
async def gateway(tmp_path: Path, mock: MockBackendProcess) -> AsyncIterator[RunningGateway]:
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock), version="v1")
        yield gw


async def admin(gw: RunningGateway, method: str, path: str, **kwargs: Any) -> Any:
    async with httpx.AsyncClient(base_url=f"{gw.url}/admin/v1", timeout=30) as client:
        response = await client.request(method, path, **kwargs)
    assert response.status_code < 300, response.text
    return response.json()


async def items(gw: RunningGateway, path: str, **params: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = (await admin(gw, "GET", path, params=params))["items"]
    return found


async def finish(gw: RunningGateway, rollout_id: str, reward: float | None = 1.0) -> None:
    """The calls' spans written (the alias drained), a reward, the attempt succeeded."""
    assert await gw.state.registry.drain("policy", 10)
    await admin(gw, "POST", f"/rollouts/{rollout_id}/rewards", json={"value": reward})
    await admin(gw, "PATCH", f"/rollouts/{rollout_id}/attempts/latest", json={"status": "succeeded"})


async def broken_stream(
    client: openai.AsyncOpenAI, mock: MockBackendProcess, messages: list[ChatCompletionMessageParam]
) -> None:
    """A streamed call whose backend connection drops after a few chunks (the client gets an error event)."""
    mock.add_faults({"kind": "drop_mid_stream", "after_chunks": 3})
    stream = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=20, stream=True, extra_body=LONG
    )
    with pytest.raises(openai.APIError):
        async with stream:
            async for _ in stream:
                pass


async def abandoned_stream(client: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam]) -> None:
    """A streamed call the client leaves after three chunks (the gateway cancels it)."""
    slow = LONG | {"mock": {"token_delay_ms": 30}}
    stream = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=200, stream=True, extra_body=slow
    )
    seen = 0
    async with stream:
        async for _ in stream:
            seen += 1
            if seen == 3:
                break


async def test_calls_that_did_not_complete_are_no_training_samples_in_any_export(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A complete call, its retry with the same prompt broken mid-stream, another call the client abandoned,
    then the final reward: every export holds the complete call alone, with the reward."""
    async with gateway(tmp_path, mock) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        done = await client.chat.completions.create(
            model="policy", messages=QUESTION, max_tokens=8, extra_body={"return_token_ids": True}
        )
        await broken_stream(client, mock, QUESTION)
        await abandoned_stream(client, OTHER)
        await finish(gw, rollout_id)

        spans = (await admin(gw, "GET", f"/rollouts/{rollout_id}/spans"))["items"]
        calls = [s for s in spans if s["name"].startswith("chat")]
        assert [s["status"]["status_code"] for s in calls] == ["OK", "ERROR", "ERROR"]
        assert calls[1]["attributes"]["rollway.prompt_token_ids"] == calls[0]["attributes"]["rollway.prompt_token_ids"]
        assert calls[2]["attributes"]["rollway.cancelled"] is True
        assert all(c["attributes"]["rollway.response_token_ids"] for c in calls)  # partial tokens were recorded

        complete = calls[0]["attributes"]
        response_ids = done.model_dump()["choices"][0]["token_ids"]
        [triplet] = await items(gw, "/triplets")
        assert (triplet["sequence_id"], triplet["reward"]) == (1, 1.0)
        assert triplet["finish_reason"] == done.choices[0].finish_reason is not None
        assert triplet["response_token_ids"] == response_ids == complete["rollway.response_token_ids"]
        [row] = await items(gw, "/triplets", merge="true")
        assert (row["n_calls"], row["reward"]) == (1, 1.0)
        assert row["token_ids"] == complete["rollway.prompt_token_ids"] + response_ids
        [sample] = await items(gw, "/exports/slime")
        assert (sample["status"], sample["reward"], sample["metadata"]["n_calls"]) == ("completed", 1.0, 1)
        assert sample["tokens"] == row["token_ids"] and sample["response_length"] == len(response_ids)
        [verl] = await items(gw, "/exports/verl")
        assert (verl["response_ids"], verl["reward"]) == (response_ids, 1.0)


async def test_a_rollout_whose_only_call_was_cancelled_gives_an_aborted_placeholder_and_no_rows(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with gateway(tmp_path, mock) as gw:
        rollout_id, _ = await claim_one(gw.store)
        await abandoned_stream(gw.client(f"{gw.url}/rollout/{rollout_id}/v1"), OTHER)
        await finish(gw, rollout_id)
        assert await items(gw, "/triplets") == []
        assert await items(gw, "/triplets", merge="true") == []
        assert await items(gw, "/exports/verl") == []
        [sample] = await items(gw, "/exports/slime")
        assert (sample["status"], sample["tokens"], sample["reward"]) == ("aborted", [], None)


async def one_call(gw: RunningGateway, rollout_id: str) -> None:
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    await client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=4)
    await finish(gw, rollout_id)


def group_indices(records: list[dict[str, Any]]) -> dict[str, int]:
    return {r["metadata"]["rollout_id"]: r["group_index"] for r in records}


async def test_every_member_of_a_group_has_one_group_index_in_every_mode(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A group of three finishing around a solo rollout: grouped, ``partial``, by ``rollout_id`` and the data
    source with ``partial=True`` all see the group as one ``group_index``."""
    async with gateway(tmp_path, mock) as gw:
        group = await gw.store.enqueue([TaskSpec(group_id="g", group_size=3)])
        [solo] = await gw.store.enqueue([TaskSpec()])
        assert len(await gw.store.claim("w", limit=4)) == 4
        g0, g1, g2 = (r.rollout_id for r in group)
        for rollout_id in (g0, solo.rollout_id, g1, g2):
            await one_call(gw, rollout_id)

        grouped = group_indices(await items(gw, "/exports/slime"))
        assert grouped[g0] == grouped[g1] == grouped[g2] != grouped[solo.rollout_id]
        partial = group_indices(await items(gw, "/exports/slime", partial="true"))
        assert partial == grouped
        named = group_indices(await items(gw, "/exports/slime", rollout_id=[g0, g1]))
        assert named == {g0: grouped[g0], g1: grouped[g0]}

        module = load_example("slime_data_source")
        source = module.RollwayDataSource(gw.url, partial=True, poll_interval=0.2)
        try:
            groups = await asyncio.to_thread(source.get_samples, 2, 10)
        finally:
            await asyncio.to_thread(source.stop)
        members = [sorted(s.metadata["rollout_id"] for s in g) for g in groups]
        assert sorted(members) == sorted([sorted([g0, g1, g2]), [solo.rollout_id]])

        large = module.RollwayDataSource(gw.url, page_size=600, poll_interval=0.2)  # streamed: records only
        try:
            groups = await asyncio.to_thread(large.get_samples, 2, 10)
        finally:
            await asyncio.to_thread(large.stop)
        assert sorted(sorted(s.metadata["rollout_id"] for s in g) for g in groups) == sorted(members)


async def test_the_data_source_hands_slime_no_sample_without_a_reward_and_waits_for_a_late_one(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A group of two, one member without a reward, and a failed solo rollout: the data source hands SLIME
    nothing of them (whole groups; with ``partial=True``, the rewarded member alone) and lists them as held.
    The late reward brings the member back with its group, which is handed over then — and once only."""
    async with gateway(tmp_path, mock) as gw:
        rewarded, unrewarded = await gw.store.enqueue([TaskSpec(group_id="g", group_size=2)])
        [failed] = await gw.store.enqueue([TaskSpec()])
        assert len(await gw.store.claim("w", limit=3)) == 3
        await one_call(gw, rewarded.rollout_id)
        client = gw.client(f"{gw.url}/rollout/{unrewarded.rollout_id}/v1")
        await client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=4)
        await finish(gw, unrewarded.rollout_id, reward=None)
        client = gw.client(f"{gw.url}/rollout/{failed.rollout_id}/v1")
        await client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=4)
        assert await gw.state.registry.drain("policy", 10)
        await admin(gw, "PATCH", f"/rollouts/{failed.rollout_id}/attempts/latest", json={"status": "failed"})
        statuses = {s["metadata"]["rollout_id"]: (s["status"], s["reward"]) for s in await items(gw, "/exports/slime")}
        assert statuses == {
            rewarded.rollout_id: ("truncated", 1.0),  # stopped on max_tokens: trained as it is
            unrewarded.rollout_id: ("aborted", None),
            failed.rollout_id: ("aborted", None),
        }

        module = load_example("slime_data_source")
        whole = module.RollwayDataSource(gw.url, poll_interval=0.1)
        partial = module.RollwayDataSource(gw.url, partial=True, poll_interval=0.1)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.to_thread(whole.get_samples, 1, 1.5)
            assert whole.held == {"g": [unrewarded.rollout_id], failed.rollout_id: [failed.rollout_id]}
            [[alone]] = await asyncio.to_thread(partial.get_samples, 1, 10)
            assert (alone.metadata["rollout_id"], alone.reward) == (rewarded.rollout_id, 1.0)
            assert set(partial.held) == {unrewarded.rollout_id, failed.rollout_id}

            await admin(gw, "POST", f"/rollouts/{unrewarded.rollout_id}/rewards", json={"value": 0.5})
            [group] = await asyncio.to_thread(whole.get_samples, 1, 10)
            [[late]] = await asyncio.to_thread(partial.get_samples, 1, 10)

            # another reward after SLIME got the group: it comes along the cursor again, but is not trained twice
            await admin(gw, "POST", f"/rollouts/{rewarded.rollout_id}/rewards", json={"value": 0.25})
            for source in (whole, partial):
                with pytest.raises(TimeoutError):
                    await asyncio.to_thread(source.get_samples, 1, 1.5)
                assert source.repeated == 1
        finally:
            await asyncio.to_thread(whole.stop)
            await asyncio.to_thread(partial.stop)
        got = {s.metadata["rollout_id"]: (s.status, s.reward) for s in group}
        truncated = module.Status.TRUNCATED
        assert got == {rewarded.rollout_id: (truncated, 1.0), unrewarded.rollout_id: (truncated, 0.5)}
        assert (late.metadata["rollout_id"], late.status, late.reward) == (unrewarded.rollout_id, truncated, 0.5)
        assert whole.held == {failed.rollout_id: [failed.rollout_id]} and set(partial.held) == {failed.rollout_id}


def reward_span(rollout_id: str, value: float | None, name: str = "primary", attempt_id: str | None = None) -> Span:
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        trace_id=secrets.token_hex(16),
        span_id=secrets.token_hex(8),
        name="rollway.reward",
        attributes={"rollway.reward.name": name, "rollway.reward.value": value},
    )


async def test_a_late_reward_moves_a_finished_rollout_and_its_group_forward_along_the_cursor(store: Store) -> None:
    """On each engine: a reward recorded after the rollout finished comes out of the next incremental pull with
    its whole group; an auxiliary or null reward changes no export and moves nothing."""
    group = await store.enqueue([TaskSpec(group_id="g", group_size=2)])
    claimed = {c.rollout.rollout_id: c.attempt.attempt_id for c in await store.claim("w", limit=2)}
    for rollout_id, attempt_id in claimed.items():
        await store.add_spans(conversation(rollout_id, attempt_id))
        await store.update_attempt(rollout_id, status="succeeded")
    first = await store.export_rollouts(ExportQuery(limit=10))
    assert len(first.rollouts) == 2
    late = group[0].rollout_id
    assert [r.finish_seq for r in first.rollouts if r.rollout_id == late] == [1]

    await store.add_spans([reward_span(late, 0.5, name="format"), reward_span(late, None)])
    assert (await store.export_rollouts(ExportQuery(since=first.next_cursor))).rollouts == []

    await store.add_spans([reward_span(late, 1.0)])
    again = await store.export_rollouts(ExportQuery(since=first.next_cursor, limit=10))
    assert sorted(r.rollout_id for r in again.rollouts) == sorted(claimed)  # the group, whole
    [moved] = [r for r in again.rollouts if r.rollout_id == late]
    assert moved.status == "succeeded" and moved.finish_seq > 2
    assert [t["reward"] for t in plain(triplets(late, moved.latest_attempt_id, moved.spans))] == [None, 1.0]
    assert (await store.export_rollouts(ExportQuery(since=again.next_cursor))).rollouts == []


async def test_a_late_reward_reaches_an_incremental_pull_and_a_stale_attempt_is_still_refused(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with gateway(tmp_path, mock) as gw:
        config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
        [retried] = await gw.store.enqueue([TaskSpec(config=config)])
        [first_claim] = await gw.store.claim("w")
        stale = first_claim.attempt.attempt_id
        await admin(gw, "PATCH", f"/rollouts/{retried.rollout_id}/attempts/latest", json={"status": "failed"})
        await gw.store.claim("w")
        client = gw.client(f"{gw.url}/rollout/{retried.rollout_id}/v1")
        await client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=4)
        await finish(gw, retried.rollout_id, reward=None)

        page = await admin(gw, "GET", "/triplets")
        assert [t["reward"] for t in page["items"]] == [None]
        async with httpx.AsyncClient(base_url=f"{gw.url}/admin/v1") as http:
            refused = await http.post(
                f"/rollouts/{retried.rollout_id}/rewards", json={"value": 1.0, "attempt_id": stale}
            )
        assert refused.status_code == 409 and "stale" in refused.json()["error"]["message"]
        assert (await admin(gw, "GET", "/triplets", params={"since": page["next_cursor"]}))["items"] == []

        await admin(gw, "POST", f"/rollouts/{retried.rollout_id}/rewards", json={"value": 1.0})
        later = await admin(gw, "GET", "/triplets", params={"since": page["next_cursor"]})
        assert [t["reward"] for t in later["items"]] == [1.0]
        [sample] = await items(gw, "/exports/slime", since=page["next_cursor"])
        assert sample["reward"] == 1.0


@pytest.mark.parametrize(
    ("sent", "prompt"),
    [("Once upon a time", "Once upon a time"), (["Once upon a time"], "Once upon a time"), ([[5, 6, 7]], [5, 6, 7])],
)
async def test_a_text_completion_exports_its_prompt(
    tmp_path: Path, mock: MockBackendProcess, sent: Any, prompt: Any
) -> None:
    """A batch of one prompt (as LangChain's ``OpenAI`` sends it) exports that prompt, not the batch."""
    async with gateway(tmp_path, mock) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        await client.completions.create(model="policy", prompt=sent, max_tokens=4)
        await finish(gw, rollout_id)
        [triplet] = await items(gw, "/triplets")
        assert (triplet["prompt"], triplet["messages"], triplet["reward"]) == (prompt, None, 1.0)
        assert isinstance(triplet["response"], str) and triplet["response"]
        [sample] = await items(gw, "/exports/slime")
        assert sample["prompt"] == prompt


async def test_each_choice_of_an_n_call_is_a_sample_and_the_conversation_follows_the_chosen_one(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A call with ``n=3``, a reward, then a next turn that continues choice 1, the final reward: every choice is
    a triplet (rewarded as its call); merged, choice 1 carries on the conversation and choices 0 and 2 are rows
    of their own; SLIME and verl have one record per row, each with the rollout's (final) reward."""
    async with gateway(tmp_path, mock) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        first = await client.chat.completions.create(model="policy", messages=OTHER, max_tokens=6, n=3)
        assert len({c.message.content for c in first.choices}) == 3
        await admin(gw, "POST", f"/rollouts/{rollout_id}/rewards", json={"value": 0.5})
        turn: list[ChatCompletionMessageParam] = [
            *OTHER,
            {"role": "assistant", "content": first.choices[1].message.content},
        ]
        await client.chat.completions.create(
            model="policy", messages=[*turn, {"role": "user", "content": "Why?"}], max_tokens=4
        )
        await finish(gw, rollout_id)

        spans = (await admin(gw, "GET", f"/rollouts/{rollout_id}/spans"))["items"]
        calls = [s["attributes"] for s in spans if s["name"].startswith("chat")]
        choice_ids = [c["token_ids"] for c in calls[0]["rollway.choices"]]
        triplets_ = await items(gw, "/triplets")
        assert [(t["sequence_id"], t["choice_index"], t["reward"]) for t in triplets_] == [
            (1, 0, 0.5),
            (1, 1, 0.5),
            (1, 2, 0.5),
            (3, 0, 1.0),
        ]
        assert [t["response_token_ids"] for t in triplets_[:3]] == choice_ids
        assert [t["response"]["content"] for t in triplets_[:3]] == [c.message.content for c in first.choices]

        prompt = calls[0]["rollway.prompt_token_ids"]
        chain, alone_0, alone_2 = await items(gw, "/triplets", merge="true")
        assert (chain["n_calls"], chain["reward"], chain["prefix_breaks"]) == (2, 1.0, 0)
        assert chain["token_ids"] == calls[1]["rollway.prompt_token_ids"] + calls[1]["rollway.response_token_ids"]
        assert chain["token_ids"][: len(prompt) + len(choice_ids[1])] == prompt + choice_ids[1]
        for row, ids in ((alone_0, choice_ids[0]), (alone_2, choice_ids[2])):
            assert (row["token_ids"], row["n_calls"], row["reward"], row["prefix_breaks"]) == (prompt + ids, 1, 0.5, 0)

        samples = await items(gw, "/exports/slime")  # each record carries the rollout's reward (its outcome)
        assert [(s["metadata"]["choice_index"], s["reward"], s["status"]) for s in samples] == [
            (0, 1.0, "truncated"),  # the last call stopped on max_tokens
            (0, 1.0, "completed"),
            (2, 1.0, "completed"),
        ]
        assert [s["metadata"]["side_choice"] for s in samples] == [False, True, True]
        assert [s["tokens"] for s in samples] == [chain["token_ids"], alone_0["token_ids"], alone_2["token_ids"]]
        verl = await items(gw, "/exports/verl")
        assert [(r["choice_index"], r["prompt_ids"], r["reward"]) for r in verl] == [
            (0, prompt, 1.0),
            (0, prompt, 1.0),
            (2, prompt, 1.0),
        ]


async def test_a_text_completion_of_several_prompts_gives_each_choice_its_own_prompt(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """vLLM answers a request holding several prompts with ``n`` choices per prompt, each with its own prompt's
    token ids: every choice is a sample of its own prompt (streamed or not)."""
    first = ["Once upon a time", "In a galaxy far, far away there lived"]
    second = ["The quick brown fox", "It was a dark and stormy night"]
    async with gateway(tmp_path, mock) as gw, httpx.AsyncClient(timeout=30) as direct:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        await client.completions.create(model="policy", prompt=first, max_tokens=4, n=2)
        stream = await client.completions.create(model="policy", prompt=second, max_tokens=3, stream=True)
        async for _ in stream:
            pass
        await finish(gw, rollout_id)
        truth = []
        for prompts, n, max_tokens in ((first, 2, 4), (second, 1, 3)):
            body = {
                "model": "mock-model",
                "prompt": prompts,
                "max_tokens": max_tokens,
                "n": n,
                "return_token_ids": True,
            }
            answer = (await direct.post(f"{mock.base_url}/completions", json=body)).json()
            truth += [(c["index"], c["prompt_token_ids"], c["token_ids"], c["text"]) for c in answer["choices"]]
        found = await items(gw, "/triplets")
        assert [
            (t["choice_index"], t["prompt_token_ids"], t["response_token_ids"], t["response"]) for t in found
        ] == truth
        assert [t["prompt"] for t in found] == [first[0], first[0], first[1], first[1], second[0], second[1]]
        assert found[1]["prompt_token_ids"] != found[2]["prompt_token_ids"]
        assert [t["reward"] for t in found] == [None] * 4 + [1.0] * 2


async def test_with_n_samples_per_prompt_the_data_source_gives_one_sample_per_rollout_and_whole_groups_only(
    tmp_path: Path, mock: MockBackendProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """SLIME counts on ``n_samples_per_prompt`` samples per group. A group of three whose members give four
    records (a prefix break) and two (an ``n=2`` call): with ``n_samples_per_prompt=3`` each rollout is one
    sample — its last segment, the continued choice — and a group of two is held back, not handed over short;
    without it every record is a sample (six)."""
    async with gateway(tmp_path, mock) as gw:
        broken, forked, plain_ = group = await gw.store.enqueue([TaskSpec(group_id="g", group_size=3)])
        pair = await gw.store.enqueue([TaskSpec(group_id="p", group_size=2)])
        assert len(await gw.store.claim("w", limit=5)) == 5
        client = gw.client(f"{gw.url}/rollout/{broken.rollout_id}/v1")
        for messages in (QUESTION, OTHER):  # the second prompt does not extend the first: a prefix break
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        await finish(gw, broken.rollout_id)
        client = gw.client(f"{gw.url}/rollout/{forked.rollout_id}/v1")
        await client.chat.completions.create(model="policy", messages=OTHER, max_tokens=4, n=2)
        await finish(gw, forked.rollout_id)
        for task in (plain_, *pair):
            await one_call(gw, task.rollout_id)
        records = await items(gw, "/exports/slime", group_id="g")
        assert [(r["metadata"]["segment"], r["metadata"]["side_choice"]) for r in records] == [
            (0, False),
            (1, False),
            (0, False),
            (1, True),
            (0, False),
        ]
        last_segment = records[1]

        module = load_example("slime_data_source")
        one = module.RollwayDataSource(gw.url, poll_interval=0.1, n_samples_per_prompt=3)
        every = module.RollwayDataSource(gw.url, poll_interval=0.1)
        try:
            with caplog.at_level("WARNING", logger="slime_data_source"):
                [samples] = await asyncio.to_thread(one.get_samples, 1, 10)
                with pytest.raises(TimeoutError):
                    await asyncio.to_thread(one.get_samples, 1, 1.0)
            groups = await asyncio.to_thread(every.get_samples, 2, 10)
        finally:
            await asyncio.to_thread(one.stop)
            await asyncio.to_thread(every.stop)
        assert [s.metadata["rollout_id"] for s in samples] == [t.rollout_id for t in group]
        assert samples[0].tokens == last_segment["tokens"]
        assert [(s.metadata["choice_index"], s.metadata["side_choice"]) for s in samples[1:]] == [(0, False)] * 2
        assert one.left_out == 2
        assert one.held == {"p": sorted(t.rollout_id for t in pair)}
        assert "2 rollouts, n_samples_per_prompt is 3" in caplog.text
        assert sorted(len(g) for g in groups) == [2, 5]
