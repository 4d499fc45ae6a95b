"""Several backends behind one alias, end to end: the official openai SDK (or httpx) → a real gateway → the mock
backend. Each backend of the alias names a model of its own on the one mock process, so that a fault can target
one backend. Covered: 429s with ``Retry-After`` on every backend, ``max_concurrency`` as a cap (calls wait for a
slot, then 429), and the version of the backend that served a call in its span and in the exports.

The mock's long-polls (``stats(wait_...)``) run in a thread: the gateway serves in this test's event loop."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rollway.mock import MockBackendProcess
from support.clock import FakeClock
from support.gateway_harness import RunningGateway, claim_one, vllm
from support.gateway_harness import serving_policy as gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 17 + 25?"}]
ENVELOPE_KEYS = {"message", "type", "param", "code"}


def backend(mock: MockBackendProcess, name: str, **extra: Any) -> dict[str, Any]:
    """Backend ``name`` of the alias: the mock, asked for model ``model-<name>`` (what a fault can match)."""
    return vllm(mock, name, model=f"model-{name}", **extra)


async def stats(mock: MockBackendProcess, **wait: Any) -> dict[str, Any]:
    return await asyncio.to_thread(mock.stats, **wait)


async def post(gw: RunningGateway, path: str = "/v1/chat/completions", timeout: float = 20) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as http:
        return await http.post(f"{gw.url}{path}", json={"model": "policy", "messages": MESSAGES, "max_tokens": 4})


async def scrape(gw: RunningGateway) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{gw.url}/metrics")
    assert response.status_code == 200, response.text
    return response.text


async def warm(gw: RunningGateway) -> None:
    """One call first, so that the timed ones do not pay for the first connections."""
    assert (await post(gw)).status_code == 200


def on_fake_time(gw: RunningGateway, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The gateway's retry waits on a clock of the test's: each wait is recorded and passes at once."""
    clock = FakeClock()
    monkeypatch.setattr(gw.state.gateway, "clock", clock)
    monkeypatch.setattr(gw.state.gateway, "sleep", clock.sleep)
    return clock


def track_outstanding(gw: RunningGateway, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every try's count of tries in flight to its backend, as it starts."""
    router = gw.state.router
    seen: list[int] = []
    started = router.begin_try

    def counting(backend_id: str) -> None:
        started(backend_id)
        seen.append(router.health(backend_id).outstanding)

    monkeypatch.setattr(router, "begin_try", counting)
    return seen


# -- Retry-After when the alias has several backends ------------------------------------------------------


async def test_when_every_backend_asks_to_wait_the_call_waits_for_the_first_to_be_ready(
    tmp_path: Path, mock: MockBackendProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both backends answer 429 with Retry-After (1 s and 2 s): the call goes from the first to the second at
    once, then waits the shorter wait, 1 s, and is served by the backend that asked for it (not re-sent within
    milliseconds to a backend that had asked for seconds)."""
    async with gateway(tmp_path, backend(mock, "a"), backend(mock, "b")) as gw:
        rollout_id, _ = await claim_one(gw.store)
        await warm(gw)
        clock = on_fake_time(gw, monkeypatch)
        mock.add_faults(
            {"kind": "rate_limit", "retry_after": 1, "match": "model-a"},
            {"kind": "rate_limit", "retry_after": 2, "match": "model-b"},
        )
        response = await post(gw, f"/rollout/{rollout_id}/v1/chat/completions")
        assert response.status_code == 200, response.text
        assert clock.slept == [1.0]
        assert (await stats(mock))["by_status"] == {"200": 2, "429": 2}
        assert await gw.state.registry.drain("policy", 10)
        [span] = await gw.store.query_spans(rollout_id)
        assert span.status.status_code == "OK"
        assert span.attributes["rollway.retry_count"] == 2
        assert span.attributes["rollway.backend_id"] == "a"


async def test_a_429_fails_over_at_once_to_a_backend_not_asking_to_wait(
    tmp_path: Path, mock: MockBackendProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with gateway(tmp_path, backend(mock, "a"), backend(mock, "b")) as gw:
        await warm(gw)
        clock = on_fake_time(gw, monkeypatch)
        mock.add_faults({"kind": "rate_limit", "retry_after": 5, "match": "model-a", "times": None})
        for _ in range(3):  # whichever backend least-outstanding picks first: served by b, without waiting
            response = await post(gw)
            assert response.status_code == 200, response.text
        assert clock.slept == []
        assert await gw.state.registry.drain("policy", 10)
        spans = await gw.store.query_spans(None)
        assert [s.attributes["rollway.backend_id"] for s in spans][1:] == ["b", "b", "b"]


async def test_a_wait_past_the_rollouts_deadline_is_not_waited_for(
    tmp_path: Path, mock: MockBackendProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backend asks for 3 s and the rollout has 1 s left: the client gets the backend's 429 (with its
    Retry-After) at once, not a 504 after the deadline."""
    async with gateway(tmp_path, backend(mock, "a"), backend(mock, "b")) as gw:
        await gw.store.enqueue([{"input": {"task": "t"}, "config": {"timeout_seconds": 1.0}}])
        [claimed] = await gw.store.claim("worker-1")
        rollout_id = claimed.rollout.rollout_id
        await warm(gw)
        clock = on_fake_time(gw, monkeypatch)
        mock.add_faults({"kind": "rate_limit", "retry_after": 3, "times": None})
        response = await post(gw, f"/rollout/{rollout_id}/v1/chat/completions")
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "3"
        assert clock.slept == []
        assert (await stats(mock))["by_status"] == {"200": 1, "429": 2}


# -- max_concurrency is a cap ---------------------------------------------------------------------------


async def test_max_concurrency_is_a_cap_calls_wait_for_a_slot(
    tmp_path: Path, mock: MockBackendProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One backend with max_concurrency 1 and three calls at once: they are served one after the other (never
    two tries in flight to it), all of them successfully."""
    async with gateway(tmp_path, backend(mock, "a", max_concurrency=1), pause_wait_seconds=10) as gw:
        seen = track_outstanding(gw, monkeypatch)
        mock.add_faults({"kind": "delay", "ms": 150, "times": None})
        responses = await asyncio.gather(*(post(gw) for _ in range(3)))
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert seen == [1, 1, 1]
        starts = sorted(r["at"] for r in await asyncio.to_thread(mock.requests, path="/v1/chat/completions"))
        assert all(later - earlier >= 0.14 for earlier, later in itertools.pairwise(starts)), starts


async def test_a_call_that_finds_every_backend_full_too_long_gets_a_429_and_a_span(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """Two capped backends, both busy (their calls hang): a third call waits up to the pause bound, then gets a
    429 ``model_busy`` with Retry-After, in the envelope, recorded as an error span; it never reached a backend."""
    capped = [backend(mock, "a", max_concurrency=1), backend(mock, "b", max_concurrency=1)]
    async with gateway(tmp_path, *capped, pause_wait_seconds=0.3) as gw:
        mock.add_faults({"kind": "hang", "times": 2})
        hanging = [asyncio.create_task(post(gw)) for _ in range(2)]
        await stats(mock, wait_requests=2, timeout=10)
        rollout_id, _ = await claim_one(gw.store)
        started = time.monotonic()
        response = await post(gw, f"/rollout/{rollout_id}/v1/chat/completions")
        assert 0.25 <= time.monotonic() - started < 2
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        assert set(error) == ENVELOPE_KEYS
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "model_busy"
        assert int(response.headers["retry-after"]) >= 1
        assert (await stats(mock))["requests_total"] == 2
        [span] = await gw.store.query_spans(rollout_id)
        assert response.headers["x-rollway-sequence-id"] == str(span.sequence_id)
        assert span.status.status_code == "ERROR"
        assert span.attributes["http.response.status_code"] == 429
        assert span.attributes["error.type"] == "model_busy"
        assert span.attributes["rollway.backend_id"] is None
        metrics = await scrape(gw)
        busy = 'rollway_request_errors_total{alias="policy",error_type="model_busy",route="/v1/chat/completions"}'
        assert f"{busy} 1.0" in metrics
        assert 'rollway_requests_waiting{alias="policy"} 0.0' in metrics
        for task in hanging:
            task.cancel()
        await asyncio.gather(*hanging, return_exceptions=True)
        assert await gw.state.registry.drain("policy", 10)


async def test_a_client_that_leaves_while_waiting_for_a_slot_leaves_the_queue(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A call waiting for the only slot is abandoned by its client: its span says cancelled, and once the busy
    call ends the slot goes to the next call (not to the one that left)."""
    async with gateway(tmp_path, backend(mock, "a", max_concurrency=1), pause_wait_seconds=30) as gw:
        mock.add_faults({"kind": "hang", "times": 1})
        busy = asyncio.create_task(post(gw))
        await stats(mock, wait_requests=1, timeout=10)
        rollout_id, _ = await claim_one(gw.store)
        with pytest.raises(httpx.ReadTimeout):
            await post(gw, f"/rollout/{rollout_id}/v1/chat/completions", timeout=0.5)
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        response = await post(gw)
        assert response.status_code == 200, response.text
        assert await gw.state.registry.drain("policy", 10)
        [left] = await gw.store.query_spans(rollout_id)
        assert left.attributes["rollway.cancelled"] is True
        assert left.attributes["rollway.backend_id"] is None
        assert (await stats(mock))["requests_total"] == 2
        assert gw.state.router.waiting() == 0 and gw.state.router.health("a").outstanding == 0


async def test_a_retry_that_finds_no_slot_fails_with_the_backends_error_not_model_busy(
    tmp_path: Path, mock: MockBackendProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first try gets a 503, and while the call backs off another call takes the only slot: the retry waits
    up to the bound, then the call ends with the backend's 503 (what it failed of), not a 429 model_busy."""
    async with gateway(
        tmp_path, backend(mock, "a", max_concurrency=1), pause_wait_seconds=0.3, upstream_retries=2, retry_max_wait=0.05
    ) as gw:
        router = gw.state.router
        finished = router.end_try

        def taken_again(backend_id: str, *, ok: bool, counts_as_failure: bool) -> None:
            finished(backend_id, ok=ok, counts_as_failure=counts_as_failure)
            if not ok:
                router.begin_try(backend_id)  # another call's try takes the slot at once

        monkeypatch.setattr(router, "end_try", taken_again)
        mock.add_faults({"kind": "status", "status": 503, "times": 1})
        response = await post(gw)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["message"] == "mock: injected status 503"
        assert (await stats(mock))["requests_total"] == 1


# -- the version of the backend that served the call ------------------------------------------------------


async def test_a_span_records_the_version_of_the_backend_that_served_it(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A backend with a version of its own: its calls' spans (and the triplets exported from them) carry that
    version; a backend without one serves under the alias's version."""
    async with gateway(tmp_path, backend(mock, "a", version="ckpt-7")) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        await gw.store.put_model("policy", [backend(mock, "b")], version="v2")
        gw.state.registry.invalidate("policy")
        later: list[ChatCompletionMessageParam] = [
            *MESSAGES,
            {"role": "assistant", "content": "42"},
            {"role": "user", "content": "And 18 + 25?"},
        ]
        await client.chat.completions.create(model="policy", messages=later, max_tokens=4)
        assert await gw.state.registry.drain("policy", 10)
        spans = await gw.store.query_spans(rollout_id)
        assert [(s.attributes["rollway.backend_id"], s.attributes["rollway.model_version"]) for s in spans] == [
            ("a", "ckpt-7"),
            ("b", "v2"),
        ]
        async with httpx.AsyncClient(base_url=f"{gw.url}/admin/v1", timeout=30) as admin:
            ended = await admin.patch(f"/rollouts/{rollout_id}/attempts/latest", json={"status": "succeeded"})
            assert ended.status_code == 200, ended.text
            triplets = (await admin.get("/triplets", params={"rollout_id": rollout_id})).json()["items"]
        assert [t["model_version"] for t in triplets] == ["ckpt-7", "v2"]
