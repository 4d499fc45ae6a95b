"""Samples an agent server dropped (Osmosis ``remove_sample``) in the exports, on each store engine: a SLIME group
with such a member is left out whole and counted (``keep_short_groups`` keeps its other members, ``keep_removed``
all of it, the dropped one marked as SLIME's own ``remove_sample``); the totals a streamed JSON Lines page ends
with; and the Python client, which reads those totals and sends no parameter an older server would refuse unless
it is asked to."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from rollway.admin import triplets as admin_triplets
from rollway.admin.client import AsyncRollwayClient, RollwayAPIError
from rollway.app.factory import RollwayApp
from rollway.settings import Settings
from rollway.store import RemoteCompletion, Store, TaskSpec
from support.gateway_harness import app_lifespan
from support.spans import conversation


@pytest.fixture
async def app(migrated_url: str) -> AsyncIterator[RollwayApp]:
    async with app_lifespan(Settings(database_url=migrated_url)) as application:
        yield application


@pytest.fixture
async def client(app: RollwayApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        yield c


@pytest.fixture
def store(app: RollwayApp) -> Store:
    opened: Store = app.state.store
    return opened


async def finish(store: Store, client: httpx.AsyncClient, rollout_id: str, *, removed: bool = False) -> None:
    """Two calls, then either a reward and success, or an Osmosis 0.3 agent server's "drop this sample" as it is
    recorded (succeeded, no reward, ``remove_sample: true`` in the completion's ``extra_fields``)."""
    attempt = (await store.get_attempt(rollout_id)).attempt_id
    await store.add_spans(conversation(rollout_id, attempt))
    if removed:
        report = RemoteCompletion(rollout_id=rollout_id, status="COMPLETED", extra_fields={"remove_sample": True})
        await store.complete_remote(report, attempt)
        return
    response = await client.post(f"/admin/v1/rollouts/{rollout_id}/rewards", json={"value": 1.0})
    assert response.status_code == 201, response.text
    response = await client.patch(f"/admin/v1/rollouts/{rollout_id}/attempts/latest", json={"status": "succeeded"})
    assert response.status_code == 200, response.text


async def a_group_with_a_removed_member(store: Store, client: httpx.AsyncClient) -> tuple[str, list[str]]:
    """A rollout without a group, finished first, then a group of three whose middle member was dropped by its
    agent server: (the solo rollout, the group's members in order)."""
    rollouts = await store.enqueue([TaskSpec(), TaskSpec(group_id="g", group_size=3)])
    assert len(await store.claim("w1", limit=len(rollouts))) == len(rollouts)
    solo, *members = (r.rollout_id for r in rollouts)
    await finish(store, client, solo)
    for n, rollout_id in enumerate(members):
        await finish(store, client, rollout_id, removed=n == 1)
    return solo, members


async def page(client: httpx.AsyncClient, path: str, **params: Any) -> tuple[dict[str, bool], dict[str, Any]]:
    """Each rollout of a JSON page's records with its ``remove_sample`` (SLIME's own field on a SLIME sample, the
    record's elsewhere), and the page's totals: the members after ``items``, and the counts' headers when the
    page sent them."""
    response = await client.get(f"/admin/v1{path}", params=params)
    assert response.status_code == 200, response.text
    body = response.json()
    rows = {r.get("metadata", r)["rollout_id"]: r["remove_sample"] for r in body.pop("items")}
    headers = {k: v for k, v in response.headers.items() if k.startswith("x-rollway-removed")}
    return rows, body | headers


def without_headers(totals: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in totals.items() if not k.startswith("x-rollway")}


def counts(samples: int, groups: int) -> dict[str, Any]:
    return {"removed_samples": samples, "removed_groups": groups}


async def test_a_slime_group_with_a_removed_member_is_left_out_whole_and_counted(
    store: Store, client: httpx.AsyncClient
) -> None:
    """GRPO's group advantage takes every one of a prompt's samples, and SLIME counts on ``n_samples_per_prompt``
    per group: a group one short is left out whole (counted in ``removed_groups``, its dropped member in
    ``removed_samples``); ``keep_short_groups`` keeps the others; ``keep_removed`` keeps the whole group, the
    dropped member marked ``remove_sample`` (SLIME's ``Sample.remove_sample``: no loss on it)."""
    solo, (first, dropped, last) = await a_group_with_a_removed_member(store, client)
    rows, totals = await page(client, "/exports/slime")
    assert rows == {solo: False}
    assert (
        totals.items() >= (counts(1, 1) | {"x-rollway-removed-samples": "1", "x-rollway-removed-groups": "1"}).items()
    )

    response = await client.get("/admin/v1/exports/slime", params={"format": "jsonl"})
    assert [orjson.loads(line)["metadata"]["rollout_id"] for line in response.text.splitlines()] == [solo]
    assert (response.headers["x-rollway-removed-samples"], response.headers["x-rollway-removed-groups"]) == ("1", "1")

    rows, totals = await page(client, "/exports/slime", keep_short_groups="true")
    assert rows == {solo: False, first: False, last: False}
    assert totals.items() >= counts(1, 0).items()

    rows, totals = await page(client, "/exports/slime", keep_removed="true")
    assert rows == {solo: False, first: False, dropped: True, last: False}
    assert totals.items() >= counts(0, 0).items()
    response = await client.get("/admin/v1/exports/slime", params={"keep_removed": "true", "group_id": "g"})
    samples = {s["metadata"]["rollout_id"]: s for s in response.json()["items"]}
    assert samples[dropped]["remove_sample"] is samples[dropped]["metadata"]["remove_sample"] is True
    assert samples[dropped]["status"] == "aborted" and samples[dropped]["reward"] is None  # no reward to train on


async def test_only_a_grouped_slime_export_leaves_a_group_out_for_a_removed_member(
    store: Store, client: httpx.AsyncClient
) -> None:
    """verl (GRPO groups by ``uid`` whatever its size) and merged rows leave out the dropped member alone; so does
    a SLIME export of rollouts one by one (``partial``, ``rollout_id``), which makes no whole groups."""
    solo, (first, dropped, last) = await a_group_with_a_removed_member(store, client)
    kept = {solo: False, first: False, last: False}
    for path, params in (
        ("/exports/verl", {}),
        ("/triplets", {"merge": "true"}),
        ("/exports/slime", {"partial": "true"}),
        ("/exports/slime", {"rollout_id": [solo, first, dropped, last]}),
    ):
        rows, totals = await page(client, path, **params)
        assert rows == kept, path
        assert totals.items() >= counts(1, 0).items(), path
    rows, totals = await page(client, "/triplets")
    assert rows == kept | {dropped: True} and totals.items() >= counts(0, 0).items()

    for path in ("/exports/verl", "/triplets"):
        response = await client.get(f"/admin/v1{path}", params={"keep_short_groups": "true"})
        assert response.status_code == 400, path
        error = response.json()["error"]
        assert "keep_short_groups" in error["message"] and error["type"] == "invalid_request_error", path


async def test_a_large_page_never_renders_a_group_in_two_chunks(
    store: Store, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large page is rendered ``CHUNK`` rollouts at a time; a chunk runs on to its last group's end, so the
    group is left out whole however the chunks fall."""
    solo, _ = await a_group_with_a_removed_member(store, client)
    rows, totals = await page(client, "/exports/slime")
    assert rows == {solo: False} and totals.items() >= counts(1, 1).items()
    monkeypatch.setattr(admin_triplets, "CHUNK", 2)  # [solo, first] would be the first chunk
    streamed_rows, streamed = await page(client, "/exports/slime", limit=10)
    assert (streamed_rows, streamed) == (rows, without_headers(totals))  # streamed: no counts before the body


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.text.splitlines()]


async def test_a_streamed_json_lines_page_ends_with_its_totals(
    store: Store, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JSON Lines page of more than ``CHUNK`` rollouts streams before its totals are known: asked with
    ``X-Rollway-Totals: line``, its last line holds them, as a JSON page's closing members do (the one line with
    ``next_cursor``); asked without, every line is a record, as a plain JSON Lines reader expects; a smaller page
    says them in headers and has no such line."""
    solo, _ = await a_group_with_a_removed_member(store, client)
    small = await client.get("/admin/v1/exports/slime", params={"format": "jsonl"})
    [sample] = lines(small)
    json_page = (await client.get("/admin/v1/exports/slime")).json()
    monkeypatch.setattr(admin_triplets, "CHUNK", 1)

    plain = await client.get("/admin/v1/exports/slime", params={"format": "jsonl", "limit": 10})
    assert lines(plain) == [sample]
    totals = {"x-rollway-totals": "line"}
    response = await client.get("/admin/v1/exports/slime", params={"format": "jsonl", "limit": 10}, headers=totals)
    *records, last = lines(response)
    assert records == [sample] and sample["metadata"]["rollout_id"] == solo
    assert last == {"next_cursor": json_page["next_cursor"], "deduped_calls": 0} | counts(1, 1)
    assert "x-rollway-removed-samples" not in response.headers  # not known before the body

    response = await client.get("/admin/v1/triplets", params={"format": "jsonl", "limit": 10}, headers=totals)
    *rows, last = lines(response)
    assert len(rows) == 8 and all("next_cursor" not in r for r in rows)  # two calls of each of four rollouts
    assert last == {"next_cursor": json_page["next_cursor"], "deduped_calls": 0} | counts(0, 0)
    response = await client.get("/admin/v1/exports/verl", params={"format": "jsonl", "limit": 10}, headers=totals)
    assert lines(response)[-1] == {"next_cursor": json_page["next_cursor"], "deduped_calls": 0} | counts(1, 0)
    params: dict[str, Any] = {"format": "jsonl", "limit": 10, "model_version": "not-it"}
    response = await client.get("/admin/v1/exports/slime", params=params, headers=totals)
    assert lines(response) == [{"next_cursor": json_page["next_cursor"], "deduped_calls": 0} | counts(0, 0)]


async def test_the_client_reads_every_page_s_counts_of_what_it_left_out(
    app: RollwayApp, store: Store, client: httpx.AsyncClient
) -> None:
    """From a JSON page, a small JSON Lines page's headers and a streamed page's last line alike; the totals
    line is no record."""
    solo, (first, _, last) = await a_group_with_a_removed_member(store, client)
    async with AsyncRollwayClient("http://127.0.0.1", transport=httpx.ASGITransport(app=app)) as admin:
        for jsonl, page_size in ((False, 600), (True, 100), (True, 600)):
            records = admin.iter_export("slime", jsonl=jsonl, page_size=page_size)
            assert [r["metadata"]["rollout_id"] async for r in records] == [solo], (jsonl, page_size)
            assert (records.removed_samples, records.removed_groups) == (1, 1), (jsonl, page_size)
            shorter = admin.iter_export("slime", jsonl=jsonl, page_size=page_size, keep_short_groups=True)
            assert {r["metadata"]["rollout_id"] async for r in shorter} == {solo, first, last}
            assert (shorter.removed_samples, shorter.removed_groups) == (1, 0), (jsonl, page_size)
            triplets = admin.iter_triplet_records(jsonl=jsonl, page_size=page_size)
            assert len([t async for t in triplets]) == 8 and triplets.next_cursor == records.next_cursor


class OlderServer(httpx.AsyncBaseTransport):
    """An export server from before ``keep_removed`` and ``keep_short_groups``: any other query parameter is a 400,
    as the export routes answer one they do not know. Records every request."""

    KNOWN = frozenset({"rollout_id", "group_id", "mode", "metadata", "model_version", "since", "limit", "partial"})

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        unknown = sorted(set(request.url.params) - self.KNOWN - {"dedupe", "format", "merge"})
        if unknown:
            error = {"message": f"unknown query parameter {unknown}", "type": "invalid_request_error"}
            return httpx.Response(400, json={"error": error | {"param": None, "code": None}})
        return httpx.Response(200, json={"items": [], "next_cursor": None, "deduped_calls": 0})


async def test_the_client_sends_keep_removed_and_keep_short_groups_only_when_asked() -> None:
    """False is the server's default: a client that sends it anyway is refused by a server older than the
    parameter, though the user asked for nothing new."""
    server = OlderServer()
    async with AsyncRollwayClient("http://rollway.test", transport=server) as admin:
        assert [r async for r in admin.iter_export("slime", keep_removed=False, keep_short_groups=False)] == []
        assert [r async for r in admin.iter_triplet_records(merge=True, keep_removed=False)] == []
        assert [r async for r in admin.iter_merged_triplets(keep_removed=False)] == []
        sent = [dict(r.url.params) for r in server.requests]
        assert all("keep_removed" not in p and "keep_short_groups" not in p for p in sent), sent
        for name, records in (
            ("keep_removed", admin.iter_export("slime", keep_removed=True)),
            ("keep_short_groups", admin.iter_export("slime", keep_short_groups=True)),
        ):
            with pytest.raises(RollwayAPIError) as refused:
                [r async for r in records]
            assert refused.value.status == 400
            assert server.requests[-1].url.params[name] == "true"
