"""The admin client (``admin.client``) against a real gateway (uvicorn on loopback, in front of the mock backend):
typed results for every route, errors carrying the server's envelope, retries on 5xx and connection errors
(never on 4xx), cursors, and the synchronous facade used from plain sync code."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from sqlalchemy import Connection, Select, select
from starlette.types import Receive, Scope, Send

from rollway.admin.client import (
    AsyncRollwayClient,
    MergedTriplet,
    RetryPolicy,
    RollwayAPIError,
    RollwayConnectionError,
    Triplet,
)
from rollway.admin.client_sync import RollwayClient
from rollway.admin.model_schemas import ModelView
from rollway.admin.schemas import Claim, GroupView, MintedKey, RolloutPage, StatsView, WaitResponse
from rollway.mock import MockBackendProcess
from rollway.store import Attempt, ResourcesUpdate, Rollout, Span
from rollway.store.db import models
from support.gateway_harness import RunningGateway, closed_port

TOKEN = "admin-secret-token"
FAST = RetryPolicy(retries=2, backoff=0.01, max_backoff=0.02)
NO_RETRY = RetryPolicy(retries=0)


class Counting(httpx.AsyncBaseTransport):
    """A transport that records every request it sends and can fail the first ``fail`` of them."""

    def __init__(self, fail: int = 0, error: type[httpx.TransportError] = httpx.ConnectError) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.requests: list[httpx.Request] = []
        self.fail, self.error = fail, error

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if len(self.requests) <= self.fail:
            raise self.error("injected", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class LosingAnswers(Counting):
    """A transport whose first ``lose`` requests reach the server and are done there, but whose answers are
    lost on the way back (the connection drops): the client cannot tell whether its write happened."""

    def __init__(self, lose: int) -> None:
        super().__init__()
        self.lose = lose

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        response = await self.inner.handle_async_request(request)
        await response.aread()
        if len(self.requests) <= self.lose:
            raise httpx.ReadError("connection dropped before the answer arrived", request=request)
        return response


class Flaky:
    """A tiny ASGI app: answers ``status`` (in the error envelope) ``failures`` times, then 200."""

    def __init__(self, failures: int, status: int = 503, ok: Any = None) -> None:
        self.failures, self.status, self.hits = failures, status, 0
        self.ok = {"items": []} if ok is None else ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        self.hits += 1
        if self.hits <= self.failures:
            error = {"message": f"flaky #{self.hits}", "type": "service_unavailable", "param": None, "code": "flaky"}
            status, body = self.status, {"error": error}
        else:
            status, body = 200, self.ok
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def first_column(query: Select[Any]) -> Callable[[Connection], Sequence[Any]]:
    """A read for ``Store.read``: the values of the query's first column."""
    return lambda conn: conn.execute(query).scalars().all()


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"admin_token": TOKEN}


@pytest.fixture
async def client(gw: RunningGateway) -> AsyncIterator[AsyncRollwayClient]:
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY) as c:
        yield c


async def test_a_rollout_round_trip_returns_typed_results(client: AsyncRollwayClient, mock: MockBackendProcess) -> None:
    model = await client.put_model(
        "policy", [{"base_url": mock.base_url, "kind": "vllm", "model": "mock-model", "api_key": "sk-up"}]
    )
    assert isinstance(model, ModelView) and model.backends[0].has_api_key
    assert "sk-up" not in model.model_dump_json()

    rollouts = await client.enqueue([{"input": {"question": "What is 2 + 3?"}, "group_size": 2}])
    assert [type(r) for r in rollouts] == [Rollout, Rollout]
    assert rollouts[0].group_id == rollouts[1].group_id is not None

    claims = await client.claim("worker-1", limit=2)
    assert all(isinstance(c, Claim) and c.base_url.endswith("/v1") for c in claims)
    for claim in claims:
        async with AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0) as llm:
            question = claim.rollout.input["question"]
            await llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
        reward = await client.add_reward(claim.rollout.rollout_id, 1.0, attempt_id=claim.attempt.attempt_id)
        assert isinstance(reward, Span) and reward.attributes["rollway.reward.value"] == 1.0
        beat = await client.heartbeat(claim.rollout.rollout_id)
        assert isinstance(beat, Attempt)
        done = await client.update_attempt(claim.rollout.rollout_id, status="succeeded", metadata={"k": 1})
        assert isinstance(done, Attempt) and done.status == "succeeded" and done.metadata == {"k": 1}

    ids = [r.rollout_id for r in rollouts]
    waited = await client.wait_for(ids, timeout=10)
    assert isinstance(waited, WaitResponse) and waited.pending == []
    assert {r.status for r in waited.finished} == {"succeeded"}

    full = await client.get_rollout(ids[0])
    assert full.attempts is not None and len(full.attempts) == 1
    spans = await client.get_spans(ids[0])
    assert [s.sequence_id for s in spans] == [1, 2]
    group = await client.get_group(rollouts[0].group_id or "")
    assert isinstance(group, GroupView) and group.complete
    stats = await client.stats()
    assert isinstance(stats, StatsView) and stats.total_spans == 4

    triplets = [t async for t in client.iter_triplets(page_size=1)]  # one rollout per page: the cursor is used
    assert all(isinstance(t, Triplet) for t in triplets)
    assert sorted(t.rollout_id for t in triplets) == sorted(ids)
    assert all(t.reward == 1.0 and t.response_token_ids for t in triplets)
    streamed = [t async for t in client.iter_triplets(jsonl=True, page_size=1)]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in triplets]
    merged = [m async for m in client.iter_merged_triplets(rollout_id=ids[0])]
    assert len(merged) == 1 and isinstance(merged[0], MergedTriplet) and 1 in merged[0].loss_mask


async def test_exports_page_on_past_rollouts_that_give_no_rows(
    client: AsyncRollwayClient, mock: MockBackendProcess
) -> None:
    """A page of rollouts that give no rows (cancelled before any call) is empty but moves the cursor: the
    export goes on past it to the rollouts after."""
    await client.put_model("policy", [{"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}])

    async def with_a_call() -> str:
        await client.enqueue([{"input": {"question": "What is 2 + 3?"}}])
        [claim] = await client.claim("worker-1")
        async with AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0) as llm:
            await llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2 + 3?"}])
        await client.update_attempt(claim.rollout.rollout_id, status="succeeded")
        return claim.rollout.rollout_id

    first = await with_a_call()
    for rollout in await client.enqueue([{"input": {"question": str(i)}} for i in range(3)]):
        await client.cancel(rollout.rollout_id)
    last = await with_a_call()
    for jsonl in (False, True):
        # Pages of two rollouts: [first, cancelled], [cancelled, cancelled] (no rows), [last].
        assert [t.rollout_id async for t in client.iter_triplets(page_size=2, jsonl=jsonl)] == [first, last], jsonl
        rows = [r async for r in client.iter_export("verl", page_size=2, jsonl=jsonl)]
        assert [r["rollout_id"] for r in rows] == [first, last]


async def finished_with_a_call(client: AsyncRollwayClient, question: str) -> str:
    """One rollout enqueued, claimed, called once through its claim and finished: its id."""
    await client.enqueue([{"input": {"question": question}}])
    [claim] = await client.claim("worker-1")
    async with AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0) as llm:
        await llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
    await client.update_attempt(claim.rollout.rollout_id, status="succeeded")
    return claim.rollout.rollout_id


@pytest.mark.parametrize("jsonl", [False, True])
async def test_an_export_hands_back_the_cursor_the_next_step_continues_from(
    client: AsyncRollwayClient, mock: MockBackendProcess, jsonl: bool
) -> None:
    """A trainer's step reads what has finished and keeps ``next_cursor``; the next step, from that cursor, gets
    only the rollouts finished since. A step that stops part-way through a page keeps the cursor of the page
    before, so the rest comes again. The sync client hands back the same cursor."""
    await client.put_model("policy", [{"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}])
    step_1 = [await finished_with_a_call(client, f"{i} + 1?") for i in range(3)]
    records = client.iter_triplets(page_size=2, jsonl=jsonl)
    assert records.next_cursor is None  # nothing read yet: from the start
    assert [t.rollout_id async for t in records] == step_1
    first_cursor = records.next_cursor
    assert first_cursor is not None

    step_2 = [await finished_with_a_call(client, f"{i} + 2?") for i in range(3)]
    later = client.iter_triplets(since=first_cursor, page_size=2, jsonl=jsonl)
    assert later.next_cursor == first_cursor
    assert [t.rollout_id async for t in later] == step_2
    assert later.next_cursor not in (None, first_cursor)
    assert [t async for t in client.iter_triplets(since=later.next_cursor, jsonl=jsonl)] == []

    part_read = client.iter_export("verl", since=first_cursor, page_size=2, jsonl=jsonl)
    assert [(await anext(part_read))["rollout_id"] for _ in range(3)] == step_2  # into the second page
    await part_read.aclose()
    again = client.iter_export("verl", since=part_read.next_cursor, jsonl=jsonl)
    assert [r["rollout_id"] async for r in again] == step_2[2:]  # the part-read page comes again

    def sync_step(url: str) -> tuple[list[str], str | None]:
        with RollwayClient(url, TOKEN, retry=NO_RETRY) as sync:
            rows = sync.iter_triplet_records(since=first_cursor, page_size=2, jsonl=jsonl)
            return [r["rollout_id"] for r in rows], rows.next_cursor

    assert await asyncio.to_thread(sync_step, client.url) == (step_2, later.next_cursor)


async def test_listing_follows_the_cursor(client: AsyncRollwayClient) -> None:
    rollouts = await client.enqueue([{"input": i} for i in range(5)])
    page = await client.list_rollouts(limit=2)
    assert len(page.items) == 2 and page.next_cursor
    seen = [r.rollout_id async for r in client.iter_rollouts(page_size=2)]
    assert seen == [r.rollout_id for r in rollouts]
    newest = [r.rollout_id async for r in client.iter_rollouts(page_size=2, order="desc")]
    assert newest == [r.rollout_id for r in reversed(rollouts)]  # paged on newest first too
    await client.cancel(rollouts[0].rollout_id)
    cancelled = await client.list_rollouts(status="cancelled")
    assert [r.rollout_id for r in cancelled.items] == [rollouts[0].rollout_id]
    assert not (await client.list_rollouts(model="policy")).items  # none of them called a model


async def test_resources_models_and_keys(client: AsyncRollwayClient, mock: MockBackendProcess) -> None:
    first = await client.add_resources({"llm": {"model": "policy"}})
    assert isinstance(first, ResourcesUpdate) and first.version == 1
    second = await client.update_resources(first.resources_id, {"llm": {"model": "policy", "t": 0.7}})
    assert second.version == 2
    assert (await client.get_resources()).resources == second.resources
    assert (await client.list_resources()).items

    backend = {"backend_id": "a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    await client.put_model("m", [backend], version="v1")
    assert (await client.pause_model("m")).state.paused
    assert not (await client.resume_model("m")).state.paused
    swapped = await client.swap_model("m", version="v2", drain_timeout_seconds=1)
    assert swapped.version == "v2" and [m.alias for m in await client.list_models()] == ["m"]
    assert swapped.drained is True and swapped.state.in_flight_old == 0
    drained = await client.drain_model("m", timeout_seconds=1)
    assert drained.drained is True and drained.state.in_flight == 0
    assert (await client.get_model("m")).drained is None  # only a drain's answer says
    await client.delete_model("m")
    assert await client.list_models() == []

    minted = await client.mint_key("admin", name="ci")
    assert isinstance(minted, MintedKey) and minted.scope == "admin"
    async with AsyncRollwayClient(client.url, minted.key, retry=NO_RETRY) as as_key:
        assert isinstance(await as_key.stats(), StatsView)  # an admin-scoped key works like the token
        await client.revoke_key(minted.key_id)
        with pytest.raises(RollwayAPIError) as caught:
            await as_key.stats()
    assert caught.value.status == 401


async def test_a_4xx_raises_the_envelope_message_and_is_never_retried(gw: RunningGateway) -> None:
    transport = Counting()
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        with pytest.raises(RollwayAPIError) as caught:
            await client.get_rollout("ro-nope")
    assert caught.value.status == 404 and caught.value.type == "not_found_error"
    assert "ro-nope" in caught.value.message
    assert len(transport.requests) == 1

    async with AsyncRollwayClient(gw.url, "wrong-token", retry=FAST) as client:
        with pytest.raises(RollwayAPIError) as caught:
            await client.stats()
    assert caught.value.status == 401 and caught.value.type == "authentication_error"


@pytest.mark.parametrize("status", [400, 409, 429])
async def test_no_4xx_status_is_retried(status: int) -> None:
    app = Flaky(failures=5, status=status)
    async with AsyncRollwayClient("http://flaky", retry=FAST, transport=httpx.ASGITransport(app)) as client:
        with pytest.raises(RollwayAPIError) as caught:
            await client.list_models()
    assert caught.value.status == status and caught.value.code == "flaky"
    assert app.hits == 1


async def test_a_5xx_is_retried_until_it_succeeds() -> None:
    app = Flaky(failures=2, status=503)
    async with AsyncRollwayClient("http://flaky", retry=FAST, transport=httpx.ASGITransport(app)) as client:
        assert await client.list_models() == []
    assert app.hits == 3


async def test_a_5xx_beyond_the_retry_budget_raises_the_last_answer() -> None:
    app = Flaky(failures=10, status=502)
    async with AsyncRollwayClient("http://flaky", retry=FAST, transport=httpx.ASGITransport(app)) as client:
        with pytest.raises(RollwayAPIError) as caught:
            await client.list_models()
    assert app.hits == 3  # the first try and two retries
    assert caught.value.status == 502 and caught.value.message == "flaky #3"


async def test_a_keyless_write_is_sent_again_after_a_503_only() -> None:
    """Rollway's 503 means nothing was written; a proxy's 502/504 may come after the server acted."""
    resources = {"resources_id": "rs-1", "version": 1, "resources": {}, "create_time": 0.0, "update_time": 0.0}
    for status, hits in ((503, 2), (502, 1), (504, 1), (500, 1)):
        app = Flaky(failures=1, status=status, ok=resources)
        async with AsyncRollwayClient("http://flaky", retry=FAST, transport=httpx.ASGITransport(app)) as client:
            if hits == 2:
                await client.add_resources({"prompt": "p"})
            else:
                with pytest.raises(RollwayAPIError):
                    await client.add_resources({"prompt": "p"})
        assert app.hits == hits, status
    app = Flaky(failures=1, status=502, ok={"spans": []})
    async with AsyncRollwayClient("http://flaky", retry=FAST, transport=httpx.ASGITransport(app)) as client:
        await client.add_spans("ro-1", [{"name": "tool"}])  # carries a key: harmless twice
    assert app.hits == 2


async def test_connection_errors_are_retried_then_the_call_succeeds(gw: RunningGateway) -> None:
    transport = Counting(fail=2)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        assert isinstance(await client.stats(), StatsView)
    assert len(transport.requests) == 3


async def test_an_enqueue_whose_answer_was_lost_is_retried_without_queueing_twice(gw: RunningGateway) -> None:
    transport = LosingAnswers(lose=2)
    tasks: list[dict[str, Any]] = [{"input": {"q": "a"}}, {"input": {"q": "b"}, "group_size": 4}]
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        rollouts = await client.enqueue(tasks)
        assert len(transport.requests) == 3  # the server queued the tasks on the first; two answers were lost
        stored = await client.list_rollouts(limit=100)
        assert sorted(r.rollout_id for r in stored.items) == sorted(r.rollout_id for r in rollouts)
        assert len(rollouts) == 5 and len({r.group_id for r in rollouts[1:]}) == 1
        # A new call is a new request: it queues again.
        assert len(await client.enqueue(tasks[:1])) == 1
        assert len((await client.list_rollouts(limit=100)).items) == 6
    raw = httpx.AsyncClient(base_url=f"{gw.url}/admin/v1", headers={"Authorization": f"Bearer {TOKEN}"})
    async with raw:
        key = {"Idempotency-Key": transport.requests[0].headers["idempotency-key"]}
        reused = await raw.post("/rollouts", json={"tasks": [{"input": {"q": "other"}}]}, headers=key)
    assert reused.status_code == 409 and reused.json()["error"]["type"] == "conflict_error"


async def test_a_claim_whose_answer_was_lost_is_retried_without_taking_more(gw: RunningGateway) -> None:
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY) as client:
        queued = await client.enqueue([{"input": i} for i in range(3)])
    transport = LosingAnswers(lose=1)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        claims = await client.claim("worker-1", limit=2)
        assert len(transport.requests) == 2
        assert [c.rollout.rollout_id for c in claims] == [r.rollout_id for r in queued[:2]]
        # The retry's answer works: its gateway key is for the attempt the first try made.
        assert all(c.api_key and c.base_url.endswith(f"/attempt/{c.attempt.attempt_id}/v1") for c in claims)
        rest = await client.claim("worker-2", limit=5)
    assert [c.rollout.rollout_id for c in rest] == [queued[2].rollout_id]


async def test_a_claim_start_or_new_attempt_answered_again_leaves_one_live_key_the_answers(
    gw: RunningGateway,
) -> None:
    """Only a hash of a gateway key is stored, so the key of a lost answer cannot be sent again: the answer to
    the retry carries a new one, and the lost one is revoked (no second live key for the attempt)."""
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY) as client:
        await client.enqueue([{"input": 1}])
        rid = (await client.start_rollout({"input": "r"}, worker_id="w")).rollout.rollout_id
    calls: dict[str, Callable[[AsyncRollwayClient], Awaitable[Claim | list[Claim]]]] = {
        "claim": lambda c: c.claim("w"),
        "start": lambda c: c.start_rollout({"input": "s"}, worker_id="w"),
        "new attempt": lambda c: c.new_attempt(rid, worker_id="w"),
    }
    keys = models.api_keys
    for name, call in calls.items():
        transport = LosingAnswers(lose=1)
        async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
            answer = await call(client)
        [claim] = answer if isinstance(answer, list) else [answer]
        assert len(transport.requests) == 2, name
        query = select(keys.c.revoked_time).where(keys.c.attempt_id == claim.attempt.attempt_id)
        minted = await gw.store.read(first_column(query))
        assert sorted(revoked is None for revoked in minted) == [False, True], name
        found = await gw.store.find_key(claim.api_key)
        assert found is not None and found.attempt_id == claim.attempt.attempt_id, name


async def test_rewards_spans_and_attempts_whose_answers_were_lost_are_not_recorded_twice(gw: RunningGateway) -> None:
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY) as client:
        claim = await client.start_rollout({"input": "q"}, worker_id="w")
    rid = claim.rollout.rollout_id
    transport = LosingAnswers(lose=2)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        spans = await client.add_spans(rid, [{"name": "tool", "attributes": {"i": 1}}, {"name": "tool"}])
        assert len(transport.requests) == 3  # written on the first try; two answers lost
        assert [s.sequence_id for s in spans] == [1, 2] and spans[0].attributes == {"i": 1}
        transport.lose = 5
        reward = await client.add_reward(rid, 0.75)
        assert len(transport.requests) == 6  # two more answers lost
        stored = await client.get_spans(rid)
    assert [(s.name, s.sequence_id) for s in stored] == [("tool", 1), ("tool", 2), ("rollway.reward", 3)]
    assert reward.span_id == stored[2].span_id and reward.attributes["rollway.reward.value"] == 0.75
    transport = LosingAnswers(lose=1)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        second = await client.new_attempt(rid, worker_id="w")
        assert len(transport.requests) == 2
        view = await client.get_rollout(rid)
    # One new attempt, the one the answer names (the first try's): a second would have made it stale.
    assert view.attempt_count == 2 and second.attempt.sequence_id == 2
    assert view.attempts is not None and view.attempts[-1].attempt_id == second.attempt.attempt_id
    raw = httpx.AsyncClient(base_url=f"{gw.url}/admin/v1", headers={"Authorization": f"Bearer {TOKEN}"})
    async with raw:
        reused = {"Idempotency-Key": "reward-key"}
        first = await raw.post(f"/rollouts/{rid}/rewards", json={"value": 1.0}, headers=reused)
        again = await raw.post(f"/rollouts/{rid}/rewards", json={"value": 1.0}, headers=reused)
        other = await raw.post(f"/rollouts/{rid}/rewards", json={"value": 0.0}, headers=reused)
        plain = [await raw.post(f"/rollouts/{rid}/rewards", json={"value": 0.5}) for _ in range(2)]
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    assert other.status_code == 409 and other.json()["error"]["type"] == "conflict_error"
    assert plain[0].json()["span_id"] != plain[1].json()["span_id"]  # no key: two requests, two rewards


async def test_an_attempts_end_and_its_reward_are_one_request_recorded_once(gw: RunningGateway) -> None:
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY) as client:
        claim = await client.start_rollout({"input": "q"}, worker_id="w")
        rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
        with pytest.raises(RollwayAPIError) as refused:  # a bool is not a reward: nothing changes
            await client.update_attempt(rid, aid, status="succeeded", reward=True)
        assert refused.value.status == 400
        assert (await client.get_rollout(rid)).status == "preparing" and await client.get_spans(rid) == []
    transport = LosingAnswers(lose=2)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        attempt = await client.update_attempt(rid, aid, status="succeeded", reward=0.25)
        assert len(transport.requests) == 3  # done on the first try; two answers lost
        assert len({r.content for r in transport.requests}) == 1  # the same request, its reward's key in it
        stored = await client.get_spans(rid)
        view = await client.get_rollout(rid)
    assert attempt.status == "succeeded" and view.status == "succeeded"
    assert [(s.name, s.attempt_id, s.attributes["rollway.reward.value"]) for s in stored] == [
        ("rollway.reward", aid, 0.25)
    ]
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY) as client:
        second = await client.start_rollout({"input": "q"}, worker_id="w")
        await client.update_attempt(second.rollout.rollout_id, status="failed", reward=None, reward_name="judge")
        [null] = await client.get_spans(second.rollout.rollout_id)
    assert null.attributes == {"rollway.reward.name": "judge", "rollway.reward.value": None}  # null, never 0


async def test_the_ends_agents_report_at_once_go_in_few_requests_each_with_its_own_answer(gw: RunningGateway) -> None:
    transport = Counting()
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY, transport=transport) as client:
        await client.enqueue([{"input": i} for i in range(20)])
        claims = await client.claim("w", limit=20)
        bad = claims[-1]
        await client.update_attempt(bad.rollout.rollout_id, bad.attempt.attempt_id, status="failed")
        sent = len(transport.requests)
        outcomes = await asyncio.gather(
            *(
                client.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded", reward=i / 20)
                for i, c in enumerate(claims)
            ),
            return_exceptions=True,
        )
        batches = transport.requests[sent:]
        rewards = [(await client.get_spans(c.rollout.rollout_id)) for c in claims]
    assert 1 <= len(batches) <= 2 and {r.url.path for r in batches} == {"/admin/v1/attempts"}
    *done, refused = outcomes
    assert all(isinstance(a, Attempt) and a.status == "succeeded" for a in done)
    assert [a.attempt_id for a in done if isinstance(a, Attempt)] == [c.attempt.attempt_id for c in claims[:-1]]
    # The ended attempt's update is refused alone, with the status and envelope a lone PATCH gets; its
    # reward, in the same transaction, is not recorded.
    assert isinstance(refused, RollwayAPIError) and refused.status == 409 and refused.type == "conflict_error"
    assert [[s.attributes["rollway.reward.value"] for s in spans] for spans in rewards] == [
        *([i / 20] for i in range(19)),
        [],
    ]


async def test_a_server_without_the_batch_route_gets_each_update_alone() -> None:
    attempt = {"rollout_id": "r", "attempt_id": "a", "sequence_id": 1, "start_time": 1.0, "status": "succeeded"}
    hits: list[tuple[str, str]] = []

    async def older(scope: Scope, receive: Receive, send: Send) -> None:
        hits.append((scope["method"], scope["path"]))
        status, body = (
            (404, {"error": {"message": "Not Found"}}) if scope["path"] == "/admin/v1/attempts" else (200, attempt)
        )
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    transport = httpx.ASGITransport(app=older)
    async with AsyncRollwayClient("http://older", retry=NO_RETRY, transport=transport) as client:
        first = await asyncio.gather(*(client.update_attempt("r", "a", status="succeeded") for _ in range(3)))
        then = await client.update_attempt("r", "a", status="succeeded")
    assert all(a.status == "succeeded" for a in [*first, then])
    assert hits == [("PATCH", "/admin/v1/attempts"), *[("PATCH", "/admin/v1/rollouts/r/attempts/a")] * 4]


async def test_a_claim_filtered_by_mode_and_metadata_leaves_the_others_queued(client: AsyncRollwayClient) -> None:
    await client.enqueue(
        [
            {"input": "probe", "mode": "val", "metadata": {"step": 1}},
            {"input": "train", "mode": "train", "metadata": {"step": 1}},
            {"input": "later", "mode": "train", "metadata": {"step": 2}},
        ]
    )
    [trainer] = await client.claim("trainer", limit=5, mode="train", metadata={"step": 1})
    [evaluator] = await client.claim("evaluator", limit=5, mode="val")
    assert (trainer.rollout.input, evaluator.rollout.input) == ("train", "probe")
    with pytest.raises(RollwayAPIError) as refused:
        await client.claim("trainer", metadata={"step": [1]})  # type: ignore[dict-item]
    assert refused.value.status == 400 and refused.value.param is not None
    assert refused.value.param.startswith("metadata")
    [left] = await client.claim("anyone", limit=5)
    assert left.rollout.input == "later"


async def test_a_write_without_a_key_is_not_sent_again_once_it_may_have_arrived(gw: RunningGateway) -> None:
    lost = LosingAnswers(lose=1)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=lost) as client:
        with pytest.raises(RollwayConnectionError, match="ReadError"):
            await client.add_resources({"prompt": "p"})  # done on the server: sending it again would add another
        assert len(lost.requests) == 1
        assert len((await client.list_resources()).items) == 1
    refused = Counting(fail=1, error=httpx.ConnectError)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=refused) as client:
        await client.add_resources({"prompt": "q"})  # never left: sent again
    assert len(refused.requests) == 2
    async with AsyncRollwayClient(gw.url, TOKEN, retry=NO_RETRY) as client:
        claim = await client.start_rollout({"input": "h"}, worker_id="w")
        await client.put_model("policy", [{"backend_id": "a", "base_url": "http://127.0.0.1:9/v1", "model": "m"}])
    rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
    # Writes that set a state are sent again (each of these loses its first answer) ...
    repeatable: dict[str, Callable[[AsyncRollwayClient], Awaitable[object]]] = {
        "heartbeat": lambda c: c.heartbeat(rid, aid),
        "attempt status": lambda c: c.update_attempt(rid, aid, metadata={"step": 1}),
        "pause": lambda c: c.pause_model("policy"),
        "resume": lambda c: c.resume_model("policy"),
        "drain": lambda c: c.drain_model("policy", 1),
        "cancel": lambda c: c.cancel(rid),
    }
    for name, write in repeatable.items():
        transport = LosingAnswers(lose=1)
        async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
            await write(client)
        assert len(transport.requests) == 2, name
    # A delete whose answer was lost finds nothing on its retry: done, not an error.
    transport = LosingAnswers(lose=1)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        await client.delete_model("policy")
        assert len(transport.requests) == 2 and await client.list_models() == []
        with pytest.raises(RollwayAPIError) as caught:
            await client.delete_model("policy")  # a first try that finds nothing is still a 404
        assert caught.value.status == 404
    # ... but not when they name the "latest" attempt: by the retry it may be another worker's.
    transport = LosingAnswers(lose=1)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=transport) as client:
        with pytest.raises(RollwayConnectionError):
            await client.heartbeat(rid)
    assert len(transport.requests) == 1


async def test_rollouts_are_listed_by_group_and_creation_time(client: AsyncRollwayClient) -> None:
    early = await client.enqueue([{"input": "a", "group_size": 2}])
    late = await client.enqueue([{"input": "b"}, {"input": "c"}])
    assert max(r.start_time for r in early) < late[0].start_time
    ids: Callable[[RolloutPage], list[str]] = lambda page: [r.rollout_id for r in page.items]  # noqa: E731
    group = early[0].group_id
    assert ids(await client.list_rollouts(group_id=group)) == [r.rollout_id for r in early]
    since = await client.list_rollouts(started_after=late[0].start_time)
    assert ids(since) == [r.rollout_id for r in late]
    before = await client.list_rollouts(started_before=late[0].start_time)
    assert ids(before) == [r.rollout_id for r in early]
    window = [r.rollout_id async for r in client.iter_rollouts(started_after=early[0].start_time, page_size=1)]
    assert window == [r.rollout_id for r in early + late]


async def test_a_closed_port_raises_a_connection_error_after_the_retries() -> None:
    transport = Counting()
    url = f"http://127.0.0.1:{closed_port()}"
    async with AsyncRollwayClient(url, TOKEN, retry=FAST, transport=transport) as client:
        with pytest.raises(RollwayConnectionError, match="ConnectError"):
            await client.stats()
    assert len(transport.requests) == 3


async def test_a_read_timeout_is_retried_for_reads_and_idempotent_writes_only(gw: RunningGateway) -> None:
    post = Counting(fail=1, error=httpx.ReadTimeout)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=post) as client:
        with pytest.raises(RollwayConnectionError):
            await client.mint_key(name="once")  # the server may have minted it: not sent twice
    assert len(post.requests) == 1
    enqueue = Counting(fail=1, error=httpx.ReadTimeout)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=enqueue) as client:
        assert len(await client.enqueue([{"input": 1}])) == 1  # carries an idempotency key: sent again
    keys = [r.headers["idempotency-key"] for r in enqueue.requests]
    assert len(keys) == 2 and keys[0] == keys[1]
    get = Counting(fail=1, error=httpx.ReadTimeout)
    async with AsyncRollwayClient(gw.url, TOKEN, retry=FAST, transport=get) as client:
        await client.stats()
    assert len(get.requests) == 2


def sync_trainer(url: str) -> dict[str, Any]:
    """What a synchronous trainer does, with no event loop of its own."""
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    with RollwayClient(url, TOKEN, retry=NO_RETRY) as client:
        rollouts = client.enqueue([{"input": {"q": i}} for i in range(3)])
        [claim] = client.claim("sync-worker")
        client.add_reward(claim.rollout.rollout_id, 0.5)
        client.update_attempt(claim.rollout.rollout_id, status="succeeded")
        waited = client.wait([claim.rollout.rollout_id], timeout_seconds=5)
        listed = [r.rollout_id for r in client.iter_rollouts(page_size=1)]
        with pytest.raises(RollwayAPIError) as caught:
            client.get_rollout("ro-missing")
        threads = {t.name for t in threading.enumerate()}
    return {
        "rollouts": rollouts,
        "finished": [r.status for r in waited.finished],
        "listed": listed,
        "missing": caught.value.status,
        "thread_while_open": "rollway-client" in threads,
    }


async def test_the_sync_client_works_from_plain_sync_code(gw: RunningGateway) -> None:
    # The gateway runs on this test's loop; the trainer runs in a plain thread, as synchronous code does.
    result = await asyncio.to_thread(sync_trainer, gw.url)
    assert [type(r) for r in result["rollouts"]] == [Rollout] * 3
    assert result["finished"] == ["succeeded"]
    assert result["listed"] == [r.rollout_id for r in result["rollouts"]]
    assert result["missing"] == 404
    assert result["thread_while_open"]
    assert "rollway-client" not in {t.name for t in threading.enumerate()}  # closed with its thread


def test_a_closed_sync_client_refuses_calls() -> None:
    client = RollwayClient(f"http://127.0.0.1:{closed_port()}", retry=NO_RETRY)
    with pytest.raises(RollwayConnectionError):
        client.stats()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.stats()
