"""The Responses API's answer and event stream as SGLang 0.5.23 serialises them (``serving_responses.py``).

No token ids: ``ResponsesRequest`` has no field that asks for them. SGLang keeps two tokens of ``max_output_tokens``
as headroom (``max_new_tokens = max_output_tokens - 2``), so an answer asked for 4 tokens has at most 2 and is
``incomplete``. The output is one message (``phase: final_answer``) holding the text, the tool-call markup
included (the mock does not parse tools here); with ``include: ["message.output_text.logprobs"]`` its logprobs
cover every generated token (``bytes``: the UTF-8 of the shown token). A stream names each event, numbers them
from 0, sends a text delta per token that adds text (``logprobs: []``) and ends with ``response.completed`` or
``response.incomplete``; it refuses the logprobs ``include`` (400).
"""

from __future__ import annotations

from typing import Any

from rollway.mock.response_items import (
    EventStream,
    ResponseAnswer,
    message_item,
    output_logprobs,
    output_text,
    request_number,
)
from rollway.mock.sglang_shapes import ended, visible

#: What SGLang keeps of ``max_output_tokens`` for the engine's own tokens.
HEADROOM = 2


def _text(answer: ResponseAnswer) -> str:
    """The output's text (the end-of-sequence token adds none)."""
    return "".join(visible(t) for t in answer.choice.tokens)


def _status(answer: ResponseAnswer) -> str:
    """``completed`` on the end-of-sequence token, else ``incomplete`` (``max_output_tokens`` cut it)."""
    return "completed" if ended(answer.choice)[0] == "stop" else "incomplete"


def _message(answer: ResponseAnswer, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return message_item(answer.message_id, content, status, phase="final_answer")


def response_object(answer: ResponseAnswer, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """``ResponsesResponse``: the request's settings echoed; ``usage`` and ``text`` once there is output."""
    request, final = answer.request, status != "in_progress"
    n_prompt, n_output = len(answer.prompt_ids), len(answer.choice.tokens)
    usage = {
        "input_tokens": n_prompt,
        "input_tokens_details": {"cached_tokens": answer.cached, "cache_write_tokens": 0},
        "output_tokens": n_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_prompt + n_output,
    }
    text = request.get("text")
    if text is None and output:
        text = {"format": {"type": "text"}}
    parallel = request.get("parallel_tool_calls")
    return {
        "id": answer.id,
        "object": "response",
        "created_at": answer.created,
        "model": answer.model,
        "output": output,
        "status": status,
        "usage": usage if final else None,
        "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": request.get("store", True),
        "temperature": request_number(request, "temperature", None),
        "text": text,
        "top_p": request_number(request, "top_p", None),
        "truncation": request.get("truncation") or "disabled",
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def response_body(answer: ResponseAnswer) -> dict[str, Any]:
    output = []
    text = _text(answer)
    if text:
        output.append(_message(answer, [output_text(text, output_logprobs(answer))], "completed"))
    return response_object(answer, output, _status(answer))


def response_stream_steps(answer: ResponseAnswer) -> list[list[dict[str, Any]]]:
    """The stream's events by decode step; the response's own events keep their fields in SGLang's order."""
    events = EventStream(answer.message_id)

    def lifecycle(type_: str, response: dict[str, Any]) -> dict[str, Any]:
        return {"type": type_, "response": response, "sequence_number": events.number()}

    pending = response_object(answer, [], "in_progress")
    steps = [[lifecycle("response.created", pending), lifecycle("response.in_progress", pending)]]
    steps += [[] for _ in answer.choice.tokens[1:]]
    text = ""
    for position, token in enumerate(answer.choice.tokens):
        piece = visible(token)
        if not piece:
            continue
        if not text:
            steps[position].extend(events.message_added(_message(answer, [], "in_progress"), output_text("", None)))
        text += piece
        steps[position].append(events.text_delta(piece, []))
    tail, output = steps[-1], []
    if text:
        item = _message(answer, [output_text(text, None)], "completed")
        tail.extend(events.message_done(text, item))
        output.append(item)
    status = _status(answer)
    tail.append(lifecycle(f"response.{status}", response_object(answer, output, status)))
    return steps
