"""``Gateway``: what every call of the data plane shares (the store, the alias registry, the router, the backend
connections, the metrics and the span exporter), and the tries of one call (``connect``): backend choice, retries
and failover, all before the first byte reaches the client.

A call itself is a ``gateway.call.Call``, driven by the ASGI layer (``gateway.dataplane``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from rollway.gateway import capture
from rollway.gateway.agent_models import AgentModels
from rollway.gateway.bounds import Sweeper
from rollway.gateway.capture import Injected, StreamOptionsRefusals
from rollway.gateway.errors import CallError, UpstreamFailure
from rollway.gateway.failover import Tries
from rollway.gateway.leases import Lease
from rollway.gateway.litellm_backend import LiteLLMBackend
from rollway.gateway.masking import without_key
from rollway.gateway.metrics import Metrics
from rollway.gateway.record import CallRecord, traceparent
from rollway.gateway.registry import ModelRegistry
from rollway.gateway.routing import Router
from rollway.gateway.scoring import Scorer
from rollway.gateway.streaming import json_answer
from rollway.gateway.upstream import Answer, Upstream, passthrough_headers, retry_after
from rollway.settings import Settings
from rollway.store import Backend, Span, Store

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
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.settings = settings
        self.clock = clock  # when a backend's Retry-After ends (``Tries``), and
        self.sleep = sleep  # the wait between a call's tries: both handed in, so a test can run them on its own time
        self.store = store
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.exporter = exporter
        self.upstream = Upstream(connect_timeout=settings.connect_timeout, read_timeout=settings.read_timeout)
        self.litellm = LiteLLMBackend()  # the calls of ``litellm`` backends (LiteLLM imported on the first)
        self.refusals = StreamOptionsRefusals()  # backends that refused the ``stream_options`` added for usage
        self.running = Running()  # the calls the data plane is running
        self.sweeper = Sweeper()  # bounds the data plane's waits on its clients
        self.agent_models = AgentModels(store)  # the model of an agent server's rollout that names none we know
        self.scorer = Scorer(self.upstream, enabled=settings.score_missing_logprobs)  # logprobs the engine left out

    async def start(self) -> None:
        await self.upstream.start()
        self.sweeper.start()

    async def close(self) -> None:
        await self.sweeper.close()
        await self.litellm.close()
        await self.upstream.close()

    def observe(self, record: CallRecord, span: Span, written: bool) -> None:
        """Count a call whose span is written (or could not be), and offer the span to the exporter."""
        self.metrics.observe_call(record, written)
        if record.completed and record.alias is not None:
            self.registry.watch.observe(record.alias, record.backend, record.trainable, record.logprobs_complete)
        if self.exporter is not None and int(record.trace_flags, 16) & 1:  # not when the caller did not sample it
            self.exporter.offer(span)

    # -- the call itself ---------------------------------------------------------------------------------

    async def connect(
        self, record: CallRecord, lease: Lease, path: str, body: dict[str, Any]
    ) -> tuple[Answer, Backend, Injected, bytes | None]:
        """Send the call to a backend, retrying and failing over (``gateway.failover``) until an answer we will
        pass on arrives (with its whole body, read, unless it is passed on as a stream). Each try holds a slot of
        its backend (``max_concurrency``) until it ends: the caller gives back the slot of the try it gets."""
        config = lease.config
        tries: Tries | None = None  # made on the first failure: a call whose first try answers needs none
        attempt, last_error = 0, None
        deadline, refused = record.deadline, ""  # refused: the backend that refused our ``stream_options``
        backend = self.router.take(config.backends, record.rollout_id)  # the fast path: a free slot at once
        while True:
            if backend is None:  # (asked again without ``stream_options``: the same backend, the same slot)
                tries = tries or Tries(config.backends, self.clock)
                backend = await self._slot(record, tries, last_error)
            if record.backend is not None and backend.backend_id != record.backend.backend_id:
                record.failovers += 1
            if backend.kind == "auto":
                backend = await self._resolved(backend)
            usage = refused != backend.backend_id and backend.backend_id not in self.refusals
            upstream_body, injected = capture.prepare(record.operation, body, backend, config.sampling, usage)
            record.backend = backend
            record.model_version = backend.version or lease.version
            retry_wait: float | None = None
            try:
                response = await self._send(record, path, backend, upstream_body)
                if response.status not in RETRY_STATUSES:
                    limit = self.settings.max_response_bytes
                    if injected.usage and await self.refusals.refused(response, backend, limit):
                        refused = backend.backend_id
                        continue  # asked again at once, without the ``stream_options`` it refused
                    if refused == backend.backend_id:
                        self.refusals.remember(backend, response.status)
                    whole = None
                    if not _streamed(record, response):  # a body that breaks off is retried: the client has nothing
                        whole = await response.read(limit)
                    return response, backend, injected, whole
                error_body = without_key(await response.read_error(), backend)
            except UpstreamFailure as exc:
                retried = exc.kind in RETRIED_FAILURES
                self.router.end_try(backend.backend_id, ok=False, counts_as_failure=retried)
                if exc.kind == "connect":
                    self.registry.kinds.forget(backend)
                if exc.kind == "response_too_large":  # (not retried: the backend would say it again)
                    raise CallError.of(502, str(exc), "upstream_error", code=exc.kind) from exc
                if exc.kind == "redirect":  # (not retried either: a backend's redirect is its configuration)
                    err = CallError.of(502, str(exc), "upstream_error", code="upstream_redirect")
                    err.error_type = "upstream_redirect"
                    raise err from exc
                if not retried:
                    raise CallError.of(504, str(exc), "timeout", code=exc.kind) from exc
                last_error = CallError.of(502, str(exc), "upstream_error", code=RETRIED_FAILURES[exc.kind])
            except BaseException:  # cancelled (the client left), or broken: the slot is given back all the same
                self.router.end_try(backend.backend_id, ok=False, counts_as_failure=False)
                raise
            else:
                self.router.end_try(backend.backend_id, ok=False, counts_as_failure=response.status >= 500)
                if response.status >= 500:
                    self.registry.kinds.forget(backend)
                last_error = CallError(response.status, error_body, passthrough_headers(response))
                if response.status == 429:
                    retry_wait = retry_after(response.headers.get("Retry-After"), self.settings.retry_max_wait)
            tries = tries or Tries(config.backends, self.clock)
            tries.failed(backend.backend_id, retry_wait)
            backend = None
            if attempt >= self.settings.upstream_retries:
                raise last_error
            pause = tries.pause(attempt + 1, self.settings.retry_max_wait)
            if pause > 0 and deadline is not None and time.time() + pause >= deadline:
                raise last_error  # the rollout's deadline would pass first: no use waiting for it
            attempt += 1
            record.retry_count = attempt
            if pause > 0:
                await self.sleep(pause)

    async def _resolved(self, backend: Backend) -> Backend:
        """An ``auto`` backend as the engine it is (asked of it on its first call); its slot is given back if the
        call is cancelled meanwhile."""
        try:
            return await self.registry.kinds.resolve(backend)
        except BaseException:
            self.router.end_try(backend.backend_id, ok=False, counts_as_failure=False)
            raise

    async def _send(self, record: CallRecord, path: str, backend: Backend, upstream_body: dict[str, Any]) -> Answer:
        """One try: the backend's answer, unread."""
        deadline = record.deadline
        if backend.kind == "litellm":
            # LiteLLM's one timeout bounds each read (httpx), like ``read_timeout`` does for aiohttp.
            timeout = self.settings.read_timeout
            if deadline is not None:
                timeout = max(0.001, min(timeout, deadline - time.time()))
            return await self.litellm.call(backend, path, upstream_body, timeout)
        return await self.upstream.send(
            backend,
            path,
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
        err.error_type = "model_busy"
        raise err


def _streamed(record: CallRecord, response: Answer) -> bool:
    """Whether the answer is passed on as a stream (a backend may answer a streamed request with one JSON body,
    e.g. embeddings: that is passed as a whole answer)."""
    return record.stream and response.status == 200 and not json_answer(response)


class Running:
    """How many calls the data plane is running; at shutdown the lifespan waits for none (``wait_for_none``): the calls
    uvicorn cancelled are writing their spans, which the store must still be open for."""

    def __init__(self) -> None:
        self.count = 0
        self.starting = 0  # calls being begun (``dataplane._begin``): not running yet, already taken on
        self._none = asyncio.Event()
        self._none.set()

    def over(self, limit: int) -> bool:
        """Whether ``limit`` calls (0: no limit) are running or being begun: a new one is refused."""
        return 0 < limit <= self.count + self.starting

    def add(self) -> None:
        self.count += 1
        self._none.clear()

    def remove(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._none.set()

    async def wait_for_none(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no call to be running; whether none is."""
        try:
            async with asyncio.timeout(timeout):
                await self._none.wait()
        except TimeoutError:
            return False
        return True
