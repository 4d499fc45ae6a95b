"""A ``litellm`` backend, end to end: the official openai SDK → a real gateway → LiteLLM → a local stub of
Anthropic's Messages API (``POST /v1/messages``, JSON or SSE events) on loopback.

LiteLLM's Anthropic adapter appends ``/v1/messages`` to ``api_base`` unless it already ends with it: the
backend's ``base_url`` is the provider's root (``http://host:port``) or the full messages URL; ``.../v1``
would be asked for ``/v1/v1/messages``.

And: a gateway without such a backend never imports LiteLLM (checked in a fresh interpreter)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollway.mock import MockBackendProcess
from support.gateway_harness import Alias, RunningGateway, claim_one, register, running_gateway

SECRET = "sk-ant-test"
UPSTREAM_MODEL = "claude-3-5-haiku-20241022"
WORDS = ["Hello", " from", " the", " stub", "!"]
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
]


# LiteLLM (1.106 to 1.110 at least) builds some pydantic models lazily, on the first streamed chunk, and pydantic
# warns about TypedDicts of LiteLLM's ("Item 'x' ... is using", "Items 'x', 'y' ... are using": which one comes
# first depends on the calls a process made before); with warnings as errors that warning would break LiteLLM.
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* (is|are) using the `ReadOnly` qualifier:UserWarning")


@dataclass
class AnthropicStub:
    """The stub's record: requests seen, when the last request of each behaviour arrived (``time.monotonic``),
    and whether a streamed answer was cut off by its client."""

    url: str
    seen: list[dict[str, Any]] = field(default_factory=list)
    arrived: dict[str, float] = field(default_factory=dict)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


def _stub_app(stub: AnthropicStub) -> Starlette:
    """``/v1/messages``. The last user message picks a behaviour: ``slow`` streams 100 words, 0.1 s apart;
    ``break`` drops the connection after two words; ``hang`` answers only after 6 s; ``garbled`` answers 200
    with a body that is not a message (LiteLLM fails reading it); ``redirect`` answers 307 back to itself (a loop
    to a client that follows it); anything else answers ``WORDS`` at once."""

    async def messages(request: Request) -> Response:
        body = await request.json()
        stub.seen.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        mode = body["messages"][-1]["content"]
        mode = mode if isinstance(mode, str) else mode[0]["text"]
        stub.arrived[mode] = time.monotonic()
        if request.headers.get("x-api-key") != SECRET:
            error = {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}
            return JSONResponse(error, status_code=401)
        if body.get("max_tokens", 0) > 4096:
            error = {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "max_tokens: 9999 > 4096, the maximum"},
            }
            return JSONResponse(error, status_code=400)
        usage = {"input_tokens": 11, "output_tokens": len(WORDS)}
        if mode == "garbled":
            return JSONResponse({"unexpected": True})
        if mode == "redirect":
            return Response(status_code=307, headers={"Location": f"{request.url}?token=signed-s3cr3t"})
        if mode == "hang":  # answers only after 6 s
            await asyncio.sleep(6)
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": "msg_stub_1",
                    "type": "message",
                    "role": "assistant",
                    "model": body["model"],
                    "content": [{"type": "text", "text": "".join(WORDS)}],
                    "stop_reason": "end_turn",
                    "stop_sequence": None,
                    "usage": usage,
                }
            )

        async def events() -> AsyncIterator[bytes]:
            start = {
                "id": "msg_stub_2",
                "type": "message",
                "role": "assistant",
                "model": body["model"],
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 11, "output_tokens": 1},
            }
            sequence: list[tuple[str, dict[str, Any]]] = [
                ("message_start", {"type": "message_start", "message": start}),
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                ),
                ("ping", {"type": "ping"}),
            ]
            words = [f" w{i}" for i in range(100)] if mode == "slow" else WORDS
            sequence += [
                (
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}},
                )
                for word in words
            ]
            sequence += [
                ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                (
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                        "usage": {"output_tokens": len(WORDS)},
                    },
                ),
                ("message_stop", {"type": "message_stop"}),
            ]
            finished = False
            try:
                for number, (name, data) in enumerate(sequence):
                    if mode == "break" and number == 5:
                        raise RuntimeError("stub: connection dropped")  # uvicorn aborts the response
                    if mode == "slow" and name == "content_block_delta":
                        await asyncio.sleep(0.1)
                    yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                finished = True
            finally:
                if not finished and mode != "break":
                    stub.disconnected.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])


class _QuietServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:
        return None


@asynccontextmanager
async def anthropic_stub() -> AsyncIterator[AnthropicStub]:
    """The stub on a loopback port, served by uvicorn in this event loop."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    stub = AnthropicStub(url=f"http://127.0.0.1:{sock.getsockname()[1]}")
    server = _QuietServer(uvicorn.Config(_stub_app(stub), log_level="critical", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield stub
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def stub() -> AsyncIterator[AnthropicStub]:
    async with anthropic_stub() as running:
        yield running


@pytest.fixture
def gateway_aliases(stub: AnthropicStub) -> list[Alias]:
    backend = {
        "backend_id": "anthropic",
        "kind": "litellm",
        "model": f"anthropic/{UPSTREAM_MODEL}",
        "base_url": stub.url,
        "api_key": SECRET,
    }
    return [Alias("claude", [backend], version="2024-10-22")]


async def assert_no_secret(gw: RunningGateway, rollout_id: str | None, *texts: str) -> None:
    spans = await gw.store.query_spans(rollout_id)
    assert spans
    for span in spans:
        assert SECRET not in span.model_dump_json()
    for text in texts:
        assert SECRET not in text


async def test_chat_through_litellm(gw: RunningGateway, stub: AnthropicStub) -> None:
    rollout_id, attempt_id = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    raw = await client.chat.completions.with_raw_response.create(model="claude", messages=MESSAGES, max_tokens=64)
    answer = raw.parse()
    assert answer.choices[0].message.content == "".join(WORDS)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.completion_tokens == len(WORDS)
    assert raw.headers["x-rollway-sequence-id"] == "1"

    [request] = stub.seen
    assert request["path"] == "/v1/messages"
    assert request["headers"]["x-api-key"] == SECRET  # the provider got the backend's key
    assert request["body"]["model"] == UPSTREAM_MODEL
    assert request["body"]["system"] in ("Be brief.", [{"type": "text", "text": "Be brief."}])
    assert request["body"]["messages"][0]["role"] == "user"

    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    attrs = span.attributes
    assert span.status.status_code == "OK"
    assert attrs["rollway.trainable"] is False
    assert attrs.get("rollway.response_token_ids") is None and attrs.get("rollway.prompt_token_ids") is None
    assert attrs["gen_ai.system"] == "litellm"
    assert attrs["rollway.backend_id"] == "anthropic"
    assert attrs["rollway.model_version"] == "2024-10-22"
    assert attrs["rollway.response"]["choices"][0]["message"]["content"] == "".join(WORDS)
    assert attrs["gen_ai.usage.output_tokens"] == len(WORDS)
    await assert_no_secret(gw, rollout_id, raw.http_response.text)


async def test_streamed_chat_through_litellm(gw: RunningGateway, stub: AnthropicStub) -> None:
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    raw = await client.chat.completions.with_raw_response.create(
        model="claude", messages=MESSAGES, max_tokens=64, stream=True
    )
    chunks = [c async for c in raw.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(WORDS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert raw.headers["content-type"] == "text/event-stream"
    [request] = stub.seen
    assert request["body"]["stream"] is True
    [span] = await gw.store.query_spans(rollout_id)
    attrs = span.attributes
    assert span.status.status_code == "OK"
    assert attrs["rollway.stream"] is True
    assert attrs["rollway.trainable"] is False
    assert attrs["rollway.response"]["choices"][0]["message"]["content"] == text
    assert attrs["rollway.ttft_seconds"] is not None
    await assert_no_secret(gw, rollout_id, *(c.model_dump_json() for c in chunks))


async def test_provider_stream_that_breaks_ends_with_an_error_event(gw: RunningGateway, stub: AnthropicStub) -> None:
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    received: list[Any] = []
    stream = await client.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": "break"}], max_tokens=64, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        async with stream:
            async for chunk in stream:
                received.append(chunk)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "stream_interrupted"
    assert "".join(c.choices[0].delta.content or "" for c in received if c.choices) == "Hello from"
    [span] = await gw.store.query_spans(rollout_id)
    assert span.status.status_code == "ERROR"
    assert span.attributes["rollway.response"]["choices"][0]["message"]["content"] == "Hello from"
    await assert_no_secret(gw, rollout_id)


async def test_client_abort_closes_the_provider_stream(gw: RunningGateway, stub: AnthropicStub) -> None:
    rollout_id, _ = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/v1")
    stream = await client.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": "slow"}], max_tokens=512, stream=True
    )
    seen = 0
    async with stream:
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
    await asyncio.wait_for(stub.disconnected.wait(), 2)  # ~10 s of answer left: the gateway hung up on it
    assert await gw.state.registry.drain("claude", 10)
    [span] = await gw.store.query_spans(rollout_id)
    assert span.attributes["rollway.cancelled"] is True
    assert span.status.status_code == "ERROR"


async def test_provider_error_comes_back_in_the_envelope_without_the_key(
    gw: RunningGateway, stub: AnthropicStub
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{gw.url}/v1/chat/completions", json={"model": "claude", "messages": MESSAGES, "max_tokens": 9999}
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "max_tokens: 9999 > 4096" in error["message"]
    assert len(stub.seen) == 1  # a 400 is not retried
    [span] = await gw.store.query_spans(None)
    assert span.status.status_code == "ERROR"
    assert span.attributes["http.response.status_code"] == 400
    await assert_no_secret(gw, None, response.text)
    with pytest.raises(openai.BadRequestError):
        await gw.client().chat.completions.create(model="claude", messages=MESSAGES, max_tokens=9999)


async def test_a_provider_answer_litellm_cannot_read_is_an_error_without_a_traceback(
    gw: RunningGateway, stub: AnthropicStub
) -> None:
    # LiteLLM words the failure with the traceback of its own code and a link to file a bug: neither is the
    # client's business (file paths of the server), and neither belongs in the span.
    garbled = [{"role": "user", "content": "garbled"}]
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{gw.url}/v1/chat/completions", json={"model": "claude", "messages": garbled, "max_tokens": 50}
        )
    assert response.status_code >= 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "'content'" in error["message"]  # what went wrong is still said
    spans = await gw.store.query_spans(None)
    assert spans and all(s.status.status_code == "ERROR" for s in spans)
    for text in [response.text, *(s.model_dump_json() for s in spans)]:
        assert "Traceback" not in text and ".py" not in text and "github.com" not in text, text[:400]
    await assert_no_secret(gw, None, response.text)


async def test_wrong_provider_key_is_not_echoed(tmp_path: Path, stub: AnthropicStub) -> None:
    async with running_gateway(tmp_path) as gw:
        wrong = "sk-ant-wrong-0123456789"
        await register(
            gw.store,
            "claude",
            {
                "backend_id": "anthropic",
                "kind": "litellm",
                "model": f"anthropic/{UPSTREAM_MODEL}",
                "base_url": stub.url,
                "api_key": wrong,
            },
        )
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "claude", "messages": MESSAGES})
        assert response.status_code == 401, response.text
        assert wrong not in response.text
        [span] = await gw.store.query_spans(None)
        assert wrong not in span.model_dump_json()


LAZY_IMPORT_CHECK = r"""
import asyncio, json, sys
import httpx
from rollway.settings import Settings
from support.gateway_harness import app_lifespan

async def main(db, base_url):
    async with app_lifespan(Settings(database_url=f"sqlite:///{db}")) as app:
        store = app.state.store
        await store.put_model("policy", [{"backend_id": "m", "base_url": base_url, "kind": "vllm", "model": "m"}])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            statuses = []
            for stream in (False, True):
                body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
                response = await client.post("/v1/chat/completions", json=body)
                statuses.append(response.status_code)
            statuses.append((await client.get("/v1/models")).status_code)
        spans = len(await store.query_spans(None))
    print(json.dumps({"statuses": statuses, "spans": spans, "litellm": "litellm" in sys.modules}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_gateway_without_litellm_backends_never_imports_litellm(tmp_path: Path, mock: MockBackendProcess) -> None:
    result = subprocess.run(
        [sys.executable, "-c", LAZY_IMPORT_CHECK, str(tmp_path / "lazy.db"), mock.base_url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"statuses": [200, 200, 200], "spans": 2, "litellm": False}


async def test_read_timeout_applies_to_a_litellm_backend(tmp_path: Path, stub: AnthropicStub) -> None:
    backend = {"backend_id": "anthropic", "kind": "litellm", "model": f"anthropic/{UPSTREAM_MODEL}"}
    async with running_gateway(tmp_path, read_timeout=1.0) as gateway:
        await register(gateway.store, "claude", {**backend, "base_url": stub.url, "api_key": SECRET})
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(
                f"{gateway.url}/v1/chat/completions",
                json={"model": "claude", "messages": [{"role": "user", "content": "hang"}], "max_tokens": 50},
            )
        # From the request's arrival at the provider: LiteLLM's set-up before it (seconds of CPU, more on a busy
        # machine) is not the timeout's business.
        elapsed = time.monotonic() - stub.arrived["hang"]
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout"
        assert elapsed < 5, elapsed  # not the stub's 6 s (nor LiteLLM's own default, 600 s)
        [span] = await gateway.store.query_spans(None)
        assert span.status.status_code == "ERROR"


@pytest.mark.parametrize(
    "field",
    [
        *("base_url", "api_base", "api_key", "mock_response", "extra_headers", "aws_secret_access_key"),
        *("azure_ad_token", "success_callback", "callbacks", "_skip_cost", "langsmith_base_url", "caching"),
    ],
)
async def test_a_client_cannot_set_where_or_how_litellm_calls(
    gw: RunningGateway, stub: AnthropicStub, field: str
) -> None:
    """LiteLLM's own keywords choose the destination and the credentials (or fake the answer); a client that could
    set them could have the backend's key sent to a server of its choosing. Refused, and nothing is sent."""
    async with anthropic_stub() as attacker:
        value: Any = {"extra_headers": {"x": "y"}, "success_callback": ["langsmith"], "callbacks": ["langsmith"]}.get(
            field, attacker.url
        )
        with pytest.raises(openai.BadRequestError) as refused:
            await gw.client().chat.completions.create(
                model="claude", messages=MESSAGES, max_tokens=64, extra_body={field: value}
            )
        assert attacker.seen == [] and stub.seen == []
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == field and error["code"] == "field_not_allowed"


async def test_provider_parameters_still_reach_the_provider(gw: RunningGateway, stub: AnthropicStub) -> None:
    """A provider's parameter goes on; OpenAI's ``metadata`` is accepted and not handed to LiteLLM (which reads
    logging settings there, e.g. a URL to post the call to)."""
    metadata = {"langsmith_base_url": "http://127.0.0.1:9", "langsmith_api_key": "x"}
    answer = await gw.client().chat.completions.create(
        model="claude", messages=MESSAGES, max_tokens=64, extra_body={"top_k": 3}, metadata=metadata
    )
    assert answer.choices[0].message.content == "".join(WORDS)
    [request] = stub.seen
    assert request["body"]["top_k"] == 3 and "metadata" not in request["body"]


async def test_alias_defaults_a_litellm_backend_does_not_take_are_left_out(tmp_path: Path, stub: AnthropicStub) -> None:
    """An alias's sampling defaults may be meant for its vLLM backends (``chat_template_kwargs``): a litellm
    backend of the alias gets the ones it takes, and its calls do not fail over a default nobody sent."""
    async with running_gateway(tmp_path) as gw:
        backend = {"backend_id": "a", "kind": "litellm", "model": f"anthropic/{UPSTREAM_MODEL}", "base_url": stub.url}
        sampling = {"temperature": 0.25, "chat_template_kwargs": {"enable_thinking": False}}
        await gw.store.put_model("claude", [backend | {"api_key": SECRET}], sampling=sampling)
        answer = await gw.client().chat.completions.create(model="claude", messages=MESSAGES, max_tokens=64)
        assert answer.choices[0].message.content == "".join(WORDS)
        [request] = stub.seen
        assert request["body"]["temperature"] == 0.25 and "chat_template_kwargs" not in request["body"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_providers_redirect_is_not_followed_and_is_a_502_that_names_it(
    gw: RunningGateway, stub: AnthropicStub, stream: bool
) -> None:
    """LiteLLM's clients follow redirects by default, re-posting the call with the provider's key (a loop: tens of
    posts, then a 500); the gateway turns that off. The 3xx is posted once and answered as an aiohttp backend's
    is: a 502 naming the status and the target's host, recorded on the call's span."""
    rollout_id, _ = await claim_one(gw.store)
    async with httpx.AsyncClient(timeout=60) as http:
        messages = [{"role": "user", "content": "redirect"}]
        body = {"model": "claude", "messages": messages, "max_tokens": 8, "stream": stream}
        response = await http.post(f"{gw.url}/rollout/{rollout_id}/v1/chat/completions", json=body)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_redirect")
    assert error["message"] == (
        "backend 'anthropic' answered 307 with a redirect to host '127.0.0.1'; the gateway does not follow redirects"
    )
    assert "s3cr3t" not in response.text
    assert len(stub.seen) == 1 and "redirect" in stub.arrived  # posted once: not followed, not retried
    [span] = await gw.store.query_spans(rollout_id)
    assert span.attributes["error.type"] == "upstream_redirect" and span.attributes["http.response.status_code"] == 502
    await assert_no_secret(gw, rollout_id, response.text)
