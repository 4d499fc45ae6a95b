"""Export of the gateway's spans to an external OTLP/HTTP collector: a test collector (a small aiohttp receiver on
loopback decoding ``ExportTraceServiceRequest``) receives them; with the collector down (closed port, or a
black hole that accepts connections and never answers) calls still succeed at normal latency, and what could
not be exported is dropped and counted, never queued without bound."""

from __future__ import annotations

import asyncio
import secrets
import socket
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from rollway.mock import MockBackendProcess
from support.gateway_harness import RunningGateway, claim_one, closed_port, register, running_gateway

BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CALLS = 12


class Collector:
    """An OTLP/HTTP trace receiver on a loopback port."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self.content_types: list[str] = []
        self.arrived = asyncio.Condition()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        request_pb = ExportTraceServiceRequest.FromString(await request.read())
        self.content_types.append(request.headers.get("content-type", ""))
        async with self.arrived:
            for resource_spans in request_pb.resource_spans:
                self.resources.append({a.key: plain(a.value) for a in resource_spans.resource.attributes})
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
            self.arrived.notify_all()
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    async def wait_for(self, count: int, timeout: float = 10.0) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.spans) >= count), timeout)


def exports(gw: RunningGateway, outcome: str) -> float:
    value = gw.state.metrics.registry.get_sample_value("rollway_otlp_export_spans_total", {"outcome": outcome})
    assert value is not None
    return value


def plain(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@asynccontextmanager
async def collector() -> AsyncIterator[Collector]:
    receiver = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    receiver.url = f"http://127.0.0.1:{port}/v1/traces"
    try:
        yield receiver
    finally:
        await runner.cleanup()


@asynccontextmanager
async def black_hole() -> AsyncIterator[str]:
    """A port that accepts TCP connections (the kernel's backlog) and never reads or answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1/traces"
    finally:
        sock.close()


@asynccontextmanager
async def gateway(tmp_path: Path, mock: MockBackendProcess, endpoint: str, **settings: Any) -> AsyncIterator[Any]:
    settings = {"otlp_export_endpoint": endpoint, "otlp_export_interval": 0.02, "access_log": False, **settings}
    async with running_gateway(tmp_path, **settings) as gw:
        backend = {"backend_id": "mock-a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
        await register(gw.store, "policy", backend, version="v1")
        yield gw


async def timed_calls(gw: RunningGateway, count: int) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(count):
            started = time.perf_counter()
            response = await http.post(f"{gw.url}/v1/chat/completions", json=BODY)
            latencies.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
    return latencies


async def test_collector_receives_the_gateways_spans(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with collector() as receiver, gateway(tmp_path, mock, receiver.url) as gw:
        rollout_id, attempt_id = await claim_one(gw.store)
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        async with httpx.AsyncClient(timeout=10) as http:
            for i in range(3):
                headers = {"traceparent": f"00-{trace_id}-{parent}-01"} if i == 0 else {}
                url = f"{gw.url}/rollout/{rollout_id}/v1/chat/completions"
                response = await http.post(url, json=BODY, headers=headers)
                assert response.status_code == 200
        await receiver.wait_for(3)
        stored = {s.span_id: s for s in await gw.store.query_spans(rollout_id)}
        exported = {span.span_id.hex(): span for span in receiver.spans}
        assert set(exported) == set(stored)
        for span_id, span in exported.items():
            attributes = {a.key: plain(a.value) for a in span.attributes}
            original = stored[span_id]
            assert span.trace_id.hex() == original.trace_id
            assert span.name == original.name == "chat policy"
            assert attributes["rollway.rollout_id"] == rollout_id
            assert attributes["rollway.attempt_id"] == attempt_id
            assert attributes["rollway.sequence_id"] == original.sequence_id
            assert attributes["gen_ai.usage.output_tokens"] == original.attributes["gen_ai.usage.output_tokens"]
            assert "rollway.request" not in attributes and "rollway.response_token_ids" not in attributes
            assert span.end_time_unix_nano >= span.start_time_unix_nano > 0
        first = next(s for s in receiver.spans if s.trace_id.hex() == trace_id)
        assert first.parent_span_id.hex() == parent
        assert receiver.resources[0]["service.name"] == "rollway"
        assert set(receiver.content_types) == {"application/x-protobuf"}
        assert exports(gw, "exported") == 3 and exports(gw, "dropped") == 0


async def test_calls_keep_their_latency_when_the_collector_is_down(tmp_path: Path, mock: MockBackendProcess) -> None:
    for name in ("up", "refused", "hole"):
        (tmp_path / name).mkdir()
    async with collector() as receiver, gateway(tmp_path / "up", mock, receiver.url) as gw:
        await timed_calls(gw, 3)  # warm up connections
        up = await timed_calls(gw, CALLS)
        await receiver.wait_for(CALLS + 3)

    refused_url = f"http://127.0.0.1:{closed_port()}/v1/traces"
    async with gateway(tmp_path / "refused", mock, refused_url) as gw:
        await timed_calls(gw, 3)
        refused = await timed_calls(gw, CALLS)
    # closed: what was queued had its one last try at shutdown; every span is accounted for, none exported
    assert exports(gw, "failed") == CALLS + 3
    assert exports(gw, "exported") == 0 and exports(gw, "dropped") == 0

    async with (
        black_hole() as hole_url,
        gateway(
            tmp_path / "hole", mock, hole_url, otlp_export_queue=4, otlp_export_batch=2, otlp_export_timeout=3.0
        ) as gw,
    ):
        await timed_calls(gw, 3)
        started = time.perf_counter()
        hole = await timed_calls(gw, CALLS)
        elapsed = time.perf_counter() - started
        assert elapsed < 3.0  # the exporter is stuck on its first request for 3 s; calls never waited for it
        assert exports(gw, "dropped") >= CALLS + 3 - 4 - 2  # queue of 4 full, one batch of 2 in flight
    assert exports(gw, "dropped") + exports(gw, "failed") == CALLS + 3
    assert exports(gw, "exported") == 0

    baseline = statistics.median(up)
    for label, latencies in (("refused", refused), ("black hole", hole)):
        assert statistics.median(latencies) < 2 * baseline + 0.05, (label, latencies, up)
        assert max(latencies) < 1.0, (label, latencies)


@asynccontextmanager
async def odd_backend(usage: dict[str, Any]) -> AsyncIterator[str]:
    """An OpenAI-compatible backend whose answers report ``usage`` (e.g. a C++ server's -1 read as unsigned)."""

    async def chat(request: web.Request) -> web.Response:
        answer = {
            "id": "chatcmpl-odd",
            "object": "chat.completion",
            "created": 0,
            "model": "odd",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
            "usage": usage,
        }
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


async def test_a_span_protobuf_cannot_hold_does_not_stop_the_export(tmp_path: Path, mock: MockBackendProcess) -> None:
    """A backend reports a token count past int64 (OTLP's integer): that span is exported with the number as text,
    and the spans after it are exported too (the exporter's task died on it: nothing was exported again)."""
    huge = 2**64 - 1
    usage = {"prompt_tokens": huge, "completion_tokens": 1, "total_tokens": huge}
    async with collector() as receiver, odd_backend(usage) as odd_url, gateway(tmp_path, mock, receiver.url) as gw:
        await register(gw.store, "odd", {"backend_id": "odd", "base_url": odd_url, "kind": "openai", "model": "odd"})
        async with httpx.AsyncClient(timeout=10) as http:
            for model in ("odd", "policy", "policy"):
                response = await http.post(f"{gw.url}/v1/chat/completions", json={**BODY, "model": model})
                assert response.status_code == 200, response.text
        await receiver.wait_for(3)
        attributes = [{a.key: plain(a.value) for a in span.attributes} for span in receiver.spans]
        assert [a["gen_ai.request.model"] for a in attributes] == ["odd", "policy", "policy"]
        assert attributes[0]["gen_ai.usage.input_tokens"] == str(huge)
        assert exports(gw, "exported") == 3


async def test_a_call_its_caller_did_not_sample_is_not_exported(tmp_path: Path, mock: MockBackendProcess) -> None:
    """W3C trace flags 00: the caller's tracer dropped its trace, so the gateway's span of that call is not sent
    to the collector (it would be an orphan there, and defeat the caller's sampling); the store keeps it."""
    async with collector() as receiver, gateway(tmp_path, mock, receiver.url) as gw:
        dropped, kept = secrets.token_hex(16), secrets.token_hex(16)
        async with httpx.AsyncClient(timeout=10) as http:
            for trace_id, flags in ((dropped, "00"), (kept, "01")):
                headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"}
                response = await http.post(f"{gw.url}/v1/chat/completions", json=BODY, headers=headers)
                assert response.status_code == 200
        async with receiver.arrived:  # the sampled call's span, sent after the other one had its chance
            await asyncio.wait_for(receiver.arrived.wait_for(lambda: kept in traces(receiver)), 10)
        assert traces(receiver) == [kept]
        assert sorted(s.trace_id for s in await gw.store.query_spans(None)) == sorted([dropped, kept])
        assert exports(gw, "exported") == 1


def traces(receiver: Collector) -> list[str]:
    return [span.trace_id.hex() for span in receiver.spans]
