"""Triplet export: the adapter's rules (reward matching, retries, attempts, merged rows), the store's export
read (order, groups, cursor; SQLite and PostgreSQL) and ``GET /admin/v1/triplets`` through the real app."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollway.admin import triplets as admin_triplets
from rollway.admin.adapters import merged_rows, triplets
from rollway.app.factory import RollwayApp
from rollway.settings import Settings
from rollway.store import ExportQuery, RemoteCompletion, RolloutConfig, Span, Store, TaskSpec
from rollway.store.exports import RawJson, read_attributes
from support.gateway_harness import app_lifespan
from support.spans import A1, A2, call, conversation, other, plain, reward


def rewards_of(spans: list[Span], attempt: str = A1) -> list[tuple[int, float | None]]:
    return [(t["sequence_id"], t["reward"]) for t in plain(triplets("ro-1", attempt, spans))]


# -- the adapter ------------------------------------------------------------------------------------------


def test_a_reward_goes_to_the_latest_earlier_call_and_the_final_one_to_the_last_call() -> None:
    spans = [call(1, [1], [2]), call(2, [3], [4]), reward(3, 0.5), call(4, [5], [6]), reward(5, 1.0)]
    assert rewards_of(spans) == [(1, None), (2, 0.5), (4, 1.0)]


def test_several_rewards_after_the_calls_fill_unmatched_calls_backwards() -> None:
    spans = [call(1, [1], [2]), call(2, [3], [4]), call(3, [5], [6]), reward(4, 0.1), reward(5, 0.2)]
    assert rewards_of(spans) == [(1, None), (2, 0.2), (3, 0.1)]


def test_a_reward_before_every_call_matches_nothing() -> None:
    spans = [reward(1, 1.0), call(2, [1], [2])]
    assert rewards_of(spans) == [(2, None)]


def test_spans_are_ordered_by_sequence_id_not_by_position() -> None:
    spans = [reward(3, 1.0), call(2, [3], [4]), call(1, [1], [2])]
    assert rewards_of(spans) == [(1, None), (2, 1.0)]


def test_a_missing_reward_stays_none_and_a_null_reward_matches_nothing() -> None:
    spans = [call(1, [1], [2]), reward(2, 0.0), call(3, [3], [4]), reward(4, None)]
    assert rewards_of(spans) == [(1, 0.0), (3, None)]


def test_auxiliary_reward_names_are_not_the_triplet_reward() -> None:
    spans = [call(1, [1], [2]), call(2, [3], [4]), reward(3, 1.0), reward(4, 0.3, name="format")]
    assert rewards_of(spans) == [(1, None), (2, 1.0)]


def test_agentlightning_reward_spans_are_rewards() -> None:
    spans = [
        call(1, [1], [2]),
        call(2, [3], [4]),
        call(3, [5], [6]),
        other(
            4,
            "agentlightning.annotation",
            {"agentlightning.reward.0.name": "task", "agentlightning.reward.0.value": 0.7},
        ),
        other(5, "agentlightning.annotation", {"reward": 0.25}),  # agentlightning 0.2
    ]
    assert rewards_of(spans) == [(1, None), (2, 0.25), (3, 0.7)]


def test_a_call_retried_with_an_identical_prompt_is_kept_once_the_last_time() -> None:
    spans = [
        call(1, [1, 2], [9]),
        call(2, [1, 2], [8]),
        call(3, [1, 2, 8, 5], [6]),
        call(4, [1, 3], [7]),
        reward(5, 1.0),
    ]
    out = plain(triplets("ro-1", A1, spans))
    assert [(t["sequence_id"], t["response_token_ids"], t["reward"]) for t in out] == [
        (2, [8], None),
        (3, [6], None),
        (4, [7], 1.0),
    ]


def test_only_the_latest_attempt_counts() -> None:
    spans = [
        call(1, [1], [2], attempt=A1),
        reward(2, 0.0, attempt=A1),
        call(1, [1], [3], attempt=A2),
        reward(2, 1.0, attempt=A2),
    ]
    out = plain(triplets("ro-1", A2, spans))
    assert [(t["attempt_id"], t["response_token_ids"], t["reward"]) for t in out] == [(A2, [3], 1.0)]
    assert triplets("ro-1", None, spans) == []  # a rollout that never ran


def test_non_trainable_calls_and_other_spans_are_not_triplets() -> None:
    no_ids = call(3, [5], [6])
    del no_ids.attributes["rollway.prompt_token_ids"]
    spans = [
        call(1, [1], [2], trainable=False),
        call(2, [3], [4], operation="embeddings"),
        no_ids,
        other(4, "tool.search", {"query": "x"}),
        call(5, [7], [], trainable=True),  # nothing sampled
        call(6, [8], [9], operation="text_completion"),
        reward(7, 1.0),
    ]
    assert rewards_of(spans) == [(6, 1.0)]


def test_a_triplet_carries_the_call_and_its_context() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    chat = call(1, [1, 2], [3, 4], logprobs=[-0.1, -0.2], messages=messages)
    chat.attributes["rollway.request"] |= {"temperature": 0.7, "top_p": 0.9, "seed": 3, "stream": True, "user": "u"}
    text = call(2, [5], [6], operation="text_completion")
    [first, second] = plain(triplets("ro-1", A1, [chat, text], group_id="g-1"))
    assert first == {
        "rollout_id": "ro-1",
        "attempt_id": A1,
        "group_id": "g-1",
        "sequence_id": 1,
        "choice_index": 0,
        "prompt_token_ids": [1, 2],
        "response_token_ids": [3, 4],
        "response_logprobs": [-0.1, -0.2],
        "reward": None,
        "messages": messages,
        "prompt": None,
        "response": chat.attributes["rollway.response"]["choices"][0]["message"],
        "model_version": "v7",
        "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": 3},  # how it was drawn, nothing else of the request
        "finish_reason": "stop",
        "deduped_calls": 0,
        "logprobs_source": "sampled",
        "logprobs_complete": True,
        "remove_sample": False,
    }
    assert second["response"] == text.attributes["rollway.response"]["choices"][0]["text"]
    assert (second["messages"], second["prompt"]) == (None, "hi")


def test_merge_chains_a_three_turn_conversation_into_one_row() -> None:
    spans = [
        call(1, [1, 2], [3, 4], logprobs=[-0.1, -0.2]),
        call(2, [1, 2, 3, 4, 5], [6], logprobs=[-0.3]),  # tool output 5
        call(3, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10], logprobs=[-0.4, -0.5]),  # observation 7, 8
        reward(4, 1.0),
    ]
    [row] = plain(merged_rows("ro-1", A1, spans, group_id="g-1"))
    assert row["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    assert row["logprobs"] == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert (row["reward"], row["n_calls"], row["prefix_breaks"], row["group_id"]) == (1.0, 3, 0, "g-1")
    assert (row["model_version"], row["model_versions"], row["sampling"]) == ("v7", ["v7"], {})


def test_a_merged_row_whose_calls_span_a_weight_update_names_both_versions() -> None:
    first, second = call(1, [1], [2], logprobs=[-0.1]), call(2, [1, 2, 3], [4], logprobs=[-0.2])
    second.attributes["rollway.model_version"] = "v8"
    second.attributes["rollway.request"]["temperature"] = 1.0
    [row] = plain(merged_rows("ro-1", A1, [first, second, reward(3, 1.0)]))
    assert (row["model_version"], row["model_versions"], row["sampling"]) == ("v8", ["v7", "v8"], {"temperature": 1.0})


def test_merge_splits_where_a_prompt_rewrote_history_and_counts_the_break() -> None:
    spans = [
        call(1, [1, 2], [3]),
        reward(2, 0.2),
        call(3, [1, 2, 3, 4], [5]),
        call(4, [1, 9, 4], [6]),  # history summarised: not an extension
        reward(5, 0.9),
    ]
    rows = plain(merged_rows("ro-1", A1, spans))
    assert [(r["token_ids"], r["loss_mask"], r["n_calls"], r["reward"]) for r in rows] == [
        ([1, 2, 3, 4, 5], [0, 0, 1, 0, 1], 2, 0.2),
        ([1, 9, 4, 6], [0, 0, 0, 1], 1, 0.9),
    ]
    assert [r["prefix_breaks"] for r in rows] == [1, 1]


def test_merge_has_no_logprobs_when_a_call_lacks_them() -> None:
    missing = call(2, [1, 2, 3], [4])
    missing.attributes["rollway.response_logprobs"] = None
    [row] = plain(merged_rows("ro-1", A1, [call(1, [1], [2]), missing]))
    assert row["logprobs"] is None
    assert row["reward"] is None


def test_every_row_says_how_its_logprobs_were_had_and_whether_they_are_complete() -> None:
    """A call's logprobs the engine gave with its answer are ``sampled``, those the gateway had it score after the
    call (``rollway.logprobs_source: scored``) ``scored``; a call without a logprob for every token has neither."""
    sampled = call(1, [1], [2, 3], logprobs=[-0.1, -0.2])
    scored = call(2, [1, 2, 3, 4], [5], logprobs=[-0.3])
    scored.attributes |= {"rollway.logprobs_source": "scored", "rollway.logprobs_complete": True}
    short = call(3, [7], [8, 9], logprobs=[-0.4])  # fewer logprobs than tokens
    missing = call(4, [7, 8, 9, 6], [5])
    missing.attributes |= {"rollway.response_logprobs": None, "rollway.logprobs_source": None}
    rows = plain(triplets("ro-1", A1, [sampled, scored, short, missing]))
    assert [(r["logprobs_source"], r["logprobs_complete"]) for r in rows] == [
        ("sampled", True),
        ("scored", True),
        (None, False),
        (None, False),
    ]
    whole, partly = plain(merged_rows("ro-1", A1, [sampled, scored, short, missing]))
    assert (whole["logprobs_source"], whole["logprobs_complete"], whole["n_calls"]) == ("scored", True, 2)
    assert (partly["logprobs_source"], partly["logprobs_complete"], partly["logprobs"]) == (None, False, None)
    [alone] = plain(merged_rows("ro-1", A1, [sampled]))
    assert (alone["logprobs_source"], alone["logprobs_complete"]) == ("sampled", True)


def test_only_the_first_choice_of_a_call_has_scored_logprobs() -> None:
    """The gateway scores a call's first choice; another choice's logprobs are its own, sampled or missing."""
    span = call(1, [1], [2, 3], logprobs=[-0.1, -0.2])
    span.attributes["rollway.logprobs_source"] = "scored"
    span.attributes["rollway.choices"] = [
        {"index": 0, "token_ids": [2, 3], "logprobs": [-0.1, -0.2]},
        {"index": 1, "token_ids": [4, 5], "logprobs": [-0.3, -0.4]},
        {"index": 2, "token_ids": [6, 7], "logprobs": None},
    ]
    rows = plain(triplets("ro-1", A1, [span]))
    assert [(r["choice_index"], r["logprobs_source"], r["logprobs_complete"]) for r in rows] == [
        (0, "scored", True),
        (1, "sampled", True),
        (2, None, False),
    ]


# -- through the store and the app -------------------------------------------------------------------------


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[RollwayApp]:
    async with app_lifespan(Settings(database_url=f"sqlite:///{tmp_path / 'app.db'}")) as application:
        yield application


@pytest.fixture
async def client(app: RollwayApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        yield c


@pytest.fixture
def app_store(app: RollwayApp) -> Store:
    store: Store = app.state.store
    return store


async def run(store: Store, client: httpx.AsyncClient, rollout_id: str, *, value: float | None = 1.0) -> str:
    """Run the rollout's current attempt to success: two calls, a reward, status succeeded."""
    attempt = (await store.get_attempt(rollout_id)).attempt_id
    await store.add_spans(conversation(rollout_id, attempt))
    response = await client.post(f"/admin/v1/rollouts/{rollout_id}/rewards", json={"value": value})
    assert response.status_code == 201
    response = await client.patch(f"/admin/v1/rollouts/{rollout_id}/attempts/latest", json={"status": "succeeded"})
    assert response.status_code == 200, response.text
    return attempt


async def enqueue(store: Store, *tasks: dict[str, Any]) -> list[str]:
    rollouts = await store.enqueue([TaskSpec(**t) for t in tasks])
    claimed = await store.claim("w1", limit=len(rollouts))
    assert len(claimed) == len(rollouts)
    return [r.rollout_id for r in rollouts]


async def export(client: httpx.AsyncClient, **params: Any) -> dict[str, Any]:
    response = await client.get("/admin/v1/triplets", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def rollouts_in(items: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(i["rollout_id"] for i in items))


async def test_a_group_exports_only_when_complete_unless_partial(app_store: Store, client: httpx.AsyncClient) -> None:
    ids = await enqueue(app_store, {"group_id": "g", "group_size": 3})
    for rollout_id in ids[:2]:
        await run(app_store, client, rollout_id)
    assert (await export(client, group_id="g"))["items"] == []
    assert sorted(rollouts_in((await export(client, group_id="g", partial="true"))["items"])) == sorted(ids[:2])
    assert (await export(client))["items"] == []  # an incremental pull waits for the group too
    await run(app_store, client, ids[2])
    whole = await export(client, group_id="g")
    assert sorted(rollouts_in(whole["items"])) == sorted(ids)
    assert len(whole["items"]) == 6  # two calls each
    assert {i["group_id"] for i in whole["items"]} == {"g"}
    assert [i["reward"] for i in whole["items"]] == [None, 1.0] * 3


async def test_a_group_of_direct_starts_exports_once_it_has_the_members_it_declared(
    app_store: Store, client: httpx.AsyncClient
) -> None:
    """Online learning: members started one at a time, each finished before the next starts. Declaring the
    group's size keeps it from looking complete (and being pulled) while only the first ones have finished."""
    started = []
    for i in range(3):
        body = {"input": i, "group_id": "online", "group_size": 3, "worker_id": "w"}
        response = await client.post("/admin/v1/rollouts/start", json=body)
        assert response.status_code == 201, response.text
        started.append(response.json()["rollout"]["rollout_id"])
        await run(app_store, client, started[-1])
        view = (await client.get("/admin/v1/groups/online")).json()
        assert (view["size"], view["finished"], view["complete"]) == (3, i + 1, i == 2)
        if i < 2:
            assert (await export(client))["items"] == []  # an incremental pull waits for the third member
    pulled = await export(client)
    assert rollouts_in(pulled["items"]) == started
    assert {i["group_id"] for i in pulled["items"]} == {"online"}


async def test_incremental_pulls_return_each_finished_rollout_once(app_store: Store, client: httpx.AsyncClient) -> None:
    solo_1, solo_2 = await enqueue(app_store, {}, {})
    pair = await enqueue(app_store, {"group_id": "pair", "group_size": 2})
    await run(app_store, client, pair[0])  # its group is not complete yet
    await run(app_store, client, solo_1)
    first = await export(client)
    assert rollouts_in(first["items"]) == [solo_1]
    assert first["next_cursor"]
    nothing_new = await export(client, since=first["next_cursor"])
    assert nothing_new == {  # keeps its place
        "items": [],
        "next_cursor": first["next_cursor"],
        "deduped_calls": 0,
        "removed_samples": 0,
        "removed_groups": 0,
    }

    await run(app_store, client, solo_2)
    await run(app_store, client, pair[1])
    second = await export(client, since=first["next_cursor"])
    assert rollouts_in(second["items"]) == [solo_2, pair[0], pair[1]]  # the group at its last finish
    third = await export(client, since=second["next_cursor"])
    assert third["items"] == []
    seen = rollouts_in(first["items"]) + rollouts_in(second["items"])
    assert sorted(seen) == sorted([solo_1, solo_2, *pair])


async def test_pages_follow_the_cursor_and_never_split_a_group(app_store: Store, client: httpx.AsyncClient) -> None:
    solo = await enqueue(app_store, {})
    trio = await enqueue(app_store, {"group_id": "trio", "group_size": 3})
    later = await enqueue(app_store, {})
    for rollout_id in [*solo, *trio, *later]:
        await run(app_store, client, rollout_id)
    pages, cursor = [], None
    while True:
        page = await export(client, limit=2, **({"since": cursor} if cursor else {}))
        if not page["items"]:
            break
        pages.append(rollouts_in(page["items"]))
        cursor = page["next_cursor"]
    assert pages == [solo, trio, later]  # the trio does not fit after solo, and comes whole on its own


async def test_jsonl_streams_one_row_per_line_with_the_cursor_in_a_header(
    app_store: Store, client: httpx.AsyncClient
) -> None:
    ids = await enqueue(app_store, {}, {})
    for rollout_id in ids:
        await run(app_store, client, rollout_id)
    as_json = await export(client)
    async with client.stream("GET", "/admin/v1/triplets", params={"format": "jsonl"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-ndjson"
        assert response.headers["x-rollway-next-cursor"] == as_json["next_cursor"]
        lines = [line async for line in response.aiter_lines() if line]
    assert [orjson.loads(line) for line in lines] == as_json["items"]
    assert len(lines) == 4


async def test_merge_returns_one_row_per_rollout_conversation(app_store: Store, client: httpx.AsyncClient) -> None:
    [rollout_id] = await enqueue(app_store, {})
    await run(app_store, client, rollout_id, value=0.5)
    [row] = (await export(client, merge="true"))["items"]
    assert row["token_ids"] == [100, 101, 200, 201, 300, 210, 211]
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 1, 1]
    assert (row["reward"], row["n_calls"], row["prefix_breaks"]) == (0.5, 2, 0)


async def test_a_retried_rollout_exports_only_its_latest_attempt(app_store: Store, client: httpx.AsyncClient) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    [rollout_id] = await enqueue(app_store, {"config": config})
    first_attempt = (await app_store.get_attempt(rollout_id)).attempt_id
    await app_store.add_spans(conversation(rollout_id, first_attempt, turns=3, tag=50))
    await client.post(f"/admin/v1/rollouts/{rollout_id}/rewards", json={"value": 0.0})
    failed = await client.patch(f"/admin/v1/rollouts/{rollout_id}/attempts/latest", json={"status": "failed"})
    assert failed.status_code == 200
    assert (await export(client, partial="true"))["items"] == []  # requeued: not finished
    [claim] = await app_store.claim("w2")
    second_attempt = await run(app_store, client, rollout_id)
    assert claim.attempt.attempt_id == second_attempt != first_attempt
    items = (await export(client, rollout_id=rollout_id))["items"]
    assert {i["attempt_id"] for i in items} == {second_attempt}
    assert [i["reward"] for i in items] == [None, 1.0]


async def test_unfinished_rollouts_are_not_exported_and_named_ones_are(
    app_store: Store, client: httpx.AsyncClient
) -> None:
    running, done = await enqueue(app_store, {}, {})
    pair = await enqueue(app_store, {"group_id": "p", "group_size": 2})
    await run(app_store, client, done)
    await run(app_store, client, pair[0])
    named = await export(client, rollout_id=[running, done, pair[0]])
    assert rollouts_in(named["items"]) == [done, pair[0]]  # named rollouts need no complete group


async def test_a_bad_cursor_or_limit_is_a_400_in_the_error_envelope(client: httpx.AsyncClient) -> None:
    for params in ({"since": "not-a-cursor"}, {"limit": 0}, {"format": "csv"}):
        response = await client.get("/admin/v1/triplets", params=params)
        assert response.status_code == 400
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/admin/v1/triplets", "/admin/v1/exports/slime", "/admin/v1/exports/verl"])
async def test_a_filter_the_export_does_not_know_is_a_400_not_ignored(
    app_store: Store, client: httpx.AsyncClient, path: str
) -> None:
    """A misspelt ``mode`` or ``group`` would otherwise export every rollout: the export refuses it, in the
    error envelope, and names the parameter; the parameters it knows still work."""
    done = await enqueue(app_store, {})
    await run(app_store, client, done[0])
    unknowns: list[dict[str, str | int]] = [
        {"mdoe": "train"},
        {"group": "g", "limit": 5},
        {"partial": "true", "modle_version": "v1"},
    ]
    for params in unknowns:
        response = await client.get(path, params=params)
        assert response.status_code == 400, (params, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        [unknown] = set(params) - {"limit", "partial"}
        assert f"'{unknown}'" in error["message"]
    known: dict[str, str | int] = {"limit": 5, "partial": "true", "format": "json", "rollout_id": done[0]}
    if path.endswith("triplets"):
        known["merge"] = "false"
    response = await client.get(path, params=known)
    assert response.status_code == 200, response.text
    assert response.json()["items"]


@pytest.mark.parametrize("partial", ["false", "true"])
async def test_an_export_by_mode_leaves_other_modes_out_and_since_now_starts_from_now(
    app_store: Store, client: httpx.AsyncClient, partial: str
) -> None:
    """``mode=train`` takes the training rollouts only (a group whole), not evaluation probes or rollouts without a
    mode; ``since=now`` hands back an empty page whose cursor leaves out everything that finished before it."""
    before = await enqueue(app_store, {"mode": "train"})
    await run(app_store, client, before[0])
    now = await export(client, since="now", partial=partial)
    assert now["items"] == [] and now["next_cursor"]
    train = await enqueue(app_store, {"mode": "train", "group_id": "g", "group_size": 2})
    others = await enqueue(app_store, {"mode": "val"}, {})
    for rollout_id in [*train, *others]:
        await run(app_store, client, rollout_id)
    page = await export(client, since=now["next_cursor"], mode="train", partial=partial)
    assert {t["rollout_id"] for t in page["items"]} == set(train)
    val = await export(client, mode="val", partial=partial)
    assert {t["rollout_id"] for t in val["items"]} == {others[0]}
    refused = await client.get("/admin/v1/triplets", params={"mode": "training"})
    assert refused.status_code == 400


async def test_store_export_orders_units_by_their_last_finish(store: Store) -> None:
    """The export read on each engine: groups at their last finish, whole, with their latest attempt's spans."""
    group = await store.enqueue([TaskSpec(group_id="g", group_size=2)])
    [solo] = await store.enqueue([TaskSpec()])
    claimed = {c.rollout.rollout_id: c.attempt.attempt_id for c in await store.claim("w", limit=3)}
    order = [group[0].rollout_id, solo.rollout_id, group[1].rollout_id]
    for rollout_id in order:
        await store.add_spans(conversation(rollout_id, claimed[rollout_id]))
        await store.update_attempt(rollout_id, status="succeeded")
    page = await store.export_rollouts(ExportQuery(limit=10))
    assert [r.rollout_id for r in page.rollouts] == [solo.rollout_id, group[0].rollout_id, group[1].rollout_id]
    assert all(len(r.spans) == 2 and r.spans[0].sequence_id == 1 for r in page.rollouts)
    assert {s.attempt_id for r in page.rollouts for s in r.spans} == set(claimed.values())
    first = page.rollouts[0].spans[0].attributes
    assert first["rollway.prompt_token_ids"] == RawJson("[100,101]")  # as stored, not decoded
    assert first["rollway.request"]["messages"] == [{"role": "user", "content": "hi"}]
    partial = await store.export_rollouts(ExportQuery(partial=True, limit=1))
    assert [r.rollout_id for r in partial.rollouts] == [group[0].rollout_id]
    rest = await store.export_rollouts(ExportQuery(partial=True, since=partial.next_cursor), with_spans=False)
    assert [r.rollout_id for r in rest.rollouts] == order[1:]
    assert all(r.spans == [] for r in rest.rollouts)


async def dropped_sample(store: Store, rollout_id: str, attempt_id: str) -> None:
    """The attempt ends as an Osmosis 0.3 agent server's "drop this sample" is recorded: succeeded, no reward,
    ``remove_sample: true`` in its completion's ``extra_fields``."""
    report = RemoteCompletion(rollout_id=rollout_id, status="COMPLETED", extra_fields={"remove_sample": True})
    await store.complete_remote(report, attempt_id)


async def test_store_export_says_which_rollouts_an_agent_server_asked_to_drop(store: Store) -> None:
    """Read on each engine from the latest attempt's metadata (the completion's ``extra_fields``); other
    metadata is no flag."""
    rollouts = await store.enqueue([TaskSpec(), TaskSpec()])
    claimed = {c.rollout.rollout_id: c.attempt.attempt_id for c in await store.claim("w", limit=2)}
    dropped, kept = (r.rollout_id for r in rollouts)
    for rollout_id, attempt_id in claimed.items():
        await store.add_spans(conversation(rollout_id, attempt_id))
    await dropped_sample(store, dropped, claimed[dropped])
    await store.update_attempt(kept, status="succeeded", metadata={"completion": {"extra_fields": None}})
    for with_spans in (True, False):
        page = await store.export_rollouts(ExportQuery(partial=True), with_spans=with_spans)
        assert {r.rollout_id: r.remove_sample for r in page.rollouts} == {dropped: True, kept: False}


async def test_merged_and_trainer_exports_leave_out_a_sample_its_agent_server_dropped(
    app_store: Store, client: httpx.AsyncClient
) -> None:
    """Triplets keep the rollout and say ``remove_sample``; merged rows, SLIME samples and verl rows leave it out
    (and count it) unless ``keep_removed=true``, in JSON pages, JSON Lines and large streamed pages alike."""
    ids = await enqueue(app_store, {}, {}, {})
    dropped = ids[1]
    for rollout_id in ids:
        attempt = (await app_store.get_attempt(rollout_id)).attempt_id
        if rollout_id == dropped:
            await app_store.add_spans(conversation(rollout_id, attempt))
            await dropped_sample(app_store, rollout_id, attempt)
        else:
            await run(app_store, client, rollout_id)

    async def flagged(path: str, **params: Any) -> tuple[dict[str, bool], dict[str, Any], httpx.Headers]:
        response = await client.get(f"/admin/v1{path}", params={"partial": "true", **params})
        assert response.status_code == 200, response.text
        if params.get("format") == "jsonl":
            body = {"items": [orjson.loads(line) for line in response.text.splitlines()]}
        else:
            body = response.json()
        rows = {}
        for row in body["items"]:
            meta = row.get("metadata", row)
            rows[meta["rollout_id"]] = meta["remove_sample"]
        return rows, body, response.headers

    rows, body, headers = await flagged("/triplets")
    assert rows == {ids[0]: False, dropped: True, ids[2]: False}
    assert body["removed_samples"] == 0 and headers["x-rollway-removed-samples"] == "0"
    for path, params in (
        ("/triplets", {"merge": "true"}),
        ("/exports/slime", {}),
        ("/exports/verl", {}),
        ("/exports/verl", {"limit": 600}),  # streamed in chunks
    ):
        rows, body, headers = await flagged(path, **params)
        assert rows == {ids[0]: False, ids[2]: False}, path
        assert body["removed_samples"] == 1, path
        rows, body, _ = await flagged(path, keep_removed="true", **params)
        assert rows == {ids[0]: False, dropped: True, ids[2]: False}, path
        assert body["removed_samples"] == 0
    rows, _, headers = await flagged("/exports/slime", format="jsonl")
    assert rows == {ids[0]: False, ids[2]: False} and headers["x-rollway-removed-samples"] == "1"
    _, body, headers = await flagged("/exports/slime", model_version="not-it")
    assert body["items"] == [] and body["removed_samples"] == 0  # left out by the filter first


async def test_large_pages_stream_in_chunks_with_the_same_rows(
    app_store: Store, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = await enqueue(app_store, {}, {}, {})
    for rollout_id in ids:
        await run(app_store, client, rollout_id)
    whole = await export(client)
    monkeypatch.setattr(admin_triplets, "CHUNK", 1)  # every page is "large": read and streamed one rollout at a time
    assert await export(client, limit=10) == whole
    asked = {"x-rollway-totals": "line"}
    response = await client.get("/admin/v1/triplets", params={"limit": 10, "format": "jsonl"}, headers=asked)
    *rows, totals = [orjson.loads(line) for line in response.text.splitlines()]
    assert rows == whole["items"]
    assert totals == {k: v for k, v in whole.items() if k != "items"}  # the JSON page's closing members
    plain = await client.get("/admin/v1/triplets", params={"limit": 10, "format": "jsonl"})
    assert [orjson.loads(line) for line in plain.text.splitlines()] == whole["items"]  # records only


async def test_a_rollout_that_finishes_again_while_a_large_page_streams_is_rendered_as_the_page_read_it(
    app_store: Store, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large page reads its spans chunk by chunk, after the page itself. A rollout that got a new attempt and
    finished again in between is rendered with the attempt the page read (and comes again at its new position),
    not as that attempt with no spans."""
    ids = await enqueue(app_store, {}, {})
    first = {rollout_id: await run(app_store, client, rollout_id) for rollout_id in ids[1:]}
    first[ids[0]] = (await app_store.get_attempt(ids[0])).attempt_id
    await app_store.add_spans(conversation(ids[0], first[ids[0]]))
    await app_store.update_attempt(ids[0], status="failed")  # a failed rollout may be run again
    whole = await export(client)
    assert {i["rollout_id"] for i in whole["items"]} == set(ids)
    monkeypatch.setattr(admin_triplets, "CHUNK", 1)
    original = app_store.export_rollouts

    ran: list[str] = []

    async def page_then_again(*args: Any, **kwargs: Any) -> Any:
        page = await original(*args, **kwargs)
        if kwargs.get("with_spans") is False and not ran:  # the page is read: now the first rollout runs again
            ran.append(ids[0])
            again = await app_store.start_attempt(ids[0], "w2")
            await app_store.add_spans(conversation(ids[0], again.attempt.attempt_id))
            await app_store.update_attempt(ids[0], status="succeeded")
        return page

    monkeypatch.setattr(app_store, "export_rollouts", page_then_again)
    streamed = await export(client, limit=10)
    assert streamed == whole
    assert {i["rollout_id"]: i["attempt_id"] for i in streamed["items"]} == first
    later = await export(client, since=streamed["next_cursor"])
    assert {i["attempt_id"] for i in later["items"]} == {(await app_store.get_attempt(ids[0])).attempt_id}


async def test_a_failure_mid_stream_ends_the_body_with_an_error(
    app: RollwayApp, app_store: Store, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = await enqueue(app_store, {}, {})
    for rollout_id in ids:
        await run(app_store, client, rollout_id)
    monkeypatch.setattr(admin_triplets, "CHUNK", 1)
    original = app_store.export_spans
    calls = itertools.count()

    async def failing(rollouts: Any) -> None:
        if next(calls) == 1:  # the first rollout's spans, then the second's: fail
            raise ConnectionError("database went away")
        await original(rollouts)

    monkeypatch.setattr(app_store, "export_spans", failing)
    body = await export(client, limit=10)
    assert len(body["items"]) == 2  # the first rollout's rows
    assert body["next_cursor"] is None
    assert body["error"]["type"] == "server_error"

    calls = itertools.count()
    response = await client.get("/admin/v1/triplets", params={"limit": 10, "format": "jsonl"})
    *rows, last = [orjson.loads(line) for line in response.text.splitlines()]
    assert len(rows) == 2
    assert last["error"]["message"] == "export failed: ConnectionError"


def test_stored_token_arrays_are_read_without_decoding_and_odd_layouts_in_full() -> None:
    attributes = {
        "gen_ai.operation.name": "chat",
        "rollway.response_token_ids": [7, 8],
        "rollway.request": {"messages": [{"role": "user", "content": '"rollway.prompt_token_ids":[1]'}]},
        "rollway.prompt_token_ids": [1, 2, 3],
        "rollway.response_logprobs": None,
    }
    read = read_attributes(orjson.dumps(attributes).decode())
    assert read["rollway.prompt_token_ids"] == RawJson("[1,2,3]")
    assert read["rollway.response_token_ids"] == RawJson("[7,8]")
    assert read["rollway.request"] == attributes["rollway.request"]
    assert read["rollway.response_logprobs"] is None
    nested = {"rollway.request": {"rollway.prompt_token_ids": [4]}, "rollway.prompt_token_ids": [5]}
    assert read_attributes(orjson.dumps(nested).decode()) == nested  # a nested key first: decoded in full
    assert read_attributes(json.dumps({"rollway.prompt_token_ids": [1, 2]})) == {"rollway.prompt_token_ids": [1, 2]}
    assert read_attributes(None) == {}


def test_rows_with_integers_beyond_64_bits_still_serialize() -> None:
    span = call(1, [1], [2], messages=[{"role": "user", "content": "big", "n": 2**70}])
    [row] = plain(triplets("ro-1", A1, [span]))
    assert row["messages"][0]["n"] == 2**70
    assert row["prompt_token_ids"] == [1]


async def test_an_export_by_metadata_and_model_version_takes_only_those_rollouts(
    app_store: Store, client: httpx.AsyncClient
) -> None:
    """``metadata=key=value`` matches the task's metadata (JSON values: ``step=3`` is the number); ``model_version``
    keeps a rollout only when every one of its calls was answered by one of the versions named."""
    ids = await enqueue(
        app_store,
        {"metadata": {"step": 3, "split": "a"}},
        {"metadata": {"step": 3, "split": "b"}},
        {"metadata": {"step": "3"}},
        {"metadata": {"step": 4}},
    )
    versions = {ids[0]: ["v3", "v3"], ids[1]: ["v2", "v3"], ids[2]: ["v3", "v3"], ids[3]: ["v4", "v4"]}
    for rollout_id, made_by in versions.items():
        attempt = (await app_store.get_attempt(rollout_id)).attempt_id
        spans = conversation(rollout_id, attempt)
        for span, version in zip(spans, made_by, strict=True):
            span.attributes["rollway.model_version"] = version
        await app_store.add_spans(spans)
        await app_store.update_attempt(rollout_id, attempt, status="succeeded")

    async def exported(**params: Any) -> list[str]:
        return rollouts_in((await export(client, partial="true", **params))["items"])

    assert await exported(metadata="step=3") == ids[:2]
    assert await exported(metadata=["step=3", "split=b"]) == [ids[1]]
    assert await exported(metadata='step="3"') == [ids[2]]
    assert await exported(model_version="v3") == [ids[0], ids[2]]  # ids[1] has a call of v2
    assert await exported(model_version=["v3", "v2"]) == ids[:3]
    assert await exported(model_version=["v4"], metadata="step=4") == [ids[3]]
    for bad in ("step", "=3", 'k"q=1'):
        assert (await client.get("/admin/v1/triplets", params={"metadata": bad})).status_code == 400, bad


async def test_the_dedupe_totals_count_only_the_rollouts_the_model_version_filter_keeps(
    app_store: Store, client: httpx.AsyncClient
) -> None:
    """Each rollout asks one prompt twice (one call removed); only the rollout of version v3 is exported, so the
    page, its header and the JSON Lines header say 1, not 2."""
    ids = await enqueue(app_store, {}, {})
    for rollout_id, version in zip(ids, ("v3", "v2"), strict=True):
        attempt = (await app_store.get_attempt(rollout_id)).attempt_id
        spans = [call(1, [1, 2], [9], attempt=attempt), call(2, [1, 2], [8], attempt=attempt)]
        for span in spans:
            span.attributes["rollway.model_version"] = version
        await app_store.add_spans([s.model_copy(update={"rollout_id": rollout_id, "sequence_id": None}) for s in spans])
        await app_store.update_attempt(rollout_id, attempt, status="succeeded")
    response = await client.get("/admin/v1/triplets", params={"model_version": "v3"})
    body = response.json()
    assert rollouts_in(body["items"]) == [ids[0]]
    assert body["deduped_calls"] == 1 and response.headers["x-rollway-deduped-calls"] == "1"
    lines = await client.get("/admin/v1/triplets", params={"model_version": "v3", "format": "jsonl"})
    assert len(lines.text.splitlines()) == 1 and lines.headers["x-rollway-deduped-calls"] == "1"
    verl = (await client.get("/admin/v1/exports/verl", params={"model_version": "v3"})).json()
    assert [r["rollout_id"] for r in verl["items"]] == [ids[0]] and verl["deduped_calls"] == 1
