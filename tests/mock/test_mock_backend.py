"""The mock backend, with the official ``openai`` SDK as the oracle, against real uvicorn servers on loopback:
``rollway mock-backend`` in a subprocess (``MockBackendProcess``) and, once, the in-process ``run_in_thread``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionFunctionToolParam
from openai.types.responses import FunctionToolParam, Response

from rollway.mock import MockBackendProcess, MockConfig, run_in_thread
from rollway.mock import tokenizer as tok

MODEL = "mock-model"
WEATHER_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["location", "unit"],
        },
    },
}
# The same function as a tool of the Responses API, without "strict": the SDK's type requires the key (its value
# may be null), but the requests leave it out, as clients do, and the mock, as vLLM, takes a tool without it.
RESPONSES_WEATHER_TOOL: FunctionToolParam = {  # type: ignore[typeddict-item]  # no "strict", on purpose
    "type": "function",
    "name": "get_weather",
    "parameters": WEATHER_TOOL["function"]["parameters"],
}


@pytest.fixture(scope="module")
def backend() -> Iterator[MockBackendProcess]:
    with MockBackendProcess() as process:
        yield process


@pytest.fixture
def mock(backend: MockBackendProcess) -> MockBackendProcess:
    backend.reset()
    return backend


@pytest.fixture
def client(mock: MockBackendProcess) -> Iterator[OpenAI]:
    with OpenAI(base_url=mock.base_url, api_key="sk-test", max_retries=0, timeout=10) as c:
        yield c


def _user(text: str) -> list[Any]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def _is_subsequence(needle: list[int], haystack: list[int]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


# ------------------------------------------------------------------------------------------------------ chat


def test_chat_non_streaming_parses_and_echoes_request_id(client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_user("Tell me something."), extra_headers={"x-request-id": "req-123"}
    )
    assert raw.headers["x-request-id"] == "req-123"
    response = raw.parse()
    assert response.object == "chat.completion"
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.endswith(".")
    assert choice.finish_reason == "stop"
    assert response.id == "chatcmpl-req-123"  # vLLM names the answer after the client's request id
    assert response.system_fingerprint is not None and response.system_fingerprint.startswith("vllm-0.32.0-")
    usage = response.usage
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is None  # vLLM's default: no --enable-prompt-tokens-details
    # without return_token_ids vLLM leaves the extension fields null
    assert response.model_dump()["prompt_token_ids"] is None


def test_chat_is_deterministic_and_bounded_by_max_tokens(client: OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=_user("Say hello."))
    again = client.chat.completions.create(model=MODEL, messages=_user("Say hello."))
    assert first.choices[0].message.content == again.choices[0].message.content
    short = client.chat.completions.create(model=MODEL, messages=_user("Say hello."), max_completion_tokens=2)
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 2
    seeded = {
        client.chat.completions.create(model=MODEL, messages=_user("Say hello."), seed=s).choices[0].message.content
        for s in range(6)
    }
    assert len(seeded) > 1


def test_return_token_ids_agree_between_streaming_and_not(client: OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": _user("What is 12 + 30?"),
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
    }
    full = client.chat.completions.create(**kwargs).model_dump()
    prompt_ids = full["prompt_token_ids"]
    response_ids = full["choices"][0]["token_ids"]
    content = full["choices"][0]["message"]["content"]
    assert _is_subsequence(tok.encode("What is 12 + 30?"), prompt_ids)
    assert response_ids == [*tok.encode(content), tok.EOS_ID]
    assert full["usage"]["prompt_tokens"] == len(prompt_ids)
    assert full["usage"]["completion_tokens"] == len(response_ids)
    assert len(full["choices"][0]["logprobs"]["content"]) == len(response_ids)

    streamed_prompt: list[int] | None = None
    streamed_ids: list[int] = []
    streamed_text = ""
    streamed_logprobs: list[float] = []
    finish = None
    usage = None
    with client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}) as stream:
        for number, chunk in enumerate(stream):
            data = chunk.model_dump()
            if number == 0:
                assert data["choices"][0]["delta"]["role"] == "assistant"
                streamed_prompt = data["prompt_token_ids"]
            else:
                assert data.get("prompt_token_ids") is None
            if chunk.usage is not None:
                assert chunk.choices == []
                usage = chunk.usage
            for choice in data["choices"]:
                streamed_text += choice["delta"].get("content") or ""
                streamed_ids += choice.get("token_ids") or []
                if choice["logprobs"]:
                    streamed_logprobs += [e["logprob"] for e in choice["logprobs"]["content"]]
                finish = choice["finish_reason"] or finish
    assert streamed_prompt == prompt_ids
    assert streamed_ids == response_ids
    assert streamed_text == content
    assert streamed_logprobs == [e["logprob"] for e in full["choices"][0]["logprobs"]["content"]]
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == len(response_ids)


def test_logprobs_per_token_with_top_logprobs(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=_user("Describe a rollout."), logprobs=True, top_logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert response.usage is not None and len(logprobs.content) == response.usage.completion_tokens
    for entry in logprobs.content:
        assert entry.logprob < 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    text = "".join(e.token for e in logprobs.content[:-1])
    assert text == response.choices[0].message.content


def test_n_gives_different_choices(client: OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=_user("Write a line."), n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content != response.choices[1].message.content
    total = sum(len(tok.encode(c.message.content or "")) + 1 for c in response.choices)
    assert response.usage is not None and response.usage.completion_tokens == total


def test_math_answers_are_right_about_seventy_percent_of_the_time(client: OpenAI) -> None:
    right = 0
    for a in range(40):
        question = f"What is {a} * {a + 3}?"
        answer = client.chat.completions.create(model=MODEL, messages=_user(question)).choices[0].message.content
        assert answer is not None and answer.startswith("The answer is ")
        value = int(answer.removeprefix("The answer is ").rstrip("."))
        assert abs(value - a * (a + 3)) <= 1
        right += value == a * (a + 3)
    assert 18 <= right <= 38


def test_prefix_cache_reports_cached_tokens(client: OpenAI, mock: MockBackendProcess) -> None:
    mock.configure(prompt_tokens_details=True)  # as vLLM started with --enable-prompt-tokens-details
    messages = _user("A long shared prefix " * 20)
    first = client.chat.completions.create(model=MODEL, messages=messages)
    second = client.chat.completions.create(model=MODEL, messages=[*messages, {"role": "user", "content": "more"}])
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens if second.usage.prompt_tokens_details else 0
    assert cached is not None and 0 < cached < second.usage.prompt_tokens and cached % 16 == 0


# ------------------------------------------------------------------------------------------------ tool calls


def test_tool_call_then_text_after_the_tool_answers(client: OpenAI) -> None:
    messages: list[Any] = _user("What is the weather in Paris?")
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["location"], str) and arguments["location"]
    assert arguments["unit"] == "celsius"
    token_ids = choice.model_dump()["token_ids"]
    assert token_ids[0] == tok.TOOL_CALL_START_ID and token_ids[-2:] == [tok.TOOL_CALL_END_ID, tok.EOS_ID]

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
    ]
    after = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert after.choices[0].finish_reason == "stop"
    assert after.choices[0].message.tool_calls in (None, [])
    assert after.choices[0].message.content

    no_tools = client.chat.completions.create(
        model=MODEL, messages=_user("Hi"), tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert no_tools.choices[0].finish_reason == "stop"


def test_streamed_tool_call_matches_the_non_streamed_one(client: OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": _user("Weather in Oslo?"), "tools": [WEATHER_TOOL]}
    expected = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert expected is not None
    name = call_id = None
    pieces: list[str] = []
    finish = None
    with client.chat.completions.create(**kwargs, stream=True) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or ():
                    assert delta.index == 0
                    if delta.id is not None:
                        assert name is None, "id and name come once, in the first delta"
                        call_id = delta.id
                        name = delta.function.name if delta.function else None
                    if delta.function and delta.function.arguments:
                        pieces.append(delta.function.arguments)
                finish = choice.finish_reason or finish
    assert (call_id, name) == (expected[0].id, "get_weather")
    assert len(pieces) > 1
    assert "".join(pieces) == expected[0].function.arguments
    assert finish == "tool_calls"


# --------------------------------------------------------------------------------- completions, embeddings, ...


def test_completions_token_ids_and_logprobs(client: OpenAI) -> None:
    prompt = "Once upon a time"
    full = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, extra_body={"return_token_ids": True}
    )
    choice = full.choices[0]
    data = choice.model_dump()
    assert data["prompt_token_ids"] == tok.encode(prompt)
    assert len(data["token_ids"]) <= 5
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == len(data["token_ids"])
    assert choice.logprobs.text_offset is not None and choice.logprobs.text_offset[0] == 0
    # the two likeliest tokens, the sampled one among them (the fake model samples its likeliest token)
    assert choice.logprobs.top_logprobs is not None and all(len(t) == 2 for t in choice.logprobs.top_logprobs)

    streamed_ids: list[int] = []
    text = ""
    prompt_ids = None
    with client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, stream=True, extra_body={"return_token_ids": True}
    ) as stream:
        for number, chunk in enumerate(stream):
            piece = chunk.choices[0].model_dump()
            if number == 0:
                prompt_ids = piece["prompt_token_ids"]
            else:
                assert piece["prompt_token_ids"] is None
            streamed_ids += piece["token_ids"]
            text += piece["text"]
    assert prompt_ids == data["prompt_token_ids"]
    assert streamed_ids == data["token_ids"]
    assert text == choice.text


def test_embeddings_base64_and_float(client: OpenAI, mock: MockBackendProcess) -> None:
    response = client.embeddings.create(model=MODEL, input=["alpha", "beta"])  # the SDK asks for base64
    assert [d.index for d in response.data] == [0, 1]
    vector = response.data[0].embedding
    assert len(vector) == 32
    assert abs(sum(v * v for v in vector) - 1.0) < 1e-3
    floats = httpx.post(
        f"{mock.base_url}/embeddings",
        json={"model": MODEL, "input": "alpha", "dimensions": 8, "encoding_format": "float"},
    ).json()
    assert len(floats["data"][0]["embedding"]) == 8
    assert response.usage.prompt_tokens == 2


def test_models_health_and_version(client: OpenAI, mock: MockBackendProcess) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    health = httpx.get(f"{mock.url}/health")
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(f"{mock.url}/version").json() == {"version": "0.32.0"}


def test_the_flavor_is_chosen_at_start(mock: MockBackendProcess) -> None:
    assert httpx.get(f"{mock.url}/mock/config").json()["flavor"] == "vllm"
    refused = httpx.post(f"{mock.url}/mock/config", json={"flavor": "sglang"})
    assert refused.status_code == 400 and "fixed" in refused.json()["error"]["message"]


def test_responses_api(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="What is 2 + 2?", instructions="Be brief.")
    assert response.status == "completed"
    assert response.output_text.startswith("The answer is ")
    assert response.usage is not None and response.usage.input_tokens > 0
    called = client.responses.create(model=MODEL, input="Weather in Rome?", tools=[RESPONSES_WEATHER_TOOL])
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["unit"] == "celsius"


def test_responses_api_streams_named_events_ending_with_the_whole_response(
    client: OpenAI, mock: MockBackendProcess
) -> None:
    ask: dict[str, Any] = {"model": MODEL, "input": "What is 2 + 2?", "max_output_tokens": 30}
    whole: Response = client.responses.create(**ask)  # not a stream: ``ask`` has no "stream"
    with httpx.stream("POST", f"{mock.base_url}/responses", json={**ask, "stream": True}) as raw:
        text = "".join(raw.iter_text())
    blocks = [b for b in text.split("\n\n") if b]
    assert "[DONE]" not in text
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == final["response"]["output"][0]["content"][0]["text"] == whole.output_text
    assert whole.usage is not None and final["response"]["usage"]["output_tokens"] == whole.usage.output_tokens
    called = list(
        client.responses.create(model=MODEL, input="Weather in Rome?", tools=[RESPONSES_WEATHER_TOOL], stream=True)
    )
    arguments = "".join(e.delta for e in called if e.type == "response.function_call_arguments.delta")
    completed = called[-1]
    assert completed.type == "response.completed"
    call = completed.response.output[0]
    assert call.type == "function_call"
    assert json.loads(arguments)["unit"] == "celsius" == json.loads(call.arguments)["unit"]


def test_errors_are_vllms(client: OpenAI, mock: MockBackendProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[])
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=10**6)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "max_tokens"
    no_model = httpx.post(f"{mock.base_url}/chat/completions", json={"messages": _user("hi")})
    assert no_model.status_code == 200 and no_model.json()["model"] == MODEL  # vLLM serves its first model
    malformed = httpx.post(f"{mock.base_url}/chat/completions", content=b"{not json")
    assert malformed.status_code == 400 and set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    unknown = httpx.get(f"{mock.url}/v1/nothing")
    assert unknown.status_code == 404 and unknown.json() == {"detail": "Not Found"}  # FastAPI's, as vLLM's
    bad_rule = httpx.post(f"{mock.url}/mock/faults", json={"kind": "explode"})
    assert bad_rule.status_code == 400


# ----------------------------------------------------------------------------------------------------- faults


def test_status_fault_fires_once(client: OpenAI, mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "status", "status": 503, "times": 1})
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=_user("hi"))
    assert caught.value.status_code == 503
    client.chat.completions.create(model=MODEL, messages=_user("hi"))
    stats = mock.stats()
    assert stats["by_route_status"]["/v1/chat/completions"] == {"503": 1, "200": 1}
    assert [f["kind"] for f in stats["faults_fired"]] == ["status"]


def test_status_fault_with_custom_body_and_model_match(client: OpenAI, mock: MockBackendProcess) -> None:
    body = {"error": {"message": "overloaded", "type": "server_error", "param": None, "code": "busy"}}
    mock.add_faults(
        {"kind": "status", "status": 502, "body": body, "times": 2, "match": {"model": "other"}},
    )
    client.chat.completions.create(model=MODEL, messages=_user("hi"))  # not matched
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="other", messages=_user("hi"))
        assert caught.value.status_code == 502
        assert isinstance(caught.value.body, dict) and caught.value.body["message"] == "overloaded"
    client.chat.completions.create(model="other", messages=_user("hi"))  # used up
    assert httpx.get(f"{mock.url}/mock/faults").json()["rules"] == []


def test_rate_limit_fault_sets_retry_after(client: OpenAI, mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "rate_limit", "retry_after": 1, "times": 1})
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=_user("hi"))
    assert caught.value.status_code == 429
    assert caught.value.response.headers["retry-after"] == "1"


def test_dropped_stream_breaks_the_sdk_stream(client: OpenAI, mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "drop_mid_stream", "after_chunks": 3, "times": 1})
    received = 0
    with (
        pytest.raises((httpx.HTTPError, openai.APIError)),
        client.chat.completions.create(model=MODEL, messages=_user("Talk."), stream=True) as stream,
    ):
        for _ in stream:
            received += 1
    assert received == 3
    with client.chat.completions.create(model=MODEL, messages=_user("Talk."), stream=True) as stream:
        assert len(list(stream)) > 3  # one-shot: the next stream is whole


def test_dropped_non_streamed_answer_breaks_the_sdk_call(client: OpenAI, mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "drop_mid_stream", "match": {"stream": False}})
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model=MODEL, messages=_user("hi"))


def test_hang_until_the_client_times_out_is_recorded_as_cancelled(mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "hang", "times": 1})
    with OpenAI(base_url=mock.base_url, api_key="sk-test", max_retries=0, timeout=0.3) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(
                model=MODEL, messages=_user("hi"), extra_headers={"x-request-id": "hung-1"}
            )
        gave_up = time.monotonic()
    stats = mock.stats(wait_cancelled=1, timeout=2)
    assert len(stats["cancelled"]) == 1
    cancelled = stats["cancelled"][0]
    assert cancelled["request_id"] == "hung-1" and cancelled["stage"] == "hang" and cancelled["fault"] == "hang"
    assert 0.25 <= cancelled["noticed_at"] - cancelled["started_at"] < 1.3
    assert cancelled["noticed_at"] - gave_up < 1.0  # CLOCK_MONOTONIC is shared by processes on Linux
    assert mock.stats(wait_idle=1, timeout=2)["in_flight"] == 0


def test_client_leaving_mid_stream_is_recorded_promptly(client: OpenAI, mock: MockBackendProcess) -> None:
    with client.chat.completions.create(
        model=MODEL,
        messages=_user("Talk slowly."),
        stream=True,
        extra_headers={"x-mock-token-delay-ms": "200", "x-request-id": "left-1"},
    ) as stream:
        next(iter(stream))
        left = time.monotonic()
    stats = mock.stats(wait_cancelled=1, timeout=2)
    assert [(c["request_id"], c["stage"]) for c in stats["cancelled"]] == [("left-1", "streaming")]
    assert stats["cancelled"][0]["noticed_at"] - left < 0.5


def test_stall_mid_stream_then_client_timeout(mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "stall_mid_stream", "after_chunks": 2})
    received = 0
    with (
        OpenAI(base_url=mock.base_url, api_key="sk-test", max_retries=0, timeout=0.3) as impatient,
        pytest.raises((httpx.ReadTimeout, openai.APITimeoutError)),
        impatient.chat.completions.create(model=MODEL, messages=_user("hi"), stream=True) as stream,
    ):
        for _ in stream:
            received += 1
    assert received == 2
    stats = mock.stats(wait_cancelled=1, timeout=2)
    assert stats["cancelled"][0]["stage"] == "stalled"


def test_hold_keeps_generation_requests_waiting_until_it_is_cleared(client: OpenAI, mock: MockBackendProcess) -> None:
    assert mock.configure(hold=True)["hold"] is True
    assert client.models.list().data  # not a generation request: answered at once
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(client.chat.completions.create, model=MODEL, messages=_user("hi")) for _ in range(2)]
        stats = mock.stats(wait_requests=3, timeout=10)
        assert stats["in_flight"] == 2 and not any(call.done() for call in held)
        mock.configure(hold=False)
        assert all(call.result(timeout=10).choices for call in held)
    assert mock.stats(wait_idle=1, timeout=10)["in_flight"] == 0
    mock.configure(hold=True)
    mock.reset()  # back to the configuration the mock started with: nothing held
    assert client.chat.completions.create(model=MODEL, messages=_user("hi")).choices


def test_delay_fault_and_latency_knobs(client: OpenAI, mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "delay", "ms": 300})
    started = time.monotonic()
    client.chat.completions.create(model=MODEL, messages=_user("hi"))
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    client.chat.completions.create(model=MODEL, messages=_user("hi"), extra_body={"mock": {"ttft_ms": 200}})
    assert time.monotonic() - started >= 0.2
    assert mock.configure(latency_ms=150)["latency_ms"] == 150
    started = time.monotonic()
    client.models.list()
    assert time.monotonic() - started >= 0.15
    mock.reset()
    assert httpx.get(f"{mock.url}/mock/config").json()["latency_ms"] == 0


def test_unlimited_rule_until_deleted_and_requests_log(client: OpenAI, mock: MockBackendProcess) -> None:
    mock.add_faults({"kind": "status", "status": 500, "times": None, "match": {"path": "/health"}})
    for _ in range(3):
        assert httpx.get(f"{mock.url}/health").status_code == 500
    client.chat.completions.create(model=MODEL, messages=_user("hi"), extra_body={"return_token_ids": True})
    httpx.delete(f"{mock.url}/mock/faults").raise_for_status()
    assert httpx.get(f"{mock.url}/health").status_code == 200
    logged = mock.requests(path="/v1/chat/completions")
    assert logged[-1]["body"]["return_token_ids"] is True
    assert logged[-1]["headers"]["authorization"] == "Bearer sk-test"


# ------------------------------------------------------------------------------------------------- in-process


async def test_run_in_thread_serves_async_clients() -> None:
    with run_in_thread(MockConfig(models=("a", "b"), token_delay_ms=1)) as server:
        assert server.base_url.endswith("/v1")
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
            assert [m.id async for m in client.models.list()] == ["a", "b"]
            stream = await client.chat.completions.create(
                model="a", messages=_user("What is 5 - 7?"), stream=True, extra_body={"return_token_ids": True}
            )
            text = ""
            async with stream:
                async for chunk in stream:
                    text += "".join(c.delta.content or "" for c in chunk.choices)
            assert text.startswith("The answer is ")
        assert server.state.stats.requests["/v1/chat/completions"] == 1
