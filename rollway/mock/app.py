"""``create_mock_app(config)``: the mock backend as a Starlette app.

Data plane of the ``vllm`` flavour: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``, ``GET /v1/models``, ``GET /health`` (200, empty), ``GET /version``. The ``sglang`` flavour has
no embeddings and no ``/version``, and adds SGLang's own routes: ``GET /v1/models/{model}``, ``/model_info`` and
``/get_model_info``, ``/server_info`` and ``/get_server_info``, ``/health_generate``, ``/ready``, ``/ping`` (200,
empty) and ``/`` (``"SGLang is running"``). Other paths answer FastAPI's ``{"detail": "Not Found"}`` (404) or
``{"detail": "Method Not Allowed"}`` (405), as both servers do. Control plane for tests: ``/mock/faults``,
``/mock/reset``, ``/mock/stats``, ``/mock/requests``, ``/mock/config`` (see ``rollway.mock.faults`` for the rule
schema).

The ``vllm`` flavour's answers carry ``x-request-id`` (the client's, or a new one), as vLLM's do with
``--enable-request-id-headers``; the client's also names chat and completion answers (``chatcmpl-<id>``). The
``sglang`` flavour's carry ``vary: Origin`` (SGLang's CORS middleware) instead.

``hold`` (``POST /mock/config``) keeps generation requests waiting until it is cleared.

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
from rollway.mock.control import control_routes
from rollway.mock.faults import GENERATION_PATHS, FaultRule, RequestRecord, with_garbage
from rollway.mock.plans import Plan, Planner
from rollway.mock.sglang_plans import SGLangPlanner
from rollway.mock.state import MockState, Watch
from rollway.mock.validation import BadRequest, schema_error
from rollway.mock.weights import weight_routes

RECORD_KEY = "rollway.mock.record"
#: The client's ``x-request-id``, when it sent a usable one.
CLIENT_ID_KEY = "rollway.mock.client_request_id"
logger = logging.getLogger("rollway.mock")
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,200}$")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


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
            request_id = uuid.uuid4().hex
        else:
            scope[CLIENT_ID_KEY] = request_id
        record = RequestRecord(request_id, scope["method"], scope["path"], time.monotonic())
        scope[RECORD_KEY] = record
        header = (b"x-request-id", request_id.encode("latin-1"))
        if self.state.config.flavor == "sglang":
            header = (b"vary", b"Origin")

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


def _parse(raw: bytes) -> dict[str, Any] | BadRequest:
    """The request body, or the 400 vLLM answers for one that is not a JSON object."""
    try:
        parsed = json.loads(raw) if raw else None
    except json.JSONDecodeError as exc:
        return schema_error(f"body.{exc.pos}", "json_invalid", "JSON decode error", {}, {"error": exc.msg})
    except UnicodeDecodeError as exc:
        return schema_error("body", "json_invalid", "JSON decode error", {}, {"error": str(exc)})
    if not isinstance(parsed, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        return schema_error("body", "model_attributes_type", msg, parsed)
    return parsed


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
        self.planner = SGLangPlanner(state, kind) if state.config.flavor == "sglang" else Planner(state, kind)

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
            parsed = _parse(raw)
            if isinstance(parsed, BadRequest):
                await _send_json(send, parsed.status, self.planner.error(parsed))
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
        watch = Watch(state, record, receive)
        try:
            await self._serve(send, record, body, headers, watch, scope)
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
        self,
        send: Send,
        record: RequestRecord,
        body: dict[str, Any],
        headers: dict[str, str],
        watch: Watch,
        scope: Scope,
    ) -> None:
        state = self.state
        try:
            plan = self.planner.plan(body, scope.get(CLIENT_ID_KEY), headers, scope.get("path_params"))
            latency, ttft, token_delay = self._delays(body, headers)
        except BadRequest as exc:
            await _send_json(send, exc.status, self.planner.error(exc))
            return
        rule = state.faults.take(path=record.path, model=record.model, stream=plan.stream)
        if rule is not None:
            state.stats.fault_fired(record, rule)
        if record.path in GENERATION_PATHS and not state.released.is_set():
            record.stage = "held"
            if await watch.until(state.released):
                return
        if record.path in GENERATION_PATHS and not state.engine_resumed.is_set():
            record.stage = "engine_paused"  # the engine's own pause (``POST /pause``): requests wait for /resume
            if await watch.until(state.engine_resumed):
                return
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
            await self._stream(send, record, _sse(plan.steps(), plan), rule, watch, ttft, token_delay)
            return
        record.stage = "generating"
        if await watch.sleep(ttft + token_delay * max(plan.decode_steps - 1, 0)):
            return
        assert plan.body is not None
        answer = plan.body()
        if answer is None:  # vLLM's /health: 200, no body
            watch.done = True
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        payload = _dumps(answer)
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
        await _send_json(send, plan.status, payload)

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
        watch: Watch,
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


def _sse(steps: list[list[dict[str, Any]]], plan: Plan) -> list[list[bytes]]:
    """The stream's events by decode step: ``data:`` lines (some named by ``plan.event_name``) and a final
    ``[DONE]`` (chat, completions), or ``event: <type>`` + ``data:`` and no ``[DONE]`` (the Responses API)."""
    if plan.named_events:
        return [[_event(c["type"], c) for c in step] for step in steps]
    name = plan.event_name or (lambda _: None)
    events = [[_event(name(chunk), chunk) for chunk in step] for step in steps]
    events[-1].append(b"data: [DONE]\n\n")
    return events


def _event(name: str | None, data: dict[str, Any]) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name is not None else b""
    return head + b"data: " + _dumps(data) + b"\n\n"


def _log_abort(rule: FaultRule, record: RequestRecord) -> None:
    if rule.kind == "drop_mid_stream":
        logger.warning("fault rule %d (%s): aborting request %s mid-body", rule.id, rule.kind, record.request_id)


async def _http_error(_: Request, exc: Exception) -> Response:
    """FastAPI's answer to a path or method the server does not route (vLLM's server is a FastAPI app)."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def create_mock_app(config: MockConfig | None = None) -> Starlette:
    """The mock backend; its state (faults, stats, config) is ``app.state.mock`` (a ``MockState``)."""
    state = MockState(config or MockConfig())

    def endpoint(kind: str) -> _Endpoint:
        return _Endpoint(state, kind)

    routes = [
        Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", endpoint("completions"), methods=["POST"]),
        Route("/v1/responses", endpoint("responses"), methods=["POST"]),
        Route("/v1/models", endpoint("models"), methods=["GET"]),
        Route("/health", endpoint("health"), methods=["GET"]),
    ]
    if state.config.flavor == "sglang":
        names = ("model_info", "get_model_info", "server_info", "get_server_info", "health_generate", "ready", "ping")
        routes += [Route(f"/{name}", endpoint(name), methods=["GET"]) for name in names]
        routes += [Route("/", endpoint("root"), methods=["GET"])]
        routes += [Route("/v1/models/{model:path}", endpoint("model_card"), methods=["GET"])]
    else:
        routes += [Route("/v1/embeddings", endpoint("embeddings"), methods=["POST"])]
        routes += [Route("/version", endpoint("version"), methods=["GET"])]
    routes += weight_routes(state)
    routes += control_routes(state)
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_Tracker, state=state)],
        exception_handlers={HTTPException: _http_error},
    )
    app.state.mock = state
    return app
