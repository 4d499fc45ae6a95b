"""The mock backend's ``sglang`` flavour answers in the shapes a real SGLang 0.5.23 answers in: field sets and their
order, null vs absent, where the token ids go (per choice, or an ``sglext`` chunk after the last choice's), which
streamed tokens lose their logprobs, its own routes and its error envelope. The expected key structures come from
a real server's answers (``tests/support/sglang_shapes.py``); these tests need no engine (the mock runs in process,
and once as ``rollway mock-backend --flavor sglang``)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from rollway.mock import MockBackendProcess, MockConfig, create_mock_app
from rollway.mock import tokenizer as tok
from support import sglang_shapes as real
from support.mock_calls import MODEL, TOOL, post, stream

#: Answered with a sentence and the end-of-sequence token (finish ``stop``); ``max_tokens: 3`` cuts it.
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
CUT = {"max_tokens": 3}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_mock_app(MockConfig(flavor="sglang", models=(MODEL,), max_model_len=1024))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as c:
        yield c


async def chunks(client: httpx.AsyncClient, path: str, **body: Any) -> list[dict[str, Any]]:
    """A stream's chunks, which are all plain ``data:`` events before ``[DONE]``."""
    streamed = await stream(client, path, **body)
    assert streamed[-1] == (None, "[DONE]")
    assert all(name is None for name, _ in streamed)
    return [data for _, data in streamed[:-1]]


def is_sglang_id(value: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{32}", value) is not None


# ---------------------------------------------------------------------------------------------- chat, whole


async def test_a_chat_body_has_sglangs_fields_and_no_token_ids_unless_asked(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/chat/completions", messages=MESSAGES)
    assert list(body) == real.CHAT_BODY  # no system_fingerprint, no prompt_token_ids
    assert is_sglang_id(body["id"])
    [choice] = body["choices"]
    assert list(choice) == real.CHAT_CHOICE and list(choice["message"]) == real.MESSAGE
    assert choice["message"]["reasoning_content"] is None and choice["logprobs"] is None
    assert list(body["usage"]) == real.USAGE and body["usage"]["prompt_tokens_details"] is None
    assert list(body["metadata"]) == real.METADATA
    assert list(body["metadata"]["weight_versions"][0]) == real.WEIGHT_VERSION
    assert body["metadata"]["weight_versions"][0]["end"] == body["usage"]["completion_tokens"]
    named = await post(client, "/v1/chat/completions", messages=MESSAGES, rid="my-req-1", foo_bar=1)
    assert named["id"] == "my-req-1"  # the request's rid; unknown fields are ignored


async def test_return_token_ids_gives_each_choice_its_prompt_and_response_ids(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True, n=2)
    ids = await post(
        client,
        "/v1/chat/completions",
        messages=MESSAGES,
        n=2,
        return_input_ids_in_sglext=True,
        return_output_ids_in_sglext=True,
    )
    assert list(ids) == real.CHAT_BODY_WITH_SGLEXT and list(ids["sglext"]) == real.SGLEXT
    for choice, output_ids in zip(body["choices"], ids["sglext"]["output_ids"], strict=True):
        assert list(choice) == real.CHAT_CHOICE_WITH_TOKEN_IDS
        assert choice["prompt_token_ids"] == ids["sglext"]["input_ids"]
        assert choice["response_token_ids"] == output_ids
    assert body["usage"]["prompt_tokens"] == len(ids["sglext"]["input_ids"])  # the prompt counted once
    assert body["usage"]["completion_tokens"] == sum(len(o) for o in ids["sglext"]["output_ids"])
    prompt_only = await post(client, "/v1/chat/completions", messages=MESSAGES, return_prompt_token_ids=True)
    assert list(prompt_only["choices"][0]) == [*real.CHAT_CHOICE, "prompt_token_ids"]


async def test_a_stop_token_is_in_the_ids_and_logprobs_not_in_the_text(client: httpx.AsyncClient) -> None:
    ask = {"messages": MESSAGES, "return_token_ids": True, "logprobs": True}
    stopped = (await post(client, "/v1/chat/completions", **ask))["choices"][0]
    assert (stopped["finish_reason"], stopped["matched_stop"]) == ("stop", tok.EOS_ID)
    assert stopped["response_token_ids"][-1] == tok.EOS_ID
    entries = stopped["logprobs"]["content"]
    assert len(entries) == len(stopped["response_token_ids"]) and entries[-1]["token"] == tok.EOS
    assert tok.EOS not in stopped["message"]["content"]
    cut = (await post(client, "/v1/chat/completions", **ask, **CUT))["choices"][0]
    assert (cut["finish_reason"], cut["matched_stop"], len(cut["response_token_ids"])) == ("length", None, 3)


async def test_logprob_entries_carry_bytes_and_no_token_id(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/chat/completions", messages=MESSAGES, logprobs=True, top_logprobs=2)
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert list(entry) == real.LOGPROB and [list(t) for t in entry["top_logprobs"]] == [real.TOP_LOGPROB] * 2
    assert entry["bytes"] == list(entry["token"].encode("utf-8"))
    none = await post(client, "/v1/chat/completions", messages=MESSAGES, logprobs=True, top_logprobs=0)
    assert none["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


async def test_meta_info_and_sglext_of_a_whole_answer(client: httpx.AsyncClient) -> None:
    body = await post(
        client,
        "/v1/chat/completions",
        messages=MESSAGES,
        logprobs=True,
        return_meta_info=True,
        return_output_ids_in_sglext=True,
        **CUT,
    )
    [choice] = body["choices"]
    assert list(choice) == real.CHAT_CHOICE_WITH_META_INFO
    assert list(choice["meta_info"]) == real.META_INFO
    assert choice["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert [t for _, t, _ in choice["meta_info"]["output_token_logprobs"]] == body["sglext"]["output_ids"][0]
    assert list(body["sglext"]) == ["output_ids"]  # only what was asked


# ------------------------------------------------------------------------------------------- chat, streamed


@pytest.mark.parametrize("key", ["return_token_ids", "return_prompt_token_ids"])
async def test_a_streamed_chat_refuses_token_ids_as_sglang_does(client: httpx.AsyncClient, key: str) -> None:
    ask = {"model": MODEL, "messages": MESSAGES, "stream": True, key: True}
    response = await client.post("/v1/chat/completions", json=ask)
    assert response.status_code == 400
    expected = real.STREAMED_RETURN_TOKEN_IDS if key == "return_token_ids" else real.STREAMED_RETURN_PROMPT_TOKEN_IDS
    assert response.json() == expected and list(response.json()) == real.ERROR


async def test_stream_chunks_have_sglangs_fields_and_the_ids_come_after_the_finish(client: httpx.AsyncClient) -> None:
    ask: dict[str, Any] = {"messages": MESSAGES, "logprobs": True, "stream_options": {"include_usage": True}}
    streamed = await chunks(
        client, "/v1/chat/completions", return_input_ids_in_sglext=True, return_output_ids_in_sglext=True, **ask
    )
    role, *contents, finish, ids, usage = streamed
    assert list(role) == real.CHUNK and list(role["choices"][0]) == real.CHUNK_CHOICE
    assert list(role["choices"][0]["delta"]) == real.ROLE_DELTA
    assert all(list(c) == real.CHUNK and list(c["choices"][0]["delta"]) == real.CONTENT_DELTA for c in contents)
    assert list(finish) == real.CHUNK and list(finish["choices"][0]["delta"]) == real.FINISH_DELTA
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["matched_stop"] == tok.EOS_ID
    assert list(ids) == real.SGLEXT_CHUNK and ids["choices"] == [] and ids["usage"] is None
    assert list(ids["sglext"]) == real.SGLEXT
    assert list(usage) == real.CHUNK_WITH_USAGE and list(usage["usage"]) == real.USAGE
    whole = await post(client, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True)
    assert ids["sglext"]["output_ids"] == [whole["choices"][0]["response_token_ids"]]
    assert ids["sglext"]["input_ids"] == whole["choices"][0]["prompt_token_ids"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in contents)
    assert text == whole["choices"][0]["message"]["content"]
    only_output = await chunks(client, "/v1/chat/completions", messages=MESSAGES, return_output_ids_in_sglext=True)
    assert list(only_output[-1]["sglext"]) == ["output_ids"]  # no usage chunk: not asked


async def test_streamed_logprobs_leave_out_a_token_that_adds_no_text(client: httpx.AsyncClient) -> None:
    """The end-of-sequence token adds no text: its step sends no chunk, and its logprob is lost (8 tokens gave 4
    logprobs on the real server, whose byte tokens add no text either); a cut answer loses none."""
    for cut in (False, True):
        extra = CUT if cut else {}
        ask: dict[str, Any] = {"messages": MESSAGES, "logprobs": True, **extra}
        streamed = await chunks(client, "/v1/chat/completions", return_output_ids_in_sglext=True, **ask)
        entries = [e for c in streamed if c["choices"] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
        [output_ids] = streamed[-1]["sglext"]["output_ids"]
        whole = (await post(client, "/v1/chat/completions", **ask))["choices"][0]["logprobs"]["content"]
        assert len(entries) == len(output_ids) - (0 if cut else 1)
        assert entries == whole[: len(entries)]


async def test_n_choices_finish_after_all_content_and_the_ids_hold_each(client: httpx.AsyncClient) -> None:
    streamed = await chunks(client, "/v1/chat/completions", messages=MESSAGES, n=2, return_output_ids_in_sglext=True)
    finishes = [i for i, c in enumerate(streamed) if c["choices"] and c["choices"][0]["finish_reason"]]
    contents = [i for i, c in enumerate(streamed) if c["choices"] and "content" in c["choices"][0]["delta"]]
    assert len(finishes) == 2 and max(contents) < min(finishes) and finishes[-1] == len(streamed) - 2
    assert len(streamed[-1]["sglext"]["output_ids"]) == 2


async def test_continuous_usage_rides_on_content_chunks_only(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    role, *contents, finish, usage = await chunks(
        client, "/v1/chat/completions", messages=MESSAGES, stream_options=options
    )
    assert "usage" not in role and "usage" not in finish
    assert [c["usage"]["completion_tokens"] for c in contents] == list(range(1, len(contents) + 1))
    assert list(contents[0]["usage"]) == real.USAGE and usage["usage"]["completion_tokens"] == len(contents) + 1


async def test_headers_ask_for_the_ids_and_frame_them_as_an_event(client: httpx.AsyncClient) -> None:
    headers = {"x-sglext-return-input-ids": "1", "x-sglext-return-output-ids": "1", "x-sglext-ids-framed": "1"}
    streamed = await stream(client, "/v1/chat/completions", headers=headers, messages=MESSAGES)
    assert [name for name, _ in streamed[-3:]] == [None, real.FRAMED_EVENT, None]
    assert list(streamed[-2][1]["sglext"]) == real.SGLEXT and streamed[-1] == (None, "[DONE]")


# ----------------------------------------------------------------------------------------------- tool calls


async def test_without_a_tool_call_parser_the_markup_is_text(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/chat/completions", messages=MESSAGES, tools=[TOOL])
    message = body["choices"][0]["message"]
    assert list(message) == real.MESSAGE and message["content"].startswith("<tool_call>get_weather")
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_a_tool_call_parser_makes_tool_calls_and_sends_every_logprob(client: httpx.AsyncClient) -> None:
    await client.post("/mock/config", json={"tool_call_parser": "qwen25"})
    info = (await client.get("/get_model_info")).json()
    assert info["tool_call_parser"] == "qwen25"
    body = await post(client, "/v1/chat/completions", messages=MESSAGES, tools=[TOOL], return_token_ids=True)
    choice = body["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"], choice["message"]["content"]) == ("tool_calls", None, "")
    [call] = choice["message"]["tool_calls"]
    assert list(call) == ["id", "index", "type", "function"] and re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    streamed = await chunks(client, "/v1/chat/completions", messages=MESSAGES, tools=[TOOL], logprobs=True)
    calls = [c for c in streamed if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert list(calls[0]) == real.CHUNK_WITH_USAGE and calls[0]["usage"] is None  # pydantic's chunk
    assert list(calls[0]["choices"][0]["delta"]) == ["role", "content", "reasoning_content", "tool_calls"]
    assert calls[0]["choices"][0]["delta"]["tool_calls"] == [
        {**call, "function": {**call["function"], "arguments": ""}}
    ]
    arguments = "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in calls)
    assert arguments == call["function"]["arguments"]
    entries = [e for c in streamed if c["choices"] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(entries) == len(choice["response_token_ids"])  # each step's logprobs in a chunk of their own
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------------------------------- completions


async def test_completions_carry_token_ids_only_when_asked(client: httpx.AsyncClient) -> None:
    plain = await post(client, "/v1/completions", prompt="The quick brown fox", max_tokens=5)
    assert list(plain) == real.COMPLETION_BODY and list(plain["choices"][0]) == real.COMPLETION_CHOICE
    body = await post(
        client, "/v1/completions", prompt="The quick brown fox", max_tokens=5, logprobs=0, return_token_ids=True
    )
    choice = body["choices"][0]
    assert list(choice) == real.COMPLETION_CHOICE_WITH_TOKEN_IDS
    assert list(choice["logprobs"]) == real.COMPLETION_LOGPROBS
    assert choice["logprobs"]["text_offset"] == [-1] * 5 and choice["logprobs"]["top_logprobs"] == []
    assert choice["prompt_token_ids"] == tok.encode("The quick brown fox") and len(choice["token_ids"]) == 5


async def test_streamed_completions_carry_each_tokens_id_and_a_null_usage(client: httpx.AsyncClient) -> None:
    ask: dict[str, Any] = {"prompt": "Tell me about the sea.", "logprobs": 1, "return_token_ids": True}
    streamed = await chunks(client, "/v1/completions", stream_options={"include_usage": True}, **ask)
    *parts, usage = streamed
    assert all(list(c) == real.COMPLETION_CHUNK and c["usage"] is None for c in parts)
    assert list(parts[0]["choices"][0]) == real.FIRST_COMPLETION_CHUNK_CHOICE
    assert all(list(c["choices"][0]) == real.COMPLETION_CHUNK_CHOICE for c in parts[1:])
    assert list(usage["usage"]) == real.COMPLETION_USAGE_CHUNK_USAGE
    whole = (await post(client, "/v1/completions", **ask))["choices"][0]
    assert [i for c in parts for i in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert whole["token_ids"][-1] == tok.EOS_ID and parts[-1]["choices"][0]["text"] == ""  # a chunk all the same
    logprobs = [v for c in parts for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert logprobs == whole["logprobs"]["token_logprobs"]  # none lost
    assert parts[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]


# --------------------------------------------------------------------------------------------- responses API


async def test_responses_keep_two_tokens_of_headroom_and_carry_no_token_ids(client: httpx.AsyncClient) -> None:
    body = await post(
        client,
        "/v1/responses",
        input="The quick brown fox",
        max_output_tokens=4,
        include=["message.output_text.logprobs"],
    )
    assert list(body) == real.RESPONSE and body["status"] == "incomplete"
    assert body["usage"]["output_tokens"] == 2 and list(body["usage"]) == real.RESPONSE_USAGE
    [item] = body["output"]
    assert list(item) == real.RESPONSE_MESSAGE and list(item["content"][0]) == real.OUTPUT_TEXT
    assert [list(e) for e in item["content"][0]["logprobs"]] == [real.LOGPROB] * 2


async def test_responses_stream_sglangs_events(client: httpx.AsyncClient) -> None:
    streamed = await stream(client, "/v1/responses", input="The quick brown fox", max_output_tokens=3)
    assert [(e["type"], list(e)) for _, e in streamed] == real.RESPONSE_EVENTS
    assert all(name == e["type"] for name, e in streamed)
    refused = await client.post(
        "/v1/responses",
        json={"model": MODEL, "input": "x", "stream": True, "include": ["message.output_text.logprobs"]},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"


# ------------------------------------------------------------------------------------- routes and errors


async def test_sglangs_routes_and_no_version(client: httpx.AsyncClient) -> None:
    version = await client.get("/version")
    assert version.status_code == 404 and version.json() == real.NOT_FOUND
    for path in ("/get_model_info", "/model_info"):
        info = (await client.get(path)).json()
        assert list(info) == real.MODEL_INFO and info["model_path"] == MODEL
    for path in ("/get_server_info", "/server_info"):
        server = (await client.get(path)).json()
        assert list(server)[-len(real.SERVER_INFO_TAIL) :] == real.SERVER_INFO_TAIL
        assert [k for k in server if k in real.SERVER_ARGS_IN_ORDER] == real.SERVER_ARGS_IN_ORDER
        assert (server["version"], server["frontend"]) == (real.VERSION, "python")
    models = (await client.get("/v1/models")).json()
    assert [list(m) for m in models["data"]] == [real.MODEL_CARD] and models["data"][0]["owned_by"] == "sglang"
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
    assert (await client.get("/v1/models/other")).status_code == 404
    for path in ("/health", "/health_generate", "/ready", "/ping"):
        empty = await client.get(path)
        assert empty.status_code == 200 and empty.content == b""
    assert (await client.get("/")).json() == real.ROOT
    assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 404


async def test_errors_are_sglangs(client: httpx.AsyncClient) -> None:
    empty = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert empty.status_code == 400 and list(empty.json()) == real.ERROR
    assert empty.json()["message"] == "Messages cannot be empty." and empty.json()["type"] == "BadRequestError"
    malformed = await client.post("/v1/chat/completions", content=b"{not json")
    assert malformed.status_code == 400 and list(malformed.json()) == real.ERROR
    required = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tool_choice": "required"}
    )
    assert required.json()["message"] == "Tools cannot be empty if tool choice is set to required."
    fixed = await client.post("/mock/config", json={"flavor": "vllm"})
    assert fixed.status_code == 400  # the flavour is chosen at start


def test_the_command_line_serves_the_sglang_flavour(sglang_mock: MockBackendProcess) -> None:
    assert httpx.get(f"{sglang_mock.url}/version").status_code == 404
    assert httpx.get(f"{sglang_mock.url}/get_model_info").json()["model_path"] == "mock-model"
    assert httpx.get(f"{sglang_mock.url}/mock/config").json()["flavor"] == "sglang"
