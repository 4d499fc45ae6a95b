"""Optional export of the gateway's own call spans to an external OpenTelemetry collector (OTLP/HTTP, protobuf).

Off unless ``otlp_export_endpoint`` is set. A call only appends its span to a bounded in-memory queue
(``offer``: no I/O, no await); a background task owned by the lifespan sends batches. When the queue is full
the span is dropped and counted (``rollway_otlp_export_spans_total{outcome="dropped"}``), so a slow or dead
collector never slows a call and never grows memory without bound. A batch whose request fails is dropped and
counted as ``failed`` (the store keeps every span; the export is a copy for tracing tools, not the record).

What leaves the process: names, ids, timings, status and the small attributes (model, backend, tokens,
latency, rollout/attempt/sequence ids). Request and response bodies, token ids and logprobs stay in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from rollway.gateway.metrics import Metrics
from rollway.store import Span

log = logging.getLogger("rollway.otlp_export")

HEAVY_ATTRIBUTES = frozenset(
    {
        "rollway.request",
        "rollway.response",
        "rollway.prompt_token_ids",
        "rollway.response_token_ids",
        "rollway.response_logprobs",
        "rollway.choices",
    }
)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
STATUS_CODES = {"UNSET": Status.STATUS_CODE_UNSET, "OK": Status.STATUS_CODE_OK, "ERROR": Status.STATUS_CODE_ERROR}


class SpanExporter:
    def __init__(
        self,
        endpoint: str,
        metrics: Metrics,
        *,
        queue_size: int = 10_000,
        batch_size: int = 512,
        interval: float = 1.0,
        timeout: float = 5.0,
    ) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.queue_size = queue_size
        self.batch_size = batch_size
        self.interval = interval
        self.timeout = timeout
        self._queue: deque[Span] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def offer(self, span: Span) -> None:
        """Queue a span for export; drop it (counted) when the queue is full. Never blocks."""
        if len(self._queue) >= self.queue_size:
            self.metrics.dropped.inc()
            return
        self._queue.append(span)
        if len(self._queue) >= self.batch_size:
            self._wake.set()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        self._task = asyncio.create_task(self._run(), name="rollway-otlp-export")

    async def close(self) -> None:
        """Stop the exporter after one last bounded attempt to send what is queued."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout):
                    while self._queue:
                        await self._send(self._take())
            if self._queue:
                self.metrics.export_failed.inc(len(self._queue))
                self._queue.clear()
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            while self._queue:
                await self._send(self._take())
                if len(self._queue) < self.batch_size:
                    break

    def _take(self) -> list[Span]:
        return [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]

    async def _send(self, batch: list[Span]) -> None:
        assert self._session is not None
        ok = False
        try:
            payload = encode(batch).SerializeToString()
        except Exception:  # a span the encoder cannot take: that batch is lost, never the exporter's task
            log.exception("OTLP export: %d spans could not be encoded", len(batch))
            self.metrics.export_failed.inc(len(batch))
            return
        try:
            async with self._session.post(
                self.endpoint, data=payload, headers={"Content-Type": "application/x-protobuf"}
            ) as response:
                await response.read()
                ok = 200 <= response.status < 300
                if not ok:
                    log.warning("OTLP collector answered %s; %d spans not exported", response.status, len(batch))
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("OTLP export failed (%s); %d spans not exported", type(exc).__name__, len(batch))
        finally:  # also when cancelled at shutdown: every span offered is counted once
            (self.metrics.exported if ok else self.metrics.export_failed).inc(len(batch))


def encode(spans: Sequence[Span]) -> ExportTraceServiceRequest:
    """An OTLP request with ``spans`` (one resource: ``service.name=rollway``; one scope: ``rollway``)."""
    out = []
    for span in spans:
        attributes = {k: v for k, v in span.attributes.items() if k not in HEAVY_ATTRIBUTES}
        attributes["rollway.rollout_id"] = span.rollout_id
        attributes["rollway.attempt_id"] = span.attempt_id
        attributes["rollway.sequence_id"] = span.sequence_id
        out.append(
            OtlpSpan(
                trace_id=bytes.fromhex(span.trace_id),
                span_id=bytes.fromhex(span.span_id),
                parent_span_id=bytes.fromhex(span.parent_id) if span.parent_id else b"",
                name=span.name,
                kind=OtlpSpan.SPAN_KIND_CLIENT,
                start_time_unix_nano=_nanos(span.start_time),
                end_time_unix_nano=_nanos(span.end_time if span.end_time is not None else span.start_time),
                attributes=_key_values(attributes),
                status=Status(
                    code=STATUS_CODES.get(span.status.status_code, Status.STATUS_CODE_UNSET),
                    message=span.status.description or "",
                ),
            )
        )
    resource_attributes = (spans[0].resource or {}).get("attributes") if spans else None
    resource = {"service.name": "rollway", **(resource_attributes or {})}
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=_key_values(resource)),
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name="rollway"), spans=out)],
            )
        ]
    )


def _nanos(seconds: float | None) -> int:
    return 0 if seconds is None else int(seconds * 1e9)


def _key_values(attributes: Mapping[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_any_value(v)) for k, v in attributes.items() if v is not None]


def _any_value(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):  # past int64 (a backend's -1 read as unsigned): as text, which OTLP can hold
        return AnyValue(int_value=value) if INT64_MIN <= value <= INT64_MAX else AnyValue(string_value=str(value))
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, list | tuple):
        return AnyValue(array_value=ArrayValue(values=[_any_value(v) for v in value if v is not None]))
    if isinstance(value, Mapping):
        return AnyValue(kvlist_value=KeyValueList(values=_key_values(value)))
    return AnyValue(string_value=str(value))
