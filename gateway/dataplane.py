"""The OpenAI-compatible routes, as a pure ASGI app in front of the FastAPI app (no per-call framework
overhead, full control of streaming and of client disconnects). Paths it does not own go to ``fallback``.

Routes: ``POST /v1/{chat/completions,completions,responses,embeddings}`` and ``GET /v1/models``, also under
``/rollout/{rollout_id}/v1/...`` and ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/...``; and Agent-lightning
1.0's ``POST /proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/...`` (``gateway.controlled``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson

from rollway import logs
from rollway.gateway import capture, controlled
from rollway.gateway.attribution import Attribution, KeyCache, attribute, authenticated, check_key
from rollway.gateway.bounds import Bound
from rollway.gateway.call import Call, call_error
from rollway.gateway.controlled import ControlledProxy
from rollway.gateway.errors import AuthError, CallError, ClientStalled, UnknownAlias
from rollway.gateway.proxy import Gateway
from rollway.gateway.record import parse_traceparent
from rollway.gateway.reply import Reply
from rollway.store import ModelAlias, NotFoundError, StoreError
from rollway.store.controlled import ATTEMPT_ATTR

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


@dataclass
class Serving:
    """What the data plane serves with, once the lifespan has started it: the gateway and its key cache."""

    gateway: Gateway
    keys: KeyCache
    controlled: ControlledProxy | None = None  # Agent-lightning 1.0's ``/proxy/...`` (``gateway.controlled``)


class DataPlane:
    """Pure ASGI middleware: serves the data-plane paths, hands everything else to ``fallback``. It serves with
    what the lifespan hands it (``serve_with``); until then, and once the lifespan has ended, a call is a 503."""

    def __init__(self, fallback: ASGIApp) -> None:
        self.fallback = fallback
        self.serving: Serving | None = None

    def serve_with(self, serving: Serving | None) -> None:
        self.serving = serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        rid = logs.request_id(scope["headers"])
        token = logs.REQUEST_ID.set(rid)
        rid_header = (logs.HEADER, rid.encode())
        try:
            match = PATH.match(scope["path"]) or controlled.PATH.match(scope["path"])
            if match is None:
                await self.fallback(scope, receive, _with_header(send, rid_header))
                return
            serving = self.serving
            if serving is None:
                await _not_serving(send, rid_header)
                return
            gateway = serving.gateway
            reply = Reply(send, gateway.settings.write_timeout, gateway.sweeper.bound())
            try:
                try:
                    await self._serve(serving, scope, receive, reply, match, rid_header)
                except ClientStalled:
                    raise
                except Exception as exc:  # refused before the call began: no span, counted as a rejection
                    err = call_error(exc, gateway)
                    gateway.metrics.observe_rejected(match["op"], err.status)
                    await reply.error(err, [rid_header])
            except ClientStalled as exc:  # (an answer or an error) left unfinished: uvicorn closes the connection
                log.warning("%s: answer abandoned, connection closed", exc)
        finally:
            logs.REQUEST_ID.reset(token)

    async def _serve(
        self,
        serving: Serving,
        scope: Scope,
        receive: Receive,
        reply: Reply,
        match: re.Match[str],
        rid_header: tuple[bytes, bytes],
    ) -> None:
        gateway, keys = serving.gateway, serving.keys
        op_path = match["op"]
        method = scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if method == "POST":  # a call past the limit costs no more than its headers: its body is never read
            _shed(gateway)
        if match.re is controlled.PATH:
            await self._serve_controlled(serving, scope, receive, reply, match, headers, rid_header)
            return
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
        _check_json(headers)
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
        except AuthError as exc:
            raise exc.refusal() from None
        admin_token = gateway.settings.admin_token
        call = await _begin(gateway, op_path, parsed, who, headers, lambda: authenticated(headers, key, admin_token))
        await call.run(reply, receive, _call_headers(call, rid_header))

    async def _serve_controlled(
        self,
        serving: Serving,
        scope: Scope,
        receive: Receive,
        reply: Reply,
        match: re.Match[str],
        headers: dict[str, str],
        rid_header: tuple[bytes, bytes],
    ) -> None:
        """A call through ``/proxy/...`` (``gateway.controlled``): checked in the order Agent-lightning's server
        checks it, then served as any call."""
        gateway, proxy = serving.gateway, serving.controlled
        if proxy is None:
            raise CallError.of(404, "the controlled proxy is not served here", "not_found_error")
        if scope["method"] != "POST":
            raise CallError.of(405, "use POST for /proxy/...", "invalid_request_error")
        try:
            await proxy.check_auth(headers)
        except StoreError as exc:
            raise CallError.of_store(exc) from None
        mode, op_path = match["mode"], match["op"]
        if mode not in controlled.MODES:
            raise CallError.of(404, f"Unsupported proxy mode: {mode}", "not_found_error")
        if op_path not in controlled.OPERATIONS:
            raise CallError.of(404, f"Unsupported upstream path: {op_path}", "not_found_error")
        _check_json(headers)
        rollout = unquote(match["rollout"])
        try:
            if not await gateway.store.controlled_live(rollout):
                raise CallError.of(404, f"Rollout not found: {rollout}", "not_found_error")
        except StoreError as exc:
            raise CallError.of_store(exc) from None
        body = await _read_body(
            receive, headers, gateway.settings.max_body_bytes, gateway.settings.body_timeout, reply.bound
        )
        try:
            parsed = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            raise CallError.of(400, "Invalid JSON in request body", "invalid_request_error") from None
        if not isinstance(parsed, dict):
            raise CallError.of(400, "Request body must be a JSON object", "invalid_request_error")
        try:
            state = await proxy.pause()
            if state.paused:
                raise controlled.paused_error(state)
            _, alias = await proxy.target()
        except StoreError as exc:
            raise CallError.of_store(exc) from None
        # (``check_auth`` let it in: an admin credential, or none configured; an unknown alias is named in full.)
        who = Attribution(rollout, None, "path", tags=((ATTEMPT_ATTR, unquote(match["attempt"])),))
        call = await _begin(gateway, op_path, proxy.prepare(parsed, mode, op_path, alias), who, headers)
        await call.run(reply, receive, _call_headers(call, rid_header))

    async def _models(self, gateway: Gateway, reply: Reply, rid_header: tuple[bytes, bytes]) -> None:
        data = [_model_object(m) for m in await gateway.store.list_models()]
        await reply.whole(
            200, [(b"content-type", b"application/json"), rid_header], orjson.dumps({"object": "list", "data": data})
        )

    async def _model(self, gateway: Gateway, alias: str, reply: Reply, rid_header: tuple[bytes, bytes]) -> None:
        """``GET /v1/models/{alias}`` (the SDK's ``models.retrieve``)."""
        try:
            model = await gateway.store.get_model(alias)
        except NotFoundError:
            raise CallError.of(
                404, f"the model '{alias}' does not exist", "not_found_error", code="model_not_found"
            ) from None
        await reply.whole(200, [(b"content-type", b"application/json"), rid_header], orjson.dumps(_model_object(model)))


async def _begin(
    gateway: Gateway,
    op_path: str,
    body: dict[str, Any],
    who: Attribution,
    headers: dict[str, str],
    listed: Callable[[], bool] = lambda: True,
) -> Call:
    """The call begun (``Call.begin``); what refuses it before that becomes its ``CallError``. A process at its
    ``max_calls_in_flight`` refuses it first (``_shed``), before it takes a sequence id. ``listed``: whether
    an unknown alias's 404 may name the known ones (``attribution.authenticated``, asked only then)."""
    _shed(gateway)  # again: the calls that passed the first look while their bodies were read count now
    gateway.running.starting += 1  # counted from here: ``run`` counts it as running before its first wait
    try:
        return await Call.begin(
            gateway,
            capture.OPERATIONS[op_path],
            op_path,
            body,
            who,
            parse_traceparent(headers.get("traceparent"), headers.get("tracestate")),
        )
    except AuthError as exc:
        raise exc.refusal() from None
    except UnknownAlias as exc:
        raise exc.refusal(listed=listed()) from None
    except StoreError as exc:
        raise CallError.of_store(exc) from None
    finally:
        gateway.running.starting -= 1


def _shed(gateway: Gateway) -> None:
    """Refuse a call (``overloaded``) while the process runs its ``max_calls_in_flight``."""
    if gateway.running.over(gateway.settings.max_calls_in_flight):
        gateway.metrics.shed.inc()
        raise overloaded(gateway.settings.max_calls_in_flight)


def overloaded(limit: int) -> CallError:
    """A call past the process's limit: 503 with ``Retry-After``, which the OpenAI SDKs wait out and retry."""
    message = f"the server is running its limit of {limit} calls (ROLLWAY_MAX_CALLS_IN_FLIGHT): retry shortly"
    err = CallError.of(503, message, "service_unavailable", code="overloaded")
    err.headers.append((b"retry-after", b"1"))
    return err


def _call_headers(call: Call, rid_header: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """The headers every answer of a begun call carries: its request id, sequence id, rollout and attempt."""
    record = call.record
    out = [rid_header, (b"x-rollway-sequence-id", str(record.sequence_id).encode())]
    if record.rollout_id:
        out.append((b"x-rollway-rollout-id", record.rollout_id.encode()))
        out.append((b"x-rollway-attempt-id", (record.attempt_id or "").encode()))
    return out


async def _not_serving(send: Send, rid_header: tuple[bytes, bytes]) -> None:
    """A call before the lifespan started the gateway, or after it stopped it."""
    body = CallError.of(503, "the server is not serving yet (or any more)", "service_unavailable").body
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), rid_header]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    """``send`` that adds ``header`` to the response start."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), header]
        await send(message)

    return wrapped


def _check_json(headers: dict[str, str]) -> None:
    """415 unless the body is declared JSON: ``application/json`` or ``application/*+json``, with any parameters
    (``; charset=utf-8``), in any case (RFC 9110). Every OpenAI client sends ``application/json``; a web page that
    posts across sites without a CORS preflight can send only ``text/plain``, a form's types or none, and none of
    those passes."""
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        message = "the request body must be JSON (Content-Type: application/json)"
        raise CallError.of(415, message, "invalid_request_error")


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
