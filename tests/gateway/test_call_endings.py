"""Every way a data-plane call ends, one test each: the call gets exactly one span, which says how it ended, and
its client is told as ``gateway/outcome.py``'s table says. The app runs in this process and each request is driven
over ASGI by the test, which decides when the client reads, stops reading or leaves, and when the server stops.
(That the span is written in one place only, ``Call._write_span``, is tests/test_architecture.py's.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.types import Message

from rollway.app.factory import RollwayApp
from rollway.gateway import capture
from rollway.mock import MockBackendProcess
from rollway.settings import Settings
from rollway.store import Span, UnavailableError
from support.gateway_harness import app_lifespan, claim_one, closed_port, sse_events, vllm

MESSAGES = [{"role": "user", "content": "Tell me about dragons."}]
# The client's read bound. The harness's send looks up the stored spans inside that bound (to see what is on disk
# when the last part goes out), so the bound leaves a loaded machine time for that lookup.
WRITE_TIMEOUT = 2.0


class Exchange:
    """One request to the app over ASGI: the body arrives at once; the test says when the client leaves
    (``leave``) and whether it reads (``reading``); ``sent`` holds every message the app sent."""

    def __init__(self, app: RollwayApp, rollout_id: str, body: dict[str, Any]) -> None:
        self.app, self.rollout_id, self.body = app, rollout_id, body
        self.path = f"/rollout/{rollout_id}/v1/chat/completions"
        self.sent: list[Message] = []
        self.left = asyncio.Event()
        self.reading = asyncio.Event()
        self.reading.set()
        self.first_part = asyncio.Event()
        self.at_the_end: list[list[Span]] = []  # the spans stored when the answer's last part was sent
        self._asked = False

    def start(self) -> asyncio.Task[None]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8080),
        }
        return asyncio.create_task(self.app(scope, self._receive, self._send))

    async def run(self) -> None:
        await asyncio.wait_for(self.start(), 30)

    def leave(self) -> None:
        self.left.set()

    async def _receive(self) -> dict[str, Any]:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": orjson.dumps(self.body), "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            await self.reading.wait()
            if not message.get("more_body", False):
                self.at_the_end.append(await self.app.state.store.query_spans(self.rollout_id))
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.first_part.set()

    @property
    def status(self) -> int:
        [start] = [m for m in self.sent if m["type"] == "http.response.start"]
        status: int = start["status"]
        return status

    @property
    def headers(self) -> dict[str, str]:
        [start] = [m for m in self.sent if m["type"] == "http.response.start"]
        return {k.decode(): v.decode() for k, v in start["headers"]}

    @property
    def body_bytes(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def ended(self) -> bool:
        """Whether the answer's last part went out."""
        return any(m["type"] == "http.response.body" and not m.get("more_body", False) for m in self.sent)


@pytest.fixture
async def app(tmp_path: Path, mock: MockBackendProcess) -> AsyncIterator[RollwayApp]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'endings.db'}", write_timeout=WRITE_TIMEOUT, pause_wait_seconds=0.2
    )
    async with app_lifespan(settings) as application:
        await application.state.store.put_model("policy", [vllm(mock)], version="v1")
        yield application


async def exchange(app: RollwayApp, **body: Any) -> tuple[Exchange, str]:
    rollout_id, _ = await claim_one(app.state.store)
    request = {"model": "policy", "messages": MESSAGES, "max_tokens": 8, **body}
    return Exchange(app, rollout_id, request), rollout_id


async def only_span(app: RollwayApp, rollout_id: str) -> Span:
    """The rollout's one span (the test's one call), once every call of the alias has ended."""
    assert await app.state.registry.drain("policy", 10)
    [span] = await app.state.store.query_spans(rollout_id)
    return span


async def test_an_answered_call_is_handed_over_once_its_span_is_on_disk(app: RollwayApp) -> None:
    ex, rollout_id = await exchange(app)
    await ex.run()
    span = await only_span(app, rollout_id)
    assert ex.status == 200
    assert orjson.loads(ex.body_bytes)["choices"][0]["message"]["content"]
    assert ex.headers["x-rollway-sequence-id"] == str(span.sequence_id)
    assert span.status.status_code == "OK" and span.attributes["rollway.trainable"] is True
    assert [[s.span_id for s in spans] for spans in ex.at_the_end] == [[span.span_id]]


async def test_a_streamed_call_sends_its_done_once_its_span_is_on_disk(app: RollwayApp) -> None:
    ex, rollout_id = await exchange(app, stream=True)
    await ex.run()
    span = await only_span(app, rollout_id)
    events = sse_events(ex.body_bytes.decode())
    assert events[-1] == (None, "[DONE]")
    assert span.status.status_code == "OK" and span.attributes["rollway.response_token_ids"]
    assert [[s.span_id for s in spans] for spans in ex.at_the_end] == [[span.span_id]]


async def test_a_backends_error_goes_to_the_client_as_it_came_and_into_the_span(
    app: RollwayApp, mock: MockBackendProcess
) -> None:
    error = {"error": {"message": "bad temperature", "type": "BadRequestError", "param": None, "code": 400}}
    mock.add_faults({"kind": "status", "status": 400, "body": error})
    ex, rollout_id = await exchange(app)
    await ex.run()
    span = await only_span(app, rollout_id)
    assert ex.status == 400 and orjson.loads(ex.body_bytes) == error
    assert span.attributes["error.type"] == "http_400"
    assert span.attributes["http.response.status_code"] == 400


async def test_a_call_refused_after_its_sequence_id_is_told_why_with_its_ids(app: RollwayApp) -> None:
    await app.state.registry.pause("policy")
    ex, rollout_id = await exchange(app)
    await ex.run()
    span = await only_span(app, rollout_id)
    assert ex.status == 429
    assert orjson.loads(ex.body_bytes)["error"]["code"] == "model_paused"
    assert ex.headers["retry-after"] == "1"
    assert ex.headers["x-rollway-sequence-id"] == str(span.sequence_id)
    assert ex.headers["x-rollway-rollout-id"] == rollout_id
    assert span.attributes["error.type"] == "model_paused"


async def test_a_call_whose_backend_cannot_be_reached_fails_with_its_span(app: RollwayApp) -> None:
    unreachable = {"backend_id": "gone", "base_url": f"http://127.0.0.1:{closed_port()}/v1", "kind": "vllm"}
    await app.state.store.put_model("policy", [unreachable | {"model": "m"}], version="v2")
    app.state.registry.invalidate("policy")
    ex, rollout_id = await exchange(app)
    await ex.run()
    span = await only_span(app, rollout_id)
    assert ex.status == 502
    assert orjson.loads(ex.body_bytes)["error"]["code"] == "backend_unreachable"
    assert span.attributes["error.type"] == "http_502"


async def test_a_call_whose_client_leaves_is_cancelled_with_what_went_by(
    app: RollwayApp, mock: MockBackendProcess
) -> None:
    mock.add_faults({"kind": "stall_mid_stream", "after_chunks": 3})
    ex, rollout_id = await exchange(app, stream=True)
    task = ex.start()
    await asyncio.wait_for(ex.first_part.wait(), 10)
    ex.leave()
    await asyncio.wait_for(task, 10)
    span = await only_span(app, rollout_id)
    assert not ex.ended  # nobody to tell
    assert span.attributes["rollway.cancelled"] is True
    assert span.attributes["error.type"] == "cancelled"
    assert span.attributes["rollway.response"] is not None  # the tokens that went by


async def test_a_call_whose_client_stops_reading_ends_as_stalled(app: RollwayApp, mock: MockBackendProcess) -> None:
    ex, rollout_id = await exchange(app, stream=True, max_tokens=64)
    ex.reading.clear()  # the client takes nothing: every send of the answer waits
    await ex.run()  # ended by the write timeout, not by the test
    span = await only_span(app, rollout_id)
    assert not ex.ended
    assert span.attributes["error.type"] == "client_stalled"
    assert span.status.description == f"the client did not read the answer for {WRITE_TIMEOUT:g} s"


async def test_a_call_the_server_stops_is_told_so_and_its_span_says_shutdown(
    app: RollwayApp, mock: MockBackendProcess
) -> None:
    mock.add_faults({"kind": "stall_mid_stream", "after_chunks": 3})
    ex, rollout_id = await exchange(app, stream=True)
    task = ex.start()
    await asyncio.wait_for(ex.first_part.wait(), 10)
    task.cancel()  # what uvicorn does to the calls still running when its graceful shutdown times out
    await asyncio.wait_for(task, 10)
    span = await only_span(app, rollout_id)
    *_, (_, last) = sse_events(ex.body_bytes.decode())
    assert last["error"]["code"] == "server_shutting_down"
    assert span.attributes["error.type"] == "shutdown"
    assert span.attributes["http.response.status_code"] == 200  # its 200 had gone out


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_whose_span_cannot_be_written_is_not_handed_over(
    app: RollwayApp, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    async def unavailable(span: Span) -> None:
        raise UnavailableError("the database is down")

    monkeypatch.setattr(app.state.store, "record_call", unavailable)
    ex, rollout_id = await exchange(app, stream=stream)
    await ex.run()
    if stream:
        assert ex.status == 200
        *_, (_, last) = sse_events(ex.body_bytes.decode())
        assert last["error"]["code"] == "not_recorded"
        assert b"[DONE]" not in ex.body_bytes
    else:
        assert ex.status == 503 and orjson.loads(ex.body_bytes)["error"]["code"] == "not_recorded"
    monkeypatch.undo()
    assert await app.state.store.query_spans(rollout_id) == []


async def test_a_failure_of_the_gateway_mid_stream_ends_the_stream_with_an_error_event(
    app: RollwayApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = capture.shown
    calls = 0

    def breaks_on_the_third(chunk: dict[str, Any], injected: capture.Injected) -> dict[str, Any] | None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a bug")
        return shown(chunk, injected)

    monkeypatch.setattr(capture, "shown", breaks_on_the_third)
    ex, rollout_id = await exchange(app, stream=True)
    await ex.run()
    span = await only_span(app, rollout_id)
    assert ex.status == 200 and ex.ended
    *_, (_, last) = sse_events(ex.body_bytes.decode())
    assert last["error"] == {
        "message": "internal error: RuntimeError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert span.attributes["error.type"] == "http_500"
