"""``GET /metrics``, end to end: a mixed load through a real gateway (the official openai SDK and httpx) against the
mock backend, then a scrape whose counters must have moved by exactly what the load did; ``promtool check
metrics`` on the output; label cardinality that does not grow with rollouts; and the Grafana dashboard only
naming metrics that exist."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from rollway.mock import MockBackendProcess
from rollway.store import Store
from support.gateway_harness import RunningGateway, closed_port, register, running_gateway, vllm

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 12 + 30?"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@asynccontextmanager
async def gateway(tmp_path: Path, mock: MockBackendProcess, **settings: Any) -> AsyncIterator[RunningGateway]:
    settings.setdefault("retry_max_wait", 0.01)
    async with running_gateway(tmp_path, **settings) as gw:
        await register(gw.store, "policy", vllm(mock), version="v1")
        dead = {"backend_id": "dead", "base_url": f"http://127.0.0.1:{closed_port()}", "model": "m", "weight": 100}
        await register(gw.store, "failover", dead, vllm(mock), version="v1")
        yield gw


async def scrape(gw: RunningGateway, **headers: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{gw.url}/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(s: Samples, name: str, **labels: str) -> float:
    return s.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def mixed_load(gw: RunningGateway, mock: MockBackendProcess) -> dict[str, int]:
    """5 chat, 4 streamed chat, 3 completions, 2 backend 400s, 1 stream broken mid-way, 2 failovers, and 2
    refusals (unknown model, malformed JSON). Sequential, so each scripted fault hits the call meant for it."""
    client = gw.client()
    for _ in range(5):
        await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
    for _ in range(4):
        stream = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=6, stream=True)
        assert [c async for c in stream]
    for _ in range(3):
        await client.completions.create(model="policy", prompt="Once upon a time", max_tokens=5)
    mock.add_faults({"kind": "status", "status": 400, "body": {"error": {"message": "bad"}}, "times": 2})
    for _ in range(2):
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
    mock.add_faults({"kind": "drop_mid_stream", "after_chunks": 3})
    stream = await client.chat.completions.create(
        model="policy", messages=MESSAGES, max_tokens=20, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    for _ in range(2):
        await client.chat.completions.create(model="failover", messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    async with httpx.AsyncClient(timeout=10) as http:
        bad = await http.post(f"{gw.url}{CHAT}", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400
    for alias in ("policy", "failover"):
        assert await gw.state.registry.drain(alias, 10)  # every lease released: in-flight is back to 0
    return {"spans": 5 + 4 + 3 + 2 + 1 + 2}


async def test_counters_move_by_exactly_the_load(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, mock) as gw:
        await gw.store.enqueue([{"input": {"n": i}} for i in range(3)])
        await gw.store.claim("worker-1")
        # The dead backend stays ejected until the scrape, however slow the machine (2 s by default).
        gw.state.router.health("dead").cooldown = 600.0
        before = samples(await scrape(gw))
        load = await mixed_load(gw, mock)
        after = samples(await scrape(gw))

        def d(name: str, **labels: str) -> float:
            return delta(before, after, name, **labels)

        policy = {"alias": "policy", "backend": "mock-a"}
        assert d("rollway_requests_total", **policy, route=CHAT, status="200") == 5 + 4 + 1
        assert d("rollway_requests_total", **policy, route=CHAT, status="400") == 2
        assert d("rollway_requests_total", **policy, route=COMPLETIONS, status="200") == 3
        assert d("rollway_requests_total", alias="failover", backend="mock-a", route=CHAT, status="200") == 2
        assert d("rollway_request_duration_seconds_count", **policy, route=CHAT, status="200") == 10
        assert d("rollway_request_duration_seconds_count", **policy, route=COMPLETIONS, status="200") == 3
        assert d("rollway_request_duration_seconds_sum", **policy, route=CHAT, status="200") > 0
        assert d("rollway_time_to_first_token_seconds_count", **policy, route=CHAT) == 4 + 1  # streamed only
        assert d("rollway_time_to_first_token_seconds_count", **policy, route=COMPLETIONS) == 0
        assert d("rollway_request_errors_total", alias="policy", route=CHAT, error_type="http_400") == 2
        assert d("rollway_request_errors_total", alias="policy", route=CHAT, error_type="stream_interrupted") == 1
        assert d("rollway_upstream_retries_total", alias="failover", backend="mock-a", route=CHAT) == 2
        assert d("rollway_upstream_failovers_total", alias="failover", backend="mock-a", route=CHAT) == 2
        assert d("rollway_requests_rejected_total", route=CHAT, status="404") == 1
        assert d("rollway_requests_rejected_total", route=CHAT, status="400") == 1
        assert value(after, "rollway_requests_in_flight", alias="policy") == 0
        assert d("rollway_spans_ingested_total", source="gateway") == load["spans"]

        spans = await gw.store.query_spans(None)
        assert len(spans) == load["spans"]
        for kind, attribute in (("input", "gen_ai.usage.input_tokens"), ("output", "gen_ai.usage.output_tokens")):
            stored = sum(s.attributes.get(attribute) or 0 for s in spans)
            counted = sum(
                d(f"rollway_{kind}_tokens_total", alias=alias, backend="mock-a", route=route)
                for alias in ("policy", "failover")
                for route in (CHAT, COMPLETIONS)
            )
            assert stored > 0 and counted == stored

        assert not any(dict(labels).get("alias") == "no-such-model" for _, labels in after)
        assert value(after, "rollway_rollouts", status="queuing") == 2
        assert value(after, "rollway_rollouts", status="preparing") == 1  # claimed, no span yet
        assert value(after, "rollway_attempts", status="preparing") == 1
        assert value(after, "rollway_queue_depth") == 2
        assert value(after, "rollway_model_paused", alias="policy") == 0
        assert value(after, "rollway_backend_up", alias="failover", backend="dead") == 0  # ejected
        assert value(after, "rollway_backend_up", alias="failover", backend="mock-a") == 1
        assert value(after, "rollway_store_up") == 1
        writes = d("rollway_store_write_batch_size_count")
        assert writes > 0 and d("rollway_store_write_batch_size_sum") >= writes
        assert d("rollway_store_write_seconds_count") == writes

        await gw.state.registry.pause("policy")
        assert value(samples(await scrape(gw)), "rollway_model_paused", alias="policy") == 1


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package 'prometheus')")
async def test_promtool_accepts_the_metrics_after_a_mixed_load(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, mock) as gw:
        await mixed_load(gw, mock)
        text = await scrape(gw)
    assert "rollway_requests_total" in text
    promtool = await asyncio.create_subprocess_exec(
        "promtool", "check", "metrics", stdin=PIPE, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(promtool.communicate(text.encode()), 60)
    assert promtool.returncode == 0, out.decode() + err.decode()
    assert not out.strip() and not err.strip()  # no lint warnings either


async def test_label_cardinality_stays_bounded_after_1000_rollouts(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, mock, access_log=False) as gw:
        # A scrape reads the store's counts within 2 s, else shows the last ones: on a loaded machine, just after
        # 990 calls' spans, the read was seen to take longer. This test is about labels, not that bound.
        gw.state.metrics.store_timeout = 60.0

        async def rollouts_with_a_call(count: int) -> list[str]:
            await gw.store.enqueue([{"input": {"n": i}} for i in range(count)])
            ids = [c.rollout.rollout_id for c in await gw.store.claim("worker-1", limit=count)]
            semaphore = asyncio.Semaphore(16)
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 2}

            async def call(http: httpx.AsyncClient, rollout_id: str) -> None:
                async with semaphore:
                    response = await http.post(f"{gw.url}/rollout/{rollout_id}{CHAT}", json=body)
                    assert response.status_code == 200, response.text

            async with httpx.AsyncClient(timeout=30) as http:
                await asyncio.gather(*(call(http, r) for r in ids))
            return ids

        await rollouts_with_a_call(10)
        early = samples(await scrape(gw))
        ids = await rollouts_with_a_call(990)
        text = await scrape(gw)
        late = samples(text)
        assert value(late, "rollway_rollouts", status="running") == 1000
        assert value(late, "rollway_requests_total", alias="policy", backend="mock-a", route=CHAT, status="200") == 1000
        assert len(late) == len(early)  # the same series: 1,000 rollouts added values, not labels
        assert set(late) == set(early)
        assert len(late) < 400
        assert not any(rollout_id in text for rollout_id in ids[:50] + ids[-50:])


async def test_metrics_token_guards_the_scrape_when_set(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, mock, metrics_token="scrape-secret") as gw, httpx.AsyncClient(timeout=10) as http:
        refused = await http.get(f"{gw.url}/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert "scrape-secret" not in refused.text
        wrong = await http.get(f"{gw.url}/metrics", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert "rollway_requests_in_flight" in await scrape(gw, authorization="Bearer scrape-secret")


async def test_grafana_dashboard_names_only_metrics_that_exist(tmp_path: Path, mock: MockBackendProcess) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("throughput", "latency", "first token", "tokens", "errors", "queue depth"):
        assert topic in titles
    referenced = {name for expr in exprs for name in re.findall(r"\brollway_[a-z_]+", expr)}
    assert len(referenced) >= 6
    async with gateway(tmp_path, mock) as gw:
        await mixed_load(gw, mock)
        exposed = {name for name, _ in samples(await scrape(gw))}
    assert referenced <= exposed, referenced - exposed


async def test_a_stuck_store_does_not_hang_the_scrape(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with gateway(tmp_path, mock) as gw:
        await gw.store.enqueue([{"input": {}}])
        first = samples(await scrape(gw))
        assert value(first, "rollway_queue_depth") == 1 and value(first, "rollway_store_up") == 1
        never = asyncio.Event()

        async def stuck() -> tuple[dict[str, int], dict[str, int]]:
            await never.wait()
            raise AssertionError("unreachable")

        gw.store.status_counts = stuck  # type: ignore[method-assign]  # a store that stopped answering
        gw.state.metrics.store_timeout = 0.2
        loop = asyncio.get_running_loop()
        started = loop.time()
        second = samples(await scrape(gw))
        assert loop.time() - started < 2.0
        assert value(second, "rollway_store_up") == 0
        assert value(second, "rollway_queue_depth") == 1  # the last values read
        assert value(second, "rollway_metrics_store_errors_total") == 1


async def test_status_counts_cover_every_status(store: Store) -> None:
    await store.enqueue([{"input": {"n": i}} for i in range(3)])
    await store.claim("worker-1")
    rollouts, attempts = await store.status_counts()
    assert rollouts == {
        "queuing": 2,
        "preparing": 1,
        "running": 0,
        "succeeded": 0,
        "failed": 0,
        "requeuing": 0,
        "cancelled": 0,
    }
    assert attempts["preparing"] == 1 and sum(attempts.values()) == 1
    assert set(attempts) == {"preparing", "running", "succeeded", "failed", "timeout", "unresponsive"}


async def test_time_to_first_token_is_observed_only_for_answers_that_streamed(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A streamed request the backend answers with an error body (no token, no stream) has no time to first
    token: only calls passed on as a stream are in the histogram."""
    async with gateway(tmp_path, mock) as gw:
        client = gw.client()
        before = samples(await scrape(gw))
        mock.add_faults({"kind": "status", "status": 400, "body": {"error": {"message": "bad"}}, "times": 2})
        for _ in range(2):
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4, stream=True)
        stream = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4, stream=True)
        assert [chunk async for chunk in stream]
        assert await gw.state.registry.drain("policy", 10)
        after = samples(await scrape(gw))
        policy = {"alias": "policy", "backend": "mock-a", "route": CHAT}
        assert delta(before, after, "rollway_requests_total", **policy, status="400") == 2
        assert delta(before, after, "rollway_time_to_first_token_seconds_count", **policy) == 1


async def test_a_call_whose_client_leaves_while_its_span_is_written_is_counted(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """The client goes away while the call's span is being written (the write goes on: the store's writer does
    not drop it): the call is counted once, as its stored span says, not lost to the metrics."""
    async with gateway(tmp_path, mock) as gw:
        store = gw.store
        record_call = store.record_call
        entered, left, gate = asyncio.Event(), asyncio.Event(), asyncio.Event()
        writes: list[asyncio.Task[None]] = []

        async def slow_write(span: Any) -> None:
            await gate.wait()
            await record_call(span)

        async def record_call_slowly(span: Any) -> None:  # a slow store: the write outlives the caller's wait
            writes.append(asyncio.ensure_future(slow_write(span)))
            entered.set()
            try:
                await asyncio.shield(writes[-1])
            except asyncio.CancelledError:
                left.set()
                raise

        before = samples(await scrape(gw))
        store.record_call = record_call_slowly  # type: ignore[method-assign]
        body = {"model": "policy", "messages": MESSAGES, "max_tokens": 4, "stream": True}
        async with httpx.AsyncClient(timeout=10) as http, http.stream("POST", f"{gw.url}{CHAT}", json=body) as r:
            assert r.status_code == 200
            await asyncio.wait_for(entered.wait(), 10)  # every token went by; the span is being written
        await asyncio.wait_for(left.wait(), 10)  # the gateway saw the client leave
        gate.set()
        await asyncio.wait_for(writes[0], 10)
        store.record_call = record_call  # type: ignore[method-assign]
        assert await gw.state.registry.drain("policy", 10)
        [span] = await store.query_spans(None)
        assert span.attributes["http.response.status_code"] == 200
        after = samples(await scrape(gw))
        policy = {"alias": "policy", "backend": "mock-a", "route": CHAT}
        assert delta(before, after, "rollway_requests_total", **policy, status="200") == 1
        assert delta(before, after, "rollway_request_duration_seconds_count", **policy, status="200") == 1
        assert delta(before, after, "rollway_spans_ingested_total", source="gateway") == 1
        assert (
            delta(before, after, "rollway_output_tokens_total", **policy)
            == span.attributes["gen_ai.usage.output_tokens"]
        )
        assert value(after, "rollway_requests_in_flight", alias="policy") == 0
