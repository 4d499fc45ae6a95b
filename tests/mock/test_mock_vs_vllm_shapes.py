"""The mock backend answers in the shapes vLLM 0.32.0 answers in: field sets and their order, null vs ``[]`` vs
absent, where ``system_fingerprint`` goes, which tokens send a stream chunk, the Responses API's events, and the
error envelopes. The expected shapes were recorded from a real vLLM 0.32.0 (CPU build, a tiny random model, the
``hermes`` tool parser); these tests need no engine (the mock runs in process)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from rollway.mock import MockConfig, create_mock_app
from support.mock_calls import MODEL, TOOL, post, stream

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
FLAT_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

#: The fields vLLM's chat and completion bodies start with, and those they end with.
BODY_HEAD = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage"]
BODY_TAIL = ["kv_transfer_params", "ec_transfer_params", "metrics"]
CHAT_BODY = [*BODY_HEAD, "prompt_logprobs", "prompt_token_ids", "prompt_text", *BODY_TAIL]
CHAT_CHOICE = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
MESSAGE = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "completion_tokens_details"]
COMPLETION_BODY = [*BODY_HEAD, *BODY_TAIL]
COMPLETION_CHOICE = [
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
    "routed_experts",
]
COMPLETION_CHUNK_CHOICE = ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"]
RESPONSE = [
    "id",
    "created_at",
    "incomplete_details",
    "instructions",
    "metadata",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "background",
    "max_output_tokens",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "reasoning",
    "service_tier",
    "status",
    "text",
    "top_logprobs",
    "truncation",
    "usage",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "kv_transfer_params",
    "ec_transfer_params",
    "input_messages",
    "output_messages",
]
FUNCTION_CALL_ITEM = ["arguments", "call_id", "name", "type", "id", "async", "caller", "namespace", "status"]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_mock_app(MockConfig(models=(MODEL,), strict_models=True, max_model_len=2048))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as c:
        yield c


def chunks(events: list[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    assert events[-1] == (None, "[DONE]")
    return [data for _, data in events[:-1]]


# ---------------------------------------------------------------------------------------------------- chat


async def test_chat_body_has_vllms_fields_and_no_empty_tool_calls(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/chat/completions", messages=MESSAGES)
    assert list(body) == CHAT_BODY
    assert body["id"].startswith("chatcmpl-") and body["system_fingerprint"].startswith("vllm-0.32.0-")
    assert list(body["choices"][0]) == CHAT_CHOICE
    assert list(body["choices"][0]["message"]) == MESSAGE  # no "tool_calls": vLLM leaves an empty list out
    assert list(body["usage"]) == USAGE
    assert body["usage"]["prompt_tokens_details"] is None  # vLLM's default (no --enable-prompt-tokens-details)
    ask = {"model": MODEL, "messages": MESSAGES}
    named = await client.post("/v1/chat/completions", json=ask, headers={"x-request-id": "r-1"})
    assert named.json()["id"] == "chatcmpl-r-1"  # vLLM names the answer after the client's request id
    assert named.headers["x-request-id"] == "r-1"  # and echoes it (with --enable-request-id-headers)


@pytest.mark.parametrize(
    ("tool_choice", "content", "finish_reason"),
    [("auto", None, "tool_calls"), (NAMED, "", "stop"), ("required", "", "tool_calls")],
)
async def test_chat_tool_call_content_and_finish_reason_follow_the_tool_choice(
    client: httpx.AsyncClient, tool_choice: Any, content: str | None, finish_reason: str
) -> None:
    body = await post(client, "/v1/chat/completions", messages=MESSAGES, tools=[TOOL], tool_choice=tool_choice)
    choice = body["choices"][0]
    assert list(choice["message"]) == [*MESSAGE[:-1], "tool_calls", "reasoning"]
    assert choice["message"]["content"] == content
    assert choice["finish_reason"] == finish_reason
    call = choice["message"]["tool_calls"][0]
    assert call["id"].startswith("chatcmpl-tool-") and list(call) == ["id", "type", "function"]
    streamed = chunks(
        await stream(client, "/v1/chat/completions", messages=MESSAGES, tools=[TOOL], tool_choice=tool_choice)
    )
    assert streamed[-1]["choices"][0]["finish_reason"] == finish_reason


async def test_a_tool_call_cut_by_max_tokens_parses_as_none(client: httpx.AsyncClient) -> None:
    """The parser cannot read a call without its end: the message is the raw output, the Responses API's too."""
    body = await post(client, "/v1/chat/completions", messages=MESSAGES, tools=[TOOL], max_tokens=4)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>")
    answer = await post(client, "/v1/responses", input="Weather?", tools=[FLAT_TOOL], max_output_tokens=4)
    assert [item["type"] for item in answer["output"]] == ["message"]
    assert answer["output"][0]["content"][0]["text"].startswith("<tool_call>")


@pytest.mark.parametrize(
    ("asked", "empty_deltas"),
    [({}, False), ({"logprobs": True}, True), ({"return_token_ids": True}, True)],
)
async def test_streamed_tokens_that_say_nothing_send_empty_deltas_when_logprobs_or_token_ids_are_asked(
    client: httpx.AsyncClient, asked: dict[str, Any], empty_deltas: bool
) -> None:
    ask = {"messages": MESSAGES, "tools": [TOOL], **asked}
    body = await post(client, "/v1/chat/completions", **ask)
    events = chunks(await stream(client, "/v1/chat/completions", **ask))
    tokens = events[1:]  # after the role chunk
    middle = [c["choices"][0]["delta"] for c in tokens[:-1]]
    assert ({} in middle) is empty_deltas
    assert tokens[-1]["choices"][0]["delta"] == {}  # the end-of-sequence token closes the call
    if empty_deltas:  # one chunk per generated token
        assert len(tokens) == body["usage"]["completion_tokens"]
    opening = next(d for d in middle if d.get("tool_calls"))
    assert opening == {
        "content": None,
        "tool_calls": [
            {"id": opening["tool_calls"][0]["id"], "type": "function", "index": 0, "function": {"name": "get_weather"}}
        ],
    }
    arguments = [d for d in middle if d.get("tool_calls") and "id" not in d["tool_calls"][0]]
    assert arguments and all(list(d) == ["content", "tool_calls"] for d in arguments)


async def test_chat_stream_chunks_carry_only_the_fields_vllm_sets(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = chunks(await stream(client, "/v1/chat/completions", messages=MESSAGES, stream_options=options))
    role, token, last, usage = events[0], events[1], events[-2], events[-1]
    assert list(role) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids", "prompt_text"]
    assert list(role["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert list(token) == ["id", "object", "created", "model", "choices", "usage"]
    assert list(token["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
    assert list(token["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens", "completion_tokens_details"]
    assert list(last["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]
    assert list(usage) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert usage["choices"] == [] and list(usage["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_system_fingerprint_is_on_terminal_chunks_or_only_on_the_usage_chunk(
    client: httpx.AsyncClient, path: str, include_usage: bool
) -> None:
    ask: dict[str, Any] = {"n": 2, "stream_options": {"include_usage": include_usage}}
    ask |= {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Once upon a time"}
    events = chunks(await stream(client, path, **ask))
    stamped = [c for c in events if "system_fingerprint" in c]
    if include_usage:
        assert stamped == [events[-1]] and events[-1]["choices"] == []
    else:
        assert len(stamped) == 2 and all(c["choices"][0]["finish_reason"] for c in stamped)
    assert all(c["system_fingerprint"].startswith("vllm-0.32.0-") for c in stamped)


async def test_prompt_tokens_details_as_with_enable_prompt_tokens_details(client: httpx.AsyncClient) -> None:
    await client.post("/mock/config", json={"prompt_tokens_details": True})
    body = await post(client, "/v1/chat/completions", messages=MESSAGES)
    assert list(body["usage"]["prompt_tokens_details"]) == [
        "cached_tokens",
        "created_cache_tokens",
        "multimodal_tokens",
    ]
    text = await post(client, "/v1/completions", prompt="Once upon a time")
    assert text["usage"]["prompt_tokens_details"]["created_cache_tokens"] is None
    events = chunks(await stream(client, "/v1/completions", prompt="x", stream_options={"include_usage": True}))
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # nulls left out


# ----------------------------------------------------------------------------------------------- completions


async def test_completion_bodies_and_chunks(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/completions", prompt="Once upon a time", max_tokens=4)
    assert list(body) == COMPLETION_BODY and list(body["choices"][0]) == COMPLETION_CHOICE
    events = chunks(await stream(client, "/v1/completions", prompt="Once upon a time", max_tokens=4))
    assert all("usage" not in c for c in events)  # no usage key unless continuous usage stats are asked
    assert all(list(c["choices"][0]) == COMPLETION_CHUNK_CHOICE for c in events)
    echoed = chunks(await stream(client, "/v1/completions", prompt="Once upon a time", max_tokens=4, echo=True))
    assert echoed[0]["choices"][0]["text"].startswith("Once upon a time")
    assert echoed[0]["choices"][0]["prompt_token_ids"]  # an echo's first chunk names the prompt's ids
    assert [c["choices"][0]["prompt_token_ids"] for c in echoed[1:]] == [None] * (len(echoed) - 1)


async def test_completion_echo_with_logprobs_scores_the_prompt(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/completions", prompt="Once upon a time", max_tokens=3, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    for position in choice["prompt_logprobs"][1:]:
        for entry in position.values():
            assert list(entry) == ["logprob", "rank", "decoded_token"]
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs=1: the sampled token


# ------------------------------------------------------------------------------------ embeddings, routes, errors


async def test_embeddings_body(client: httpx.AsyncClient) -> None:
    body = await post(client, "/v1/embeddings", input=["alpha", "beta"])
    assert list(body) == ["id", "object", "created", "model", "data", "usage"] and body["id"].startswith("embd-")
    assert list(body["data"][0]) == ["index", "object", "embedding"]
    assert list(body["usage"]) == USAGE and body["usage"]["completion_tokens"] == 0


async def test_version_health_and_unrouted_paths(client: httpx.AsyncClient) -> None:
    assert (await client.get("/version")).json() == {"version": "0.32.0"}
    health = await client.get("/health")
    assert health.status_code == 200 and health.content == b"" and "content-type" not in health.headers
    assert (await client.get("/v1/nothing")).json() == {"detail": "Not Found"}
    wrong = await client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json() == {"detail": "Method Not Allowed"}
    models = (await client.get("/v1/models")).json()["data"][0]
    assert models["owned_by"] == "vllm" and models["permission"][0]["object"] == "model_permission"


@pytest.mark.parametrize(
    ("path", "body", "status", "type_", "param"),
    [
        ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, "NotFoundError", "model"),
        ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "NotFoundError", None),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100_000}, 400, "BadRequestError", "max_tokens"),
        ("/v1/responses", {"input": "x", "max_output_tokens": 100_000}, 400, "BadRequestError", "max_output_tokens"),
        ("/v1/completions", {"prompt": "hi " * 3000}, 400, "BadRequestError", "input_tokens"),
        ("/v1/chat/completions", {"messages": []}, 400, "BadRequestError", None),
        ("/v1/chat/completions", {"model": MODEL}, 400, "Bad Request", "body.messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "BadRequestError", "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "stream_options": {}},
            400,
            "BadRequestError",
            "stream_options",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, "Bad Request", "body.temperature"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "tool_choice": "required"},
            400,
            "BadRequestError",
            "tool_choice",
        ),
        ("/v1/completions", {"prompt": []}, 400, "BadRequestError", None),
    ],
)
async def test_errors_are_vllms(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, type_: str, param: str | None
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert (error["type"], error["param"], error["code"]) == (type_, param, status)


async def test_a_body_that_is_not_json_is_a_bad_request_at_its_position(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "Bad Request",
        "param": "body.1",
        "code": 400,
    }


async def test_a_request_without_a_model_is_served_by_the_first_model(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert response.status_code == 200 and response.json()["model"] == MODEL


# ------------------------------------------------------------------------------------------------ responses


async def test_response_body_without_and_with_messages_and_logprobs(client: httpx.AsyncClient) -> None:
    plain = await post(client, "/v1/responses", input="Say hi", max_output_tokens=5)
    assert list(plain) == RESPONSE
    assert plain["tool_choice"] == "none" and plain["metadata"] is None and plain["text"] is None
    assert plain["input_messages"] is None and plain["output_messages"] is None and plain["top_logprobs"] is None
    assert list(plain["output"][0]) == ["id", "content", "role", "status", "type", "phase"]
    assert plain["output"][0]["content"][0] == {
        "annotations": [],
        "text": plain["output"][0]["content"][0]["text"],
        "type": "output_text",
        "logprobs": None,
    }
    assert plain["status"] == "incomplete" and plain["incomplete_details"] == {"reason": "max_output_tokens"}
    assert plain["output"][0]["status"] == "completed"
    details = plain["usage"]["input_tokens_details"]
    assert list(details) == ["cached_tokens", "cache_write_tokens", "input_tokens_per_turn", "cached_tokens_per_turn"]

    full = await post(
        client,
        "/v1/responses",
        input="Say hi",
        enable_response_messages=True,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    assert full["top_logprobs"] == 2
    (sent,) = full["input_messages"]
    assert list(sent) == ["message", "tokens", "type"] and sent["type"] == "raw_message_tokens"
    assert "Say hi" in sent["message"] and len(sent["tokens"]) == full["usage"]["input_tokens"]
    (got,) = full["output_messages"]
    assert got["message"] == full["output"][0]["content"][0]["text"]
    assert len(got["tokens"]) == full["usage"]["output_tokens"]
    logprobs = full["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == len(got["tokens"])
    assert list(logprobs[0]) == ["token", "bytes", "logprob", "top_logprobs"]
    assert [list(t) for t in logprobs[0]["top_logprobs"]] == [["token", "bytes", "logprob"]] * 2


@pytest.mark.parametrize("asked", [False, True])
async def test_response_stream_events(client: httpx.AsyncClient, asked: bool) -> None:
    extra: dict[str, Any] = {"include": ["message.output_text.logprobs"], "top_logprobs": 1} if asked else {}
    events = await stream(client, "/v1/responses", input="Say hi", enable_response_messages=True, **extra)
    assert all(name == data["type"] for name, data in events)  # named events, no [DONE]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    types = [data["type"] for _, data in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["usage"] is None and created["input_messages"] is None
    assert events[3][1]["part"]["logprobs"] == []
    deltas = [data for _, data in events if data["type"] == "response.output_text.delta"]
    for delta in deltas:
        assert list(delta) == [
            "content_index",
            "delta",
            "item_id",
            "logprobs",
            "output_index",
            "sequence_number",
            "type",
        ]
        if asked:
            assert [list(e) for e in delta["logprobs"]] == [["token", "logprob", "top_logprobs"]]
        else:
            assert delta["logprobs"] == []
    assert events[-4][1]["logprobs"] == []
    part = events[-3][1]["part"]
    assert (part["logprobs"] is None) is not asked
    final = events[-1][1]["response"]
    assert final["output_messages"][0]["message"] == "".join(d["delta"] for d in deltas)
    assert final["input_messages"][0]["type"] == "raw_message_tokens"


async def test_a_truncated_response_stream_still_ends_with_response_completed(client: httpx.AsyncClient) -> None:
    events = await stream(client, "/v1/responses", input="Say hi", max_output_tokens=2)
    final = events[-1][1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "incomplete"


async def test_response_function_call_stream(client: httpx.AsyncClient) -> None:
    choice = {"type": "function", "name": "get_weather"}
    body = await post(client, "/v1/responses", input="Weather?", tools=[FLAT_TOOL], tool_choice=choice)
    item = body["output"][0]
    assert list(item) == FUNCTION_CALL_ITEM and item["call_id"].startswith("chatcmpl-tool-")
    assert body["tool_choice"] == {"name": "get_weather", "type": "function"}
    assert list(body["tools"][0]) == [
        "name",
        "parameters",
        "strict",
        "type",
        "allowed_callers",
        "async",
        "defer_loading",
        "description",
        "output_schema",
    ]
    events = [data for _, data in await stream(client, "/v1/responses", input="Weather?", tools=[FLAT_TOOL])]
    added = events[2]
    assert added["type"] == "response.output_item.added" and added["item"]["status"] == "in_progress"
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert list(done) == ["arguments", "item_id", "output_index", "sequence_number", "type", "name"]
    assert done["arguments"] == "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    assert events[-1]["response"]["output"][0]["arguments"] == done["arguments"]
