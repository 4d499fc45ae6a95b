"""The Responses API's answer (``POST /v1/responses``) and its event stream, as vLLM 0.32 serialises them.

The response object echoes the request's settings (``tool_choice`` is ``none`` when no tools are given; a
truncated answer is ``status: incomplete`` with ``incomplete_details``, its message still ``completed``). With
``include: ["message.output_text.logprobs"]`` the text carries per-token logprobs (``top_logprobs`` echoes how many
alternatives; null when not asked); with ``enable_response_messages: true``, ``input_messages`` and
``output_messages`` hold the raw prompt and output (text and token ids).

The stream names each event (``event: <type>`` before its ``data:``), numbers them from 0 and has no ``[DONE]``:
``response.created``, ``response.in_progress``, the output item opened, one delta per token that adds text or
arguments (a text delta carries its token's logprobs, ``[]`` when not asked), the item closed, and
``response.completed`` carrying the final response -- also when it is ``incomplete``.
"""

from __future__ import annotations

from typing import Any

from rollway.mock.answer import NO_BYTES_KEYS, OPENAI_KEYS, logprob_entry
from rollway.mock.response_items import (
    EventStream,
    ResponseAnswer,
    message_item,
    output_logprobs,
    output_text,
    request_number,
)


def _incomplete(answer: ResponseAnswer) -> bool:
    """The output ran into ``max_output_tokens``."""
    return answer.choice.finish_reason == "length"


def _message(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return message_item(item_id, content, status, phase=None)


def _function_call(answer: ResponseAnswer, arguments: str, status: str) -> dict[str, Any]:
    call = answer.choice.tool_call
    assert call is not None
    return {
        "arguments": arguments,
        "call_id": call.id,
        "name": call.name,
        "type": "function_call",
        "id": answer.call_item_id,
        "async": None,
        "caller": None,
        "namespace": None,
        "status": status,
    }


def _tool(tool: Any) -> Any:
    """A function tool as vLLM echoes it (every field of its model, unset ones null)."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return tool
    return {
        "name": tool.get("name"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
        "type": "function",
        "allowed_callers": tool.get("allowed_callers"),
        "async": tool.get("async"),
        "defer_loading": tool.get("defer_loading"),
        "description": tool.get("description"),
        "output_schema": tool.get("output_schema"),
    }


def _raw(message: str, tokens: list[int]) -> list[dict[str, Any]]:
    return [{"message": message, "tokens": tokens, "type": "raw_message_tokens"}]


def response_object(
    answer: ResponseAnswer, output: list[dict[str, Any]], *, final: bool, status: str | None = None
) -> dict[str, Any]:
    """The response object: ``final`` (usage, status, messages) or as the stream's first events show it."""
    request, choice = answer.request, answer.choice
    tools = request.get("tools") or []
    tool_choice = request.get("tool_choice", "auto")
    if not tools and tool_choice in ("auto", "none"):
        tool_choice = "none"
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"name": tool_choice.get("name"), "type": "function"}
    n_prompt, n_output = len(answer.prompt_ids), len(choice.tokens)
    usage = {
        "input_tokens": n_prompt,
        "input_tokens_details": {
            "cached_tokens": answer.cached,
            "cache_write_tokens": answer.created_cache,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": n_output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": n_prompt + n_output,
    }
    input_messages = output_messages = None
    if final and answer.messages:
        input_messages = _raw(answer.prompt_text, answer.prompt_ids)
        output_messages = _raw(choice.raw_text, choice.token_ids)
    incomplete = final and _incomplete(answer)
    return {
        "id": answer.id,
        "created_at": answer.created,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata"),
        "model": answer.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "temperature": request_number(request, "temperature", 1.0),
        "tool_choice": tool_choice,
        "tools": [_tool(t) for t in tools],
        "top_p": request_number(request, "top_p", 1.0),
        "background": request.get("background") is True,
        "max_output_tokens": answer.max_output_tokens,
        "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"),
        "prompt": None,
        "reasoning": request.get("reasoning"),
        "service_tier": request.get("service_tier") or "auto",
        "status": status or ("incomplete" if incomplete else "completed"),
        "text": request.get("text"),
        "top_logprobs": answer.top_logprobs if answer.logprobs else None,
        "truncation": request.get("truncation") or "disabled",
        "usage": usage if final else None,
        "user": request.get("user"),
        "presence_penalty": request_number(request, "presence_penalty", 0.0),
        "frequency_penalty": request_number(request, "frequency_penalty", 0.0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": input_messages,
        "output_messages": output_messages,
    }


def response_body(answer: ResponseAnswer) -> dict[str, Any]:
    """The non-streamed answer: its logprobs cover every output token; a tool call cut by ``max_output_tokens``
    parses as none, and the raw output is the message's text."""
    choice = answer.choice
    output: list[dict[str, Any]] = []
    call = choice.parsed_call
    text = choice.raw_text if choice.unparsed else choice.content
    if text:
        output.append(_message(answer.message_id, [output_text(text, output_logprobs(answer))], "completed"))
    if call is not None:
        output.append(_function_call(answer, call.arguments, "completed"))
    return response_object(answer, output, final=True)


def response_stream_steps(answer: ResponseAnswer) -> list[list[dict[str, Any]]]:
    """The stream's events by decode step. The final response reuses the items as streamed: their logprobs are
    those of the tokens that sent a delta."""
    choice = answer.choice
    item_id = answer.call_item_id if choice.tool_call is not None else answer.message_id
    events = EventStream(item_id)
    event, where = events.event, events.where
    pending = response_object(answer, [], final=False, status="in_progress")
    steps: list[list[dict[str, Any]]] = [
        [event("response.created", response=pending), event("response.in_progress", response=pending)]
    ]
    output: list[dict[str, Any]] = []
    text, logprobs, opened = "", [], False
    for position, token in enumerate(choice.tokens):
        if position >= len(steps):
            steps.append([])
        step = steps[position]
        if choice.tool_call is not None:
            if token.opens_tool_call:
                item = _function_call(answer, "", "in_progress")
                step.append(event("response.output_item.added", item=item, output_index=0))
            elif token.arguments:
                text += token.arguments
                step.append(event("response.function_call_arguments.delta", delta=token.arguments, **where))
            continue
        if not token.content:
            continue
        if not opened:
            opened = True
            step.extend(events.message_added(_message(item_id, [], "in_progress"), output_text("", [])))
        entries = []
        if answer.logprobs:
            entries = [logprob_entry(choice, position, answer.top_logprobs, NO_BYTES_KEYS)]
            logprobs.append(logprob_entry(choice, position, answer.top_logprobs, OPENAI_KEYS))
        text += token.content
        step.append(events.text_delta(token.content, entries))
    tail = steps[-1]
    if choice.tool_call is not None:
        item = _function_call(answer, text, "completed")
        done = event("response.function_call_arguments.done", arguments=text, **where)
        tail.append({**done, "name": choice.tool_call.name})  # vLLM's addition comes after OpenAI's fields
        tail.append(event("response.output_item.done", item=item, output_index=0))
        output.append(item)
    elif opened:
        item = _message(item_id, [output_text(text, logprobs or None)], "completed")
        tail.extend(events.message_done(text, item))
        output.append(item)
    tail.append(event("response.completed", response=response_object(answer, output, final=True)))
    return steps
