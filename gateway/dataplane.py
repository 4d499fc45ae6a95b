"""The OpenAI-compatible routes, as a pure ASGI app in front of the FastAPI app (no per-call framework
overhead, full control of streaming and of client disconnects). Paths it does not own go to ``fallback``.

Routes: ``POST /v1/{chat/completions,completions,responses,embeddings}`` and ``GET /v1/models``, also under
``/rollout/{rollout_id}/v1/...`` and ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote

import orjson

from rollway import logs
from rollway.gateway import capture, outcome
from rollway.gateway.attribution import KeyCache, attribute, check_key
from rollway.gateway.bounds import Bound
from rollway.gateway.errors import AuthError, CallError, ClientStalled, UnknownAlias
from rollway.gateway.proxy import Gateway
from rollway.gateway.record import CallRecord, parse_traceparent
from rollway.store import ModelAlias, NotFoundError, StoreError
from rollway.store.db.faults import unavailable

log = logging.getLogger("rollway.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATH = re.compile(
    r"^(?:/rollout/(?P<rollout>[^/]+)(?:/attempt/(?P<attempt>[^/]+))?)?"
    r"/v1/(?P<op>chat/completions|completions|responses|embeddings|models)(?:(?<=models)/(?P<model>.+?))?/?$"
)
#: How long a call ended by the server's shutdown waits for its client to take the news.
SHUTDOWN_WRITE_TIMEOUT = 1.0


class AsgiReply:
    """Sends one HTTP response over ASGI, remembering whether it started.

    A send waits while the client does not read (uvicorn's flow control: the backend's answer is not piled up in
    memory), but not for ever: one that waits ``write_timeout`` seconds, or past ``deadline`` (the rollout's, wall
    clock), raises ``ClientStalled`` (``bound``: the handler task's, kept by the gateway's ``Sweeper``)."""

    def __init__(self, send: Send, write_timeout: float, bound: Bound) -> None:
        self._send = send
        self.started = False
        self.sized = False  # a whole answer (its length said): nothing may be added to it
        self.ended = False
        self.write_timeout = write_timeout
        self.deadline: float | None = None
        self.bound = bound

    async def _put(self, message: Message) -> None:
        try:
            with self.bound.within(self.write_timeout, self.deadline):
                await self._send(message)
        except TimeoutError:
            if self.deadline is not None and time.time() >= self.deadline:
                raise ClientStalled("the client did not read the answer before the rollout's deadline") from None
            raise ClientStalled(f"the client did not read the answer for {self.write_timeout:g} s") from None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._put({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool) -> None:
        self.ended = self.ended or not more
        await self._put({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(self, status: int, headers: list[tuple[bytes, bytes]], data: bytes) -> None:
        """A response in one piece, with its length (not chunked: an HTTP/1.0 client cannot read chunks)."""
        self.sized = True
        await self.start(status, [*headers, (b"content-length", str(len(data)).encode())])
        await self.body(data, more=False)


class DataPlane:
    """Pure ASGI middleware: serves the data-plane paths, hands everything else to ``app``. The running
    gateway is found on the application state (``scope["app"].state.rollway``), set up by the lifespan."""

    def __init__(self, app: ASGIApp) -> None:
        self.fallback = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        rid = logs.request_id(scope["headers"])
        token = logs.REQUEST_ID.set(rid)
        rid_header = (logs.HEADER, rid.encode())
        try:
            match = PATH.match(scope["path"])
            if match is None:
                await self.fallback(scope, receive, _with_header(send, rid_header))
                return
            gateway = scope["app"].state.rollway.gateway
            reply = AsgiReply(send, gateway.settings.write_timeout, gateway.sweeper.bound())
            try:
                try:
                    await self._serve(scope, receive, reply, match, rid_header)
                except Exception as exc:
                    err = _call_error(exc, gateway)
                    if err is None:
                        raise
                    if not err.counted:
                        gateway.metrics.observe_rejected(match["op"], err.status)
                    if not reply.started:
                        headers = [rid_header, *err.headers]
                        if not any(name == b"content-type" for name, _ in err.headers):  # a backend's has its own
                            headers.insert(0, (b"content-type", b"application/json"))
                        await reply.whole(err.status, headers, err.body)
            except ClientStalled as exc:  # (an answer or an error) left unfinished: uvicorn closes the connection
                log.warning("%s: answer abandoned, connection closed", exc)
        finally:
            logs.REQUEST_ID.reset(token)

    async def _serve(
        self, scope: Scope, receive: Receive, reply: AsgiReply, match: re.Match[str], rid_header: tuple[bytes, bytes]
    ) -> None:
        state = scope["app"].state.rollway
        gateway: Gateway = state.gateway
        keys: KeyCache = state.keys
        op_path = match["op"]
        method = scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:  # before the body is read: a caller without a valid key costs no more than its headers
            key = await check_key(headers, keys, gateway.settings.gateway_auth == "keys")
        except AuthError as exc:
            raise exc.refusal() from None
        except StoreError as exc:
            raise CallError.of_store(exc) from None
        if op_path == "models":
            if method != "GET":
                raise CallError.of(405, "use GET for /v1/models", "invalid_request_error")
            if match["model"] is None:
                await self._models(gateway, reply, rid_header)
            else:
                await self._model(gateway, unquote(match["model"]), reply, rid_header)
            return
        if method != "POST":
            raise CallError.of(405, f"use POST for /v1/{op_path}", "invalid_request_error")
        if "json" not in headers.get("content-type", "").lower():  # media types ignore case (RFC 9110)
            raise CallError.of(
                415, "the request body must be JSON (Content-Type: application/json)", "invalid_request_error"
            )
        if headers.get("content-encoding", "identity").lower() != "identity":
            message = f"Content-Encoding '{headers['content-encoding'][:40]}' is not supported: send the body as is"
            raise CallError.of(415, message, "invalid_request_error")
        body = await _read_body(
            receive, headers, gateway.settings.max_body_bytes, gateway.settings.body_timeout, reply.bound
        )
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise CallError.of(400, "the request body is not valid JSON", "invalid_request_error") from None
        if not isinstance(parsed, dict):
            raise CallError.of(400, "the request body must be a JSON object", "invalid_request_error")
        model = parsed.get("model")
        if not isinstance(model, str) or not model:
            raise CallError.of(400, "you must provide a model parameter", "invalid_request_error", param="model")
        rollout = unquote(match["rollout"]) if match["rollout"] else None
        attempt = unquote(match["attempt"]) if match["attempt"] else None
        try:
            who = attribute(rollout, attempt, headers, parsed, key)
            prepared = await gateway.begin(
                capture.OPERATIONS[op_path],
                op_path,
                parsed,
                who,
                parse_traceparent(headers.get("traceparent"), headers.get("tracestate")),
            )
        except (AuthError, UnknownAlias) as exc:
            raise exc.refusal() from None
        except StoreError as exc:
            raise CallError.of_store(exc) from None
        record = prepared.record
        reply.deadline = record.deadline  # a client that does not read is not waited for past it either
        out_headers = [rid_header, (b"x-rollway-sequence-id", str(record.sequence_id).encode())]
        if record.rollout_id:
            out_headers.append((b"x-rollway-rollout-id", record.rollout_id.encode()))
            out_headers.append((b"x-rollway-attempt-id", (record.attempt_id or "").encode()))
        await self._run_watched(gateway, prepared, parsed, receive, reply, out_headers)

    async def _models(self, gateway: Gateway, reply: AsgiReply, rid_header: tuple[bytes, bytes]) -> None:
        data = [_model_object(m) for m in await gateway.store.list_models()]
        await reply.whole(
            200, [(b"content-type", b"application/json"), rid_header], orjson.dumps({"object": "list", "data": data})
        )

    async def _model(self, gateway: Gateway, alias: str, reply: AsgiReply, rid_header: tuple[bytes, bytes]) -> None:
        """``GET /v1/models/{alias}`` (the SDK's ``models.retrieve``)."""
        try:
            model = await gateway.store.get_model(alias)
        except NotFoundError:
            raise CallError.of(
                404, f"the model '{alias}' does not exist", "not_found_error", code="model_not_found"
            ) from None
        await reply.whole(200, [(b"content-type", b"application/json"), rid_header], orjson.dumps(_model_object(model)))

    async def _run_watched(
        self,
        gateway: Gateway,
        prepared: Any,
        body: dict[str, Any],
        receive: Receive,
        reply: AsgiReply,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """Run the call in this task; a client disconnect cancels it at once (and with it the upstream request).

        The call is not a task of its own: starting one costs a turn of the event loop before the request
        goes upstream. A watcher task cancels this one when the client goes away."""
        record = prepared.record
        task = asyncio.current_task()
        assert task is not None
        state = {"over": False, "disconnected": False}

        def client_gone(watcher: asyncio.Future[None]) -> None:
            if state["over"] or watcher.cancelled() or watcher.exception() is not None:
                return
            state["disconnected"] = True
            task.cancel()

        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(client_gone)
        gateway.running.started()
        try:
            await gateway.run(prepared, body, reply, headers)
        except asyncio.CancelledError:
            task.uncancel()
            state["over"] = True
            if not state["disconnected"]:  # the server's graceful shutdown ran out of time with the call in flight
                await _shut_down(gateway, record, reply, headers)
                return
            if not outcome.ended(record):
                outcome.unfinished(record, "cancelled", cancelled=True)
                await gateway.finish(record)
        except ClientStalled as exc:
            state["over"] = True
            if not outcome.ended(record):
                outcome.unfinished(record, "client_stalled", str(exc))
                await gateway.finish(record)
            raise
        except Exception as exc:
            state["over"] = True
            err = _call_error(exc, gateway)
            if err is None:
                raise
            if not outcome.ended(record):
                outcome.failed(record, err)
                await gateway.finish(record)
            err.counted = True
            # The call has its ids (and its span): the error tells them like any answer (not the request id:
            # the caller adds that to every answer).
            own = {name for name, _ in err.headers}  # a refusal already names its sequence id
            err.headers = [*(h for h in headers if h[0].startswith(b"x-rollway-") and h[0] not in own), *err.headers]
            raise err from None
        finally:
            state["over"] = True
            watcher.cancel()
            prepared.release()
            gateway.running.done()


async def _shut_down(
    gateway: Gateway, record: CallRecord, reply: AsgiReply, headers: list[tuple[bytes, bytes]]
) -> None:
    """A call uvicorn cancelled as it stops (``ROLLWAY_SHUTDOWN_TIMEOUT`` passed): its span says so (with the
    tokens that went by), and its client is told, as for any error — an envelope, or for a stream that started a
    final error event instead of ``[DONE]`` — if it takes it within ``SHUTDOWN_WRITE_TIMEOUT``. The lifespan waits
    for these calls before it closes the store (``Running.ended``)."""
    err = outcome.shutting_down()
    if not outcome.ended(record):
        outcome.unfinished(record, "shutdown", err.body.decode(), status=None if reply.started else err.status)
        await gateway.finish(record)
    reply.write_timeout = min(reply.write_timeout, SHUTDOWN_WRITE_TIMEOUT)
    with contextlib.suppress(ClientStalled):
        if not reply.started:
            await reply.whole(503, [(b"content-type", b"application/json"), *headers], err.body)
        elif not reply.sized and not reply.ended:
            await reply.body(b"data: " + err.body + b"\n\n", more=False)


def _call_error(exc: Exception, gateway: Gateway) -> CallError | None:
    """The answer to an exception of a call: itself if it is one; a store error (or a database failure the store
    did not name, 503) by its kind; anything else a 500 in the envelope, logged (once per kind per interval). None
    for ``ClientStalled``: nothing more can be said to that client."""
    if isinstance(exc, CallError):
        return exc
    if isinstance(exc, ClientStalled):
        return None
    failure = exc if isinstance(exc, StoreError) else unavailable(exc)
    if failure is not None:
        return CallError.of_store(failure)
    gateway.store.failures.log(log, f"call:{type(exc).__name__}", "call failed", exc_info=exc)
    return CallError.of(500, f"internal error: {type(exc).__name__}", "server_error")


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    """``send`` that adds ``header`` to the response start."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), header]
        await send(message)

    return wrapped


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _read_body(receive: Receive, headers: dict[str, str], limit: int, timeout: float, bound: Bound) -> bytes:
    """The whole body, within ``limit`` bytes and ``timeout`` seconds (a body sent a byte at a time, or never
    finished, would hold its connection for ever): 408 after, and the connection is closed."""
    try:
        with bound.within(timeout):
            return await _body(receive, headers, limit)
    except TimeoutError:
        err = CallError.of(408, f"the request body did not arrive within {timeout:g} s", "invalid_request_error")
        err.headers.append((b"connection", b"close"))  # the rest of the body may still come: not a next request
        raise err from None


async def _body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise CallError.of(413, f"the request body is larger than {limit} bytes", "invalid_request_error")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise CallError.of(400, "the client went away", "invalid_request_error")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise CallError.of(413, f"the request body is larger than {limit} bytes", "invalid_request_error")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _model_object(model: ModelAlias) -> dict[str, Any]:
    """An alias as OpenAI's ``/v1/models`` lists a model."""
    return {"id": model.alias, "object": "model", "created": int(model.created_time), "owned_by": "rollway"}
