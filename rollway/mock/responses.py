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

from dataclasses import dataclass
from typing import Any

from rollway.mock.model import Choice
from rollway.mock.shapes import Options

LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True, slots=True)
class ResponseAnswer:
    """A generated answer to the Responses API, with what the request asked for."""

    id: str
    created: int
    model: str
    choice: Choice
    prompt_ids: list[int]
    prompt_text: str
    cached: int
    created_cache: int
    request: dict[str, Any]
    max_output_tokens: int
    #: The output item's id, after its prefix (``msg_`` or ``fc_``).
    item_key: str
    opts: Options
    messages: bool = False

    @property
    def message_id(self) -> str:
        return f"msg_{self.item_key}"

    @property
    def call_item_id(self) -> str:
        return f"fc_{self.item_key}"

    @property
    def incomplete(self) -> bool:
        return self.choice.finish_reason == "length"


def _logprob(answer: ResponseAnswer, position: int, *, with_bytes: bool) -> dict[str, Any]:
    value, alternatives = answer.choice.logprob(position, answer.opts.top_logprobs)
    text = answer.choice.tokens[position].text

    def entry(token: str, logprob: float) -> dict[str, Any]:
        if with_bytes:
            return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": logprob}
        return {"token": token, "logprob": logprob}

    return {**entry(text, value), "top_logprobs": [entry(t, lp) for t, lp in alternatives]}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message", "phase": None}


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


def _number(request: dict[str, Any], key: str, default: float) -> float:
    value = request.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


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
    incomplete = final and answer.incomplete
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
        "temperature": _number(request, "temperature", 1.0),
        "tool_choice": tool_choice,
        "tools": [_tool(t) for t in tools],
        "top_p": _number(request, "top_p", 1.0),
        "background": request.get("background") is True,
        "max_output_tokens": answer.max_output_tokens,
        "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"),
        "prompt": None,
        "reasoning": request.get("reasoning"),
        "service_tier": request.get("service_tier") or "auto",
        "status": status or ("incomplete" if incomplete else "completed"),
        "text": request.get("text"),
        "top_logprobs": answer.opts.top_logprobs if answer.opts.logprobs else None,
        "truncation": request.get("truncation") or "disabled",
        "usage": usage if final else None,
        "user": request.get("user"),
        "presence_penalty": _number(request, "presence_penalty", 0.0),
        "frequency_penalty": _number(request, "frequency_penalty", 0.0),
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
        logprobs = None
        if answer.opts.logprobs:
            logprobs = [_logprob(answer, p, with_bytes=True) for p in range(len(choice.tokens))]
        output.append(_message(answer.message_id, [_text_part(text, logprobs)], "completed"))
    if call is not None:
        output.append(_function_call(answer, call.arguments, "completed"))
    return response_object(answer, output, final=True)


def response_stream_steps(answer: ResponseAnswer) -> list[list[dict[str, Any]]]:
    """The stream's events by decode step. The final response reuses the items as streamed: their logprobs are
    those of the tokens that sent a delta."""
    numbers = iter(range(1 << 30))

    def event(type_: str, **fields: Any) -> dict[str, Any]:
        """An event, its fields in OpenAI's models' (alphabetical) order."""
        return dict(sorted({**fields, "sequence_number": next(numbers), "type": type_}.items()))

    choice = answer.choice
    item_id = answer.call_item_id if choice.tool_call is not None else answer.message_id
    pending = response_object(answer, [], final=False, status="in_progress")
    steps: list[list[dict[str, Any]]] = [
        [event("response.created", response=pending), event("response.in_progress", response=pending)]
    ]
    where = {"item_id": item_id, "output_index": 0}
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
            step.append(event("response.output_item.added", item=_message(item_id, [], "in_progress"), output_index=0))
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            step.append(event("response.content_part.added", content_index=0, part=part, **where))
        entries = []
        if answer.opts.logprobs:
            entries = [_logprob(answer, position, with_bytes=False)]
            logprobs.append(_logprob(answer, position, with_bytes=True))
        text += token.content
        step.append(
            event("response.output_text.delta", content_index=0, delta=token.content, logprobs=entries, **where)
        )
    tail = steps[-1]
    if choice.tool_call is not None:
        item = _function_call(answer, text, "completed")
        done = event("response.function_call_arguments.done", arguments=text, **where)
        tail.append({**done, "name": choice.tool_call.name})  # vLLM's addition comes after OpenAI's fields
        tail.append(event("response.output_item.done", item=item, output_index=0))
        output.append(item)
    elif opened:
        part = _text_part(text, logprobs or None)
        item = _message(item_id, [part], "completed")
        tail.append(event("response.output_text.done", content_index=0, logprobs=[], text=text, **where))
        tail.append(event("response.content_part.done", content_index=0, part=part, **where))
        tail.append(event("response.output_item.done", item=item, output_index=0))
        output.append(item)
    tail.append(event("response.completed", response=response_object(answer, output, final=True)))
    return steps
