"""Bad input and attribution, end to end (httpx and the official openai SDK → the gateway's app → the mock), the
app served in process but where the bytes on the connection are the point (a real gateway).

A refused call is a 4xx in OpenAI's envelope and leaves nothing behind: no span, no sequence id (the next good
call of the attempt is sequence id 1), and the gateway keeps serving. Attribution follows docs/gateway.md: path,
rollout key, ``X-Rollout-Id`` header, body ``rollout_id`` (never forwarded), else an unattributed span."""

from __future__ import annotations

import asyncio
import gzip
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rollway.gateway.attribution import KEY_CACHE_TTL, KeyCache
from rollway.mock import MockBackendProcess
from rollway.store import Store, TaskSpec
from support.clock import FakeClock
from support.gateway_harness import Alias, RunningGateway, claim_one, register, running_gateway

pytestmark = pytest.mark.in_process

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 12 + 30?"}]
GOOD: dict[str, Any] = {"model": "policy", "messages": MESSAGES, "max_tokens": 4}
MAX_BODY = 4096


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"max_body_bytes": MAX_BODY}


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    return [Alias("policy", [backend(mock)], version="v1")]


@pytest.fixture
async def http(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the gateway (in process or not: ``gw.http``)."""
    async with gw.http(timeout=10) as client:
        yield client


def backend(mock: MockBackendProcess) -> dict[str, Any]:
    return {"backend_id": "mock-a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}


def assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


async def all_spans(gw: RunningGateway, rollout_id: str) -> list[Any]:
    return [*(await gw.store.query_spans(rollout_id)), *(await gw.store.query_spans(None))]


def json_headers(**extra: str) -> dict[str, str]:
    return {"content-type": "application/json", **extra}


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 1000):
        yield data[i : i + 1000]


BAD_INPUTS: list[tuple[str, dict[str, Any], int, str]] = [
    ("malformed json", {"content": b'{"model": "policy", "messages": [', "headers": json_headers()}, 400, "JSON"),
    ("not an object", {"content": b'["policy"]', "headers": json_headers()}, 400, "object"),
    ("missing model", {"json": {"messages": MESSAGES}}, 400, "model"),
    ("empty model", {"json": {"model": "", "messages": MESSAGES}}, 400, "model"),
    ("model not a string", {"json": {"model": 7, "messages": MESSAGES}}, 400, "model"),
    ("unknown alias", {"json": {"model": "nope", "messages": MESSAGES}}, 404, "known models: policy"),
    (
        "oversized, declared",
        {"json": {"model": "policy", "messages": [{"role": "user", "content": "x" * MAX_BODY}]}},
        413,
        f"{MAX_BODY} bytes",
    ),
    (
        "oversized, chunked",
        {
            "content": lambda: _chunks(b'{"model": "policy", "pad": "' + b"x" * MAX_BODY + b'"}'),
            "headers": json_headers(),
        },
        413,
        f"{MAX_BODY} bytes",
    ),
    ("wrong content type", {"content": b'{"model": "policy"}', "headers": {"content-type": "text/plain"}}, 415, "JSON"),
    ("no content type", {"content": b'{"model": "policy"}'}, 415, "JSON"),
    (
        "compressed body",
        {"content": gzip.compress(orjson.dumps(GOOD)), "headers": json_headers(**{"content-encoding": "gzip"})},
        415,
        "Content-Encoding 'gzip'",
    ),
]


async def test_media_type_case_and_parameters_do_not_matter(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    for content_type in ("Application/JSON", "application/json; charset=UTF-8"):
        response = await http.post(
            f"{gw.url}/v1/chat/completions", content=orjson.dumps(GOOD), headers={"content-type": content_type}
        )
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(("case", "request_kwargs", "status", "says"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
async def test_bad_input_is_refused_in_the_envelope_and_records_nothing(
    gw: RunningGateway,
    http: httpx.AsyncClient,
    mock: MockBackendProcess,
    case: str,
    request_kwargs: dict[str, Any],
    status: int,
    says: str,
) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    url = f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"
    if callable(request_kwargs.get("content")):  # a fresh chunked body (a generator is consumed once)
        request_kwargs = request_kwargs | {"content": request_kwargs["content"]()}
    error = assert_envelope(await http.post(url, **request_kwargs), status)
    assert says in error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert await all_spans(gw, rollout_id) == []
    assert mock.stats()["requests_total"] == 0
    good = await http.post(url, json=GOOD)  # the gateway keeps serving; no sequence id was consumed
    assert good.status_code == 200, good.text
    assert good.headers["x-rollway-sequence-id"] == "1"
    assert [s.sequence_id for s in await all_spans(gw, rollout_id)] == [1]


async def test_unknown_alias_with_the_sdk_lists_the_known_ones(gw: RunningGateway) -> None:
    judge = {"backend_id": "judge-a", "base_url": "http://127.0.0.1:9/v1", "kind": "openai", "model": "judge"}
    await register(gw.store, "judge", judge)
    with pytest.raises(openai.NotFoundError) as info:
        await gw.client().chat.completions.create(model="polcy", messages=MESSAGES)
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "model_not_found"
    assert "known models: judge, policy" in info.value.body["message"]


async def test_wrong_method_is_a_405_in_the_envelope(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    assert_envelope(await http.get(f"{gw.url}/v1/chat/completions"), 405)
    assert_envelope(await http.post(f"{gw.url}/v1/models", json={}), 405)


# -------------------------------------------------------------------------------------- rollout lifecycle


async def test_unknown_rollout_or_attempt_is_404(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    rollout_id, _ = await claim_one(gw.store)
    for path in ("/rollout/ro-nope/v1", f"/rollout/{rollout_id}/attempt/at-nope/v1", "/rollout/ro-nope/attempt/x/v1"):
        error = assert_envelope(await http.post(f"{gw.url}{path}/chat/completions", json=GOOD), 404)
        assert error["type"] == "not_found_error"
    by_header = await http.post(f"{gw.url}/v1/chat/completions", json=GOOD, headers={"x-rollout-id": "ro-nope"})
    assert_envelope(by_header, 404)
    assert await all_spans(gw, rollout_id) == []


async def test_stale_attempt_is_409_and_the_new_one_is_served(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    rollout_id, old = await claim_one(gw.store)
    new = (await gw.store.start_attempt(rollout_id)).attempt.attempt_id
    assert new != old
    error = assert_envelope(
        await http.post(f"{gw.url}/rollout/{rollout_id}/attempt/{old}/v1/chat/completions", json=GOOD), 409
    )
    assert error["type"] == "conflict_error" and "stale" in error["message"]
    served = await http.post(f"{gw.url}/rollout/{rollout_id}/v1/chat/completions", json=GOOD)  # the latest
    assert served.status_code == 200
    assert served.headers["x-rollway-attempt-id"] == new
    assert served.headers["x-rollway-sequence-id"] == "1"
    assert [(s.attempt_id, s.sequence_id) for s in await gw.store.query_spans(rollout_id)] == [(new, 1)]


async def test_finished_rollout_is_409(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    url = f"{gw.url}/rollout/{rollout_id}/v1/chat/completions"
    assert (await http.post(url, json=GOOD)).status_code == 200
    await gw.store.update_attempt(rollout_id, attempt_id, status="succeeded")
    error = assert_envelope(await http.post(url, json=GOOD), 409)
    assert error["type"] == "conflict_error"
    assert [s.sequence_id for s in await gw.store.query_spans(rollout_id)] == [1]


# -------------------------------------------------------------------------------------------- attribution


async def test_unattributed_call_is_served_and_recorded(gw: RunningGateway) -> None:
    raw = await gw.client().chat.completions.with_raw_response.create(**GOOD)
    assert raw.parse().choices[0].message.content
    assert "x-rollway-rollout-id" not in raw.headers
    [span] = await gw.store.query_spans(None)
    assert span.rollout_id is None and span.attempt_id is None
    assert span.status.status_code == "OK"
    assert span.attributes["rollway.response_token_ids"]


async def test_header_attribution(gw: RunningGateway) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    client = gw.client(default_headers={"X-Rollout-Id": rollout_id, "X-Attempt-Id": attempt_id})
    raw = await client.chat.completions.with_raw_response.create(**GOOD)
    assert raw.headers["x-rollway-rollout-id"] == rollout_id
    assert raw.headers["x-rollway-attempt-id"] == attempt_id
    only_rollout = gw.client(default_headers={"X-Rollout-Id": rollout_id})  # the latest attempt
    await only_rollout.chat.completions.create(**GOOD)
    spans = await gw.store.query_spans(rollout_id)
    assert [(s.attempt_id, s.sequence_id) for s in spans] == [(attempt_id, 1), (attempt_id, 2)]
    assert await gw.store.query_spans(None) == []


async def test_body_attribution_is_not_forwarded_upstream(gw: RunningGateway, mock: MockBackendProcess) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    raw = await gw.client().chat.completions.with_raw_response.create(**GOOD, extra_body={"rollout_id": rollout_id})
    assert raw.headers["x-rollway-rollout-id"] == rollout_id
    [span] = await gw.store.query_spans(rollout_id)
    assert (span.attempt_id, span.sequence_id) == (attempt_id, 1)
    assert "rollout_id" not in span.attributes["rollway.request"]
    [upstream] = mock.requests(path="/v1/chat/completions")
    assert "rollout_id" not in upstream["body"]
    assert upstream["body"]["model"] == "mock-model"


async def test_path_beats_header_and_body(gw: RunningGateway) -> None:
    first, _ = await claim_one(gw.store)
    second, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{first}/v1", default_headers={"X-Rollout-Id": second})
    await client.chat.completions.create(**GOOD, extra_body={"rollout_id": second})
    assert len(await gw.store.query_spans(first)) == 1
    assert await gw.store.query_spans(second) == []


async def test_rollout_key_attributes_and_is_confined_to_its_rollout(
    gw: RunningGateway, http: httpx.AsyncClient
) -> None:
    mine, my_attempt = await claim_one(gw.store)
    other, _ = await claim_one(gw.store)
    _, key = await gw.store.mint_key("rollout", rollout_id=mine, attempt_id=my_attempt)
    assert key.startswith("rk-")
    client = gw.client(api_key=key)
    raw = await client.chat.completions.with_raw_response.create(**GOOD)
    assert raw.headers["x-rollway-rollout-id"] == mine
    # on its own rollout's path too
    await gw.client(f"{gw.url}/rollout/{mine}/v1", api_key=key).chat.completions.create(**GOOD)
    auth = {"authorization": f"Bearer {key}"}
    for url in (
        f"{gw.url}/rollout/{other}/v1/chat/completions",
        f"{gw.url}/rollout/{mine}/attempt/at-someother/v1/chat/completions",
    ):
        error = assert_envelope(await http.post(url, json=GOOD, headers=auth), 403)
        assert error["type"] == "permission_error"
    with pytest.raises(openai.PermissionDeniedError):
        await gw.client(f"{gw.url}/rollout/{other}/v1", api_key=key).chat.completions.create(**GOOD)
    assert [s.sequence_id for s in await gw.store.query_spans(mine)] == [1, 2]
    assert await gw.store.query_spans(other) == []


async def test_revoked_or_unknown_rollout_key_is_401(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    record, key = await gw.store.mint_key("rollout", rollout_id=rollout_id, attempt_id=attempt_id)
    await gw.client(api_key=key).chat.completions.create(**GOOD)
    await gw.store.revoke_key(record.key_id)
    gw.state.keys.forget(record.key_id)  # what the admin API does with a revocation
    for plain in (key, "rk-" + secrets.token_urlsafe(24)):
        error = assert_envelope(
            await http.post(f"{gw.url}/v1/chat/completions", json=GOOD, headers={"authorization": f"Bearer {plain}"}),
            401,
        )
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await gw.client(api_key=key).chat.completions.create(**GOOD)
    assert [s.sequence_id for s in await gw.store.query_spans(rollout_id)] == [1]


async def test_a_cached_key_stops_working_when_it_expires(store: Store, clock: FakeClock) -> None:
    _, plain = await store.mint_key("gateway", expires_time=clock.now + 10)
    keys = KeyCache(store)
    assert await keys.find(plain) is not None  # now cached
    clock.advance(9.9)
    assert await keys.find(plain) is not None
    clock.advance(0.1)
    assert await keys.find(plain) is None


async def test_required_keys(tmp_path: Path, mock: MockBackendProcess) -> None:
    async with running_gateway(tmp_path, gateway_auth="keys", in_process=True) as gw, gw.http(timeout=10) as http:
        await register(gw.store, "policy", backend(mock))
        url = f"{gw.url}/v1/chat/completions"
        assert_envelope(await http.post(url, json=GOOD), 401)
        for token in ("unused", "sk-rw-" + secrets.token_urlsafe(24)):
            assert_envelope(await http.post(url, json=GOOD, headers={"authorization": f"Bearer {token}"}), 401)
        with pytest.raises(openai.AuthenticationError):
            await gw.client(api_key="unused").chat.completions.create(**GOOD)
        _, gateway_key = await gw.store.mint_key("gateway", name="agents")
        assert (await gw.client(api_key=gateway_key).chat.completions.create(**GOOD)).choices
        rollout_id, attempt_id = await claim_one(gw.store)
        _, rollout_key = await gw.store.mint_key("rollout", rollout_id=rollout_id, attempt_id=attempt_id)
        await gw.client(api_key=rollout_key).chat.completions.create(**GOOD)
        assert [s.sequence_id for s in await gw.store.query_spans(rollout_id)] == [1]
        # Listing the models is a call too: it needs a key (a gateway or a rollout key).
        for path in ("/v1/models", "/v1/models/policy"):
            assert_envelope(await http.get(gw.url + path), 401)
            assert_envelope(await http.get(gw.url + path, headers={"authorization": "Bearer unused"}), 401)
            for key in (gateway_key, rollout_key):
                listed = await http.get(gw.url + path, headers={"authorization": f"Bearer {key}"})
                assert listed.status_code == 200 and "policy" in listed.text
        assert len(await gw.store.query_spans(None)) == 1  # the gateway key's call


async def test_a_call_without_a_key_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    """With keys required, a caller with no valid key gets 401 on its headers alone: a body it never sends is not
    waited for, and one that is not JSON is not looked at (the refusal is about the key, not the body)."""
    async with running_gateway(tmp_path, gateway_auth="keys") as gw, httpx.AsyncClient(timeout=10) as http:
        headers = {"content-type": "application/json"}
        bad = await http.post(f"{gw.url}/v1/chat/completions", content=b"{not json", headers=headers)
        assert_envelope(bad, 401)
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += "Content-Length: 1000000\r\n\r\n"
        writer.write(head.encode())  # the headers only: the promised megabyte never comes
        try:
            status = await asyncio.wait_for(reader.readline(), 10)
        finally:
            writer.close()
        assert status.split()[1] == b"401", status
        assert await gw.store.query_spans(None) == []


async def test_top_logprobs_without_logprobs_gets_the_backends_answer(
    gw: RunningGateway, mock: MockBackendProcess, http: httpx.AsyncClient
) -> None:
    body = {**GOOD, "top_logprobs": 3}
    async with httpx.AsyncClient(timeout=10) as plain:
        direct = await plain.post(f"{mock.url}/v1/chat/completions", json=body)
    through = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    assert direct.status_code == through.status_code == 400
    assert through.json() == direct.json()
    assert mock.requests(path="/v1/chat/completions")[-1]["body"]["top_logprobs"] == 3  # not overwritten


async def test_traceparent_is_continued(gw: RunningGateway, mock: MockBackendProcess) -> None:
    rollout_id, _ = await claim_one(gw.store)
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    await client.chat.completions.create(**GOOD, extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    await client.chat.completions.create(**GOOD, extra_headers={"traceparent": "00-zz-not-a-trace"})
    unsampled = {"traceparent": f"00-{trace_id}-{parent}-00", "tracestate": "vendor=abc,other=1"}
    await client.chat.completions.create(**GOOD, extra_headers=unsampled)
    first, second, third = await gw.store.query_spans(rollout_id)
    assert (first.trace_id, first.parent_id) == (trace_id, parent)
    assert first.span_id != parent
    assert second.trace_id != trace_id and second.parent_id is None  # an invalid header starts a new trace
    upstream = mock.requests(path="/v1/chat/completions")
    assert upstream[0]["headers"]["traceparent"] == f"00-{trace_id}-{first.span_id}-01"
    assert "tracestate" not in upstream[0]["headers"]
    assert upstream[1]["headers"]["traceparent"] == f"00-{second.trace_id}-{second.span_id}-01"
    # The caller's flags (here: not sampled) and tracestate go on to the backend unchanged.
    assert upstream[2]["headers"]["traceparent"] == f"00-{trace_id}-{third.span_id}-00"
    assert upstream[2]["headers"]["tracestate"] == "vendor=abc,other=1"


@pytest.mark.parametrize("flags", ["_1", " 1", "+1", "0X"])
async def test_a_traceparent_with_flags_that_are_not_two_hex_digits_starts_a_new_trace(
    gw: RunningGateway, flags: str
) -> None:
    """Python's ``int(x, 16)`` takes ``_1``, `` 1`` and ``+1``: they are not W3C flags (two lower-case hex digits)."""
    rollout_id, _ = await claim_one(gw.store)
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    await client.chat.completions.create(**GOOD, extra_headers={"traceparent": f"00-{trace_id}-{parent}-{flags}"})
    [span] = await gw.store.query_spans(rollout_id)
    assert span.trace_id != trace_id and span.parent_id is None


@pytest.mark.in_process(False)  # the answer's bytes on a real connection
@pytest.mark.parametrize(("model", "status"), [("policy", 200), ("nope", 404)])
async def test_an_http_1_0_client_gets_a_length_not_chunks(gw: RunningGateway, model: str, status: int) -> None:
    """HTTP/1.0 has no chunked transfer coding: a whole answer (or error) carries Content-Length."""
    host, port = gw.url.removeprefix("http://").split(":")
    body = orjson.dumps(GOOD | {"model": model})
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    raw = await asyncio.wait_for(reader.read(), 10)  # the server closes an HTTP/1.0 connection after the answer
    writer.close()
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    lines = head_bytes.decode().split("\r\n")
    fields = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert lines[0].split()[1] == str(status)
    assert "transfer-encoding" not in fields
    assert int(fields["content-length"]) == len(payload)
    assert "choices" in orjson.loads(payload) if status == 200 else "error" in orjson.loads(payload)


async def test_the_key_cache_keeps_only_keys_it_may_still_serve(store: Store) -> None:
    """A trainer's rollout keys are used for one attempt and never again: entries past the TTL are dropped as new
    keys come in, so the cache holds the last few seconds' keys, not every finished attempt's (each was ~1.6 KB,
    up to ``KEY_CACHE_SIZE`` of them)."""
    ticks = FakeClock(0.0)
    keys = KeyCache(store, clock=ticks)
    for batch in range(8):
        for _ in range(20):
            rollout_id, attempt_id = await claim_one(store)
            _, plain = await store.mint_key("rollout", rollout_id=rollout_id, attempt_id=attempt_id)
            assert await keys.find(plain) is not None
            ticks.advance(KEY_CACHE_TTL / 40)  # 20 keys each half a TTL: at most 3 batches are younger than it
        assert len(keys) <= 60, f"batch {batch}: {len(keys)} keys cached"
    ticks.advance(2 * KEY_CACHE_TTL)
    _, plain = await store.mint_key("gateway")
    assert await keys.find(plain) is not None
    assert len(keys) == 1


async def test_a_claims_keys_are_known_to_the_gateway_without_a_read(store: Store, monkeypatch: Any) -> None:
    keys = KeyCache(store)
    store.key_observer = keys.prime
    await store.enqueue([TaskSpec(input=i) for i in range(3)])
    claimed = await store.claim_with_keys("w", limit=3)

    async def no_read(plain: str) -> None:
        raise AssertionError("the key was read from the store")

    monkeypatch.setattr(store, "find_key", no_read)
    found = [await keys.find(plain) for _, plain in claimed]
    assert [(k.scope, k.rollout_id, k.attempt_id) for k in found if k is not None] == [
        ("rollout", a.rollout.rollout_id, a.attempt.attempt_id) for a, _ in claimed
    ]


@pytest.mark.in_process(False)
@pytest.mark.parametrize("auth", ["none", "keys"])
async def test_an_unknown_alias_lists_the_known_ones_only_to_an_authenticated_caller(
    tmp_path: Path, mock: MockBackendProcess, auth: str
) -> None:
    """With an admin token set and the data plane open (``none``), anyone who can reach it may call, and is told
    only that the model does not exist; a caller with a key the gateway checks (a rollout key, any key with
    ``keys``) or the admin token is authenticated and is told the aliases there are too."""
    token = "admin-token-for-aliases"
    async with running_gateway(tmp_path, admin_token=token, gateway_auth=auth) as gw, gw.http(timeout=10) as http:
        await register(gw.store, "policy", backend(mock))
        await register(gw.store, "judge", backend(mock))
        rollout_id, attempt_id = await claim_one(gw.store)
        _, rollout_key = await gw.store.mint_key("rollout", rollout_id=rollout_id, attempt_id=attempt_id)
        _, gateway_key = await gw.store.mint_key("gateway")
        unknown = {"model": "polcy", "messages": MESSAGES}
        path = f"/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"
        callers: list[tuple[str, dict[str, str], bool]] = [
            ("/v1/chat/completions", {"authorization": f"Bearer {token}"}, auth == "none"),
            (path, {"authorization": f"Bearer {rollout_key}"}, True),
            ("/v1/chat/completions", {"authorization": f"Bearer {gateway_key}"}, auth == "keys"),
        ]
        if auth == "none":
            callers += [("/v1/chat/completions", {}, False), (path, {}, False)]
        for url, headers, listed in callers:
            answer = await http.post(url, json=unknown, headers=headers)
            if auth == "keys" and headers["authorization"].endswith(token):
                assert answer.status_code == 401  # the admin token is no data-plane key
                continue
            error = assert_envelope(answer, 404)
            assert error["code"] == "model_not_found"
            says = "model 'polcy' does not exist" + ("; known models: judge, policy" if listed else "")
            assert error["message"] == says, (url, headers)
        assert await all_spans(gw, rollout_id) == []
