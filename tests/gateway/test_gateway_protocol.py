"""End to end, the less common corners of the OpenAI protocol: the official openai SDK → a real gateway (uvicorn,
SQLite) → the vLLM-like mock backend process, compared with the same request sent to the mock directly. The
client must see what a direct call answers; the span holds what the backend said."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
)
from openai.types.chat.chat_completion import Choice

from rollway.mock import MockBackendProcess
from support.gateway_harness import Alias, RunningGateway, claim_one, running_gateway, serving_policy, vllm

VOLATILE = {"id", "created", "system_fingerprint", "model"}
PROMPT = "Once upon a time"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 12 + 30?"}]
CALCULATOR: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def comparable(obj: Any) -> Any:
    return {k: v for k, v in obj.model_dump().items() if k not in VOLATILE}


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    return [Alias("policy", [vllm(mock)], version="v1")]


@pytest.fixture
async def direct(mock: MockBackendProcess) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=mock.base_url, api_key="unused", max_retries=0) as client:
        yield client


async def attempt_client(gw: RunningGateway) -> tuple[AsyncOpenAI, str, str]:
    rollout_id, attempt_id = await claim_one(gw.store)
    return gw.client(f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"), rollout_id, attempt_id


async def completion(client: AsyncOpenAI, model: str, stream: bool, **ask: Any) -> list[Any]:
    """The answer (one item) or the stream's chunks, each as comparable data."""
    if not stream:
        return [comparable(await client.completions.create(model=model, **ask))]
    return [comparable(c) async for c in await client.completions.create(model=model, stream=True, **ask)]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_echo_answers_the_prompts_text_as_a_direct_call_does(
    gw: RunningGateway, direct: AsyncOpenAI, mock: MockBackendProcess, stream: bool
) -> None:
    """``echo``: vLLM leaves the prompt's text out of an echo that asks for token ids (and computes the prompt's
    logprobs for one that asks for logprobs): the gateway asks for neither, so the text starts with the prompt."""
    client, rollout_id, attempt_id = await attempt_client(gw)
    ask: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4, "echo": True}
    via = await completion(client, "policy", stream, **ask)
    assert via == await completion(direct, "mock-model", stream, **ask)
    text = "".join(c["choices"][0]["text"] for c in via if c["choices"])
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert all(c["choices"][0]["prompt_logprobs"] is None for c in via if c["choices"] and not stream)
    sent = mock.requests(path="/v1/completions")[-2]["body"]  # the gateway's (the direct call came after it)
    assert sent["model"] == "mock-model" and "return_token_ids" not in sent and "logprobs" not in sent

    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.status.status_code == "OK"
    assert span.attributes["rollway.response"]["choices"][0]["text"] == text
    assert span.attributes["rollway.trainable"] is False  # no token ids: the echo is not a training sample


@pytest.mark.parametrize("stream", [False, True])
async def test_an_echo_that_asks_for_token_ids_and_logprobs_records_the_generated_ones(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    """The client's own ``return_token_ids`` and ``logprobs: 2`` with ``echo``: passed on, answered as a direct
    call; the span's logprobs are the generated tokens' (the echo's start with the prompt's)."""
    client, rollout_id, attempt_id = await attempt_client(gw)
    ask: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 2}
    ask["extra_body"] = {"return_token_ids": True}
    via = await completion(client, "policy", stream, **ask)
    assert via == await completion(direct, "mock-model", stream, **ask)
    truth = (await direct.completions.create(model="mock-model", **ask)).choices[0]
    assert truth.logprobs is not None and truth.logprobs.token_logprobs is not None
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    attrs = span.attributes
    assert attrs["rollway.prompt_token_ids"] == truth.model_extra["prompt_token_ids"]
    assert attrs["rollway.response_token_ids"] == truth.model_extra["token_ids"]
    assert attrs["rollway.response_logprobs"] == truth.logprobs.token_logprobs[-len(truth.model_extra["token_ids"]) :]
    assert len(truth.logprobs.token_logprobs) > len(truth.model_extra["token_ids"])  # the prompt's came first
    assert attrs["rollway.trainable"] is True


async def test_a_completion_to_an_openai_kind_backend_keeps_its_echo(tmp_path: Path, mock: MockBackendProcess) -> None:
    """No token ids are asked of an ``openai``-kind backend: its echo was never at stake (and stays so)."""
    async with serving_policy(tmp_path, vllm(mock, kind="openai")) as gw:
        client, _, _ = await attempt_client(gw)
        answer = await client.completions.create(model="policy", prompt=PROMPT, max_tokens=3, echo=True)
        assert answer.choices[0].text.startswith(PROMPT)


@pytest.mark.parametrize("logprobs", [False, True])
async def test_streamed_tool_calls_of_n_choices_are_the_chunks_of_a_direct_call(
    tmp_path: Path, mock: MockBackendProcess, direct: AsyncOpenAI, logprobs: bool
) -> None:
    """vLLM sends a token its tool parser holds back (the call's markup, its name before it is whole) as a chunk
    with ``delta: {}`` only when the request asked for token ids or logprobs: the gateway asks for both, and a
    client that asked for logprobs sees every such chunk (each carries one of its logprobs), one that asked for
    neither sees none, as from a direct call. Three choices' tool calls interleave; each is recorded whole, with
    all its token ids."""
    async with running_gateway(tmp_path) as gw:
        await gw.store.put_model("policy", [vllm(mock)], version="v1")
        client, rollout_id, attempt_id = await attempt_client(gw)
        ask: dict[str, Any] = {"messages": MESSAGES, "tools": [CALCULATOR], "n": 3, "stream": True}
        if logprobs:
            ask |= {"logprobs": True, "top_logprobs": 2}
        via = [comparable(c) async for c in await client.chat.completions.create(model="policy", **ask)]
        expected = [comparable(c) async for c in await direct.chat.completions.create(model="mock-model", **ask)]
        assert via == expected
        held = [c["choices"][0] for c in via if c["choices"] and _says_nothing(c["choices"][0]["delta"])]
        held = [c for c in held if c["finish_reason"] is None]  # (not a choice's last chunk, its EOS)
        assert bool(held) is logprobs
        assert any(c["choices"][0]["logprobs"] for c in via if c["choices"]) is logprobs

        truth = await direct.chat.completions.create(
            model="mock-model", messages=MESSAGES, tools=[CALCULATOR], n=3, extra_body={"return_token_ids": True}
        )
        [span] = await gw.store.query_spans(rollout_id, attempt_id)
    choices = span.attributes["rollway.choices"]
    assert [c["token_ids"] for c in choices] == [_extra(c)["token_ids"] for c in truth.choices]
    recorded = span.attributes["rollway.response"]["choices"]
    calls = [c["message"]["tool_calls"][0] for c in recorded]
    truth_calls = [_first_function_call(c.message) for c in truth.choices]
    assert [(c["id"], c["function"]) for c in calls] == [(t.id, t.function.model_dump()) for t in truth_calls]
    assert span.attributes["gen_ai.response.finish_reasons"] == ["tool_calls"] * 3


def _extra(choice: Choice) -> dict[str, Any]:
    """The fields of a choice the SDK has no attribute for (vLLM's ``token_ids``), kept in ``model_extra``."""
    assert choice.model_extra is not None
    return choice.model_extra


def _first_function_call(message: ChatCompletionMessage) -> ChatCompletionMessageFunctionToolCall:
    """A message's first tool call, a function call (the only kind of tool the test offers)."""
    assert message.tool_calls
    call = message.tool_calls[0]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    return call


def _says_nothing(delta: dict[str, Any]) -> bool:
    """A ``delta: {}`` as the SDK parses it: every field it knows, null."""
    return all(value is None for value in delta.values())
