"""Logprobs the engine leaves out, scored by the same engine (``gateway.scoring``), against the mock vLLM.

The mock's logprob of a token depends only on the tokens before it and the loaded weights, as a model's does, so
the score of an output sent back as a prompt is the logprob the mock sampled it with. vLLM's Responses API gives
no logprob for a function call's tokens: such a turn is where scoring is needed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI

from rollway.gateway.record import CallRecord
from rollway.mock import MockBackendProcess
from support.gateway_harness import Alias, RunningGateway, claim_one, vllm

CALCULATOR = {
    "type": "function",
    "name": "calculator",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
ASK: dict[str, Any] = {"input": "What is 12 + 30?", "tools": [CALCULATOR], "tool_choice": "required"}


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    return [Alias("policy", [vllm(mock)], version="v1")]


@pytest.fixture
async def direct(mock: MockBackendProcess) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=mock.base_url, api_key="unused", max_retries=0) as client:
        yield client


async def tool_call(gw: RunningGateway, stream: bool) -> dict[str, Any]:
    """A Responses API tool call through Rollway: its span's attributes."""
    rollout_id, attempt_id = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1")
    if stream:
        events = [e async for e in await client.responses.create(model="policy", stream=True, **ASK)]
        output = events[-1].response.output
    else:
        output = (await client.responses.create(model="policy", **ASK)).output
    assert [item.type for item in output] == ["function_call"]
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    return span.attributes


async def engines_scores(direct: AsyncOpenAI, prompt: list[int], output: list[int]) -> list[float]:
    """The engine's logprob of each output token after the prompt and the tokens before it (an echo)."""
    echoed = await direct.completions.create(
        model="mock-model", prompt=[*prompt, *output], max_tokens=1, echo=True, logprobs=0
    )
    assert echoed.choices[0].logprobs is not None
    values = echoed.choices[0].logprobs.token_logprobs or []
    return [float(v) for v in values[len(prompt) : len(prompt) + len(output)]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_tool_call_turn_gets_every_logprob_from_the_engine(
    gw: RunningGateway, direct: AsyncOpenAI, stream: bool
) -> None:
    attrs = await tool_call(gw, stream)
    prompt, output = attrs["rollway.prompt_token_ids"], attrs["rollway.response_token_ids"]
    assert attrs["rollway.trainable"] is True and prompt and output
    assert attrs["rollway.logprobs_complete"] is True and attrs["rollway.logprobs_source"] == "scored"
    assert attrs["rollway.response_logprobs"] == await engines_scores(direct, prompt, output)
    assert gw.state.registry.watch.counts("policy").without_logprobs == 0


async def test_a_scoring_the_engine_refuses_leaves_the_span_incomplete_and_counted(
    gw: RunningGateway, mock: MockBackendProcess
) -> None:
    """The call is answered all the same; its span says its logprobs are incomplete, and so does the count."""
    mock.add_faults({"kind": "status", "status": 500, "match": {"path": "/v1/completions"}})
    attrs = await tool_call(gw, stream=False)
    assert attrs["rollway.trainable"] is True
    assert attrs["rollway.logprobs_complete"] is False and attrs["rollway.logprobs_source"] is None
    assert attrs["rollway.response_logprobs"] is None
    assert gw.state.registry.watch.counts("policy").without_logprobs == 1
    assert mock.stats()["by_route_status"]["/v1/completions"] == {"500": 1}  # the scoring it refused


async def test_a_chat_answer_with_its_logprobs_is_not_scored(gw: RunningGateway, mock: MockBackendProcess) -> None:
    """Scoring runs only when a logprob is missing: a chat answer (which has them all) costs no second request."""
    rollout_id, attempt_id = await claim_one(gw.store)
    client = gw.client(f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1")
    before = mock.stats()["requests_total"]
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert mock.stats()["requests_total"] == before + 1
    [span] = await gw.store.query_spans(rollout_id, attempt_id)
    assert span.attributes["rollway.logprobs_source"] == "sampled"


def test_a_call_of_several_choices_is_complete_only_if_every_choice_is() -> None:
    """``n > 1``: scoring fills the first choice only, so a later choice without a logprob for every token keeps
    the span incomplete, and says so of itself."""

    def choice(index: int, logprobs: list[float] | None) -> dict[str, Any]:
        content = None if logprobs is None else [{"token": "a", "logprob": v} for v in logprobs]
        return {"index": index, "token_ids": [5, 6], "logprobs": {"content": content}, "finish_reason": "stop"}

    def span_of(second: list[float] | None, scored: list[float] | None = None) -> dict[str, Any]:
        response = {"prompt_token_ids": [1, 2], "choices": [choice(0, None), choice(1, second)]}
        record = CallRecord("chat", "policy", {}, False, 0.0, status_code=200, response=response, end_time=1.0)
        record.scored_logprobs = scored
        return record.span().attributes

    whole = span_of([-0.5, -0.25], scored=[-0.1, -0.2])
    assert whole["rollway.logprobs_complete"] is True and whole["rollway.logprobs_source"] == "scored"
    assert [c["logprobs"] for c in whole["rollway.choices"]] == [[-0.1, -0.2], [-0.5, -0.25]]
    partial = span_of(None, scored=[-0.1, -0.2])
    assert partial["rollway.logprobs_complete"] is False
    assert [c["logprobs_complete"] for c in partial["rollway.choices"]] == [True, False]
