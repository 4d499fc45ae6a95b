"""OTLP/HTTP trace ingest (``POST /v1/traces``): ``ExportTraceServiceRequest`` as protobuf or JSON, optionally
gzip-compressed, decoded with ``opentelemetry-proto`` (imported on first use).

Each span's rollout, attempt and sequence id come from its own attributes first, then from its resource's:
``rollway.rollout_id`` / ``agentlightning.rollout_id``, ``rollway.attempt_id`` / ``agentlightning.attempt_id``,
``rollway.sequence_id`` / ``agentlightning.span_sequence_id``. No attempt means the rollout's latest; no (or a
non-positive) sequence id means the store assigns the next one, in the order the spans arrive (per rollout:
spans naming its latest attempt and spans naming none are one run); spans may share
one, as Agent-lightning's LLM proxy sends them (``store.sql.spans._share``). Spans are
written like any other span (each is a heartbeat). A span without a rollout, or for a rollout or attempt the
store refuses (unknown, stale), is rejected and counted in ``partial_success`` as OTLP specifies; the others
are kept.
"""

from __future__ import annotations

import base64
import gzip
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollway.store import Span, SpanStatus, Store, StoreError

ROLLOUT_KEYS = ("rollway.rollout_id", "agentlightning.rollout_id")
ATTEMPT_KEYS = ("rollway.attempt_id", "agentlightning.attempt_id")
SEQUENCE_KEYS = ("rollway.sequence_id", "agentlightning.span_sequence_id")
STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}
PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class OtlpError(ValueError):
    """A request that is not an OTLP trace export (400), or in a format not spoken (415)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class IngestResult:
    accepted: list[Span] = field(default_factory=list)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def error_message(self) -> str:
        return "; ".join(dict.fromkeys(self.errors))[:2000]


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise OtlpError(f"unsupported Content-Encoding '{encoding}'", 415)
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except (zlib.error, gzip.BadGzipFile) as exc:
        raise OtlpError(f"the body is not valid {encoding}: {exc}") from None
    if len(out) > limit:
        raise OtlpError(f"the decompressed body is larger than {limit} bytes", 413)
    return out


def media_type(content_type: str) -> str:
    kind = content_type.split(";")[0].strip().lower()
    if kind in (PROTOBUF, "application/protobuf"):
        return PROTOBUF
    if kind == JSON:
        return JSON
    raise OtlpError(f"Content-Type must be {PROTOBUF} or {JSON}, got '{kind or 'none'}'", 415)


def parse(body: bytes, kind: str) -> Any:
    """The ``ExportTraceServiceRequest`` message in ``body``."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    message = ExportTraceServiceRequest()
    if kind == PROTOBUF:
        try:
            message.ParseFromString(body)
        except DecodeError as exc:
            raise OtlpError(f"the body is not an OTLP ExportTraceServiceRequest: {exc}") from None
        return message
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise OtlpError("the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OtlpError("the body must be a JSON object")
    try:
        json_format.ParseDict(_hex_ids_to_base64(data), message, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise OtlpError(f"the body is not an OTLP ExportTraceServiceRequest: {exc}") from None
    return message


_ID_FIELDS = {"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"}


def _hex_ids_to_base64(value: Any) -> Any:
    """OTLP/JSON writes trace and span ids as hex, protobuf's JSON mapping expects base64 for bytes."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in _ID_FIELDS and isinstance(item, str):
                try:
                    out[key] = base64.b64encode(bytes.fromhex(item)).decode()
                except ValueError:
                    raise OtlpError(f"'{key}' must be hex, got '{item[:40]}'") from None
            else:
                out[key] = _hex_ids_to_base64(item)
        return out
    if isinstance(value, list):
        return [_hex_ids_to_base64(v) for v in value]
    return value


def response(result: IngestResult, kind: str) -> bytes:
    """The ``ExportTraceServiceResponse`` (``partial_success`` only when something was rejected)."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    message = ExportTraceServiceResponse()
    if result.rejected:
        message.partial_success.rejected_spans = result.rejected
        message.partial_success.error_message = result.error_message
    if kind == PROTOBUF:
        return bytes(message.SerializeToString())
    text: str = json_format.MessageToJson(message)
    return text.encode()


# -- conversion ------------------------------------------------------------------------------------------------


def any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return key_values(value.kvlist_value.values)
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind)


def key_values(items: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in items}


def _seconds(nanos: int) -> float | None:
    return nanos / 1e9 if nanos else None


def _context(trace_id: str, span_id: str) -> dict[str, Any]:
    return {"trace_id": trace_id, "span_id": span_id, "is_remote": False, "trace_state": {}}


def _first(keys: tuple[str, ...], *sources: dict[str, Any]) -> Any:
    for source in sources:
        for key in keys:
            value = source.get(key)
            if value not in (None, ""):
                return value
    return None


def spans_of(message: Any) -> tuple[list[Span], int, list[str]]:
    """The spans of an export, attributed; plus how many were rejected and why."""
    out: list[Span] = []
    rejected = 0
    errors: list[str] = []
    for resource_spans in message.resource_spans:
        resource_attrs = key_values(resource_spans.resource.attributes)
        resource = {"attributes": resource_attrs, "schema_url": resource_spans.schema_url}
        for scope_spans in resource_spans.scope_spans:
            scope = {"name": scope_spans.scope.name, "version": scope_spans.scope.version}
            for item in scope_spans.spans:
                attrs = key_values(item.attributes)
                rollout_id = _first(ROLLOUT_KEYS, attrs, resource_attrs)
                if not isinstance(rollout_id, str):
                    rejected += 1
                    errors.append("a span names no rollout (rollway.rollout_id or agentlightning.rollout_id)")
                    continue
                attempt_id = _first(ATTEMPT_KEYS, attrs, resource_attrs)
                sequence = _first(SEQUENCE_KEYS, attrs, resource_attrs)
                if isinstance(sequence, str) and sequence.isdigit():
                    sequence = int(sequence)
                if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
                    sequence = None
                trace_id = item.trace_id.hex()
                span_id = item.span_id.hex()
                parent_id = item.parent_span_id.hex() or None
                out.append(
                    Span(
                        rollout_id=rollout_id,
                        attempt_id=str(attempt_id) if attempt_id else None,
                        sequence_id=sequence,
                        trace_id=trace_id,
                        span_id=span_id,
                        parent_id=parent_id,
                        name=item.name,
                        status=SpanStatus(
                            status_code=STATUS_CODES.get(item.status.code, "UNSET"),
                            description=item.status.message or None,
                        ),
                        start_time=_seconds(item.start_time_unix_nano),
                        end_time=_seconds(item.end_time_unix_nano),
                        attributes=attrs,
                        events=[
                            {
                                "name": e.name,
                                "attributes": key_values(e.attributes),
                                "timestamp": _seconds(e.time_unix_nano),
                            }
                            for e in item.events
                        ],
                        links=[
                            {
                                "context": _context(link.trace_id.hex(), link.span_id.hex()),
                                "attributes": key_values(link.attributes),
                            }
                            for link in item.links
                        ],
                        resource=resource,
                        context=_context(trace_id, span_id),
                        parent=_context(trace_id, parent_id) if parent_id else None,
                        kind=item.kind,
                        instrumentation_scope=scope,
                    )
                )
    return out, rejected, errors


async def ingest(store: Store, message: Any) -> IngestResult:
    """Write the export's spans, per rollout, in the order they came: spans that name the rollout's latest
    attempt and spans that leave it out are numbered as one run (``store.sql.spans.add``). A rollout whose spans the
    store refuses is tried again per (rollout, attempt), so only the refused attempt's spans are rejected."""
    spans, rejected, errors = spans_of(message)
    result = IngestResult(rejected=rejected, errors=errors)
    rollouts: dict[str | None, list[Span]] = defaultdict(list)
    for span in spans:
        rollouts[span.rollout_id].append(span)
    for members in rollouts.values():
        try:
            result.accepted.extend(await store.add_spans(members, shared_sequence=True))
            continue
        except StoreError as exc:
            if len({span.attempt_id for span in members}) == 1:
                result.rejected += len(members)
                result.errors.append(exc.message)
                continue
        groups: dict[str | None, list[Span]] = defaultdict(list)
        for span in members:
            groups[span.attempt_id].append(span)
        for group in groups.values():
            try:
                result.accepted.extend(await store.add_spans(group, shared_sequence=True))
            except StoreError as exc:
                result.rejected += len(group)
                result.errors.append(exc.message)
    return result
