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

from dataclasses import dataclass
from typing import Any

from rollway.mock.model import Choice
from rollway.mock.sglang_shapes import ended, visible

LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: What SGLang keeps of ``max_output_tokens`` for the engine's own tokens.
HEADROOM = 2


@dataclass(frozen=True, slots=True)
class ResponseAnswer:
    id: str
    created: int
    model: str
    choice: Choice
    prompt_tokens: int
    cached: int
    request: dict[str, Any]
    item_id: str
    logprobs: bool
    top_logprobs: int

    @property
    def text(self) -> str:
        return "".join(visible(t) for t in self.choice.tokens)

    @property
    def status(self) -> str:
        return "completed" if ended(self.choice)[0] == "stop" else "incomplete"


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


def _logprobs(answer: ResponseAnswer) -> list[dict[str, Any]] | None:
    if not answer.logprobs:
        return None
    out = []
    for position, token in enumerate(answer.choice.tokens):
        value, alternatives = answer.choice.logprob(position, answer.top_logprobs)
        entry = _entry(token.text, value)
        entry["top_logprobs"] = [_entry(t, lp) for t, lp in alternatives]
        out.append(entry)
    return out


def _part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message(answer: ResponseAnswer, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": answer.item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": "final_answer",
    }


def _float(request: dict[str, Any], key: str) -> float | None:
    value = request.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def response_object(answer: ResponseAnswer, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """``ResponsesResponse``: the request's settings echoed; ``usage`` and ``text`` once there is output."""
    request, final = answer.request, status != "in_progress"
    n_output = len(answer.choice.tokens)
    usage = {
        "input_tokens": answer.prompt_tokens,
        "input_tokens_details": {"cached_tokens": answer.cached, "cache_write_tokens": 0},
        "output_tokens": n_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": answer.prompt_tokens + n_output,
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
        "temperature": _float(request, "temperature"),
        "text": text,
        "top_p": _float(request, "top_p"),
        "truncation": request.get("truncation") or "disabled",
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def response_body(answer: ResponseAnswer) -> dict[str, Any]:
    output = []
    if answer.text:
        output.append(_message(answer, [_part(answer.text, _logprobs(answer))], "completed"))
    return response_object(answer, output, answer.status)


def response_stream_steps(answer: ResponseAnswer) -> list[list[dict[str, Any]]]:
    """The stream's events by decode step."""
    numbers = iter(range(1 << 30))

    def event(type_: str, **fields: Any) -> dict[str, Any]:
        """An item event, its fields in OpenAI's models' (alphabetical) order."""
        return dict(sorted({**fields, "sequence_number": next(numbers), "type": type_}.items()))

    def lifecycle(type_: str, response: dict[str, Any]) -> dict[str, Any]:
        return {"type": type_, "response": response, "sequence_number": next(numbers)}

    pending = response_object(answer, [], "in_progress")
    steps = [[lifecycle("response.created", pending), lifecycle("response.in_progress", pending)]]
    steps += [[] for _ in answer.choice.tokens[1:]]
    where = {"item_id": answer.item_id, "output_index": 0}
    text = ""
    for position, token in enumerate(answer.choice.tokens):
        piece = visible(token)
        if not piece:
            continue
        if not text:
            steps[position].append(
                event("response.output_item.added", item=_message(answer, [], "in_progress"), output_index=0)
            )
            steps[position].append(event("response.content_part.added", content_index=0, part=_part("", None), **where))
        text += piece
        steps[position].append(event("response.output_text.delta", content_index=0, delta=piece, logprobs=[], **where))
    tail, output = steps[-1], []
    if text:
        item = _message(answer, [_part(text, None)], "completed")
        tail.append(event("response.output_text.done", content_index=0, logprobs=[], text=text, **where))
        tail.append(event("response.content_part.done", content_index=0, part=_part(text, None), **where))
        tail.append(event("response.output_item.done", item=item, output_index=0))
        output.append(item)
    status = answer.status
    tail.append(lifecycle(f"response.{status}", response_object(answer, output, status)))
    return steps
