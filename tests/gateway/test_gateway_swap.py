"""Pause, drain and swap under load, end to end: the official openai SDK → a real gateway → two mock backend
processes (A and B). A call holds the alias configuration it was admitted with: calls in flight when the alias
is swapped finish on A, later calls go to B, and every span records the version that served it.

The mock's long-polls (``stats(wait_requests=N)``) run in a thread so the gateway (this event loop) keeps
serving while the test waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from rollway.mock import MockBackendProcess
from support.gateway_harness import Alias, RunningGateway, claim_one, register, running_gateway

ALIAS = "policy"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[MockBackendProcess, MockBackendProcess]]:
    with MockBackendProcess() as a, MockBackendProcess() as b:
        yield a, b


@pytest.fixture
def backends(pair: tuple[MockBackendProcess, MockBackendProcess]) -> tuple[MockBackendProcess, MockBackendProcess]:
    for process in pair:
        process.reset()
    return pair


def entry(mock: MockBackendProcess, backend_id: str) -> dict[str, Any]:
    return {"backend_id": backend_id, "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"pause_wait_seconds": 10}


@pytest.fixture
def gateway_aliases(backends: tuple[MockBackendProcess, MockBackendProcess]) -> list[Alias]:
    return [Alias(ALIAS, [entry(backends[0], "a")], version="v1")]


def wide_client(gw: RunningGateway, base_url: str | None = None) -> AsyncOpenAI:
    """A client whose pool lets hundreds of calls be in flight at once (httpx's default is 100)."""
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    return gw.client(base_url, http_client=httpx.AsyncClient(limits=limits, timeout=60))


async def wait_requests(mock: MockBackendProcess, count: int, timeout: float = 20) -> dict[str, Any]:
    snapshot = await asyncio.to_thread(mock.stats, wait_requests=count, timeout=timeout)
    assert snapshot["requests_total"] >= count, snapshot["requests_total"]
    return snapshot


async def swap_to(gw: RunningGateway, mock: MockBackendProcess, backend_id: str, version: str) -> None:
    state = gw.state
    new = await state.store.put_model(ALIAS, [entry(mock, backend_id)], version=version)
    state.registry.install(ALIAS, new)


async def call(client: AsyncOpenAI, tag: str, stream: bool) -> str:
    """One chat call tagged ``tag`` (its user message); returns the answer's text."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": tag}]
    if stream:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=ALIAS, messages=messages, max_tokens=4, stream=True
            )
        ]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = await client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=4)
    return answer.choices[0].message.content or ""


def tag_of(span: Any) -> str:
    tag: str = span.attributes["rollway.request"]["messages"][0]["content"]
    return tag


async def test_swap_under_load(gw: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]) -> None:
    a, b = backends
    a.configure(hold=True)  # calls stay in flight on A while the swap happens, until released below
    rollouts = [await claim_one(gw.store) for _ in range(10)]
    clients = [wide_client(gw, f"{gw.url}/rollout/{r}/v1") for r, _ in rollouts]

    before = [asyncio.create_task(call(clients[i % 10], f"before {i}", i % 2 == 0)) for i in range(200)]
    snapshot = await wait_requests(a, 200)
    assert snapshot["in_flight"] == 200  # all 200 are at A, none finished
    await swap_to(gw, b, "b", "v2")
    after = [asyncio.create_task(call(clients[i % 10], f"after {i}", i % 2 == 0)) for i in range(50)]
    done_after = await asyncio.wait_for(asyncio.gather(*after), 20)
    assert all(done_after)
    assert not any(t.done() for t in before)  # B answered while A's calls were still in flight
    a.configure(hold=False)
    done_before = await asyncio.wait_for(asyncio.gather(*before, return_exceptions=True), 30)
    assert [r for r in done_before if not isinstance(r, str) or not r] == []  # none failed

    assert {r["body"]["messages"][0]["content"] for r in a.requests(limit=1000)} == {f"before {i}" for i in range(200)}
    assert {r["body"]["messages"][0]["content"] for r in b.requests(limit=1000)} == {f"after {i}" for i in range(50)}
    assert await gw.state.registry.drain(ALIAS, 10)
    spans = [s for r, _ in rollouts for s in await gw.store.query_spans(r)]
    assert len(spans) == 250
    served = {tag_of(s): (s.attributes["rollway.backend_id"], s.attributes["rollway.model_version"]) for s in spans}
    assert served == {f"before {i}": ("a", "v1") for i in range(200)} | {f"after {i}": ("b", "v2") for i in range(50)}
    assert all(s.status.status_code == "OK" for s in spans)
    for rollout_id, _ in rollouts:  # gap-free sequence ids per attempt through the swap
        assert [s.sequence_id for s in await gw.store.query_spans(rollout_id)] == list(range(1, 26))


async def test_paused_calls_wait_and_resume_releases_them(
    gw: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    a, _ = backends
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    await gw.state.registry.pause(ALIAS)
    waiting = [asyncio.create_task(call(client, f"waiting {i}", i == 0)) for i in range(3)]
    done, _ = await asyncio.wait(waiting, timeout=0.5)  # a window to show nothing happens while paused
    assert not done
    assert a.stats()["requests_total"] == 0
    await gw.state.registry.resume(ALIAS)
    assert all(await asyncio.wait_for(asyncio.gather(*waiting), 10))
    assert a.stats()["requests_total"] == 3
    spans = await gw.store.query_spans(rollout_id)
    assert [s.sequence_id for s in spans] == [1, 2, 3]
    assert all(s.status.status_code == "OK" for s in spans)


async def test_an_alias_deleted_while_a_call_waits_for_it_ends_the_call_with_a_404_and_its_span(
    gw: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    registry = gw.state.registry
    await registry.pause(ALIAS)
    waiting = asyncio.create_task(call(client, "waiting", False))
    # Until the call has its sequence id and waits for the resume (it comes over HTTP: nothing to await).
    while registry.waiting(ALIAS) == 0:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    await gw.store.delete_model(ALIAS)  # as another replica would: this one sees it when it re-reads the alias
    with pytest.raises(openai.NotFoundError) as info:
        await asyncio.wait_for(waiting, 10)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    assert info.value.response.headers["x-rollway-sequence-id"] == "1"
    [span] = await gw.store.query_spans(rollout_id)  # the sequence id it took is not a hole
    assert (span.attempt_id, span.sequence_id, span.status.status_code) == (attempt_id, 1, "ERROR")
    assert span.attributes["http.response.status_code"] == 404
    assert backends[0].stats()["requests_total"] == 0


async def test_a_client_that_leaves_while_its_alias_is_paused_ends_its_call_at_once(
    gw: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    """A call waiting for a resume whose client goes away is cancelled then (its span says so), not sent to the
    backend when the alias resumes."""
    a, _ = backends
    rollout_id, attempt_id = await claim_one(gw.store)
    registry = gw.state.registry
    await registry.pause(ALIAS)
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=30) as http:
        leaving = asyncio.create_task(http.post(f"{gw.url}/rollout/{rollout_id}/v1/chat/completions", json=body))
        while registry.waiting(ALIAS) == 0:  # noqa: ASYNC110 (it comes over HTTP: nothing to await)
            await asyncio.sleep(0.01)
        leaving.cancel()  # the client closes its connection
        with pytest.raises(asyncio.CancelledError):
            await leaving
    deadline = time.monotonic() + 5  # well before the 10 s bound: only the disconnect can end the call
    while registry.waiting(ALIAS) or not await gw.store.query_spans(rollout_id):
        assert time.monotonic() < deadline, "the call still waits for the resume"
        await asyncio.sleep(0.02)
    [span] = await gw.store.query_spans(rollout_id)
    assert (span.attempt_id, span.sequence_id, span.status.status_code) == (attempt_id, 1, "ERROR")
    assert span.attributes["rollway.cancelled"] is True
    assert registry.in_flight(ALIAS) == 0
    await registry.resume(ALIAS)
    assert await call(gw.client(f"{gw.url}/rollout/{rollout_id}/v1"), "after", False)
    assert a.stats()["requests_total"] == 1  # the call that left never reached the backend


async def test_paused_longer_than_the_bound_is_429_with_retry_after_and_a_span(
    tmp_path: Path, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    a, _ = backends
    async with running_gateway(tmp_path, pause_wait_seconds=0.3) as gw:
        await register(gw.store, ALIAS, entry(a, "a"), version="v1")
        rollout_id, attempt_id = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        await gw.state.registry.pause(ALIAS)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}])
        assert 0.3 <= time.monotonic() - started < 3
        assert info.value.status_code == 429
        assert float(info.value.response.headers["retry-after"]) >= 0.3
        assert isinstance(info.value.body, dict)
        assert info.value.body["code"] == "model_paused"
        assert set(info.value.body) == {"message", "type", "param", "code"}
        assert a.stats()["requests_total"] == 0
        [span] = await gw.store.query_spans(rollout_id)
        assert (span.attempt_id, span.sequence_id) == (attempt_id, 1)  # the sequence id is not lost
        assert span.attributes["http.response.status_code"] == 429
        assert span.status.status_code == "ERROR"
        await gw.state.registry.resume(ALIAS)
        raw = await client.chat.completions.with_raw_response.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.headers["x-rollway-sequence-id"] == "2"


async def test_drain_returns_once_in_flight_calls_finish(
    gw: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    a, _ = backends
    a.configure(hold=True)
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    calls = [asyncio.create_task(call(client, f"call {i}", i % 2 == 0)) for i in range(5)]
    await wait_requests(a, 5)
    registry = gw.state.registry
    assert registry.in_flight(ALIAS) == 5
    assert await registry.drain(ALIAS, 0.05) is False
    a.configure(hold=False)
    assert await registry.drain(ALIAS, 10) is True
    assert registry.in_flight(ALIAS) == 0
    assert len(await gw.store.query_spans(rollout_id)) == 5  # every span is written before the drain ends
    assert all(await asyncio.wait_for(asyncio.gather(*calls), 10))
    assert await registry.drain(ALIAS, 0) is True  # nothing in flight: at once


async def test_weight_update_cycle_pause_drain_swap_resume(
    gw: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    """What a trainer does between steps: pause, drain the calls in flight on A, swap to B, resume; calls
    that arrived during the pause are served by B with the new version."""
    a, b = backends
    a.configure(latency_ms=600)
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    registry = gw.state.registry
    in_flight = [asyncio.create_task(call(client, f"old {i}", i % 2 == 0)) for i in range(4)]
    await wait_requests(a, 4)
    await registry.pause(ALIAS)
    waiting = [asyncio.create_task(call(client, f"new {i}", i % 2 == 0)) for i in range(4)]
    assert await registry.drain(ALIAS, 10)
    assert not any(t.done() for t in waiting)
    assert all(await asyncio.wait_for(asyncio.gather(*in_flight), 10))
    await swap_to(gw, b, "b", "v2")
    await registry.resume(ALIAS)
    assert all(await asyncio.wait_for(asyncio.gather(*waiting), 10))
    assert await registry.drain(ALIAS, 10)
    spans = await gw.store.query_spans(rollout_id)
    served = {tag_of(s): (s.attributes["rollway.backend_id"], s.attributes["rollway.model_version"]) for s in spans}
    assert served == {f"old {i}": ("a", "v1") for i in range(4)} | {f"new {i}": ("b", "v2") for i in range(4)}
    assert a.stats()["requests_total"] == 4 and b.stats()["requests_total"] == 4


# -- replicas: two gateways on one database file ------------------------------------------------------------


@pytest.fixture
async def replica(tmp_path: Path, gw: RunningGateway) -> AsyncIterator[RunningGateway]:
    """A second gateway process's worth (its own store connections, registry and caches) on ``gw``'s file."""
    async with running_gateway(tmp_path, pause_wait_seconds=10) as other:
        assert other.state.settings.database_url == gw.state.settings.database_url
        yield other


async def test_a_swap_through_one_replica_applies_to_the_next_call_through_another(
    gw: RunningGateway, replica: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    a, b = backends
    rollout_id, _ = await claim_one(gw.store)
    client = replica.client(f"{replica.url}/rollout/{rollout_id}/v1")
    assert await call(client, "first", stream=False)  # the replica now holds v1 in its cache (TTL 2 s)
    await swap_to(gw, b, "b", "v2")  # through the other replica: its store, its registry
    assert await call(client, "second", stream=True)  # at once: no wait for the replica's cache to expire
    spans = await replica.store.query_spans(rollout_id)
    served = {tag_of(s): (s.attributes["rollway.backend_id"], s.attributes["rollway.model_version"]) for s in spans}
    assert served == {"first": ("a", "v1"), "second": ("b", "v2")}
    assert [r["body"]["messages"][0]["content"] for r in a.requests(limit=10)] == ["first"]
    assert [r["body"]["messages"][0]["content"] for r in b.requests(limit=10)] == ["second"]
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{replica.url}/metrics")).text
    assert "rollway_catalog_changes_total 2.0" in metrics  # the revision it started with, then the swap


async def test_a_pause_and_resume_through_one_replica_hold_and_release_calls_through_another(
    gw: RunningGateway, replica: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    a, _ = backends
    rollout_id, _ = await claim_one(gw.store)
    client = replica.client(f"{replica.url}/rollout/{rollout_id}/v1")
    assert await call(client, "before", stream=False)  # cached as running by the replica
    await gw.state.registry.pause(ALIAS)
    waiting = asyncio.create_task(call(client, "held", stream=False))
    async with asyncio.timeout(10):
        while replica.state.registry.waiting(ALIAS) == 0:  # the call arrives over HTTP: no event to await
            assert not waiting.done()
            await asyncio.sleep(0.01)
    assert a.stats()["requests_total"] == 1
    await gw.state.registry.resume(ALIAS)
    # Released by the resume through the other replica (the waiting call asks the store for the catalog revision
    # every 0.25 s). How soon is not timed here: under a loaded CI worker the call took 3.3 s end to end.
    assert await asyncio.wait_for(waiting, 10)
    assert a.stats()["requests_total"] == 2
    assert [s.sequence_id for s in await replica.store.query_spans(rollout_id)] == [1, 2]


async def test_a_drain_through_one_replica_waits_for_the_calls_in_flight_through_another(
    gw: RunningGateway, replica: RunningGateway, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    """The weight-update cycle with replicas: pause and drain through one; a call the other is serving on the
    old weights ends (its span written) before the drain answers. Before, the drain counted only its own
    process's calls and answered at once."""
    a, _ = backends
    a.configure(hold=True)
    rollout_id, _ = await claim_one(gw.store)
    slow = asyncio.create_task(call(replica.client(f"{replica.url}/rollout/{rollout_id}/v1"), "slow", stream=True))
    await wait_requests(a, 1)  # at the backend, in flight in the other replica
    async with httpx.AsyncClient(base_url=f"{gw.url}/admin/v1", timeout=30) as admin:
        (await admin.post(f"/models/{ALIAS}/pause")).raise_for_status()
        short = await admin.post(f"/models/{ALIAS}/drain", json={"timeout_seconds": 0.2})
        assert short.status_code == 200 and short.json()["drained"] is False  # the call is still at A
        a.configure(hold=False)
        answer = await admin.post(f"/models/{ALIAS}/drain")  # the default timeout, 30 s
        assert answer.status_code == 200, answer.text
        assert answer.json()["drained"] is True and answer.json()["state"]["in_flight"] == 0
        assert replica.state.registry.in_flight(ALIAS) == 0
        assert [tag_of(s) for s in await gw.store.query_spans(rollout_id)] == ["slow"]
        assert await asyncio.wait_for(slow, 10)
        late = asyncio.create_task(call(replica.client(f"{replica.url}/rollout/{rollout_id}/v1"), "late", False))
        (await admin.post(f"/models/{ALIAS}/resume")).raise_for_status()
        assert await asyncio.wait_for(late, 10)
        again = await admin.post(f"/models/{ALIAS}/drain", json={"timeout_seconds": 10})
        assert again.json()["drained"] is True  # nothing in flight anywhere (once the other has reported)
        missing = await admin.post("/models/nope/drain", json={})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


async def test_a_call_between_its_arrival_and_its_lease_holds_a_drain_through_another_replica(
    gw: RunningGateway, replica: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose arrival read the catalog before a pause may still lease the old configuration: it counts
    for a drain elsewhere from before its arrival transaction, not only from its lease."""
    rollout_id, _ = await claim_one(gw.store)
    client = replica.client(f"{replica.url}/rollout/{rollout_id}/v1")
    assert await call(client, "first", stream=False)  # the replica caches the alias as running
    reached, gate = asyncio.Event(), asyncio.Event()
    arrive = replica.store.begin_call

    async def held(*args: Any) -> Any:
        ticket = await arrive(*args)  # the catalog read before the pause
        reached.set()
        await gate.wait()
        return ticket

    monkeypatch.setattr(replica.store, "begin_call", held)
    racing = asyncio.create_task(call(client, "racing", stream=False))
    await asyncio.wait_for(reached.wait(), 10)
    await gw.state.registry.pause(ALIAS)
    await replica.state.reporter.report()
    try:
        assert await gw.state.registry.drain(ALIAS, 0) is False
    finally:
        gate.set()
    assert await gw.state.registry.drain(ALIAS, 10) is True
    assert replica.state.registry.in_flight(ALIAS) == 0  # it either ran (on v1) and ended, or waits
    await gw.state.registry.resume(ALIAS)
    assert await asyncio.wait_for(racing, 10)


async def test_a_key_revoked_through_one_replica_is_refused_by_another_after_its_next_call(
    tmp_path: Path, backends: tuple[MockBackendProcess, MockBackendProcess]
) -> None:
    async with (
        running_gateway(tmp_path, gateway_auth="keys") as one,
        running_gateway(tmp_path, gateway_auth="keys") as other,
    ):
        await register(one.store, ALIAS, entry(backends[0], "a"), version="v1")
        revoked_key, revoked = await one.store.mint_key("gateway", name="revoked")
        _, kept = await one.store.mint_key("gateway", name="kept")
        bad, good = other.client(api_key=revoked), other.client(api_key=kept)
        assert await call(bad, "cached", stream=False)  # the replica caches the key for 5 s
        await one.store.revoke_key(revoked_key.key_id)
        assert await call(good, "sees the change", stream=False)  # its arrival reads the new catalog revision
        with pytest.raises(openai.AuthenticationError):
            await call(bad, "refused", stream=False)


async def test_an_unexpected_error_while_a_call_waits_for_its_alias_ends_it_with_a_500_and_its_span(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")

    async def broken(alias: str, *_: Any) -> Any:
        raise RuntimeError("database error the store did not wrap")

    monkeypatch.setattr(gw.state.registry, "admit", broken)
    with pytest.raises(openai.InternalServerError) as info:
        await call(client, "refused", stream=False)
    assert info.value.response.headers["x-rollway-sequence-id"] == "1"
    [span] = await gw.store.query_spans(rollout_id)  # its sequence id was taken: no hole
    assert (span.sequence_id, span.status.status_code) == (1, "ERROR")
    assert span.attributes["http.response.status_code"] == 500
