"""Weight updates as one operation, end to end: the official openai SDK → a real gateway → a mock vLLM process
with its weight routes (``/pause``, ``/collective_rpc``, ``/update_weight_version``, ``/resume``,
``/weight_info``), whose answers change when its weights are reloaded.

A call made during an update is held, then answered by the new weights; a call in flight when it began finishes
on the old ones (drain) or is ended as an aborted span (abort); an engine that fails leaves the alias on its old
version, resumed, with the failure recorded; the trainer form holds the alias between a begin and a commit, and
expires when it is not committed in time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from rollway.admin.client import AsyncRollwayClient, WeightUpdateFailed
from rollway.admin.client_sync import RollwayClient
from rollway.mock import MockBackendProcess
from rollway.store import WeightUpdate
from support.gateway_harness import Alias, RunningGateway, claim_one, running_gateway

ALIAS = "policy"
BODY = {"model": "mock-model", "max_tokens": 6}


@pytest.fixture(scope="module")
def engine() -> Iterator[MockBackendProcess]:
    with MockBackendProcess() as mock:
        yield mock


@pytest.fixture
def mock(engine: MockBackendProcess) -> MockBackendProcess:
    engine.reset()
    return engine


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"pause_wait_seconds": 2}  # shorter than the updates below: their hold outlasts it


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    backend = {"backend_id": "a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    return [Alias(ALIAS, [backend], version="step-0")]


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a state of this process (no event tells it) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def ask(client: AsyncOpenAI, text: str) -> str:
    answer = await client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": text}], max_tokens=6
    )
    return answer.choices[0].message.content or ""


def straight(mock: MockBackendProcess, text: str) -> str:
    """What the engine answers ``text`` with now, asked directly."""
    body = {**BODY, "messages": [{"role": "user", "content": text}]}
    answer = httpx.post(f"{mock.base_url}/chat/completions", json=body, timeout=10).json()
    content: str = answer["choices"][0]["message"]["content"]
    return content


async def held_until_drained(mock: MockBackendProcess, count: int) -> None:
    snapshot = await asyncio.to_thread(mock.stats, wait_requests=count, timeout=10)
    assert snapshot["in_flight"] >= 1, snapshot


async def test_a_call_made_during_an_update_is_held_and_answered_by_the_new_weights(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    old_answer = straight(mock, "second")
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    mock.configure(hold=True)  # the first call stays in flight on the old weights until released
    first = asyncio.create_task(ask(client, "first"))
    await held_until_drained(mock, 2)  # the direct call above and the first call
    async with gw.http() as admin:
        update = asyncio.create_task(
            admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"version": "step-1"}, timeout=30)
        )
        registry = gw.state.registry
        await until(lambda: registry.held(ALIAS))
        second = asyncio.create_task(ask(client, "second"))
        await until(lambda: registry.waiting(ALIAS) == 1)  # held by Rollway, past the 2 s pause bound below
        assert not update.done()  # draining the first call
        mock.configure(hold=False)
        answer = await asyncio.wait_for(second, 20)
        response = await update
    assert response.status_code == 200, response.text
    record = response.json()
    assert record["state"] == "committed"
    assert (record["from_version"], record["to_version"]) == ("step-0", "step-1")
    assert record["drained"] is True and record["aborted_calls"] == 0
    assert [s["action"] for s in record["steps"]] == [
        "pause",
        "collective_rpc",
        "update_weight_version",
        "resume",
        "weight_info",
    ]
    assert record["engine_versions"] == {"a": "step-1"}
    assert await first  # finished on the old weights
    assert answer == straight(mock, "second") != old_answer  # the new weights answered it
    spans = await gw.store.query_spans(rollout_id)
    versions = {
        s.attributes["rollway.request"]["messages"][0]["content"]: s.attributes["rollway.model_version"] for s in spans
    }
    assert versions == {"first": "step-0", "second": "step-1"}
    model = await gw.store.get_model(ALIAS)
    assert (model.version, model.paused, model.update_id) == ("step-1", False, None)
    assert [u.update_id for u in await gw.store.list_updates(ALIAS)] == [record["update_id"]]


async def test_an_update_whose_engine_call_fails_resumes_on_the_old_version(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    mock.add_faults({"kind": "status", "status": 500, "match": {"path": "/collective_rpc"}})
    async with gw.http() as admin:
        response = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"version": "step-1"})
        assert response.status_code == 502, response.text
        body = response.json()
        assert body["error"]["code"] == "weight_update_failed"
        assert "collective_rpc answered 500" in body["error"]["message"]
        record = body["update"]
        assert record["state"] == "failed" and "resumed on the old version" in record["error"]
        assert [(s["action"], s["ok"]) for s in record["steps"]] == [
            ("pause", True),
            ("collective_rpc", False),
            ("resume", True),  # the engine is not left paused
        ]
        stored = (await admin.get(f"/admin/v1/updates/{record['update_id']}")).json()
        assert stored["state"] == "failed" and stored["error"] == record["error"]
        model = (await admin.get(f"/admin/v1/models/{ALIAS}")).json()
        assert model["version"] == "step-0" and model["state"]["paused"] is False
        metrics = (await admin.get("/metrics")).text
    assert 'rollway_weight_updates_total{alias="policy",state="failed"} 1.0' in metrics
    rollout_id, _ = await claim_one(gw.store)
    assert await ask(gw.client(f"{gw.url}/rollout/{rollout_id}/v1"), "after")
    [span] = await gw.store.query_spans(rollout_id)
    assert span.attributes["rollway.model_version"] == "step-0"


async def test_a_backend_that_took_the_new_weights_when_another_failed_is_recorded_under_them(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """Two engines behind the alias, the second's reload fails: the alias stays on ``step-0``, but the first engine
    serves the new weights, so its calls are recorded as ``step-1`` (its own version) and the other's as
    ``step-0``, until an update commits on both."""
    with MockBackendProcess() as other:
        other.add_faults({"kind": "status", "status": 500, "match": {"path": "/collective_rpc"}, "times": 1})
        backends = [
            {"backend_id": "a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"},
            {"backend_id": "b", "base_url": other.base_url, "kind": "vllm", "model": "mock-model"},
        ]
        async with running_gateway(tmp_path) as gw, gw.http() as admin:
            await gw.store.put_model(ALIAS, backends, version="step-0")
            failed = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"version": "step-1"}, timeout=30)
            assert failed.status_code == 502, failed.text
            record = failed.json()["update"]
            assert record["state"] == "failed"
            assert "backends a took the new weights and are recorded as 'step-1'" in record["error"]
            model = await gw.store.get_model(ALIAS)
            assert model.version == "step-0" and model.update_id is None and not model.paused
            assert {b.backend_id: b.version for b in model.backends} == {"a": "step-1", "b": None}
            first, second = await claim_one(gw.store), await claim_one(gw.store)
            before = mock.stats()["requests_total"]
            mock.configure(hold=True)  # the first call stays at engine a, so the second goes to b
            held = asyncio.create_task(ask(gw.client(f"{gw.url}/rollout/{first[0]}/v1"), "first"))
            await asyncio.to_thread(mock.stats, wait_requests=before + 1, timeout=10)
            assert await ask(gw.client(f"{gw.url}/rollout/{second[0]}/v1"), "second")
            mock.configure(hold=False)
            assert await held
            served = {
                s.attributes["rollway.request"]["messages"][0]["content"]: (
                    s.attributes["rollway.backend_id"],
                    s.attributes["rollway.model_version"],
                )
                for rollout_id, _ in (first, second)
                for s in await gw.store.query_spans(rollout_id)
            }
            assert served == {"first": ("a", "step-1"), "second": ("b", "step-0")}  # each under its own weights
            committed = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"version": "step-2"}, timeout=30)
            assert committed.status_code == 200, committed.text
            model = await gw.store.get_model(ALIAS)
            assert model.version == "step-2" and [b.version for b in model.backends] == [None, None]


async def test_abort_ends_the_calls_in_flight_as_recorded_spans(gw: RunningGateway, mock: MockBackendProcess) -> None:
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    mock.configure(hold=True)
    first = asyncio.create_task(ask(client, "first"))
    await held_until_drained(mock, 1)
    async with gw.http() as admin:
        response = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"in_flight": "abort"}, timeout=30)
    assert response.status_code == 200, response.text
    record = response.json()
    assert (record["state"], record["to_version"], record["aborted_calls"]) == ("committed", "step-1", 1)
    with pytest.raises(openai.InternalServerError) as raised:
        await first
    assert raised.value.status_code == 503
    assert raised.value.response.headers["retry-after"] == "1"
    assert "updating its weights (step-0 → step-1)" in raised.value.message
    [span] = await gw.store.query_spans(rollout_id)
    assert span.attributes["error.type"] == "aborted"
    assert span.status.status_code == "ERROR"
    assert span.attributes["rollway.model_version"] == "step-0"
    mock.configure(hold=False)


async def test_a_call_is_counted_once_by_the_abort_that_ended_it(gw: RunningGateway, mock: MockBackendProcess) -> None:
    """A replica looks again for calls to abort while an update is open: a call it ended already, still writing its
    span, is not ended (nor counted) a second time."""
    rollout_id, _ = await claim_one(gw.store)
    mock.configure(hold=True)
    first = asyncio.create_task(ask(gw.client(f"{gw.url}/rollout/{rollout_id}/v1"), "first"))
    await held_until_drained(mock, 1)
    registry = gw.state.registry
    assert [registry.abort(ALIAS, "a weight update"), registry.abort(ALIAS, "a weight update")] == [1, 0]
    with pytest.raises(openai.InternalServerError):
        await first
    assert registry.abort(ALIAS, "a weight update") == 0
    [span] = await gw.store.query_spans(rollout_id)
    assert span.attributes["error.type"] == "aborted"
    mock.configure(hold=False)


async def test_the_trainer_form_holds_until_commit(gw: RunningGateway, mock: MockBackendProcess) -> None:
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    async with gw.http() as admin:
        begun = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"form": "trainer", "note": "nccl"})
        assert begun.status_code == 201, begun.text
        update_id = begun.json()["update_id"]
        assert begun.json()["state"] == "open"
        refused = await admin.post(f"/admin/v1/models/{ALIAS}/resume")
        assert refused.status_code == 409 and update_id in refused.json()["error"]["message"]
        again = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"form": "trainer"})
        assert again.status_code == 409
        model = (await admin.get(f"/admin/v1/models/{ALIAS}")).json()
        assert model["state"]["updating"] == update_id and model["state"]["paused"] is True
        call = asyncio.create_task(ask(client, "held"))
        await until(lambda: gw.state.registry.waiting(ALIAS) == 1)
        assert mock.stats()["requests_total"] == 0
        committed = await admin.post(f"/admin/v1/updates/{update_id}/commit")
        assert committed.status_code == 200, committed.text
        assert committed.json()["state"] == "committed"
        assert committed.json()["engine_versions"] == {"a": "default"}  # the trainer did not set vLLM's version
        assert await asyncio.wait_for(call, 10)
        twice = await admin.post(f"/admin/v1/updates/{update_id}/commit")
        assert twice.status_code == 409 and "committed" in twice.json()["error"]["message"]
    [span] = await gw.store.query_spans(rollout_id)
    assert span.attributes["rollway.model_version"] == "step-1"


async def test_a_trainer_update_not_committed_in_time_expires_on_the_old_version(gw: RunningGateway) -> None:
    async with gw.http() as admin:
        begun = await admin.post(
            f"/admin/v1/models/{ALIAS}/updates", json={"form": "trainer", "timeout_seconds": 0.3, "version": "v9"}
        )
        assert begun.status_code == 201, begun.text
        update_id = begun.json()["update_id"]
        for _ in range(200):  # the expiry is the gateway's own timer: poll the record until it has run
            stored = (await admin.get(f"/admin/v1/updates/{update_id}")).json()
            if stored["state"] != "open":
                break
            await asyncio.sleep(0.05)
        assert stored["state"] == "expired" and "not committed within" in stored["error"]
        late = await admin.post(f"/admin/v1/updates/{update_id}/commit")
        assert late.status_code == 409 and "expired" in late.json()["error"]["message"]
        model = (await admin.get(f"/admin/v1/models/{ALIAS}")).json()
    assert model["version"] == "step-0" and model["state"] == {
        "paused": False,
        "in_flight": 0,
        "in_flight_old": 0,
        "updating": None,
    }


async def test_an_alias_whose_engine_cannot_reload_is_refused_before_anything_is_held(gw: RunningGateway) -> None:
    await gw.store.put_model(
        ALIAS, [{"backend_id": "o", "base_url": "http://127.0.0.1:9/v1", "kind": "openai", "model": "gpt"}]
    )
    async with gw.http() as admin:
        response = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={})
        assert response.status_code == 400
        assert "cannot reload backend 'o' (openai)" in response.json()["error"]["message"]
        model = (await admin.get(f"/admin/v1/models/{ALIAS}")).json()
        assert model["state"]["paused"] is False
        assert (await admin.get(f"/admin/v1/models/{ALIAS}/updates")).json() == {"items": []}


async def test_a_vllm_without_dev_mode_is_named_in_the_failure(gw: RunningGateway) -> None:
    with MockBackendProcess(extra_args=["--no-dev-mode"]) as plain:
        backend = {"backend_id": "p", "base_url": plain.base_url, "kind": "vllm", "model": "mock-model"}
        await gw.store.put_model(ALIAS, [backend], version="step-0")
        async with gw.http() as admin:
            response = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={})
    assert response.status_code == 502
    assert "VLLM_SERVER_DEV_MODE=1" in response.json()["error"]["message"]
    assert (await gw.store.get_model(ALIAS)).version == "step-0"


async def test_the_python_clients_drive_both_forms(gw: RunningGateway, mock: MockBackendProcess) -> None:
    async with AsyncRollwayClient(gw.url) as client:
        done = await client.update_weights(ALIAS, "step-1", note="from python")
        assert (done.state, done.to_version, done.note) == ("committed", "step-1", "from python")
        mock.add_faults({"kind": "status", "status": 503, "match": {"path": "/pause"}})
        with pytest.raises(WeightUpdateFailed) as failed:
            await client.update_weights(ALIAS)
        assert failed.value.status == 502 and failed.value.update.state == "failed"
        assert failed.value.update.to_version == "step-2" and "pause answered 503" in (failed.value.update.error or "")
        begun = await client.begin_update(ALIAS, "step-2")
        assert (await client.get_model(ALIAS)).state.updating == begun.update_id
        aborted = await client.abort_update(begun.update_id, "the trainer crashed")
        assert (aborted.state, aborted.error) == ("aborted", "the trainer crashed")
        assert (await client.get_model(ALIAS)).version == "step-1"
        listed = await client.list_updates(ALIAS)
        assert [u.state for u in listed] == ["aborted", "failed", "committed"]

    def synchronous() -> tuple[WeightUpdate, WeightUpdate]:  # in a thread: this loop serves the gateway
        with RollwayClient(gw.url) as sync:
            return sync.get_update(done.update_id), sync.update_weights(ALIAS, "step-3")

    again, third = await asyncio.to_thread(synchronous)
    assert again == done and third.state == "committed"


async def test_an_engine_whose_own_version_differs_is_flagged(tmp_path: Path, mock: MockBackendProcess) -> None:
    """Rollway asks each engine for its weight version and shows how it compares with the recorded one: ``unset``
    for an engine never given one, ``match`` after an update, ``mismatch`` once something else changed it."""
    backend = {"backend_id": "a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    async with running_gateway(tmp_path, version_check_interval=0.05) as gw, gw.http() as admin:
        await gw.store.put_model(ALIAS, [backend], version="step-0")

        async def seen(state: str) -> dict[str, Any]:
            deadline = time.monotonic() + 10
            while True:  # the watch's next round: no event tells a client it ran
                found = (await admin.get(f"/admin/v1/models/{ALIAS}")).json()["engine_versions"].get("a")
                if found is not None and found["state"] == state:
                    return dict(found)
                assert time.monotonic() < deadline, found
                await asyncio.sleep(0.05)

        assert (await seen("unset"))["reported"] == "default"
        committed = await admin.post(f"/admin/v1/models/{ALIAS}/updates", json={"version": "step-1"}, timeout=30)
        assert committed.status_code == 200, committed.text
        assert (await seen("match"))["reported"] == "step-1"
        async with httpx.AsyncClient() as engine:  # the engine's version changed behind Rollway's back
            await engine.post(f"{mock.base_url.removesuffix('/v1')}/update_weight_version", json={"new_version": "x"})
        differs = await seen("mismatch")
        assert (differs["reported"], differs["expected"]) == ("x", "step-1")
        scraped = (await admin.get("/metrics")).text
        assert 'rollway_engine_version_mismatch{alias="policy",backend="a"} 1.0' in scraped
