"""``POST /v1/traces``: a real OpenTelemetry SDK exporter (HTTP/protobuf, plain and gzip) delivers spans that land
under their rollout and attempt with sequence ids in order; OTLP/JSON; partial success; spans as heartbeats;
bad input; auth (header or ``/t/<token>`` path prefix)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from rollway.store import AttemptedRollout, Store
from support.gateway_harness import RunningGateway, running_gateway

TOKEN = "otlp-admin-token-abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"admin_token": TOKEN}


async def claimed(store: Store, **config: Any) -> AttemptedRollout:
    await store.enqueue([{"input": {"q": 1}, "config": config or None}])
    (claim,) = await store.claim("w1")
    return claim


def trace_with(exporter: SpanExporter, resource: dict[str, Any], names: list[str], **span_attrs: Any) -> None:
    """Spans ``names`` (the first is the parent of the others), exported one by one as each ends."""
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent")
    with tracer.start_as_current_span(names[0], attributes=span_attrs):
        for name in names[1:]:
            with tracer.start_as_current_span(name, attributes={**span_attrs, "step": name}):
                pass
    provider.shutdown()


async def test_sdk_exporter_spans_land_under_their_rollout_and_attempt_in_order(gw: RunningGateway) -> None:
    store = gw.store
    first, second = await claimed(store), await claimed(store)
    url = f"{gw.url}/v1/traces"
    # Resource attributes name the rollout (Rollway's names), protobuf as it is.
    resource = {"rollway.rollout_id": first.rollout.rollout_id, "rollway.attempt_id": first.attempt.attempt_id}
    exporter = OTLPSpanExporter(endpoint=url, headers=AUTH)
    await asyncio.to_thread(trace_with, exporter, resource, ["agent", "tool", "llm"])
    # Span attributes name it (Agent-lightning's names), gzip-compressed, through the path-token address.
    ids = {
        "agentlightning.rollout_id": second.rollout.rollout_id,
        "agentlightning.attempt_id": second.attempt.attempt_id,
    }
    zipped = OTLPSpanExporter(endpoint=f"{gw.url}/t/{TOKEN}/v1/traces", compression=Compression.Gzip)
    await asyncio.to_thread(trace_with, zipped, {"service.name": "other"}, ["root", "child"], **ids)

    spans = await store.query_spans(first.rollout.rollout_id, first.attempt.attempt_id)
    # SimpleSpanProcessor exports each span as it ends: children first, then the parent.
    assert [(s.name, s.sequence_id) for s in spans] == [("tool", 1), ("llm", 2), ("agent", 3)]
    parent = spans[2]
    assert parent.parent_id is None and {s.parent_id for s in spans[:2]} == {parent.span_id}
    assert len(parent.trace_id) == 32 and len(parent.span_id) == 16
    assert parent.status.status_code == "UNSET" and parent.start_time is not None and parent.start_time < 1e11
    assert parent.resource["attributes"]["rollway.rollout_id"] == first.rollout.rollout_id
    assert (await store.get_attempt(first.rollout.rollout_id)).status == "running"  # the first span moved it

    other = await store.query_spans(second.rollout.rollout_id, "latest")
    assert [(s.name, s.sequence_id, s.attempt_id) for s in other] == [
        ("child", 1, second.attempt.attempt_id),
        ("root", 2, second.attempt.attempt_id),
    ]
    assert other[0].attributes["step"] == "child"


async def test_a_span_revives_an_unresponsive_attempt_but_not_a_timed_out_one(gw: RunningGateway) -> None:
    store = gw.store
    quiet = await claimed(store, max_attempts=1)
    late = await claimed(store, max_attempts=1)
    await store.update_attempt(quiet.rollout.rollout_id, status="unresponsive")
    await store.update_attempt(late.rollout.rollout_id, status="timeout")
    for ar in (quiet, late):
        resource = {"rollway.rollout_id": ar.rollout.rollout_id}  # no attempt: the latest one
        await asyncio.to_thread(
            trace_with, OTLPSpanExporter(endpoint=f"{gw.url}/v1/traces", headers=AUTH), resource, ["s"]
        )
    assert (await store.get_attempt(quiet.rollout.rollout_id)).status == "running"
    assert (await store.get_attempt(late.rollout.rollout_id)).status == "timeout"
    assert [s.sequence_id for s in await store.query_spans(quiet.rollout.rollout_id, "latest")] == [1]


class Capture(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Any) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def otlp_json(spans: list[ReadableSpan]) -> dict[str, Any]:
    """The SDK's own encoding of ``spans`` in OTLP/JSON (ids in hex, as the OTLP spec writes them)."""
    data: dict[str, Any] = json_format.MessageToDict(encode_spans(spans))

    def fix(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: (
                    bytes(json_format.base64.b64decode(v)).hex()
                    if k in ("traceId", "spanId", "parentSpanId")
                    else fix(v)
                )
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    return fix(data)  # type: ignore[no-any-return]


async def test_json_export_reports_rejected_spans_as_partial_success(gw: RunningGateway) -> None:
    store = gw.store
    good = await claimed(store)
    captured: list[list[ReadableSpan]] = []
    for resource in (
        {"rollway.rollout_id": good.rollout.rollout_id, "rollway.attempt_id": good.attempt.attempt_id},
        {"service.name": "no-rollout"},
        {"rollway.rollout_id": "ro-unknown"},
    ):
        sink = Capture()
        trace_with(sink, resource, ["a", "b"])
        captured.append(sink.spans)
    body = otlp_json([s for batch in captured for s in batch])
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        response = await client.post("/v1/traces", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        partial = response.json()["partialSuccess"]
        assert partial["rejectedSpans"] == "4" or partial["rejectedSpans"] == 4
        assert "no rollout" in partial["errorMessage"] and "ro-unknown" in partial["errorMessage"]
        spans = await store.query_spans(good.rollout.rollout_id, "latest")
        assert [(s.name, s.sequence_id) for s in spans] == [("b", 1), ("a", 2)]

        # The same export in protobuf: duplicates (same span ids) are not written twice; the answer is protobuf.
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as encode

        raw = encode([s for batch in captured for s in batch]).SerializeToString()
        response = await client.post("/v1/traces", content=raw, headers={"content-type": "application/x-protobuf"})
        assert response.status_code == 200
        message = ExportTraceServiceResponse.FromString(response.content)
        assert message.partial_success.rejected_spans == 4
        assert len(await store.query_spans(good.rollout.rollout_id, "latest")) == 2

        # A clean export answers an empty response (no partial_success).
        clean = otlp_json(captured[0])
        response = await client.post("/v1/traces", json=clean)
        assert response.status_code == 200 and "partialSuccess" not in response.json()


@pytest.mark.parametrize(
    ("headers", "content", "status"),
    [
        ({"content-type": "application/x-protobuf"}, b"\xff\xff\xff garbage", 400),
        ({"content-type": "application/json"}, b"{not json", 400),
        (
            {"content-type": "application/json"},
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
            400,
        ),
        ({"content-type": "text/plain"}, b"hello", 415),
        ({"content-type": "application/x-protobuf", "content-encoding": "gzip"}, b"not gzip", 400),
        ({"content-type": "application/x-protobuf", "content-encoding": "br"}, b"x", 415),
    ],
)
async def test_bad_exports_get_a_clear_4xx_and_store_nothing(
    gw: RunningGateway, headers: dict[str, str], content: bytes, status: int
) -> None:
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        response = await client.post("/v1/traces", content=content, headers=headers)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]
    assert (await gw.store.stats()).total_spans == 0


Check = Callable[[httpx.Response], bool]


async def test_ingest_and_store_routes_need_the_admin_token_in_a_header_or_the_path(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for path in ("/v1/agl/health", "/v1/agl/statistics"):
            assert (await client.get(path)).status_code == 401
            assert (await client.get(path, headers={"Authorization": "Bearer wrong"})).status_code == 401
            assert (await client.get(path, headers=AUTH)).status_code == 200
            assert (await client.get(f"/t/{TOKEN}{path}")).status_code == 200
            refused = await client.get(f"/t/not-the-token{path}")
            assert refused.status_code == 401 and "not-the-token" not in refused.text
        assert (
            await client.post("/v1/traces", content=b"", headers={"content-type": "application/json"})
        ).status_code == 401
        # The path prefix opens only these routes, not the admin API or the data plane.
        assert (await client.get(f"/t/{TOKEN}/admin/v1/stats")).status_code == 404
        assert (await client.get(f"/t/{TOKEN}/v1/models")).status_code == 404


async def test_without_an_admin_token_the_plain_routes_serve_loopback(tmp_path: Path) -> None:
    async with (
        running_gateway(tmp_path) as gateway,
        httpx.AsyncClient(base_url=gateway.url) as client,
    ):
        assert (await client.get("/v1/agl/health")).json() == {"status": "ok"}
        assert (await client.get("/t/anything/v1/agl/health")).status_code == 401


async def test_an_export_naming_the_attempt_for_some_spans_numbers_them_in_its_order(gw: RunningGateway) -> None:
    """Spans of one rollout, some naming its (latest) attempt and some leaving it out: one attempt, so one run of
    sequence ids in the export's order (as ``Store.add_spans`` numbers such a batch), not the named ones first."""
    store = gw.store
    claim = await claimed(store)
    rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id

    def otlp_span(n: int, named: bool) -> dict[str, Any]:
        attrs = [{"key": "rollway.rollout_id", "value": {"stringValue": rid}}]
        if named:
            attrs.append({"key": "rollway.attempt_id", "value": {"stringValue": aid}})
        return {"traceId": "ab" * 16, "spanId": f"{n:016x}", "name": f"s{n}", "attributes": attrs}

    spans = [otlp_span(1, True), otlp_span(2, False), otlp_span(3, True), otlp_span(4, False)]
    body = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans}]}]}
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        response = await client.post("/v1/traces", json=body)
    assert response.status_code == 200 and "partialSuccess" not in response.json(), response.text
    stored = await store.query_spans(rid, aid)
    assert [(s.name, s.sequence_id) for s in stored] == [("s1", 1), ("s2", 2), ("s3", 3), ("s4", 4)]

    # The named attempt is stale now: its span is rejected, the one naming none kept (under the new attempt).
    newer = await store.start_attempt(rid)
    body = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [otlp_span(5, True), otlp_span(6, False)]}]}]}
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        partial = (await client.post("/v1/traces", json=body)).json()["partialSuccess"]
    assert int(partial["rejectedSpans"]) == 1
    assert [(s.name, s.sequence_id) for s in await store.query_spans(rid, newer.attempt.attempt_id)] == [("s6", 1)]
