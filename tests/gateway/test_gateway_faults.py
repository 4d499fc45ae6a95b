"""Resilience, end to end: the official openai SDK (or httpx) → a real gateway → the mock backend with scripted
faults. Retries and failover happen only before the first byte reached the client; every call leaves exactly
one span, also when it fails or is cancelled; a client that leaves cancels the backend's request at once.

The mock's long-polls (``mock.stats(wait_...)``) are blocking calls: they run in a thread, so the gateway, which
serves in this test's event loop, keeps working meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from rollway.mock import MockBackendProcess
from rollway.store.db import writer as store_writer
from support.gateway_harness import RunningGateway, claim_one, closed_port, vllm
from support.gateway_harness import serving_policy as gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story about a dragon."}]
LONG = {"ignore_eos": True}  # the mock then answers exactly max_tokens tokens
ENVELOPE_KEYS = {"message", "type", "param", "code"}


def parse(metrics: str) -> list[Any]:
    return [sample for family in text_string_to_metric_families(metrics) for sample in family.samples]


async def stats(mock: MockBackendProcess, **wait: Any) -> dict[str, Any]:
    """``mock.stats`` off the event loop (its long-poll must not stop the gateway serving in this loop)."""
    return await asyncio.to_thread(mock.stats, **wait)


async def one_span(gw: RunningGateway, rollout_id: str | None) -> Any:
    """The call's only span, once the gateway is done with every call of the alias (the lease is released
    after the span is written, so a drain is the event to wait on)."""
    assert await gw.state.registry.drain("policy", 10)
    [span] = await gw.store.query_spans(rollout_id)
    return span


def assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize("stream", [False, True])
async def test_5xx_then_success_is_retried_into_one_span(
    tmp_path: Path, mock: MockBackendProcess, stream: bool
) -> None:
    async with gateway(tmp_path, vllm(mock)) as gw:
        rollout_id, _ = await claim_one(gw.store)
        mock.add_faults({"kind": "status", "status": 503, "times": 1})
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        if stream:
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model="policy", messages=MESSAGES, max_tokens=8, stream=True
                )
            ]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            answer = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=8)
            text = answer.choices[0].message.content or ""
        assert text
        assert (await stats(mock))["by_status"] == {"503": 1, "200": 1}
        span = await one_span(gw, rollout_id)
        assert span.sequence_id == 1
        assert span.status.status_code == "OK"
        assert span.attributes["rollway.retry_count"] >= 1
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["rollway.response_token_ids"]


async def test_persistent_5xx_gives_the_backends_last_answer_and_one_span(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with gateway(tmp_path, vllm(mock), upstream_retries=2, retry_max_wait=0.05) as gw:
        mock.add_faults({"kind": "status", "status": 502, "times": None})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        error = assert_envelope(response, 502)
        assert error["message"] == "mock: injected status 502"  # the backend's own body, passed on
        assert (await stats(mock))["by_status"] == {"502": 3}
        span = await one_span(gw, None)
        assert span.status.status_code == "ERROR"
        assert span.attributes["rollway.retry_count"] == 2
        assert span.attributes["http.response.status_code"] == 502
        assert len(response.headers.get_list("content-type")) == 1  # the backend's, not also the gateway's
        assert response.headers["x-rollway-sequence-id"] == str(span.sequence_id)


async def test_one_backend_down_all_calls_succeed_via_the_other(tmp_path: Path, mock: MockBackendProcess) -> None:
    dead = {"backend_id": "dead", "base_url": f"http://127.0.0.1:{closed_port()}/v1", "kind": "vllm", "model": "m"}
    async with gateway(tmp_path, dead, vllm(mock, "alive")) as gw:
        rollouts = [await claim_one(gw.store) for _ in range(4)]
        clients = [gw.client(f"{gw.url}/rollout/{r}/v1") for r, _ in rollouts]

        async def one(i: int) -> str:
            answer = await clients[i % 4].chat.completions.create(
                model="policy", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=4
            )
            return answer.choices[0].message.content or ""

        answers = await asyncio.gather(*(one(i) for i in range(20)))
        assert all(answers)
        assert (await stats(mock))["by_status"] == {"200": 20}
        assert await gw.state.registry.drain("policy", 10)
        spans = [s for r, _ in rollouts for s in await gw.store.query_spans(r)]
        assert len(spans) == 20
        assert {s.attributes["rollway.backend_id"] for s in spans} == {"alive"}
        assert all(s.status.status_code == "OK" for s in spans)
        assert not gw.state.router.is_up("dead")  # passively ejected


async def test_a_backend_that_cannot_be_reached_is_said_in_the_os_words_without_its_address(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    port = closed_port()
    dead = {"backend_id": "dead", "base_url": f"http://127.0.0.1:{port}/v1", "kind": "vllm", "model": "m"}
    async with gateway(tmp_path, dead) as gw:
        client = gw.client()
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    message = info.value.message
    assert "cannot reach backend 'dead': Connection refused" in message
    assert str(port) not in message and "127.0.0.1" not in message


async def test_connect_timeout_fails_over(tmp_path: Path, mock: MockBackendProcess) -> None:
    """A backend that accepts no connection at all (its accept queue is full, so SYNs are dropped) costs one
    connect timeout, then the call fails over instead of ending in a 504."""
    blackhole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    port = blackhole.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):  # fill the accept queue; later connects hang
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.settimeout(0.3)
        try:
            probe.connect(("127.0.0.1", port))
            pytest.skip("this kernel accepts connections beyond a full accept queue: no blackhole on loopback")
        except TimeoutError:
            pass
        finally:
            probe.close()
        hole = {"backend_id": "hole", "base_url": f"http://127.0.0.1:{port}/v1", "kind": "vllm", "model": "m"}
        async with gateway(tmp_path, hole, vllm(mock, "alive"), connect_timeout=0.3) as gw:
            client = gw.client()
            for i in range(4):
                answer = await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4
                )
                assert answer.choices[0].message.content
            assert await gw.state.registry.drain("policy", 10)
            spans = await gw.store.query_spans(None)
            assert {s.attributes["rollway.backend_id"] for s in spans} == {"alive"}
    finally:
        for filler in fillers:
            filler.close()
        blackhole.close()


async def test_429_retry_after_is_honoured(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, vllm(mock)) as gw:
        client = gw.client()
        await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)  # warm
        mock.add_faults({"kind": "rate_limit", "retry_after": 1})
        started = time.monotonic()
        answer = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        elapsed = time.monotonic() - started
        assert answer.choices[0].message.content
        assert 0.95 <= elapsed < 2.5, elapsed
        assert (await stats(mock))["by_status"] == {"200": 2, "429": 1}
        assert await gw.state.registry.drain("policy", 10)
        spans = await gw.store.query_spans(None)
        assert [s.attributes["rollway.retry_count"] for s in spans] == [0, 1]
        assert spans[1].status.status_code == "OK"


async def test_backend_drops_mid_stream_client_gets_an_error_event(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, vllm(mock)) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        mock.add_faults({"kind": "drop_mid_stream", "after_chunks": 5})
        received: list[Any] = []
        stream = await client.chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=20, stream=True, extra_body=LONG
        )
        with pytest.raises(openai.APIError) as info:
            async with stream:
                async for chunk in stream:
                    received.append(chunk)
        assert info.value.body == {
            "message": "the backend stream broke: ClientPayloadError",
            "type": "upstream_error",
            "param": None,
            "code": "stream_interrupted",
        }
        assert 1 <= len(received) <= 5
        span = await one_span(gw, rollout_id)
        assert span.status.status_code == "ERROR"
        assert span.attributes["error.type"] == "stream_interrupted"
        token_ids = span.attributes["rollway.response_token_ids"]
        assert token_ids and len(token_ids) < 20  # what arrived before the drop, no more
        text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
        assert span.attributes["rollway.response"]["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_client_abort_cancels_the_backend_request_and_the_span_says_so(
    tmp_path: Path, mock: MockBackendProcess, how: str
) -> None:
    async with gateway(tmp_path, vllm(mock)) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        slow = LONG | {"mock": {"token_delay_ms": 50}}  # 200 tokens: ~10 s if nobody stops it
        three = asyncio.Event()

        async def consume() -> int:
            seen = 0
            stream = await client.chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=200, stream=True, extra_body=slow
            )
            async with stream:
                async for _ in stream:
                    seen += 1
                    if seen == 3:
                        three.set()
                        if how == "close":
                            break
            return seen

        task = asyncio.create_task(consume())
        await asyncio.wait_for(three.wait(), 10)
        if how == "cancel":
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            assert await task == 3
        aborted = time.monotonic()
        seen = await stats(mock, wait_cancelled=1, timeout=2)
        assert time.monotonic() - aborted < 1.0
        [cancelled] = seen["cancelled"]
        assert cancelled["stage"] == "streaming"
        span = await one_span(gw, rollout_id)
        assert span.attributes["rollway.cancelled"] is True
        assert span.status.status_code == "ERROR"
        assert span.attributes["error.type"] == "cancelled"
        assert 2 <= len(span.attributes["rollway.response_token_ids"]) < 200


async def test_non_streaming_client_disconnect_cancels_the_hanging_backend(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with gateway(tmp_path, vllm(mock)) as gw:
        rollout_id, _ = await claim_one(gw.store)
        mock.add_faults({"kind": "hang"})
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1", timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        # The gateway's read timeout is minutes away: a cancel within seconds is the disconnect's.
        left = time.monotonic()
        seen = await stats(mock, wait_cancelled=1, timeout=5)
        assert time.monotonic() - left < 5
        assert [c["stage"] for c in seen["cancelled"]] == ["hang"]
        span = await one_span(gw, rollout_id)
        assert span.attributes["rollway.cancelled"] is True
        assert span.status.status_code == "ERROR"


@pytest.mark.parametrize("stream", [False, True])
async def test_read_timeout_before_the_answer_is_a_504(tmp_path: Path, mock: MockBackendProcess, stream: bool) -> None:
    async with gateway(tmp_path, vllm(mock), read_timeout=0.5) as gw:
        mock.add_faults({"kind": "hang"})
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(
                f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES, "stream": stream}
            )
        assert 0.45 <= time.monotonic() - started < 3
        error = assert_envelope(response, 504)
        assert error["type"] == "timeout"
        assert response.headers["content-type"] == "application/json"
        assert [c["stage"] for c in (await stats(mock, wait_cancelled=1, timeout=2))["cancelled"]] == ["hang"]
        span = await one_span(gw, None)
        assert span.status.status_code == "ERROR"
        assert span.attributes["http.response.status_code"] == 504
        assert response.headers["x-rollway-sequence-id"] == str(span.sequence_id)


async def test_the_rollouts_deadline_cuts_a_hung_call_short(tmp_path: Path, mock: MockBackendProcess) -> None:
    """A rollout with ``timeout_seconds``: its calls end at the attempt's start + timeout (504), well before the
    gateway's own read timeout, and the backend's request is cancelled."""
    async with gateway(tmp_path, vllm(mock), read_timeout=30) as gw:
        await gw.store.enqueue([{"input": {"task": "t"}, "config": {"timeout_seconds": 1.0}}])
        [claimed] = await gw.store.claim("worker-1")
        rollout_id, attempt_id = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        deadline = claimed.attempt.start_time + 1.0
        mock.add_faults({"kind": "hang"})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(
                f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions",
                json={"model": "policy", "messages": MESSAGES},
            )
        ended = time.time()
        error = assert_envelope(response, 504)
        assert error["type"] == "timeout"
        assert deadline - 0.05 <= ended < deadline + 2  # at the deadline, not at the 30 s read timeout
        assert [c["stage"] for c in (await stats(mock, wait_cancelled=1, timeout=2))["cancelled"]] == ["hang"]
        span = await one_span(gw, rollout_id)
        assert span.attempt_id == attempt_id and span.attributes["http.response.status_code"] == 504


async def test_read_timeout_mid_stream_ends_the_stream_with_an_error_event(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with gateway(tmp_path, vllm(mock), read_timeout=0.5) as gw:
        mock.add_faults({"kind": "stall_mid_stream", "after_chunks": 3})
        client = gw.client()
        received: list[Any] = []
        stream = await client.chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=20, stream=True, extra_body=LONG
        )
        with pytest.raises(openai.APIError) as info:
            async with stream:
                async for chunk in stream:
                    received.append(chunk)
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "stream_interrupted"
        assert len(received) == 3
        assert [c["stage"] for c in (await stats(mock, wait_cancelled=1, timeout=2))["cancelled"]] == ["stalled"]
        span = await one_span(gw, None)
        assert span.status.status_code == "ERROR"
        assert 1 <= len(span.attributes["rollway.response_token_ids"]) < 20


@pytest.mark.parametrize(("kind", "status"), [("stall_mid_stream", 504), ("drop_mid_stream", 502)])
async def test_broken_non_streamed_body_is_an_envelope_not_a_500(
    tmp_path: Path, mock: MockBackendProcess, kind: str, status: int
) -> None:
    """The backend sent its headers and half a JSON body, then stalled (read timeout) or dropped the
    connection: nothing reached the client yet, so it gets a clean gateway error in the envelope."""
    async with gateway(tmp_path, vllm(mock), read_timeout=0.5) as gw:
        mock.add_faults({"kind": kind, "times": 4 if kind == "drop_mid_stream" else 1})  # drop: every try
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert_envelope(response, status)
        span = await one_span(gw, None)
        assert span.status.status_code == "ERROR"
        assert span.attributes["http.response.status_code"] == status
        # a body that broke off was tried again (nothing had reached the client); a stalled one was not
        assert span.attributes["rollway.retry_count"] == (3 if kind == "drop_mid_stream" else 0)
        answer = await gw.client().chat.completions.create(model="policy", messages=MESSAGES)
        assert answer.choices  # and the gateway keeps serving


async def test_a_whole_answer_whose_body_broke_off_is_retried(tmp_path: Path, mock: MockBackendProcess) -> None:
    """The backend dropped the connection halfway through a non-streamed answer: nothing reached the client, so
    the call is tried again like a dropped connection, and the client gets the next try's answer; one span."""
    async with gateway(tmp_path, vllm(mock)) as gw:
        mock.add_faults({"kind": "drop_mid_stream", "times": 1})
        answer = await gw.client().chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        assert answer.choices[0].message.content
        assert (await stats(mock))["requests_total"] == 2
        span = await one_span(gw, None)
        assert (span.status.status_code, span.attributes["rollway.retry_count"]) == ("OK", 1)


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_400_is_passed_through_unchanged(tmp_path: Path, mock: MockBackendProcess, stream: bool) -> None:
    body = {
        "error": {"message": "max_tokens is too large: 99999", "type": "BadRequestError", "param": "x", "code": 400}
    }
    async with gateway(tmp_path, vllm(mock)) as gw:
        mock.add_faults({"kind": "status", "status": 400, "body": body, "headers": {"x-backend": "1"}, "times": 3})
        request = {"model": "policy", "messages": MESSAGES, "stream": stream}
        async with httpx.AsyncClient(timeout=10) as http:
            direct = await http.post(f"{mock.base_url}/chat/completions", json=request | {"model": "mock-model"})
            response = await http.post(f"{gw.url}/v1/chat/completions", json=request)
        assert direct.status_code == 400
        assert response.status_code == 400
        assert response.content == direct.content
        assert response.json() == body
        with pytest.raises(openai.BadRequestError) as info:
            await gw.client().chat.completions.create(model="policy", messages=MESSAGES, stream=stream)
        assert info.value.body == body["error"]
        assert (await stats(mock))["by_status"] == {"400": 3}
        assert await gw.state.registry.drain("policy", 10)
        spans = await gw.store.query_spans(None)
        assert [s.attributes["http.response.status_code"] for s in spans] == [400, 400]
        assert spans[0].attributes["rollway.error"] == direct.text
        assert all(s.status.status_code == "ERROR" and s.attributes["rollway.retry_count"] == 0 for s in spans)


@pytest.mark.parametrize(("api", "stream"), [("chat", False), ("chat", True), ("responses", True)])
async def test_a_completion_the_store_could_not_record_is_not_handed_over(
    tmp_path: Path,
    mock: MockBackendProcess,
    api: str,
    stream: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A completion that reached the client is on disk (docs/gateway.md). When the span cannot be written (here the
    database stays locked by another process past the store's wait), the client gets a 503 envelope, or its
    stream ends with an error event instead of ``[DONE]`` (or ``response.completed``); the loss is counted."""
    monkeypatch.setattr(store_writer, "LOCK_WAIT_SECONDS", 0.5)  # the wait for the lock: 30 s by default
    async with gateway(tmp_path, vllm(mock)) as gw:
        rollout_id, _ = await claim_one(gw.store)
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        received: list[Any] = []

        async def call() -> None:
            if not stream:
                await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=8)
                return
            if api == "responses":
                events: Any = await client.responses.create(
                    model="policy", input="Tell me a story.", max_output_tokens=8, stream=True
                )
            else:
                events = await client.chat.completions.create(
                    model="policy", messages=MESSAGES, max_tokens=8, stream=True
                )
            async with events:
                async for event in events:
                    received.append(event)

        mock.configure(hold=True)  # the answer waits at the backend until the database is locked
        task = asyncio.create_task(call())
        await stats(mock, wait_requests=1)  # admitted (its sequence id is committed) and at the backend
        with contextlib.closing(sqlite3.connect(tmp_path / "gateway.db", isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")  # another process writing, for longer than the store waits
            await asyncio.to_thread(mock.configure, hold=False)
            with pytest.raises(openai.APIError) as info:
                await task
            other.execute("ROLLBACK")
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "not_recorded"
        if stream:
            assert received and not isinstance(info.value, openai.APIStatusError)  # the error came as an event
            assert not any(getattr(e, "type", "") == "response.completed" for e in received)
        else:
            assert isinstance(info.value, openai.APIStatusError) and info.value.status_code == 503
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{gw.url}/metrics")).text
        assert "rollway_spans_unwritten_total 1.0" in metrics
        # counted as what the client got: a 503 (or, streamed, a 200 that ended in an error), not a success
        route, status = "/v1/responses" if api == "responses" else "/v1/chat/completions", "200" if stream else "503"
        counted = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse(metrics) if s.value}
        labels = (("alias", "policy"), ("backend", "mock-a"), ("route", route), ("status", status))
        assert {k: v for k, v in counted.items() if k[0] == "rollway_requests_total"} == {
            ("rollway_requests_total", labels): 1.0
        }
        errors = (("alias", "policy"), ("error_type", "not_recorded"), ("route", route))
        assert counted[("rollway_request_errors_total", errors)] == 1.0
        # logged once each, in one line without a traceback: the database's failure (the store), the call with its
        # ids and why
        [lost] = [r for r in caplog.records if r.name == "rollway.gateway"]
        assert rollout_id in lost.getMessage() and "database is locked" in lost.getMessage()
        assert lost.exc_info is None
        [failed] = [r for r in caplog.records if r.name == "rollway.store" and "write failed" in r.getMessage()]
        assert "database is locked" in failed.getMessage() and failed.exc_info is None
        # The store serves again once the lock is gone; the lost call left no span (its sequence id stays used).
        answer = await client.chat.completions.with_raw_response.create(model="policy", messages=MESSAGES, max_tokens=4)
        assert answer.headers["x-rollway-sequence-id"] == "2"
        assert [s.sequence_id for s in await gw.store.query_spans(rollout_id)] == [2]


async def test_a_stream_event_that_is_not_json_is_passed_on_and_the_call_goes_on(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with gateway(tmp_path, vllm(mock)) as gw:
        rollout_id, _ = await claim_one(gw.store)
        mock.add_faults({"kind": "garbage_event", "after_chunks": 3, "body": "{not json"})
        body = {"model": "policy", "messages": MESSAGES, "max_tokens": 12, "stream": True, **LONG}
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/rollout/{rollout_id}/v1/chat/completions", json=body)
        assert response.status_code == 200
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert "{not json" in events and events[-1] == "[DONE]"  # passed on where it came; the stream finished
        span = await one_span(gw, rollout_id)
        assert span.status.status_code == "OK"
        assert len(span.attributes["rollway.response_token_ids"]) == 12  # every token, before and after it


async def test_a_streamed_request_answered_with_one_json_body_gets_that_body(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """The backend answers ``stream: true`` with plain JSON (the mock, like vLLM, does for embeddings)."""
    async with gateway(tmp_path, vllm(mock)) as gw, httpx.AsyncClient(timeout=10) as http:
        body = {"model": "policy", "input": "hello", "stream": True}
        direct = await http.post(f"{mock.url}/v1/embeddings", json={**body, "model": "mock-model"})
        assert direct.headers["content-type"].startswith("application/json")
        response = await http.post(f"{gw.url}/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["data"] == direct.json()["data"]
        span = await one_span(gw, None)
        assert span.status.status_code == "OK"


async def test_a_backend_answer_that_is_not_a_json_object_is_a_502(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, vllm(mock)) as gw:
        mock.add_faults({"kind": "status", "status": 200, "body": "not an object"})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        error = assert_envelope(response, 502)
        assert (error["type"], error["code"]) == ("upstream_error", "bad_response")
        span = await one_span(gw, None)
        assert span.status.status_code == "ERROR"
        assert span.attributes["http.response.status_code"] == 502
        assert (await gw.client().chat.completions.create(model="policy", messages=MESSAGES)).choices


@pytest.mark.parametrize("stream", [False, True])
async def test_a_backend_redirect_is_not_followed_and_is_a_502_that_names_it(
    tmp_path: Path, mock: MockBackendProcess, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Following a redirect would post the agent's body, and the backend's key, wherever it points; a loop of
    them ended in a 500. The 3xx is a 502 naming the status and the target's host (never its path or query),
    sent once, and the call's span records it."""
    looping = f"{mock.base_url}/chat/completions?token=s3cr3t-signed"  # back to itself: a loop if followed
    async with gateway(tmp_path, vllm(mock, api_key="sk-backend-key")) as gw:
        rollout_id, _ = await claim_one(gw.store)
        mock.add_faults({"kind": "status", "status": 307, "headers": {"Location": looping}, "times": None})
        async with httpx.AsyncClient(timeout=10) as http:
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 4, "stream": stream}
            response = await http.post(f"{gw.url}/rollout/{rollout_id}/v1/chat/completions", json=body)
        error = assert_envelope(response, 502)
        assert (error["type"], error["code"]) == ("upstream_error", "upstream_redirect")
        assert error["message"] == (
            "backend 'mock-a' answered 307 with a redirect to host '127.0.0.1'; the gateway does not follow redirects"
        )
        assert "s3cr3t" not in response.text and "sk-backend-key" not in response.text
        assert (await stats(mock))["by_status"] == {"307": 1}  # sent once, not re-posted, not retried
        span = await one_span(gw, rollout_id)
        assert span.status.status_code == "ERROR"
        assert span.attributes["http.response.status_code"] == 502
        assert span.attributes["error.type"] == "upstream_redirect"
        assert orjson.loads(span.attributes["rollway.error"])["error"]["message"] == error["message"]
        mock.reset()
        mock.add_faults({"kind": "status", "status": 302, "headers": {"Location": "/elsewhere?key=s3cr3t"}})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        error = assert_envelope(response, 502)
        assert "answered 302 with a redirect to another path" in error["message"] and "s3cr3t" not in response.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
