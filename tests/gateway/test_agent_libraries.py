"""Agent libraries, unchanged, pointed at a claim's URL against the mock vLLM: LangChain 1's agent (a LangGraph
graph) on its ``ChatOpenAI`` (chat completions), and pydantic-ai on its ``openai:`` model (the Responses API, whole
and streamed) and its chat model. Each runs a tool-using two-turn task (a call of the tool, then the answer): both
turns are spans of the attempt, trainable, with a logprob for every output token (scored by the engine where the
Responses API leaves them out: ``gateway.scoring``). docs/agents.md says how each is pointed at a claim."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from rollway.mock import MockBackendProcess
from rollway.store import Span
from support.gateway_harness import Alias, RunningGateway, claim_one, vllm

QUESTION = "What is 12 + 30?"


@pytest.fixture
def gateway_aliases(mock: MockBackendProcess) -> list[Alias]:
    return [Alias("policy", [vllm(mock)], version="v1")]


async def claimed(gw: RunningGateway) -> tuple[str, str, str]:
    """A claimed attempt: its route (the claim's ``base_url``), rollout id and attempt id."""
    rollout_id, attempt_id = await claim_one(gw.store)
    return f"{gw.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1", rollout_id, attempt_id


def add(expression: str) -> str:
    """Add the numbers of an expression such as '12 + 30'."""
    return str(sum(int(term) for term in expression.replace(" ", "").split("+")))


def assert_two_trainable_turns(spans: list[Span], operation: str, sources: list[str]) -> None:
    """A tool call and the answer after its result, each a full training sample."""
    assert [s.attributes["gen_ai.operation.name"] for s in spans] == [operation, operation]
    assert [s.sequence_id for s in spans] == [1, 2]
    for span in spans:
        attrs = span.attributes
        assert span.status.status_code == "OK" and attrs["rollway.trainable"] is True
        assert attrs["rollway.logprobs_complete"] is True
        assert len(attrs["rollway.response_logprobs"]) == len(attrs["rollway.response_token_ids"])
    assert [s.attributes["rollway.logprobs_source"] for s in spans] == sources


async def test_a_langchain_agent_on_chat_openai_records_both_turns(gw: RunningGateway) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    url, rollout_id, attempt_id = await claimed(gw)
    calls: list[str] = []

    @tool
    def calculator(expression: str) -> str:
        """Add the numbers of an expression such as '12 + 30'."""
        calls.append(expression)
        return add(expression)

    async with httpx.AsyncClient() as http:  # the test's, to close (the library would leave its own open)
        llm = ChatOpenAI(model="policy", base_url=url, api_key="unused", max_retries=0, http_async_client=http)
        agent = create_agent(llm, [calculator])
        result: dict[str, Any] = await agent.ainvoke({"messages": [HumanMessage(QUESTION)]})
    assert len(calls) == 1 and result["messages"][-1].content
    spans = await gw.store.query_spans(rollout_id, attempt_id)
    assert_two_trainable_turns(spans, "chat", ["sampled", "sampled"])
    assert spans[0].attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]


@pytest.mark.parametrize(("api", "stream"), [("responses", False), ("responses", True), ("chat", False)])
async def test_a_pydantic_ai_agent_records_both_turns(gw: RunningGateway, api: str, stream: bool) -> None:
    """pydantic-ai's ``openai:`` models speak the Responses API, where the engine gives no logprob for a
    function call's tokens (nor, streamed, for the end token): those turns are scored."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    url, rollout_id, attempt_id = await claimed(gw)
    calls: list[str] = []

    def calculator(expression: str) -> str:
        """Add the numbers of an expression such as '12 + 30'."""
        calls.append(expression)
        return add(expression)

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)  # the test's, to close
    provider = OpenAIProvider(openai_client=client)
    model = (
        OpenAIResponsesModel("policy", provider=provider)
        if api == "responses"
        else OpenAIChatModel("policy", provider=provider)
    )
    agent = Agent(model, tools=[calculator])
    async with client:
        if stream:
            async with agent.run_stream(QUESTION) as run:
                output = await run.get_output()
        else:
            output = (await agent.run(QUESTION)).output
    assert len(calls) == 1 and output
    spans = await gw.store.query_spans(rollout_id, attempt_id)
    if api == "chat":
        assert_two_trainable_turns(spans, "chat", ["sampled", "sampled"])
    else:  # the tool call's tokens have none; streamed, the end token's neither
        assert_two_trainable_turns(spans, "responses", ["scored", "scored" if stream else "sampled"])
