"""``create_mock_app(config)``: the mock backend as a Starlette app.

Data plane (vLLM-like): ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``,
``GET /v1/models``, ``GET /health``. Control plane for tests: ``/mock/faults``, ``/mock/reset``, ``/mock/stats``,
``/mock/requests``, ``/mock/config`` (see ``rollway.mock.faults`` for the rule schema).

Per-request latency overrides: headers ``x-mock-latency-ms``, ``x-mock-ttft-ms``, ``x-mock-token-delay-ms``, or a
body field ``"mock": {"latency_ms": .., "ttft_ms": .., "token_delay_ms": ..}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from rollway.envelope import envelope
from rollway.mock.config import MockConfig
from rollway.mock.faults import FaultBook, FaultError, FaultRule, RequestRecord, Stats, with_garbage
from rollway.mock.model import FakeModel, PrefixCache
from rollway.mock.plans import BadRequest, Planner

RECORD_KEY = "rollway.mock.record"
logger = logging.getLogger("rollway.mock")
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,200}$")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class MockState:
    """Everything the app holds, reachable as ``app.state.mock``."""

    def __init__(self, config: MockConfig) -> None:
        self.initial_config = config
        self.config = config
        self.model = FakeModel(math_accuracy=config.math_accuracy)
        self.prefix_cache = PrefixCache(config.prefix_block_size)
        self.faults = FaultBook()
        self.stats = Stats(config.request_log_size)
        self.watches: set[_Watch] = set()
        self.shutting_down = False

    def set_config(self, config: MockConfig) -> None:
        self.config = config
        self.model = FakeModel(math_accuracy=config.math_accuracy)
        if config.prefix_block_size != self.prefix_cache.block_size:
            self.prefix_cache = PrefixCache(config.prefix_block_size)

    def reset(self) -> None:
        self.set_config(self.initial_config)
        self.faults.clear()
        self.stats.reset()
        self.prefix_cache.clear()

    def begin_shutdown(self) -> None:
        """Wake every hanging or stalled request so the server can stop."""
        self.shutting_down = True
        for watch in list(self.watches):
            watch.stop.set()


class _Watch:
    """Watches ``receive`` for ``http.disconnect``; records a cancellation unless the response was complete."""

    def __init__(self, state: MockState, record: RequestRecord, receive: Receive) -> None:
        self.state, self.record = state, record
        self.stop = asyncio.Event()
        self.done = False
        self._task = asyncio.get_running_loop().create_task(self._run(receive))
        state.watches.add(self)

    async def _run(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.state.stats.cancel(self.record, time.monotonic())
        self.stop.set()

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; True when the client left (or the server stops) meanwhile."""
        if self.stop.is_set():
            return True
        if seconds <= 0:
            return False
        try:
            async with asyncio.timeout(seconds):
                await self.stop.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.done = True
        self._task.cancel()
        self.state.watches.discard(self)


class _Tracker:
    """Gives each data-plane request an id (echoed as ``x-request-id``) and counts it."""

    def __init__(self, app: ASGIApp, state: MockState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/mock/"):
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value.decode("latin-1")
        if not _REQUEST_ID_RE.match(request_id):
            request_id = f"mock-{uuid.uuid4().hex}"
        record = RequestRecord(request_id, scope["method"], scope["path"], time.monotonic())
        scope[RECORD_KEY] = record
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def tracked_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        self.state.stats.begin(record)
        try:
            await self.app(scope, receive, tracked_send)
        finally:
            self.state.stats.end(record)


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send: Send, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
    body = obj if isinstance(obj, bytes) else _dumps(obj) if not isinstance(obj, str) else obj.encode("utf-8")
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Endpoint:
    """One data-plane route, as a raw ASGI app (it must control disconnects and aborts)."""

    def __init__(self, state: MockState, kind: str) -> None:
        self.state = state
        self.planner = Planner(state, kind)

    # -- serving ---------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        record: RequestRecord = scope[RECORD_KEY]
        body: dict[str, Any] = {}
        if scope["method"] == "POST":
            raw = await _read_body(receive)
            if raw is None:
                state.stats.cancel(record, time.monotonic())
                return
            try:
                parsed = json.loads(raw) if raw else None
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                await _send_json(send, 400, envelope(f"malformed JSON body: {exc}", "invalid_request_error"))
                return
            if not isinstance(parsed, dict):
                await _send_json(send, 400, envelope("the body must be a JSON object", "invalid_request_error"))
                return
            body = parsed
            record.model = body.get("model") if isinstance(body.get("model"), str) else None
            record.stream = body.get("stream") is True
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        state.stats.log.append(
            {
                "request_id": record.request_id,
                "method": record.method,
                "path": record.path,
                "query": scope.get("query_string", b"").decode("latin-1"),
                "headers": headers,
                "body": body,
                "at": record.started_at,
            }
        )
        watch = _Watch(state, record, receive)
        try:
            await self._serve(send, record, body, headers, watch)
        finally:
            watch.close()

    def _delays(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, float, float]:
        config = self.state.config
        values = {"latency_ms": config.latency_ms, "ttft_ms": config.ttft_ms, "token_delay_ms": config.token_delay_ms}
        for key in values:
            header = headers.get("x-mock-" + key.replace("_", "-"))
            if header is not None:
                try:
                    values[key] = max(0.0, float(header))
                except ValueError:
                    raise BadRequest(f"header x-mock-{key.replace('_', '-')} must be a number") from None
        override = body.get("mock")
        if isinstance(override, dict):
            for key in values:
                value = override.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
                    values[key] = float(value)
        return values["latency_ms"] / 1000, values["ttft_ms"] / 1000, values["token_delay_ms"] / 1000

    async def _serve(
        self, send: Send, record: RequestRecord, body: dict[str, Any], headers: dict[str, str], watch: _Watch
    ) -> None:
        state = self.state
        try:
            plan = self.planner.plan(body)
            latency, ttft, token_delay = self._delays(body, headers)
        except BadRequest as exc:
            await _send_json(send, exc.status, envelope(exc.message, exc.type, param=exc.param, code=exc.status))
            return
        rule = state.faults.take(path=record.path, model=record.model, stream=plan.stream)
        if rule is not None:
            state.stats.fault_fired(record, rule)
        record.stage = "waiting"
        if await watch.sleep(latency):
            return
        if rule is not None:
            if rule.kind == "delay":
                record.stage = "delay"
                if await watch.sleep(rule.ms / 1000):
                    return
            elif rule.kind in ("status", "rate_limit"):
                await self._send_fault(send, rule)
                return
            elif rule.kind == "hang":
                record.stage = "hang"
                await watch.stop.wait()
                return
        if plan.steps is not None:
            await self._stream(send, record, _sse(plan.steps(), plan.named_events), rule, watch, ttft, token_delay)
            return
        record.stage = "generating"
        if await watch.sleep(ttft + token_delay * max(plan.decode_steps - 1, 0)):
            return
        assert plan.body is not None
        payload = _dumps(plan.body())
        if rule is not None and rule.kind in ("drop_mid_stream", "stall_mid_stream"):
            start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": start_headers})
            await send({"type": "http.response.body", "body": payload[: len(payload) // 2], "more_body": True})
            if rule.kind == "stall_mid_stream":
                record.stage = "stalled"
                await watch.stop.wait()
            _log_abort(rule, record)
            return  # returning mid-body makes the server abort the connection
        watch.done = True
        await _send_json(send, 200, payload)

    async def _send_fault(self, send: Send, rule: FaultRule) -> None:
        headers = dict(rule.headers)
        if rule.kind == "rate_limit":
            retry = rule.retry_after
            headers.setdefault("retry-after", str(int(retry)) if retry == int(retry) else str(retry))
            default = envelope("mock: rate limit reached", "rate_limit_exceeded", code="rate_limit_exceeded")
        else:
            kind = "server_error" if rule.status >= 500 else "invalid_request_error"
            default = envelope(f"mock: injected status {rule.status}", kind, code=rule.status)
        await _send_json(send, rule.status, default if rule.body is None else rule.body, headers)

    async def _stream(
        self,
        send: Send,
        record: RequestRecord,
        events: list[list[bytes]],
        rule: FaultRule | None,
        watch: _Watch,
        ttft: float,
        token_delay: float,
    ) -> None:
        limit = rule.after_chunks if rule is not None and rule.kind.endswith("_mid_stream") else None
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        record.stage = "streaming"
        sent = 0
        if rule is not None and rule.kind == "garbage_event":
            events = with_garbage(events, rule)
        for number, step in enumerate(events):
            if await watch.sleep(ttft if number == 0 else token_delay):
                return
            if token_delay <= 0:
                await asyncio.sleep(0)  # let the disconnect watcher run between steps
                if watch.stop.is_set():
                    return
            if limit is not None and sent + len(step) > limit:
                part = step[: limit - sent]
                if part:
                    await send({"type": "http.response.body", "body": b"".join(part), "more_body": True})
                assert rule is not None
                if rule.kind == "stall_mid_stream":
                    record.stage = "stalled"
                    await watch.stop.wait()
                _log_abort(rule, record)
                return  # returning mid-body makes the server abort the connection
            await send({"type": "http.response.body", "body": b"".join(step), "more_body": True})
            sent += len(step)
        watch.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _sse(steps: list[list[dict[str, Any]]], named: bool) -> list[list[bytes]]:
    """The stream's events by decode step: ``data:`` lines and a final ``[DONE]`` (chat, completions), or
    ``event: <type>`` + ``data:`` and no ``[DONE]`` (``named``: the Responses API)."""
    if named:
        return [[b"event: " + c["type"].encode() + b"\ndata: " + _dumps(c) + b"\n\n" for c in step] for step in steps]
    events = [[b"data: " + _dumps(chunk) + b"\n\n" for chunk in step] for step in steps]
    events[-1].append(b"data: [DONE]\n\n")
    return events


def _log_abort(rule: FaultRule, record: RequestRecord) -> None:
    if rule.kind == "drop_mid_stream":
        logger.warning("fault rule %d (%s): aborting request %s mid-body", rule.id, rule.kind, record.request_id)


# ------------------------------------------------------------------------------------------- control plane


def _control_routes(state: MockState) -> list[Route]:
    async def faults(request: Request) -> Response:
        if request.method == "DELETE":
            state.faults.clear()
        elif request.method == "POST":
            try:
                added = state.faults.add(await request.json())
            except (FaultError, json.JSONDecodeError) as exc:
                return JSONResponse(envelope(str(exc), "invalid_request_error"), status_code=400)
            return JSONResponse(
                {"added": [r.as_dict() for r in added], "rules": [r.as_dict() for r in state.faults.rules]}
            )
        return JSONResponse({"rules": [r.as_dict() for r in state.faults.rules]})

    async def reset(_: Request) -> Response:
        state.reset()
        return JSONResponse({"status": "reset"})

    async def stats(request: Request) -> Response:
        query = request.query_params
        try:
            timeout = min(float(query.get("timeout", "5")), 60.0)
            want_cancelled = int(query.get("wait_cancelled", "0"))
            want_requests = int(query.get("wait_requests", "0"))
            want_idle = query.get("wait_idle", "0") not in ("0", "", "false")
        except ValueError:
            return JSONResponse(envelope("bad query parameter", "invalid_request_error"), status_code=400)
        s = state.stats
        if want_cancelled or want_requests or want_idle:
            await s.wait_until(
                lambda: (
                    len(s.cancelled) >= want_cancelled
                    and sum(s.requests.values()) >= want_requests
                    and (not want_idle or not s.in_flight)
                ),
                timeout,
            )
        return JSONResponse(s.snapshot())

    async def requests(request: Request) -> Response:
        try:
            limit = int(request.query_params.get("limit", "100"))
        except ValueError:
            return JSONResponse(envelope("limit must be an integer", "invalid_request_error"), status_code=400)
        path = request.query_params.get("path")
        items = [r for r in state.stats.log if path is None or r["path"] == path]
        return JSONResponse({"requests": items[-limit:] if limit > 0 else []})

    async def config(request: Request) -> Response:
        if request.method == "POST":
            try:
                changes = await request.json()
                if not isinstance(changes, dict):
                    raise ValueError("send an object of config keys")
                state.set_config(state.config.updated(changes))
            except ValueError as exc:
                return JSONResponse(envelope(str(exc), "invalid_request_error"), status_code=400)
        return JSONResponse(state.config.as_dict())

    return [
        Route("/mock/faults", faults, methods=["GET", "POST", "DELETE"]),
        Route("/mock/reset", reset, methods=["POST"]),
        Route("/mock/stats", stats, methods=["GET"]),
        Route("/mock/requests", requests, methods=["GET"]),
        Route("/mock/config", config, methods=["GET", "POST"]),
    ]


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(envelope(str(exc.detail), kind, code=exc.status_code), status_code=exc.status_code)


def create_mock_app(config: MockConfig | None = None) -> Starlette:
    """The mock backend; its state (faults, stats, config) is ``app.state.mock`` (a ``MockState``)."""
    state = MockState(config or MockConfig())

    def endpoint(kind: str) -> _Endpoint:
        return _Endpoint(state, kind)

    routes = [
        Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", endpoint("completions"), methods=["POST"]),
        Route("/v1/embeddings", endpoint("embeddings"), methods=["POST"]),
        Route("/v1/responses", endpoint("responses"), methods=["POST"]),
        Route("/v1/models", endpoint("models"), methods=["GET"]),
        Route("/health", endpoint("health"), methods=["GET"]),
        *_control_routes(state),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_Tracker, state=state)],
        exception_handlers={HTTPException: _http_error},
    )
    app.state.mock = state
    return app
