"""Slow, stuck and misbehaving peers, end to end (a real gateway in this loop, the mock backend process, raw
sockets as clients): a call always ends within its bounds, gives back its backend slot and alias lease, and
leaves its span; the gateway keeps serving the others."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.settings import Settings
from rollway.store import Store
from support.gateway_harness import RunningGateway, claim_one, vllm
from support.gateway_harness import serving_policy as gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story about a dragon."}]


async def stats(mock: MockBackendProcess, **wait: Any) -> dict[str, Any]:
    return await asyncio.to_thread(mock.stats, **wait)


class RawClient:
    """An HTTP/1.1 client on a raw socket with a tiny receive buffer, that reads only when told: an agent that
    stops reading without closing (suspended, blocked) is one that sends its request and is never asked to read."""

    def __init__(self, gw: RunningGateway) -> None:
        host, port = gw.url.removeprefix("http://").split(":")
        self.address = (host, int(port))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
        self.sock.setblocking(False)

    async def post(self, path: str, body: dict[str, Any], *, partial_body: bool = False) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_connect(self.sock, self.address)
        data = orjson.dumps(body)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.address[0]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        await loop.sock_sendall(self.sock, head + (data[: len(data) // 2] if partial_body else data))

    async def read_to_end(self, timeout: float) -> bytes:
        """Everything until the gateway closes the connection (TimeoutError if it does not)."""
        loop = asyncio.get_running_loop()
        chunks = []
        async with asyncio.timeout(timeout):
            while chunk := await loop.sock_recv(self.sock, 1 << 16):
                chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


async def test_a_client_that_stops_reading_a_stream_ends_its_call_after_the_write_timeout(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A suspended agent's stream: the gateway does not pile the answer up (the backend is held back by flow
    control), and after ``ROLLWAY_WRITE_TIMEOUT`` without the client taking a byte the call ends — the backend
    request closed, the backend's only slot (``max_concurrency: 1``) and the alias lease given back, the span
    written with the tokens that went by — and the connection is closed; the next call is served at once."""
    async with gateway(tmp_path, vllm(mock, max_concurrency=1), write_timeout=1.0, pause_wait_seconds=30) as gw:
        rollout_id, _ = await claim_one(gw.store)
        stalled = RawClient(gw)
        try:
            # ~3 x 20000 chunks, some 12 MB: far more than the sockets' buffers between the gateway and the client
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 20000, "n": 3, "stream": True}
            await stalled.post(f"/rollout/{rollout_id}/v1/chat/completions", body | {"ignore_eos": True})
            await stats(mock, wait_requests=1, timeout=30)  # (a loaded machine: seen over 5 s)
            assert await gw.state.registry.drain("policy", 15)  # the call ended (it would hold the drain for ever)
            [span] = await gw.store.query_spans(rollout_id)
            assert span.status.status_code == "ERROR"
            assert span.attributes["error.type"] == "client_stalled"
            assert span.status.description == "the client did not read the answer for 1 s"
            sent = span.attributes["rollway.response_token_ids"]
            assert sent and len(sent) < 20000  # what went by before the client stopped taking it
            assert gw.state.router.health("mock-a").outstanding == 0
            received = await stalled.read_to_end(10)  # what the buffers held, then the gateway's close
            assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
        finally:
            stalled.close()
        client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
        answer = await asyncio.wait_for(
            client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4), 5
        )
        assert answer.choices[0].message.content


DEADLINE = 10  # the rollout's, in the test below


async def test_a_client_that_stops_reading_is_not_waited_for_past_the_rollouts_deadline(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """The rollout's deadline bounds the wait for a reader too, when it comes before the write timeout."""
    # The gateway's writes to the client are held back after some 100 KB (its 16 KiB send buffer, the client's
    # 4 KiB window, uvicorn's buffer): a 5,000-token answer (~750 KB) is well past that, and the mock starts it at
    # once, so the deadline finds the gateway waiting on the client, not on a backend still producing the answer.
    async with gateway(tmp_path, vllm(mock), write_timeout=60, send_buffer=16384) as gw:
        await gw.store.enqueue([{"input": {"task": "t"}, "config": {"timeout_seconds": DEADLINE}}])
        [claimed] = await gw.store.claim("worker-1")
        rollout_id = claimed.rollout.rollout_id
        stalled = RawClient(gw)
        try:
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 5000, "stream": True}
            await stalled.post(f"/rollout/{rollout_id}/v1/chat/completions", body | {"ignore_eos": True})
            await stats(mock, wait_requests=1, timeout=30)  # (a loaded machine: seen over 5 s)
            assert await gw.state.registry.drain("policy", DEADLINE + 5)
            [span] = await gw.store.query_spans(rollout_id)
            assert span.attributes["error.type"] == "client_stalled"
            assert span.status.description == "the client did not read the answer before the rollout's deadline"
            assert span.end_time is not None
            assert span.end_time < claimed.attempt.start_time + DEADLINE + 1.0  # at the deadline, not 60 s later
        finally:
            stalled.close()


async def test_sigterm_ends_the_calls_still_running_after_the_shutdown_timeout_each_recorded_and_told(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """``rollway serve`` stopped (SIGTERM) with a stream and a non-streamed call that will not end on their own:
    after ``ROLLWAY_SHUTDOWN_TIMEOUT`` uvicorn cancels them; each still gets its span (the stream's with the tokens
    that went by) and its client an error (a final event for the stream, a 503 for the other), and the process
    exits by itself. Each step waits for what it needs (both calls begun at the backend, the stream's last event,
    the process's end) and when the calls ended is read from their spans, not from how long the whole stop took:
    a loaded machine makes the test slower, not wrong."""
    database_url = f"sqlite:///{tmp_path / 'gateway.db'}"
    shutdown_timeout = 1
    with GatewayProcess(database_url, env={"ROLLWAY_SHUTDOWN_TIMEOUT": str(shutdown_timeout)}) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            backend = {"backend_id": "mock-a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
            (await http.put("/admin/v1/models/policy", json={"backends": [backend]})).raise_for_status()
            mock.add_faults({"kind": "hang", "match": {"stream": False}})
            hung = asyncio.create_task(
                http.post("/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
            )
            client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            slow = {"ignore_eos": True, "mock": {"token_delay_ms": 50}}  # 400 tokens: 20 s
            stream = await client.chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=400, stream=True, extra_body=slow
            )
            stopping: asyncio.Task[int | None] | None = None
            with pytest.raises(openai.APIError) as info:
                async with stream:
                    async for _ in stream:
                        if stopping is None:
                            # The mock counts a request when it begins it: both calls are then in flight.
                            assert (await stats(mock, wait_requests=2, timeout=30))["requests_total"] == 2
                            signalled = time.time()  # (the signal itself goes a little later)
                            stopping = asyncio.create_task(asyncio.to_thread(gw.stop, 60))
            assert info.value.body is not None and info.value.body["code"] == "server_shutting_down"  # type: ignore[index]
            answer = await hung
            await client.close()
        assert stopping is not None
        exit_status = await stopping
    assert exit_status in (0, -signal.SIGTERM)  # it ended by itself: ``stop`` kills it (SIGKILL) after 60 s
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_shutting_down"
    store = await Store.open(database_url)
    try:
        spans = await store.query_spans(None)
    finally:
        await store.close()
    by_stream = {span.attributes["rollway.stream"]: span for span in spans}
    assert len(spans) == 2 and set(by_stream) == {True, False}
    default_timeout = Settings.model_fields["shutdown_timeout"].default
    for span in spans:
        assert span.status.status_code == "ERROR" and span.attributes["error.type"] == "shutdown"
        # Ended by the timeout set: not before it passed, nor as late as the default one would have
        assert span.end_time is not None
        assert signalled + shutdown_timeout <= span.end_time < signalled + default_timeout
    assert by_stream[False].attributes["http.response.status_code"] == 503
    token_ids = by_stream[True].attributes["rollway.response_token_ids"]
    assert token_ids and len(token_ids) < 400


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/admin/v1/rollouts"])
async def test_a_request_body_that_never_finishes_is_a_408_within_the_body_timeout(
    tmp_path: Path, mock: MockBackendProcess, path: str
) -> None:
    """Slowloris on the body: headers, half the body, then nothing (without closing). The connection is not
    held for ever, on the data plane or the admin API: a 408 envelope, the connection closed, nothing sent to
    the backend nor recorded."""
    async with gateway(tmp_path, vllm(mock), body_timeout=0.5) as gw:
        slow = RawClient(gw)
        try:
            body = {"model": "policy", "messages": MESSAGES, "tasks": [{"input": "x"}]}
            await slow.post(path, body, partial_body=True)
            answer = await slow.read_to_end(5)
        finally:
            slow.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        assert orjson.loads(payload)["error"]["message"] == "the request body did not arrive within 0.5 s"
        assert (await stats(mock))["requests_total"] == 0
        assert await gw.store.query_spans(None) == []
        client = gw.client()
        assert (await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)).choices


async def endless_backend(request: web.Request) -> web.StreamResponse:
    """A backend gone wrong (no backend does this on purpose): a chat answer, streamed or whole, whose content
    never ends — 8 MiB of it, in 64 KiB writes, no length declared."""
    streamed = (await request.json()).get("stream")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if streamed else "application/json"})
    await response.prepare(request)
    head = b'data: {"choices":[{"index":0,"delta":{"content":"' if streamed else b'{"choices":[{"message":{"content":"'
    await response.write(head)
    for _ in range(128):
        await response.write(b"a" * 65536)
    await response.write(b'"}}]}\n\ndata: [DONE]\n\n' if streamed else b'"}}]}')
    return response


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_past_max_response_bytes_is_a_502_not_held_in_memory(tmp_path: Path, stream: bool) -> None:
    """An answer (a whole body, or one stream event) larger than ``ROLLWAY_MAX_RESPONSE_BYTES`` is not read on: a
    502 ``response_too_large`` (for a stream, its final error event), not retried, recorded as such."""
    app = web.Application()
    calls: list[web.Request] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(request)
        return await endless_backend(request)

    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    backend = {"backend_id": "endless", "base_url": f"http://127.0.0.1:{port}/v1", "kind": "openai", "model": "m"}
    try:
        async with gateway(tmp_path, backend, max_response_bytes=1 << 20) as gw:
            async with httpx.AsyncClient(timeout=30) as http:
                body = {"model": "policy", "messages": MESSAGES, "stream": stream}
                answer = await http.post(f"{gw.url}/v1/chat/completions", json=body)
            error = {
                "message": "the backend's answer is larger than 1048576 bytes",
                "type": "upstream_error",
                "param": None,
                "code": "response_too_large",
            }
            if stream:
                assert answer.status_code == 200 and answer.content.endswith(
                    b"data: " + orjson.dumps({"error": error}) + b"\n\n"
                )
            else:
                assert answer.status_code == 502 and answer.json() == {"error": error}
            assert len(calls) == 1  # not retried: the backend would say it again
            assert await gw.state.registry.drain("policy", 5)
            [span] = await gw.store.query_spans(None)
            assert span.status.status_code == "ERROR"
            assert error["message"] in (span.attributes["rollway.error"] or "")
    finally:
        await runner.cleanup()


async def test_a_streamed_calls_refusal_sent_without_a_length_reaches_the_client_whole(tmp_path: Path) -> None:
    """An OpenAI-compatible server's 400 to a streamed call, sent chunked (no Content-Length: a proxy in front of
    it, or a server that streams its errors): the gateway reads it to see whether it names ``stream_options``;
    it does not, so the client gets it, body and all, as from a direct call (not an empty body)."""
    refusal = {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}}

    async def refuse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=400, headers={"Content-Type": "application/json"})
        await response.prepare(request)  # no length declared: chunked
        await response.write(orjson.dumps(refusal))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    backend = {"backend_id": "strict", "base_url": f"http://127.0.0.1:{port}/v1", "kind": "openai", "model": "m"}
    try:
        async with gateway(tmp_path, backend) as gw, httpx.AsyncClient(timeout=30) as http:
            body = {"model": "policy", "messages": MESSAGES, "stream": True}
            answer = await http.post(f"{gw.url}/v1/chat/completions", json=body)
            assert answer.status_code == 400 and answer.json() == refusal
            [span] = await gw.store.query_spans(None)
            assert "max_tokens is too large" in (span.attributes["rollway.error"] or "")
    finally:
        await runner.cleanup()
