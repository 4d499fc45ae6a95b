"""The ``/v1/agl`` routes in-process (no Agent-lightning install needed): null-vs-absent, ``200 null`` for missing
objects, validation, paging, and a gateway call read back in the LLM proxy's span form. The gateway is served in
process too (``in_process``), but for the stream that breaks off, which needs a real connection."""

from __future__ import annotations

import ast
import logging
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rollway.mock import MockBackendProcess
from support.gateway_harness import RunningGateway, register


@pytest.fixture
async def agl(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with gw.http("/v1/agl", timeout=30) as client:
        yield client


@pytest.mark.in_process
async def test_missing_objects_are_200_null(agl: httpx.AsyncClient) -> None:
    for path in ("/rollouts/ro-nope", "/rollouts/ro-nope/attempts/latest", "/resources/rs-nope", "/workers/w-nope"):
        response = await agl.get(path)
        assert response.status_code == 200 and response.json() is None, path
    assert (await agl.get("/resources/latest")).json() is None
    assert (await agl.post("/rollouts/ro-nope", json={"status": "failed"})).status_code == 404


@pytest.mark.in_process
async def test_explicit_null_is_refused_and_absent_leaves_values_unchanged(agl: httpx.AsyncClient) -> None:
    (rollout,) = (await agl.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]})).json()
    rid = rollout["rollout_id"]
    (claimed,) = (await agl.post("/queues/rollouts/dequeue", json={"limit": 1, "worker_id": "w"})).json()
    aid = claimed["attempt"]["attempt_id"]
    for field in ("status", "worker_id", "last_heartbeat_time", "metadata"):
        response = await agl.post(f"/rollouts/{rid}/attempts/{aid}", json={field: None})
        assert response.status_code == 400 and field in response.json()["error"]["message"]
    for field in ("status", "config"):
        assert (await agl.post(f"/rollouts/{rid}", json={field: None})).status_code == 400
    updated = (await agl.post(f"/rollouts/{rid}/attempts/latest", json={"metadata": {"k": 1}})).json()
    assert updated["metadata"] == {"k": 1} and updated["status"] == "preparing" and updated["worker_id"] == "w"
    changed = (await agl.post(f"/rollouts/{rid}", json={"metadata": {"m": 2}})).json()
    assert changed["metadata"] == {"m": 2} and changed["input"] == 1 and changed["status"] == "preparing"
    # An illegal transition is a 409; the rollout is as it was.
    assert (await agl.post(f"/rollouts/{rid}", json={"status": "queuing"})).status_code == 409
    assert (await agl.get(f"/rollouts/{rid}")).json()["status"] == "preparing"


@pytest.mark.in_process
async def test_bad_bodies_and_queries_are_400s(agl: httpx.AsyncClient) -> None:
    assert (await agl.post("/resources", json={"x": {"resource_type": "gpu"}})).status_code == 400
    assert (await agl.post("/resources", content=b"{", headers={"content-type": "application/json"})).status_code == 400
    assert (await agl.post("/rollouts/search", json={"sort_by": "nope"})).status_code == 400
    assert (await agl.post("/rollouts/search", json={"limit": 0})).status_code == 400
    assert (await agl.post("/spans", json={"rollout_id": "ro-x", "name": "s"})).status_code == 400
    assert (await agl.post("/queues/rollouts/enqueue", json={"rollouts": [{"mode": "bogus"}]})).status_code == 400


@pytest.mark.in_process
async def test_queries_filter_sort_and_page_like_agent_lightning(agl: httpx.AsyncClient) -> None:
    body = {"rollouts": [{"input": i} for i in range(5)]}
    ids = [r["rollout_id"] for r in (await agl.post("/queues/rollouts/enqueue", json=body)).json()]
    await agl.post("/queues/rollouts/dequeue", json={"limit": 2})
    page = (await agl.post("/rollouts/search", json={"limit": 2, "offset": 1})).json()
    assert [r["rollout_id"] for r in page["items"]] == ids[1:3] and page["total"] == 5
    assert "attempt" in page["items"][0] and "attempt" not in page["items"][1]
    queued = (await agl.get("/rollouts", params=[("status_in", "queuing")])).json()
    assert [r["rollout_id"] for r in queued["items"]] == ids[2:]
    either = {"status_in": ["preparing"], "rollout_id_in": [ids[4]], "filter_logic": "or", "sort_by": "input"}
    found = (await agl.post("/rollouts/search", json={**either, "sort_order": "desc"})).json()
    assert [r["input"] for r in found["items"]] == [4, 1, 0]


@pytest.mark.in_process
async def test_a_gateway_call_reads_back_as_an_llm_proxy_span(
    gw: RunningGateway, agl: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    await register(gw.store, "policy", {"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"})
    await gw.store.enqueue([{"input": 1}])
    (claimed,) = await gw.store.claim("w")
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    client = gw.client(base_url=f"{gw.url}/rollout/{rid}/attempt/{aid}/v1")
    completion = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=8
    )
    seq = (await agl.post("/spans/next", json={"rollout_id": rid, "attempt_id": aid})).json()["sequence_id"]
    assert seq == 2  # after the call's own sequence id
    spans = (await agl.post("/spans/search", json={"rollout_id": rid, "attempt_id": "latest"})).json()["items"]
    (span,) = spans
    stored = (await gw.store.query_spans(rid, aid))[0]
    assert span["name"] == "raw_gen_ai_request" and span["sequence_id"] == 1
    assert span["attributes"]["rollway.span_name"] == stored.name
    assert (
        ast.literal_eval(span["attributes"]["llm.hosted_vllm.prompt_token_ids"])
        == stored.attributes["rollway.prompt_token_ids"]
    )
    choices = ast.literal_eval(span["attributes"]["llm.hosted_vllm.choices"])
    assert choices == [{"token_ids": stored.attributes["rollway.response_token_ids"]}]
    assert span["attributes"]["llm.hosted_vllm.id"] == completion.id
    # Attribute values are OpenTelemetry's: no nulls, structured values as JSON text.
    assert all(v is not None and not isinstance(v, dict) for v in span["attributes"].values())
    assert isinstance(span["attributes"]["rollway.request"], str)
    assert span["context"] is None and span["resource"]["schema_url"] == ""
    by_name = (await agl.get("/spans", params={"rollout_id": rid, "name": "raw_gen_ai_request"})).json()
    assert by_name["total"] == 1


async def test_a_call_that_did_not_complete_is_not_shown_as_an_llm_proxy_span(
    gw: RunningGateway, agl: httpx.AsyncClient, mock: MockBackendProcess
) -> None:
    """A stream that broke off keeps its first tokens on the span; Agent-lightning's proxy records no
    ``raw_gen_ai_request`` for a failed call, and its ``LlmProxyTraceToTriplet`` reads any such span as a
    complete call (it does not look at the status): shown so, the partial answer would be trained on and take
    the rollout's final reward."""
    await register(gw.store, "policy", {"base_url": mock.base_url, "kind": "vllm", "model": "mock-model"})
    await gw.store.enqueue([{"input": 1}])
    (claimed,) = await gw.store.claim("w")
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    client = gw.client(base_url=f"{gw.url}/rollout/{rid}/attempt/{aid}/v1")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    mock.add_faults({"kind": "drop_mid_stream", "after_chunks": 3})
    stream = await client.chat.completions.create(model="policy", messages=messages, stream=True)
    with pytest.raises(openai.APIError):
        async with stream:
            async for _ in stream:
                pass
    stored = await gw.store.query_spans(rid, aid)
    assert stored[1].status.status_code == "ERROR" and stored[1].attributes["rollway.response_token_ids"]
    spans = (await agl.post("/spans/search", json={"rollout_id": rid, "attempt_id": "latest"})).json()["items"]
    assert [s["name"] for s in spans] == ["raw_gen_ai_request", stored[1].name]
    assert not any(key.startswith("llm.hosted_vllm.") for key in spans[1]["attributes"])
    by_name = (await agl.get("/spans", params={"rollout_id": rid, "name": "raw_gen_ai_request"})).json()
    assert by_name["total"] == 1


@pytest.mark.in_process
async def test_spans_may_share_a_sequence_id_as_agent_lightning_allows(agl: httpx.AsyncClient) -> None:
    """Agent-lightning lets several spans use one sequence id (its ``add_otel_span`` with a given id, its LLM
    proxy); each is kept and shown under it, ordered after the spans of lower ids."""
    (rollout,) = (await agl.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]})).json()
    rid = rollout["rollout_id"]
    (claimed,) = (await agl.post("/queues/rollouts/dequeue", json={"limit": 1})).json()
    aid = claimed["attempt"]["attempt_id"]

    async def add(seq: int, n: int) -> httpx.Response:
        body = {"rollout_id": rid, "attempt_id": aid, "sequence_id": seq, "trace_id": "a" * 32, "name": f"s{n}"}
        return await agl.post("/spans", json={**body, "span_id": f"{n:016x}"})

    first = (await agl.post("/spans/next", json={"rollout_id": rid, "attempt_id": aid})).json()["sequence_id"]
    second = (await agl.post("/spans/next", json={"rollout_id": rid, "attempt_id": aid})).json()["sequence_id"]
    for seq, n in ((second, 1), (first, 2), (second, 3), (first, 4)):
        response = await add(seq, n)
        assert response.status_code == 201 and response.json()["sequence_id"] == seq, response.text
    assert (await add(first, 2)).json() is None  # the same span again
    for attempt in ("latest", None):
        query = {"rollout_id": rid} | ({"attempt_id": attempt} if attempt else {})
        found = (await agl.post("/spans/search", json=query)).json()
        shown = [(s["name"], s["sequence_id"]) for s in found["items"]]
        assert shown == [("s2", first), ("s4", first), ("s1", second), ("s3", second)] and found["total"] == 4
    after = (await agl.post("/spans/next", json={"rollout_id": rid, "attempt_id": aid})).json()["sequence_id"]
    assert after > second


async def test_a_limit_or_offset_beyond_64_bits_is_a_400_with_no_traceback(
    agl: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither the databases' ``LIMIT`` nor the answer's JSON encoder carries a number past a signed 64-bit
    integer: such a limit or offset is refused as the admin API refuses it, on every listing, GET and search; the
    largest one that fits still pages."""
    (rollout,) = (await agl.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]})).json()
    rid = rollout["rollout_id"]
    huge, top = str(2**63), 2**63 - 1
    listings = ["/rollouts", "/workers", "/resources", f"/rollouts/{rid}/attempts", f"/spans?rollout_id={rid}"]
    for path in listings:
        for field in ("limit", "offset"):
            answer = await agl.get(path, params={field: "99999999999999999999"})
            assert answer.status_code == 400, (path, answer.text)
            assert answer.json()["error"]["type"] == "invalid_request_error"
            assert (await agl.get(path, params={field: huge})).status_code == 400
    for path, body in (("/rollouts/search", {}), ("/spans/search", {"rollout_id": rid})):
        assert (await agl.post(path, json={**body, "limit": 2**64})).status_code == 400
    paged = (await agl.get("/rollouts", params={"limit": top, "offset": 0})).json()
    assert [r["rollout_id"] for r in paged["items"]] == [rid] and paged["limit"] == top
    beyond = (await agl.get("/rollouts", params={"limit": top, "offset": top})).json()
    assert beyond["items"] == [] and beyond["total"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_number_that_is_not_finite_in_a_tasks_input_or_metadata_is_refused_by_agent_lightnings_routes(
    gw: RunningGateway, agl: httpx.AsyncClient
) -> None:
    """Agent-lightning's routes take a task's input and metadata too (0.3's start, rollout and attempt updates;
    1.0's create): NaN or Infinity is refused in each one's envelope (0.3: 400; 1.0: 422 with ``detail``, as its
    server refuses a body), and nothing is stored."""
    json_type = {"content-type": "application/json"}
    for path, body in (
        ("/rollouts", b'{"input": {"q": NaN}}'),
        ("/queues/rollouts/enqueue", b'{"rollouts": [{"input": Infinity}]}'),
    ):
        refused = await agl.post(path, content=body, headers=json_type)
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", path
    assert (await agl.get("/rollouts")).json()["total"] == 0
    (rollout,) = (await agl.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]})).json()
    rid = rollout["rollout_id"]
    (claimed,) = (await agl.post("/queues/rollouts/dequeue", json={"limit": 1})).json()
    aid = claimed["attempt"]["attempt_id"]
    for path, body in (
        (f"/rollouts/{rid}", b'{"input": [1, NaN]}'),
        (f"/rollouts/{rid}", b'{"metadata": {"w": -Infinity}}'),
        (f"/rollouts/{rid}/attempts/{aid}", b'{"metadata": {"w": 1e999}}'),
    ):
        refused = await agl.post(path, content=body, headers=json_type)
        assert refused.status_code == 400 and "a JSON number must be finite" in refused.json()["error"]["message"]
    shown = (await agl.get(f"/rollouts/{rid}")).json()
    assert (shown["input"], shown["metadata"], shown["attempt"]["metadata"]) == (1, {}, None)
    for timeout in (b"NaN", b"Infinity"):  # a NaN wait never ended (nor did its request)
        body = b'{"rollout_ids": ["' + rid.encode() + b'"], "timeout": ' + timeout + b"}"
        refused = await agl.post("/waits/rollouts", content=body, headers=json_type)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "timeout"
    async with gw.http() as root:
        created = await root.post("/api/rollouts", content=b'[{"input": {"q": NaN}}]', headers=json_type)
        assert created.status_code == 422
        assert created.json()["detail"][0]["msg"] == "input holds NaN: a JSON number must be finite"
        assert (await root.get("/api/rollouts", params={"state_in": "queuing"})).json() == []
