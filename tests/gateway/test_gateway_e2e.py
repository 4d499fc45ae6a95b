"""End to end: the official openai SDK → a real gateway (uvicorn) → the vLLM-like mock backend process.

The oracle for "identical" is a direct call to the same mock with the same request: the gateway's answer
differs only in the fields the gateway injected and strips, and the span holds exactly the backend's token
ids and logprobs (asked of the mock directly with ``return_token_ids``/``logprobs``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai import AsyncOpenAI
from openai.types import Completion
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
)
from openai.types.responses import Response, ResponseOutputMessage, ResponseOutputText, ResponseStreamEvent
from pydantic import BaseModel

from rollway.mock import MockBackendProcess
from support.gateway_harness import Alias, RunningGateway, claim_one, register

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 12 + 30?"}]
VOLATILE = {"id", "created", "system_fingerprint"}


def comparable(obj: Any) -> Any:
    data = obj.model_dump() if hasattr(obj, "model_dump") else obj
    return {k: v for k, v in data.items() if k not in VOLATILE}


def extra(model: BaseModel) -> dict[str, Any]:
    """The fields of ``model`` its SDK class does not declare (vLLM's token ids): the SDK's models keep them all."""
    assert model.model_extra is not None
    return model.model_extra


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    backend = {"backend_id": "mock-a", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
    return [Alias("policy", [backend], version="v1")]


@pytest.fixture
async def direct(mock: MockBackendProcess) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=mock.base_url, api_key="unused", max_retries=0) as client:
        yield client


async def rollout_client(gw: RunningGateway, via: str) -> tuple[AsyncOpenAI, str, str]:
    rollout_id, attempt_id = await claim_one(gw.store)
    if via == "path":
        return gw.client(f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"), rollout_id, attempt_id
    _, key = await gw.store.mint_key("rollout", rollout_id=rollout_id, attempt_id=attempt_id)
    return gw.client(api_key=key), rollout_id, attempt_id


VIA = pytest.mark.parametrize("via", ["path", "key"])


@VIA
async def test_chat_answer_is_the_backends_and_span_holds_its_token_ids(
    gw: RunningGateway, direct: AsyncOpenAI, via: str
) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, via)
    raw = await client.chat.completions.with_raw_response.create(model="policy", messages=MESSAGES, max_tokens=12)
    answer = raw.parse()
    expected = await direct.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=12)
    assert comparable(answer) | {"model": None} == comparable(expected) | {"model": None}
    assert extra(answer).get("prompt_token_ids") is None  # injected, stripped
    assert answer.choices[0].logprobs is None
    assert raw.headers["x-rollway-rollout-id"] == rollout_id
    assert raw.headers["x-rollway-attempt-id"] == attempt_id
    assert raw.headers["x-rollway-sequence-id"] == "1"

    truth = await direct.chat.completions.create(
        model="mock-model", messages=MESSAGES, max_tokens=12, logprobs=True, extra_body={"return_token_ids": True}
    )
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    attrs = span.attributes
    assert span.sequence_id == 1
    assert span.status.status_code == "OK"
    assert attrs["rollway.prompt_token_ids"] == extra(truth)["prompt_token_ids"]
    assert attrs["rollway.response_token_ids"] == extra(truth.choices[0])["token_ids"]
    logprobs = truth.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert attrs["rollway.response_logprobs"] == [t.logprob for t in logprobs.content]
    assert attrs["rollway.trainable"] is True
    assert attrs["gen_ai.request.model"] == "policy"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert truth.usage is not None and attrs["gen_ai.usage.output_tokens"] == truth.usage.completion_tokens
    assert attrs["rollway.backend_id"] == "mock-a"
    assert attrs["rollway.model_version"] == "v1"
    assert attrs["rollway.request"]["model"] == "policy"
    assert attrs["rollway.response"]["choices"][0]["message"]["content"] == answer.choices[0].message.content


@VIA
async def test_streamed_chat_passes_chunks_through_and_records_the_whole_call(
    gw: RunningGateway, direct: AsyncOpenAI, via: str
) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, via)
    stream = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=10, stream=True)
    chunks = [chunk async for chunk in stream]
    direct_stream = await direct.chat.completions.create(
        model="mock-model", messages=MESSAGES, max_tokens=10, stream=True
    )
    expected = [chunk async for chunk in direct_stream]
    assert [comparable(c) | {"model": None} for c in chunks] == [comparable(c) | {"model": None} for c in expected]
    assert all(c.usage is None for c in chunks)  # the injected usage chunk is not shown
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    truth = await direct.chat.completions.create(
        model="mock-model", messages=MESSAGES, max_tokens=10, logprobs=True, extra_body={"return_token_ids": True}
    )
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    attrs = span.attributes
    assert attrs["rollway.stream"] is True
    assert attrs["rollway.prompt_token_ids"] == extra(truth)["prompt_token_ids"]
    assert attrs["rollway.response_token_ids"] == extra(truth.choices[0])["token_ids"]
    logprobs = truth.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert attrs["rollway.response_logprobs"] == [t.logprob for t in logprobs.content]
    assert attrs["rollway.response"]["choices"][0]["message"]["content"] == text
    assert truth.usage is not None and attrs["gen_ai.usage.output_tokens"] == truth.usage.completion_tokens
    assert attrs["rollway.ttft_seconds"] is not None


def without_ids(data: Any) -> Any:
    """``data`` without what differs between two calls of the same request: ids and timestamps."""
    if isinstance(data, dict):
        return {k: without_ids(v) for k, v in data.items() if k not in ("id", "item_id", "created_at")}
    if isinstance(data, list):
        return [without_ids(v) for v in data]
    return data


def first_text(response: Response) -> ResponseOutputText:
    """The first part of ``response``'s first output item, which here is a message's text."""
    message = response.output[0]
    assert isinstance(message, ResponseOutputMessage)
    text = message.content[0]
    assert isinstance(text, ResponseOutputText)
    return text


@pytest.mark.parametrize(("stream", "scoring"), [(False, True), (True, True), (True, False)])
async def test_responses_api_is_passed_through_and_recorded_trainable(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool, scoring: bool
) -> None:
    """``/v1/responses`` to vLLM: the gateway asks for the token ids (``enable_response_messages``) and logprobs,
    the SDK sees what a direct call answers (its events, for a stream, which ends with ``response.completed`` and
    no ``[DONE]``), and the span holds the whole response with the engine's token ids and logprobs. vLLM's stream
    leaves out the logprob of a token without text (its end): the engine then scores the output, which gives the
    logprobs the engine sampled; with scoring off, the span says its logprobs are incomplete."""
    gw.state.gateway.scorer.enabled = scoring
    client, rollout_id, attempt_id = await rollout_client(gw, "path")
    ask: dict[str, Any] = {"input": "What is 12 + 30?", "instructions": "Be brief.", "max_output_tokens": 12}
    # ``**ask`` may hold any key as far as mypy knows ("stream" too), so it types these calls' answers as Any:
    # the annotations say which they are.
    answer: Response
    if stream:
        events: list[ResponseStreamEvent] = [
            e async for e in await client.responses.create(model="policy", stream=True, **ask)
        ]
        expected = [e async for e in await direct.responses.create(model="mock-model", stream=True, **ask)]
        assert [without_ids(e.model_dump()) for e in events] == [without_ids(e.model_dump()) for e in expected]
        first, last = events[0], events[-1]
        assert last.type == "response.completed" and first.type == "response.created"
        assert all(e.logprobs == [] for e in events if e.type == "response.output_text.delta")
        answer = last.response
    else:
        answer = await client.responses.create(model="policy", **ask)
        expected_answer = await direct.responses.create(model="mock-model", **ask)
        assert without_ids(answer.model_dump()) == without_ids(expected_answer.model_dump())
    assert answer.model_extra is not None and answer.model_extra["input_messages"] is None
    assert first_text(answer).logprobs is None
    truth: Response = await direct.responses.create(
        model="mock-model",
        include=["message.output_text.logprobs"],
        top_logprobs=0,
        extra_body={"enable_response_messages": True},
        **ask,
    )
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    attrs = span.attributes
    assert span.status.status_code == "OK", span.status
    assert attrs["gen_ai.operation.name"] == "responses" and attrs["rollway.stream"] is stream
    recorded = attrs["rollway.response"]
    assert recorded["id"] == answer.id and recorded["status"] == "completed"
    assert recorded["output"][0]["content"][0]["text"] == answer.output_text
    assert answer.usage is not None and attrs["gen_ai.usage.output_tokens"] == answer.usage.output_tokens
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
    assert truth.model_extra is not None
    assert attrs["rollway.trainable"] is True
    assert attrs["rollway.prompt_token_ids"] == truth.model_extra["input_messages"][0]["tokens"]
    assert attrs["rollway.response_token_ids"] == truth.model_extra["output_messages"][0]["tokens"]
    logprobs = first_text(truth).logprobs
    complete = not stream or scoring
    if complete:
        assert logprobs and attrs["rollway.response_logprobs"] == [entry.logprob for entry in logprobs]
    else:
        assert attrs["rollway.response_logprobs"] is None
    # Said apart from the ids, with where they came from, counted for the alias, and in the metrics.
    assert attrs["rollway.logprobs_complete"] is complete
    assert attrs["rollway.logprobs_source"] == (None if not complete else "scored" if stream else "sampled")
    assert gw.state.registry.watch.counts("policy").without_logprobs == int(not complete)
    async with gw.http() as http:
        metrics = (await http.get("/metrics")).text

    def counted(name: str) -> float:
        lines = [line for line in metrics.splitlines() if line.startswith(f"{name}_total{{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    assert counted("rollway_calls_without_logprobs") == int(not complete)
    assert counted("rollway_calls_scored_logprobs") == int(stream and scoring)


async def test_a_responses_answer_cut_at_max_output_tokens_says_length(gw: RunningGateway) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, "path")
    answer = await client.responses.create(model="policy", input="Tell me a long story.", max_output_tokens=2)
    assert answer.status == "incomplete"
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.attributes["gen_ai.response.finish_reasons"] == ["length"]


async def test_a_responses_stream_that_breaks_off_records_its_text_so_far(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, "path")
    mock.add_faults({"kind": "drop_mid_stream", "after_chunks": 7})  # created, in_progress, 2 opened, 3 deltas
    events: list[Any] = []
    with pytest.raises(openai.APIError):
        stream = await client.responses.create(model="policy", input="Tell me a story.", stream=True)
        async for event in stream:
            events.append(event)
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(texts) == 3
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.status.status_code == "ERROR" and span.attributes["error.type"] == "stream_interrupted"
    partial = span.attributes["rollway.response"]
    assert partial["status"] == "incomplete" and partial["output"][0]["content"][0]["text"] == "".join(texts)
    assert span.attributes["gen_ai.response.finish_reasons"] == [None]  # cut off: it did not end on "length"


async def test_client_that_asks_for_token_ids_gets_them(gw: RunningGateway, direct: AsyncOpenAI) -> None:
    client, _, _ = await rollout_client(gw, "path")
    answer = await client.chat.completions.create(
        model="policy", messages=MESSAGES, logprobs=True, extra_body={"return_token_ids": True}
    )
    truth = await direct.chat.completions.create(
        model="mock-model", messages=MESSAGES, logprobs=True, extra_body={"return_token_ids": True}
    )
    assert extra(answer)["prompt_token_ids"] == extra(truth)["prompt_token_ids"]
    assert extra(answer.choices[0])["token_ids"] == extra(truth.choices[0])["token_ids"]
    assert answer.choices[0].logprobs is not None


TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluate arithmetic",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_round_trip(gw: RunningGateway, direct: AsyncOpenAI, stream: bool) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, "path")
    if stream:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="policy", messages=MESSAGES, tools=TOOLS, stream=True
            )
        ]
        names = [
            tc.function.name
            for c in chunks
            if c.choices
            for tc in (c.choices[0].delta.tool_calls or [])
            if tc.function and tc.function.name
        ]
        assert names == ["calculator"]
    else:
        answer = await client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
        expected = await direct.chat.completions.create(model="mock-model", messages=MESSAGES, tools=TOOLS)
        answer_calls = answer.choices[0].message.tool_calls
        expected_calls = expected.choices[0].message.tool_calls
        assert answer_calls is not None and expected_calls is not None
        assert isinstance(answer_calls[0], ChatCompletionMessageFunctionToolCall)
        assert isinstance(expected_calls[0], ChatCompletionMessageFunctionToolCall)
        assert answer_calls[0].function.model_dump() == expected_calls[0].function.model_dump()
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    message = span.attributes["rollway.response"]["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "calculator"
    assert span.attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert span.attributes["rollway.response_token_ids"]


async def test_n_choices_are_all_recorded(gw: RunningGateway, direct: AsyncOpenAI) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, "key")
    answer = await client.chat.completions.create(model="policy", messages=MESSAGES, n=3, max_tokens=8)
    expected = await direct.chat.completions.create(
        model="mock-model", messages=MESSAGES, n=3, max_tokens=8, extra_body={"return_token_ids": True}
    )
    assert [c.message.content for c in answer.choices] == [c.message.content for c in expected.choices]
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    choices = span.attributes["rollway.choices"]
    assert [c["token_ids"] for c in choices] == [extra(c)["token_ids"] for c in expected.choices]
    assert [c["logprobs_complete"] for c in choices] == [True] * 3 and span.attributes["rollway.logprobs_complete"]


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_record_prompt_and_response_ids(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, "path")
    if stream:
        parts = [
            c
            async for c in await client.completions.create(
                model="policy", prompt="Once upon a time", max_tokens=6, stream=True
            )
        ]
        text = "".join(p.choices[0].text for p in parts if p.choices)
    else:
        text = (
            (await client.completions.create(model="policy", prompt="Once upon a time", max_tokens=6)).choices[0].text
        )
    truth = await direct.completions.create(
        model="mock-model", prompt="Once upon a time", max_tokens=6, logprobs=0, extra_body={"return_token_ids": True}
    )
    assert text == truth.choices[0].text
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["rollway.prompt_token_ids"] == extra(truth.choices[0])["prompt_token_ids"]
    assert span.attributes["rollway.response_token_ids"] == extra(truth.choices[0])["token_ids"]
    assert truth.choices[0].logprobs is not None
    assert span.attributes["rollway.response_logprobs"] == truth.choices[0].logprobs.token_logprobs


async def _raw_chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON objects of a stream's events as sent, without the fields that differ between two calls."""
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(url, json=body)
    events = [line[len("data: ") :] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return [{k: v for k, v in orjson.loads(e).items() if k not in {"id", "created", "model"}} for e in events[:-1]]


@pytest.mark.parametrize("operation", ["chat/completions", "completions"])
async def test_stream_events_are_the_backends_own_keys_and_values(
    gw: RunningGateway, mock: MockBackendProcess, operation: str
) -> None:
    """Key for key, not only as the SDK parses them: no key the gateway asked for (token ids, logprobs) shows,
    none is added (vLLM's streams are not asked for usage), and the last chunk keeps ``system_fingerprint``."""
    _, rollout_id, attempt_id = await rollout_client(gw, "path")
    fields = {"messages": MESSAGES} if operation == "chat/completions" else {"prompt": "Once upon a time"}
    body: dict[str, Any] = {**fields, "max_tokens": 6, "stream": True}
    prefix = f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}"
    via = await _raw_chunks(f"{prefix}/v1/{operation}", body | {"model": "policy"})
    direct = await _raw_chunks(f"{mock.url}/v1/{operation}", body | {"model": "mock-model"})
    assert via == direct
    assert not any("usage" in c for c in via)
    assert via[-1]["system_fingerprint"] is not None


async def test_embeddings_and_models(gw: RunningGateway, direct: AsyncOpenAI) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, "path")
    vectors = await client.embeddings.create(model="policy", input=["hello", "world"])
    expected = await direct.embeddings.create(model="mock-model", input=["hello", "world"])
    assert [d.embedding for d in vectors.data] == [d.embedding for d in expected.data]
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.attributes["gen_ai.operation.name"] == "embeddings"
    assert span.attributes["rollway.trainable"] is False
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    assert (await client.models.retrieve("policy")) == models.data[0]
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_concurrent_calls_of_one_attempt_get_gap_free_sequence_ids(gw: RunningGateway) -> None:
    client, rollout_id, attempt_id = await rollout_client(gw, "path")

    async def one(i: int) -> int:
        raw = await client.chat.completions.with_raw_response.create(
            model="policy",
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=4,
            stream=i % 2 == 0,
        )
        if i % 2 == 0:
            stream = raw.parse()
            assert isinstance(stream, openai.AsyncStream)
            async for _ in stream:
                pass
        return int(raw.headers["x-rollway-sequence-id"])

    got = await asyncio.gather(*(one(i) for i in range(32)))
    assert sorted(got) == list(range(1, 33))
    spans = await gw.store.query_spans(rollout_id, attempt_id)
    assert [s.sequence_id for s in spans] == list(range(1, 33))
    assert all(s.attributes["rollway.prompt_token_ids"] for s in spans)


async def openai_kind(gw: RunningGateway, mock: MockBackendProcess, alias: str) -> None:
    """``alias`` served by the mock as an ``openai``-kind backend (id ``alias``): no token ids are asked for."""
    backend = {"backend_id": alias, "base_url": mock.base_url, "kind": "openai", "model": "mock-model"}
    await register(gw.store, alias, backend)


def refuse_streams(mock: MockBackendProcess, message: str, times: int) -> None:
    """The mock answers the next ``times`` streamed requests with a 400 saying ``message``."""
    refusal = {"error": {"message": message, "type": "invalid_request_error"}}
    mock.add_faults({"kind": "status", "status": 400, "body": refusal, "times": times, "match": {"stream": True}})


@pytest.mark.parametrize("operation", ["chat", "completions"])
async def test_a_stream_from_an_openai_kind_backend_records_its_usage(
    gw: RunningGateway, direct: AsyncOpenAI, mock: MockBackendProcess, operation: str
) -> None:
    """Not a token-id backend: no token ids are asked for, but the stream's usage is (and not shown unasked)."""
    await openai_kind(gw, mock, "plain")
    client = gw.client()
    stream: openai.AsyncStream[ChatCompletionChunk] | openai.AsyncStream[Completion]
    truth: ChatCompletion | Completion
    if operation == "chat":
        stream = await client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=9, stream=True)
        truth = await direct.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=9)
    else:
        stream = await client.completions.create(model="plain", prompt="Once upon", max_tokens=9, stream=True)
        truth = await direct.completions.create(model="mock-model", prompt="Once upon", max_tokens=9)
    chunks = [chunk async for chunk in stream]
    assert chunks and all(c.usage is None and c.choices for c in chunks)  # no usage chunk: the client did not ask
    assert await gw.state.registry.drain("plain", 10)
    [span] = await gw.store.query_spans(None)
    attrs = span.attributes
    assert truth.usage is not None
    assert attrs["gen_ai.usage.input_tokens"] == truth.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == truth.usage.completion_tokens
    assert attrs.get("rollway.response_token_ids") is None and attrs["rollway.trainable"] is False


async def test_a_backend_that_refuses_stream_options_is_asked_again_without_them(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    """An OpenAI-compatible server that does not know ``stream_options`` (which the gateway adds, for usage):
    the call is asked again at once without it, and later calls to that backend go without it."""
    await openai_kind(gw, mock, "strict")
    refuse_streams(mock, "Unrecognized request argument supplied: stream_options", times=1)
    client = gw.client()
    for _ in range(2):
        stream = await client.chat.completions.create(model="strict", messages=MESSAGES, max_tokens=5, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in [chunk async for chunk in stream] if c.choices)
    sent = [r["body"] for r in mock.requests(path="/v1/chat/completions")]
    assert ["stream_options" in body for body in sent] == [True, False, False]
    assert await gw.state.registry.drain("strict", 10)
    spans = await gw.store.query_spans(None)
    assert [s.status.status_code for s in spans] == ["OK", "OK"] and all(
        s.attributes["rollway.retry_count"] == 0 for s in spans
    )


async def test_a_stream_keeps_the_backends_content_type_and_is_not_buffered(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    async with httpx.AsyncClient(timeout=10) as http:
        direct = await http.post(f"{mock.base_url}/chat/completions", json=body | {"model": "mock-model"})
        proxied = await http.post(f"{gw.url}/v1/chat/completions", json=body | {"model": "policy"})
        whole = await http.post(f"{gw.url}/v1/chat/completions", json=body | {"model": "policy", "stream": False})
    assert direct.headers["content-type"].startswith("text/event-stream")
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    # Not cached, and not buffered by a reverse proxy in front (nginx reads X-Accel-Buffering).
    assert proxied.headers["cache-control"] == "no-cache"
    assert proxied.headers["x-accel-buffering"] == "no"
    assert whole.status_code == 200 and "x-accel-buffering" not in whole.headers


async def test_a_refusal_that_only_quotes_stream_options_is_passed_on_and_not_remembered(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    """A 400 that names ``stream_options`` for another reason (here: asked again without ours, refused again)
    is the client's answer; the backend still gets ``stream_options`` on the next call."""
    await openai_kind(gw, mock, "picky")
    refuse_streams(mock, "stream_options.continuous_usage_stats is not supported", times=2)
    client = gw.client()
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="picky", messages=MESSAGES, max_tokens=5, stream=True)
    stream = await client.chat.completions.create(model="picky", messages=MESSAGES, max_tokens=5, stream=True)
    assert [chunk async for chunk in stream]
    sent = [r["body"] for r in mock.requests(path="/v1/chat/completions")]
    assert ["stream_options" in body for body in sent] == [True, False, True]
