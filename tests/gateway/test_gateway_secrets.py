"""Secrets a gateway holds for others — a backend's API key, an agent server's key — are shown to no one: not when
the server they belong to echoes them back in an error, and not as part of a URL."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollway.gateway.masking import KeyGuard
from rollway.mock import MockBackendProcess
from support.gateway_harness import register, running_gateway, serving, vllm

BACKEND_KEY = "sk-backend-4f1c9a7e2b"
AGENT_KEY = "agent-key-8d2e6b0c93"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("status", "times", "retries"), [(401, 1, 0), (500, None, 1)])
async def test_a_backend_that_echoes_its_key_in_an_error_shows_it_to_no_one(
    tmp_path: Path, mock: MockBackendProcess, status: int, times: int | None, retries: int
) -> None:
    """An answered error (401, passed on) and a retried one (500, the last passed on) each echo the key."""
    async with running_gateway(tmp_path, upstream_retries=retries, retry_max_wait=0.05) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": BACKEND_KEY})
        echoed = {"error": {"message": f"bad key: you sent Authorization: Bearer {BACKEND_KEY}", "type": "auth"}}
        mock.add_faults({"kind": "status", "status": status, "body": echoed, "times": times})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert response.status_code == status
        assert response.json()["error"]["message"] == "bad key: you sent Authorization: Bearer ***"
        assert await gw.state.registry.drain("policy", 10)
        [span] = await gw.store.query_spans(None)
        assert "Bearer ***" in span.attributes["rollway.error"]
        assert BACKEND_KEY not in span.model_dump_json()


async def test_a_backend_that_echoes_its_key_in_an_answer_shows_it_to_no_one(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """A 200 answer quoting the request's key (a debugging proxy, a model told to repeat its headers): masked in
    what the client gets and in the span, the rest of the answer as the backend sent it."""
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": BACKEND_KEY})
        message = {"role": "assistant", "content": f"your header was Bearer {BACKEND_KEY}"}
        answer = {"id": "chatcmpl-echo", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
        mock.add_faults({"kind": "status", "status": 200, "body": answer, "times": 1})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "your header was Bearer ***"
        assert await gw.state.registry.drain("policy", 10)
        [span] = await gw.store.query_spans(None)
        assert span.status.status_code == "OK" and BACKEND_KEY not in span.model_dump_json()
        assert "Bearer ***" in span.model_dump_json()


async def test_a_url_holding_credentials_is_refused_without_showing_them(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as admin:
        backend = {"base_url": "http://user:hunter2-secret@127.0.0.1:9/v1", "kind": "vllm", "model": "m"}
        refused = await admin.put("/admin/v1/models/policy", json={"backends": [backend]})
        assert refused.status_code == 400, refused.text
        assert "credentials" in refused.json()["error"]["message"] and "hunter2" not in refused.text
        refused = await admin.put("/admin/v1/agents/a", json={"url": "http://u:hunter2-secret@127.0.0.1:9"})
        assert refused.status_code == 400, refused.text
        assert "credentials" in refused.json()["error"]["message"] and "hunter2" not in refused.text
        assert (await admin.get("/admin/v1/models")).json()["items"] == []


@asynccontextmanager
async def echoing_agent_server() -> AsyncIterator[str]:
    """An agent server that refuses every init with a 401 repeating the headers it got."""

    async def init(request: Request) -> Response:
        return JSONResponse({"detail": f"refused, headers were {dict(request.headers)}"}, status_code=401)

    async with serving(Starlette(routes=[Route("/v1/rollout/init", init, methods=["POST"])])) as url:
        yield url


async def test_an_agent_server_that_echoes_its_key_gets_it_neither_stored_nor_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        echoing_agent_server() as url,
        running_gateway(tmp_path) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as admin,
    ):
        assert (await admin.put("/admin/v1/agents/echo", json={"url": url, "api_key": AGENT_KEY})).status_code == 200
        task: dict[str, Any] = {"rollout_id": "ro-echo", "input": {"messages": MESSAGES}, "agent": "echo"}
        assert (await admin.post("/admin/v1/rollouts", json={"tasks": [task]})).status_code in (200, 201)
        done, pending = await gw.store.wait_for_rollouts(["ro-echo"], 20)
        assert not pending and done[0].status == "failed"
        [attempt] = await gw.store.list_attempts("ro-echo")
        error = (attempt.metadata or {})["dispatch"]["error"]
        assert "401" in error and "Bearer ***" in error  # the echo is there, the key is not
        rollout = await admin.get("/admin/v1/rollouts/ro-echo")
        assert AGENT_KEY not in rollout.text and AGENT_KEY not in error
    assert "refused rollout ro-echo" in caplog.text and AGENT_KEY not in caplog.text


async def test_a_placeholder_key_is_not_masked_in_error_bodies(tmp_path: Path, mock: MockBackendProcess) -> None:
    """Keyless vLLM servers get placeholder keys ("null", "x"): masking them would break the JSON around them."""
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": "null"})
        refusal = {"error": {"message": "bad request", "type": "invalid_request_error", "param": None, "code": None}}
        mock.add_faults({"kind": "status", "status": 400, "body": refusal, "times": 1})
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "policy", "messages": MESSAGES})
        assert response.status_code == 400 and response.json() == refusal


async def test_a_backend_that_echoes_its_key_mid_stream_shows_it_to_no_one(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    """An error event (``{"error": ...}``, recorded as the span's error) and an event that is not JSON (passed on
    as it came), each echoing the key in the middle of a stream: masked in the stream and in the span."""
    async with running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", vllm(mock) | {"api_key": BACKEND_KEY})
        for echo in (f'{{"error": {{"message": "you sent Bearer {BACKEND_KEY}"}}}}', f"not json: {BACKEND_KEY}"):
            mock.add_faults({"kind": "garbage_event", "after_chunks": 2, "body": echo, "times": 1})
            body = {"model": "policy", "messages": MESSAGES, "stream": True}
            async with httpx.AsyncClient(timeout=10) as http:
                response = await http.post(f"{gw.url}/v1/chat/completions", json=body)
            assert response.status_code == 200 and "data: [DONE]" in response.text
            assert "Bearer ***" in response.text or "not json: ***" in response.text
            assert BACKEND_KEY not in response.text
        assert await gw.state.registry.drain("policy", 10)
        spans = await gw.store.query_spans(None)
        assert len(spans) == 2 and "Bearer ***" in spans[0].attributes["rollway.error"]
        assert all(BACKEND_KEY not in span.model_dump_json() for span in spans)


def escaped(text: str) -> str:
    """``text`` as a JSON string may write it, every character a ``\\uXXXX`` escape (``sk-`` → ``\\u0073...``)."""
    return "".join(f"\\u{ord(char):04X}" for char in text)


def reveals(text: str) -> bool:
    """Whether ``text`` (bytes as sent, a log, a database row) holds the backend key as it is or JSON-escaped:
    escapes decoded, twice, for JSON kept as a string inside JSON."""
    for _ in range(3):
        if BACKEND_KEY in text:
            return True
        text = re.sub(r"\\+u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text).replace("\\/", "/")
    return False


def chunk(content: str, finish: str | None = None) -> bytes:
    delta = {"content": content} if content else {}
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _with_key(body: dict[str, Any], key: str) -> bytes:
    """``body`` as JSON with ``key`` (JSON text already) in place of ``KEY``."""
    return json.dumps(body).replace("KEY", key).encode()


ANSWER = {"id": "chatcmpl-2", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "your key is KEY"}}]}  # fmt: skip
HYPHENS = BACKEND_KEY.replace("-", "\\u002d")  # the escape a JSON encoder may choose for one character


#: What the stand-in backend answers, by the user message's content: (status, its body or its stream's events).
#: The key comes in clear or JSON-escaped (every character, or the hyphens), whole or split across two events.
ANSWERS: dict[str, tuple[int, list[bytes]]] = {
    "split": (200, [chunk("your key is sk-back"), chunk("end-4f1c9a7e2b, keep it"), chunk("", "stop")]),
    "split-escaped": (
        200,
        [
            chunk("your key is "),
            chunk("KEY").replace(b"KEY", escaped(BACKEND_KEY[:9]).encode()),
            chunk("KEY, keep it").replace(b"KEY", escaped(BACKEND_KEY[9:]).encode()),
            chunk("and the whole one: KEY").replace(b"KEY", escaped(BACKEND_KEY).encode()),
            chunk("", "stop"),
        ],
    ),
    "not-the-key": (200, [chunk("a sk-back"), chunk("ward step"), chunk("", "stop")]),
    "escaped-200": (200, [_with_key(ANSWER, escaped(BACKEND_KEY))]),
    "escaped-401": (401, [_with_key({"error": {"message": "bad key: Bearer KEY", "type": "auth"}}, HYPHENS)]),
}


@asynccontextmanager
async def echoing_backend() -> AsyncIterator[tuple[str, list[str]]]:
    """A backend that answers as ``ANSWERS`` says, a stream event by event (each its own write): its URL and
    the ``Authorization`` headers it got."""
    seen: list[str] = []

    async def complete(request: Request) -> Response:
        seen.append(request.headers.get("authorization", ""))
        status, parts = ANSWERS[(await request.json())["messages"][-1]["content"]]
        if len(parts) == 1:
            return Response(parts[0], status_code=status, media_type="application/json")

        async def events() -> AsyncIterator[bytes]:
            for part in [*parts, b"data: [DONE]\n\n"]:
                yield part
                await asyncio.sleep(0.02)  # apart: each event its own read

        return StreamingResponse(events(), media_type="text/event-stream")

    async with serving(Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"])])) as url:
        yield f"{url}/v1", seen


def standin(url: str) -> dict[str, Any]:
    return {"backend_id": "standin", "base_url": url, "kind": "openai", "model": "m", "api_key": BACKEND_KEY}


async def _asked(gw: Any, say: str, *, stream: bool) -> httpx.Response:
    body = {"model": "policy", "messages": [{"role": "user", "content": say}], "stream": stream}
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(f"{gw.url}/v1/chat/completions", json=body)


def _streamed_text(response: httpx.Response) -> str:
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", ()):
                text += choice["delta"].get("content") or ""
    return text


def _span_rows(path: Path) -> str:
    with closing(sqlite3.connect(path)) as db:
        return repr(db.execute("SELECT * FROM spans").fetchall())


@pytest.mark.parametrize(
    ("say", "stream", "status", "shown"),
    [
        ("split", True, 200, "your key is ***, keep it"),
        ("split-escaped", True, 200, "your key is ***, keep itand the whole one: ***"),
        ("escaped-200", False, 200, "your key is ***"),
        ("escaped-401", False, 401, "bad key: Bearer ***"),
    ],
)
async def test_a_key_split_across_events_or_escaped_reaches_no_client_span_or_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, say: str, stream: bool, status: int, shown: str
) -> None:
    """The key whole in one event or body, JSON-escaped (``\\u0073...``, ``\\u002d``), or split across two stream
    events (in clear or escaped): masked in what the client gets (its bytes, and the text it joins), in the span
    as the store gives it and as its row holds it, and in the logs."""
    caplog.set_level(logging.DEBUG)
    async with echoing_backend() as (url, _), running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", standin(url))
        response = await _asked(gw, say, stream=stream)
        assert response.status_code == status, response.text
        assert not reveals(response.text)
        if stream:
            assert _streamed_text(response) == shown and "data: [DONE]" in response.text
        elif status == 200:
            assert response.json()["choices"][0]["message"]["content"] == shown
        else:
            assert response.json()["error"]["message"] == shown
        assert await gw.state.registry.drain("policy", 10)
        [span] = await gw.store.query_spans(None)
        assert not reveals(span.model_dump_json()) and "***" in span.model_dump_json()
    assert not reveals(_span_rows(tmp_path / "gateway.db"))
    assert not reveals(caplog.text)


async def test_text_that_only_begins_like_the_key_goes_out_as_it_came(tmp_path: Path) -> None:
    """An event held back because its text ends as the key begins goes out unchanged once the next one shows
    the text is something else."""
    async with echoing_backend() as (url, _), running_gateway(tmp_path) as gw:
        await register(gw.store, "policy", standin(url))
        response = await _asked(gw, "not-the-key", stream=True)
        assert _streamed_text(response) == "a sk-backward step"
        assert response.text.count("data: {") == 3 and "data: [DONE]" in response.text
        assert await gw.state.registry.drain("policy", 10)
        [span] = await gw.store.query_spans(None)
        assert "a sk-backward step" in span.model_dump_json()


def _events(*chunks: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    return [(b"data: " + json.dumps(c).encode() + b"\n\n", json.dumps(c).encode()) for c in chunks]


def _tool(arguments: str, index: int = 0) -> dict[str, Any]:
    call = {"index": 0, "function": {"arguments": arguments}}
    return {"choices": [{"index": index, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


def _delta(text: str, output: int = 0) -> dict[str, Any]:
    return {"type": "response.output_text.delta", "output_index": output, "content_index": 0, "delta": text}


@pytest.mark.parametrize(
    ("chunks", "joined"),
    [
        # a tool call's arguments, the key in three parts
        ([_tool('{"k": "sk-b'), _tool("ackend-4f1c"), _tool('9a7e2b"}')], '{"k": "***"}'),
        # a Responses API stream's text deltas
        ([_delta("Bearer sk-backend-"), _delta("4f1c9a7e2b.")], "Bearer ***."),
    ],
)
def test_a_key_split_across_tool_call_or_responses_deltas_is_masked(chunks: list[dict[str, Any]], joined: str) -> None:
    guard = KeyGuard(BACKEND_KEY)
    out = [event for pair in _events(*chunks) for event in guard.feed([pair])] + guard.flush()
    assert len(out) == len(chunks) and all(BACKEND_KEY[:5] not in raw.decode() for raw, _, _ in out[1:])
    texts = [c["delta"] if "delta" in c else c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
             for _, _, c in out if c is not None]  # fmt: skip
    assert "".join(texts) == joined
    assert all(json.loads(payload or b"") == chunk for _, payload, chunk in out)  # rewritten events re-encoded


def test_only_an_event_ending_as_the_key_begins_waits_and_only_for_its_choice() -> None:
    """Two choices: choice 0 ends in ``s`` (the key begins ``sk-``), so it and what follows wait until choice 0's
    next event; choice 1's finish does not release choice 0's text, choice 0's own finish does."""
    guard = KeyGuard(BACKEND_KEY)

    def chat(index: int, text: str, finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]}

    def fed(chunk: dict[str, Any]) -> list[str]:
        return [c["choices"][0]["delta"]["content"] for _, _, c in guard.feed(_events(chunk)) if c is not None]

    assert fed(chat(0, "hello")) == ["hello"]
    assert fed(chat(0, " yes")) == []
    assert fed(chat(1, "other", "stop")) == []
    assert fed(chat(0, " ok", "stop")) == [" yes", "other", " ok"]


def _call(index: int, arguments: str) -> dict[str, Any]:
    call = {"index": index, "function": {"arguments": arguments}}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


def _content(text: str, reasoning: str | None = None) -> dict[str, Any]:
    delta = {"content": text} if reasoning is None else {"content": text, "reasoning_content": reasoning}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


@pytest.mark.parametrize(
    "chunks",
    [
        [_call(0, '{"k": "sk-b'), _call(1, "{"), _call(0, 'ackend-4f1c9a7e2b"}')],  # another call in between
        [_content("sk-b", reasoning=""), _content("ackend-4f1c9a7e2b")],  # a reasoning field beside it
    ],
    ids=["tool-calls", "reasoning"],
)
def test_another_text_between_the_keys_parts_does_not_let_it_out(chunks: list[dict[str, Any]]) -> None:
    """A client joins each text on its own (each tool call's arguments, the content): the text of another one
    between the key's parts does not release the first part unmasked."""
    guard = KeyGuard(BACKEND_KEY)
    out = [event for pair in _events(*chunks) for event in guard.feed([pair])] + guard.flush()
    assert len(out) == len(chunks)
    joined: dict[str, str] = {}
    for _, _, chunk in out:
        assert chunk is not None
        delta = chunk["choices"][0]["delta"]
        for call in delta.get("tool_calls") or ():
            joined[f"call {call['index']}"] = joined.get(f"call {call['index']}", "") + call["function"]["arguments"]
        if "content" in delta:
            joined["content"] = joined.get("content", "") + delta["content"]
    assert all(BACKEND_KEY not in text and BACKEND_KEY[:5] not in text for text in joined.values()), joined
    assert any("***" in text for text in joined.values())
