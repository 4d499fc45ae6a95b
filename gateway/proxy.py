"""One LLM call from arrival to span: attribution, sequence id, pause gate, backend choice, retries and
failover (only before the first byte reached the client), streaming pass-through, and the span.

``Gateway.handle`` is driven by the ASGI layer (``gateway.dataplane``), which owns the wire: it gives a
``Reply`` object to send headers and body parts, and cancels the call when the client disconnects.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from rollway.gateway import capture, outcome, relay
from rollway.gateway.attribution import Attribution
from rollway.gateway.bounds import Sweeper
from rollway.gateway.call import Prepared, Reply, Running
from rollway.gateway.capture import Injected
from rollway.gateway.errors import AliasPaused, CallError, UnknownAlias, UpstreamFailure
from rollway.gateway.failover import Tries
from rollway.gateway.metrics import Metrics
from rollway.gateway.record import CallRecord, Trace, traceparent
from rollway.gateway.registry import Arrival, ModelRegistry
from rollway.gateway.routing import Router
from rollway.gateway.streaming import json_answer, json_object
from rollway.gateway.upstream import (
    Upstream,
    passthrough_headers,
    read_quietly,
    read_whole,
    retry_after,
    wait,
    without_key,
)
from rollway.settings import Settings
from rollway.store import Backend, Span, Store, StoreError

if TYPE_CHECKING:
    from rollway.gateway.otlp_export import SpanExporter

log = logging.getLogger("rollway.gateway")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Failures of a try that are retried (another try, maybe on another backend) → the error code if none succeeds.
RETRIED_FAILURES = {"connect": "backend_unreachable", "broken": "stream_interrupted"}


class Gateway:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        registry: ModelRegistry,
        router: Router,
        metrics: Metrics,
        exporter: SpanExporter | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.exporter = exporter
        self.upstream = Upstream(connect_timeout=settings.connect_timeout, read_timeout=settings.read_timeout)
        self.running = Running()  # the calls the data plane is running
        self.sweeper = Sweeper()  # bounds the data plane's waits on its clients

    async def start(self) -> None:
        await self.upstream.start()
        self.sweeper.start()

    async def close(self) -> None:
        await self.sweeper.close()
        await self.upstream.close()

    async def begin(
        self, operation: str, path: str, body: dict[str, Any], who: Attribution, trace: Trace | None
    ) -> Prepared:
        """Everything that happens before the backend is called. Raises CallError with nothing recorded for
        bad input (unknown alias, unknown/stale rollout); from here on every call gets exactly one span."""
        alias = body["model"]
        await self.registry.state(alias)  # unknown alias → UnknownAlias, before any sequence id is taken
        arrival = self.registry.arrival(alias)  # in flight for a drain from before the catalog is read
        try:
            ticket = await self.store.begin_call(who.rollout_id, who.attempt_id)
            self.registry.observe(ticket.catalog_revision)  # a change made through another replica: reload first
            record = CallRecord(
                operation=operation,
                alias=alias,
                request=body,
                stream=bool(body.get("stream")),
                start_time=time.time(),
                rollout_id=ticket.rollout_id,
                attempt_id=ticket.attempt_id,
                sequence_id=ticket.sequence_id,
            )
        except BaseException:
            arrival.done()  # ``admit`` ends it from here on
            raise
        if trace is not None:
            record.trace_id, record.parent_id = trace.trace_id, trace.parent_id
            record.trace_flags, record.trace_state = trace.flags, trace.state
        record.deadline = ticket.deadline
        record.osmosis = who.osmosis
        prepared = Prepared(record=record, lease=None, path=path)
        if self.registry.paused(alias) and self.settings.pause_wait_seconds > 0:
            # It waits in ``run``, where a client that leaves ends it; not a call to drain meanwhile, since it
            # leases what is current when the alias resumes (as ``admit`` counts a call that waits).
            arrival.done()
        else:
            await self._admit(prepared, alias, arrival)
        return prepared

    async def _admit(self, prepared: Prepared, alias: str, arrival: Arrival | None) -> None:
        """The call's lease on its alias, waiting while the alias is paused; refused with its span written."""
        record = prepared.record
        try:
            lease = await self.registry.admit(alias, self.settings.pause_wait_seconds, arrival)
        except AliasPaused as exc:
            raise await self._refused(record, exc.refusal(), "model_paused") from None
        except UnknownAlias as exc:  # deleted while the call waited for it to resume
            raise await self._refused(record, exc.refusal()) from None
        except StoreError as exc:  # the store failed while the call re-read the paused alias
            raise await self._refused(record, CallError.of(503, exc.message, "service_unavailable")) from None
        except Exception as exc:  # anything else on the way (a database error the store did not wrap)
            log.exception(
                "call %s/%s seq %s failed before it was sent", record.rollout_id, record.attempt_id, record.sequence_id
            )
            err = CallError.of(500, f"internal error: {type(exc).__name__}", "server_error")
            raise await self._refused(record, err) from None
        record.model_version = lease.version
        prepared.lease, prepared.in_flight = lease, self.metrics.call_started(alias)

    async def _refused(self, record: CallRecord, err: CallError, error_type: str | None = None) -> CallError:
        """A call refused after its sequence id was taken: its span says why (no gap in the sequence)."""
        err.headers.append((b"x-rollway-sequence-id", str(record.sequence_id).encode()))
        return await self._record_refusal(record, err, error_type)

    async def _record_refusal(self, record: CallRecord, err: CallError, error_type: str | None) -> CallError:
        outcome.failed(record, err, error_type)
        await self.finish(record)
        err.counted = True
        return err

    async def finish(self, record: CallRecord) -> bool:
        """Write the call's span (durably, before the client is told the call ended); False if the store could
        not. A completion whose span is not on disk is then not handed over as one (``not_recorded``)."""
        record.end_time = record.end_time or time.time()
        written = True
        span = record.span()
        try:
            await self.store.record_call(span)
        except StoreError as exc:  # (the store logs the database's failure itself)
            written = False
            ids = (record.rollout_id, record.attempt_id, record.sequence_id, record.alias)
            message = "span of call %s/%s seq %s (model %s) not written: %s"
            self.store.failures.log(log, "span not written", message, *ids, exc.message)
            if outcome.withheld(record):
                span = record.span()
        except asyncio.CancelledError:
            # The client left while the span was being written: the store's writer goes on with the write (it is
            # shielded from its caller), so the call is counted and exported as its span says all the same.
            self._observe(record, span, True)
            raise
        self._observe(record, span, written)
        return written

    def _observe(self, record: CallRecord, span: Span, written: bool) -> None:
        self.metrics.observe_call(record, written)
        if record.completed and record.alias is not None:
            self.registry.watch.observe(record.alias, record.backend, record.trainable)
        if self.exporter is not None and int(record.trace_flags, 16) & 1:  # not when the caller did not sample it
            self.exporter.offer(span)

    # -- the call itself ---------------------------------------------------------------------------------

    async def connect(
        self, prepared: Prepared, body: dict[str, Any]
    ) -> tuple[aiohttp.ClientResponse, Backend, Injected, bytes | None]:
        """Send the call to a backend, retrying and failing over (``gateway.failover``) until a response we will
        pass on arrives (with its whole body, read, unless it is passed on as a stream). Each try holds a slot of
        its backend (``max_concurrency``) until it ends."""
        record, lease = prepared.record, prepared.lease
        assert lease is not None  # ``run`` admitted it
        config = lease.config
        tries: Tries | None = None  # made on the first failure: a call whose first try answers needs none
        attempt, last_error = 0, None
        deadline, refused = record.deadline, ""  # refused: the backend that refused our ``stream_options``
        backend = self.router.take(config.backends, record.rollout_id)  # the fast path: a free slot at once
        while True:
            if backend is None:  # (asked again without ``stream_options``: the same backend, the same slot)
                tries = tries or Tries(config.backends)
                backend = await self._slot(record, tries, last_error)
            if record.backend is not None and backend.backend_id != record.backend.backend_id:
                record.failovers += 1
            if backend.kind == "auto":
                backend = await self._resolved(backend)
            usage = refused != backend.backend_id
            upstream_body, injected = capture.prepare(record.operation, body, backend, config.sampling, usage)
            record.backend = backend
            record.model_version = backend.version or lease.version
            retry_wait: float | None = None
            try:
                response = await self._send(prepared, backend, upstream_body)
                if response.status not in RETRY_STATUSES:
                    if injected.usage and await capture.refused_stream_options(response, backend):
                        refused = backend.backend_id
                        continue  # asked again at once, without the ``stream_options`` it refused
                    if refused == backend.backend_id:
                        capture.asked_again(backend, response.status)
                    whole = None
                    if not _streamed(record, response):  # a body that breaks off is retried: the client has nothing
                        whole = await read_whole(response, self.settings.max_response_bytes)
                    return response, backend, injected, whole  # the try's slot is ``run``'s to give back
                error_body = without_key(await read_quietly(response), backend)
            except UpstreamFailure as exc:
                retried = exc.kind in RETRIED_FAILURES
                self.router.finished(backend.backend_id, ok=False, counts_as_failure=retried)
                if exc.kind == "connect":
                    self.registry.kinds.forget(backend)
                if exc.kind == "response_too_large":  # (not retried: the backend would say it again)
                    raise CallError.of(502, str(exc), "upstream_error", code=exc.kind) from exc
                if not retried:
                    raise CallError.of(504, str(exc), "timeout", code=exc.kind) from exc
                last_error = CallError.of(502, str(exc), "upstream_error", code=RETRIED_FAILURES[exc.kind])
            except BaseException:  # cancelled (the client left), or broken: the slot is given back all the same
                self.router.finished(backend.backend_id, ok=False, counts_as_failure=False)
                raise
            else:
                self.router.finished(backend.backend_id, ok=False, counts_as_failure=response.status >= 500)
                if response.status >= 500:
                    self.registry.kinds.forget(backend)
                last_error = CallError(response.status, error_body, passthrough_headers(response))
                if response.status == 429:
                    retry_wait = retry_after(response.headers.get("Retry-After"), self.settings.retry_max_wait)
            tries = tries or Tries(config.backends)
            tries.failed(backend.backend_id, retry_wait)
            backend = None
            if attempt >= self.settings.upstream_retries:
                raise last_error
            pause = tries.pause(attempt + 1, self.settings.retry_max_wait)
            if pause > 0 and deadline is not None and time.time() + pause >= deadline:
                raise last_error  # the rollout's deadline would pass first: no use waiting for it
            attempt += 1
            record.retry_count = attempt
            await wait(pause)

    async def _resolved(self, backend: Backend) -> Backend:
        """An ``auto`` backend as the engine it is (asked of it on its first call); its slot is given back if the
        call is cancelled meanwhile."""
        try:
            return await self.registry.kinds.resolve(backend)
        except BaseException:
            self.router.finished(backend.backend_id, ok=False, counts_as_failure=False)
            raise

    async def _send(self, prepared: Prepared, backend: Backend, upstream_body: dict[str, Any]) -> Any:
        """One try: the backend's response (aiohttp's, or LiteLLM's look-alike), unread."""
        record, deadline = prepared.record, prepared.record.deadline
        if backend.kind == "litellm":
            from rollway.gateway import litellm_backend  # LiteLLM only when such a backend serves a call

            # LiteLLM's one timeout bounds each read (httpx), like ``read_timeout`` does for aiohttp.
            timeout = self.settings.read_timeout
            if deadline is not None:
                timeout = max(0.001, min(timeout, deadline - time.time()))
            return await litellm_backend.call(backend, prepared.path, upstream_body, timeout)
        return await self.upstream.send(
            backend,
            prepared.path,
            orjson.dumps(upstream_body),
            trace=(traceparent(record.trace_id, record.span_id, record.trace_flags), record.trace_state),
            deadline=deadline,
        )

    async def _slot(self, record: CallRecord, tries: Tries, last_error: CallError | None = None) -> Backend:
        """The backend of the call's next try, its slot taken: waiting while every backend the call may use is at
        its ``max_concurrency``, up to ``ROLLWAY_PAUSE_WAIT_SECONDS`` or the rollout's deadline; then 429, or, for
        a retry, the error of the try before (``last_error``: what the backend said is what the call failed of)."""
        bound = self.settings.pause_wait_seconds
        if record.deadline is not None:
            bound = min(bound, record.deadline - time.time())
        pick = functools.partial(tries.pick, self.router, record.rollout_id)
        backend = await self.router.acquire(record.alias or "", tries.backends, pick, bound, tries.next_ready)
        if backend is not None:
            return backend
        if last_error is not None:
            raise last_error
        message = f"every backend of model '{record.alias}' is busy (at its max_concurrency); retry later"
        err = CallError.of(429, message, "rate_limit_exceeded", code="model_busy")
        err.headers.append((b"retry-after", str(int(max(1.0, self.settings.pause_wait_seconds))).encode()))
        raise await self._record_refusal(record, err, "model_busy")

    async def run(
        self, prepared: Prepared, body: dict[str, Any], reply: Reply, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """Forward the call and send the answer through ``reply``; the span is written before the end."""
        record = prepared.record
        if prepared.lease is None:  # the alias was paused when the call arrived
            await self._admit(prepared, body["model"], None)
        response, backend, injected, whole = await self.connect(prepared, body)
        ok = response.status < 500
        try:
            if whole is None:
                # (a backend may answer a streamed request with one JSON body, e.g. embeddings: passed as such)
                limit = self.settings.max_response_bytes
                await relay.stream(self.finish, limit, record, response, injected, reply, headers)
            else:
                await self._whole(record, response, whole, injected, reply, headers)
        except BaseException:
            response.close()  # closing (not releasing) the connection tells the backend to stop generating
            raise
        else:
            response.release()
        finally:
            self.router.finished(backend.backend_id, ok=ok, counts_as_failure=not ok)

    async def _whole(
        self,
        record: CallRecord,
        response: aiohttp.ClientResponse,
        whole: bytes,
        injected: Injected,
        reply: Reply,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        # read whole by ``connect``; a backend echoing its key (an answer quoting the request) is masked
        raw = without_key(whole, record.backend)
        record.ttft_seconds = time.time() - record.start_time
        out, parsed = raw, None
        if response.status < 400:
            parsed = json_object(raw)
            if parsed is None:
                raise CallError.of(
                    502, "the backend's answer is not a JSON object", "upstream_error", code="bad_response"
                )
            if record.osmosis:
                answer = capture.answer(parsed, injected, record.operation) if injected.any else parsed
                out = orjson.dumps(capture.with_traingate_fields(answer, parsed, record.operation))
            elif injected.any:
                out = orjson.dumps(capture.answer(parsed, injected, record.operation))
        outcome.answered(record, response.status, raw, parsed)
        if not await self.finish(record) and response.status < 400:
            raise outcome.not_recorded()
        content_type = response.headers.get("Content-Type", "application/json").encode()
        await reply.whole(response.status, [(b"content-type", content_type), *headers], out)


def _streamed(record: CallRecord, response: Any) -> bool:
    """Whether the answer is passed on as a stream (a backend may answer a streamed request with one JSON body,
    e.g. embeddings: that is passed as a whole answer)."""
    return record.stream and response.status == 200 and not json_answer(response)
