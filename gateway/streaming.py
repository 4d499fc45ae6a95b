"""Server-sent events: split the upstream byte stream into events as they arrive, and accumulate the chunks
of a streamed completion into the response a non-streamed call would have returned (for the span)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

DONE = b"[DONE]"


class SSEDecoder:
    """Feed bytes, get complete events (the raw bytes of each, separator included, and its ``data``).

    Linear in the bytes fed and lazy: ``feed`` yields each event as it is cut, so the first events of a large
    read go on while the rest are still unparsed (a backend writing flat out can leave 60 KiB and 200 events
    in one read). Consume one ``feed``'s events before the next ``feed``."""

    def __init__(self) -> None:
        self._buffer = b""
        self._pos = 0  # the start of the incomplete event in ``_buffer``

    def feed(self, data: bytes) -> Iterator[tuple[bytes, bytes | None]]:
        rest = self._buffer[self._pos :] if self._pos < len(self._buffer) else b""
        self._buffer = rest + data if rest else data
        self._pos = 0
        return self._events(self._buffer)

    def _events(self, buffer: bytes) -> Iterator[tuple[bytes, bytes | None]]:
        size = len(buffer)
        while True:
            start = self._pos
            newline = buffer.find(b"\n", start)
            if newline < 0:
                return
            end = newline + 2
            if (
                end <= size
                and buffer[newline + 1] == 10  # LF LF
                and buffer.startswith(b"data:", start)
                and buffer.find(b"\r", start, newline) < 0
            ):
                # The usual event, one ``data:`` line: its data without splitting it into lines (the first case
                # of ``_event_end``, without its call).
                self._pos = end
                yield buffer[start:end], buffer[start + 5 : newline].lstrip(b" ")
                continue
            cut, length, one_line = _event_end(buffer, start)
            if cut < 0:
                return
            self._pos = cut + length
            if one_line and buffer.startswith(b"data:", start) and buffer.find(b"\r", start, cut) < 0:
                yield buffer[start : self._pos], buffer[start + 5 : cut].lstrip(b" ")
            else:
                yield buffer[start : self._pos], _data_of(buffer[start:cut])

    def pending(self) -> int:
        """How many bytes fed are not in a complete event yet."""
        return len(self._buffer) - self._pos

    def rest(self) -> bytes:
        """What was fed after the last complete event."""
        return self._buffer[self._pos :]


def _event_end(buffer: bytes, start: int) -> tuple[int, int, bool]:
    """Where the first event from ``start`` ends (a blank line: LF LF or CR LF CR LF), the separator's length, and
    whether the event is one line; (-1, 0, False) when it has not ended yet.

    The usual event is one line: the first line feed (a one-byte ``find``, a ``memchr``) tells. Otherwise two
    ``find``s of the blank lines (of two and four bytes: in CPython several times slower per byte than one
    byte, but linear however many lines the event has)."""
    newline = buffer.find(b"\n", start)
    if newline < 0:
        return -1, 0, False
    following = buffer[newline + 1 : newline + 3]
    if following[:1] == b"\n":
        return newline, 2, True
    if following == b"\r\n" and newline > start and buffer[newline - 1] == 13:  # CR LF CR LF
        return newline - 1, 4, True
    lf = buffer.find(b"\n\n", newline)
    # A CR LF blank line before the first LF LF ends no later than two bytes after it (and holds no LF LF).
    crlf = buffer.find(b"\r\n\r\n", start, len(buffer) if lf < 0 else lf + 2)
    if crlf >= 0:
        return crlf, 4, False
    return lf, 2 if lf >= 0 else 0, False


def _data_of(event: bytes) -> bytes | None:
    parts = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


class ChoiceAccumulator:
    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs_content: list[dict[str, Any]] = []
        self.completion_logprobs: dict[str, list[Any]] = {}
        self.saw_logprobs = False
        self.saw_token_ids = False
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.delta_text: dict[str, list[str]] = {}  # other text the deltas carried (reasoning_content, refusal)
        self.delta_other: dict[str, Any] = {}  # other delta fields: objects merged (their text joined), else last
        self.last: dict[str, Any] = {}  # the choice's last chunk and the one that finished it: their other
        self.finished: dict[str, Any] = {}  # fields (vLLM's stop_reason, SGLang's matched_stop) are kept


#: What ``_feed_choice`` reads itself. Any other field of a chat delta is kept (text joined; an object merged,
#: its text fields joined, like a legacy ``function_call``; anything else the last value), and so are the other
#: non-null fields of the chunk that finished a choice and of its last chunk: the span's response is the message
#: the call would have answered without streaming -- reasoning text included.
_CHOICE_KEYS = frozenset({"index", "delta", "logprobs", "finish_reason", "token_ids", "prompt_token_ids", "text"})
_DELTA_KEYS = frozenset({"role", "content", "tool_calls"})
#: The fields of the span's response taken from the first chunk that carries each.
_HEAD_KEYS = ("id", "model", "created", "system_fingerprint")


class StreamAccumulator:
    """Rebuilds a chat or text completion from its chunks: text, tool calls, token ids, logprobs, usage."""

    def __init__(self, operation: str, n: int = 1) -> None:
        self.operation = operation
        self.n = n  # choices per prompt (the request's ``n``): how the usage counted from token ids groups them
        self.head: dict[str, Any] = {}
        self.choices: dict[int, ChoiceAccumulator] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.chunks = 0
        self._missing: tuple[str, ...] = _HEAD_KEYS  # the head's fields no chunk has carried yet

    def feed(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        if self._missing:  # the head's fields not seen yet: looked for until each has come
            head, added = self.head, False
            for key in self._missing:
                if key in chunk:
                    head[key], added = chunk[key], True
            if added:
                self._missing = tuple(key for key in self._missing if key not in head)
        if self.prompt_token_ids is None and chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("sglext"), dict):
            self._feed_sglext(chunk["sglext"])
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            acc = self.choices.get(index)
            if acc is None:
                acc = self.choices[index] = ChoiceAccumulator(index)
            self._feed_choice(acc, choice)

    def _feed_sglext(self, ext: dict[str, Any]) -> None:
        """SGLang's streamed chat ids, in one chunk after the choices' last: the prompt's, and each choice's."""
        if isinstance(ext.get("input_ids"), list) and self.prompt_token_ids is None:
            self.prompt_token_ids = list(ext["input_ids"])
        for index, ids in enumerate(ext.get("output_ids") or ()):
            if not isinstance(ids, list):
                continue
            acc = self.choices.get(index)
            if acc is None:
                acc = self.choices[index] = ChoiceAccumulator(index)
            acc.token_ids, acc.saw_token_ids = list(ids), True

    def _feed_choice(self, acc: ChoiceAccumulator, choice: dict[str, Any]) -> None:
        get = choice.get
        if acc.prompt_token_ids is None and get("prompt_token_ids") is not None:
            acc.prompt_token_ids = list(choice["prompt_token_ids"])
        token_ids = get("token_ids")
        if token_ids is not None:
            acc.saw_token_ids = True
            acc.token_ids.extend(token_ids)
        finish_reason = get("finish_reason")
        if finish_reason is not None:
            acc.finish_reason = finish_reason
            acc.finished = choice  # (SGLang may send one more chunk after it, e.g. hidden states)
        acc.last = choice
        logprobs = get("logprobs")
        if self.operation == "chat":
            delta = get("delta") or {}
            if delta.get("role"):
                acc.role = delta["role"]
            if delta.get("content"):
                acc.text.append(delta["content"])
            if not delta.keys() <= _DELTA_KEYS:  # (the usual delta holds content only: no loop)
                _feed_other(acc, delta)
            for call in delta.get("tool_calls") or ():
                slot = acc.tool_calls.setdefault(
                    call.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                if call.get("type"):
                    slot["type"] = call["type"]
                function = call.get("function") or {}
                if function.get("name"):
                    slot["function"]["name"] += function["name"]
                if function.get("arguments"):
                    slot["function"]["arguments"] += function["arguments"]
            if logprobs and logprobs.get("content"):
                acc.saw_logprobs = True
                acc.logprobs_content.extend(logprobs["content"])
        else:
            if choice.get("text"):
                acc.text.append(choice["text"])
            if logprobs:
                acc.saw_logprobs = True
                for key, values in logprobs.items():
                    if isinstance(values, list):
                        acc.completion_logprobs.setdefault(key, []).extend(values)

    def response(self) -> dict[str, Any]:
        """The accumulated completion, shaped like a non-streamed response."""
        choices = []
        for index in sorted(self.choices):
            acc = self.choices[index]
            out: dict[str, Any] = {"index": index, "finish_reason": acc.finish_reason}
            for source in (acc.finished, acc.last):
                out.update((k, v) for k, v in source.items() if v is not None and k not in _CHOICE_KEYS)
            if self.operation == "chat":
                message: dict[str, Any] = {"role": acc.role or "assistant", "content": "".join(acc.text) or None}
                message.update(acc.delta_other)
                message.update((key, "".join(parts)) for key, parts in acc.delta_text.items())
                if acc.tool_calls:
                    message["tool_calls"] = [acc.tool_calls[i] for i in sorted(acc.tool_calls)]
                out["message"] = message
                out["logprobs"] = {"content": acc.logprobs_content} if acc.saw_logprobs else None
            else:
                out["text"] = "".join(acc.text)
                out["logprobs"] = acc.completion_logprobs if acc.saw_logprobs else None
                out["prompt_token_ids"] = acc.prompt_token_ids
            out["token_ids"] = acc.token_ids if acc.saw_token_ids else None
            choices.append(out)
        body: dict[str, Any] = dict(self.head)
        body["object"] = "chat.completion" if self.operation == "chat" else "text_completion"
        body["choices"] = choices
        body["usage"] = self.usage if self.usage is not None else self._counted_usage()
        body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def _counted_usage(self) -> dict[str, int] | None:
        """The usage the token ids add up to (a stream whose usage chunk was not asked for: vLLM's); None unless
        every choice carried its token ids and the prompt's are known. Counted as vLLM counts: each prompt once,
        however many choices it has."""
        if not self.choices or not all(acc.saw_token_ids for acc in self.choices.values()):
            return None
        if self.operation == "chat":
            if self.prompt_token_ids is None:
                return None
            prompt = len(self.prompt_token_ids)
        else:
            prompts: dict[int, int] = {}
            for index, acc in self.choices.items():
                if acc.prompt_token_ids is not None:
                    prompts.setdefault(index // max(1, self.n), len(acc.prompt_token_ids))
            if len(prompts) * max(1, self.n) < len(self.choices):
                return None
            prompt = sum(prompts.values())
        completion = sum(len(acc.token_ids) for acc in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _feed_other(acc: ChoiceAccumulator, delta: dict[str, Any]) -> None:
    """The fields of a chat delta that ``_feed_choice`` does not read itself."""
    for key, value in delta.items():
        if value is None or key in _DELTA_KEYS:
            continue
        if isinstance(value, str):
            acc.delta_text.setdefault(key, []).append(value)
        elif isinstance(value, dict) and isinstance(slot := acc.delta_other.setdefault(key, {}), dict):
            for field, part in value.items():
                if isinstance(part, str) and isinstance(slot.get(field), str):
                    slot[field] += part
                elif part is not None:
                    slot[field] = part
        else:
            acc.delta_other[key] = value


#: The events that end a Responses API stream (it has no ``[DONE]``), each carrying the whole response.
RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesAccumulator:
    """Follows a Responses API stream: the response its last event carries, or, when the stream broke off
    before that, what its text deltas had said (for the span)."""

    def __init__(self) -> None:
        self.started: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None
        self.ended_by: str | None = None
        self.text: list[str] = []
        self.chunks = 0

    def feed(self, event: dict[str, Any]) -> None:
        self.chunks += 1
        kind = event.get("type")
        if kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self.text.append(event["delta"])
        elif kind == "response.created" and isinstance(event.get("response"), dict):
            self.started = event["response"]
        elif kind in RESPONSE_ENDS and isinstance(event.get("response"), dict):
            self.final, self.ended_by = event["response"], kind

    def response(self) -> dict[str, Any]:
        if self.final is not None:
            return self.final
        text = {"type": "output_text", "text": "".join(self.text), "annotations": []}
        partial = {"type": "message", "role": "assistant", "status": "incomplete", "content": [text]}
        return {**self.started, "object": "response", "status": "incomplete", "output": [partial], "usage": None}


def encode_event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def with_data(event: bytes, data: dict[str, Any]) -> bytes:
    """``event`` (one server-sent event, its separator included) with ``data`` as its data, its other lines (the
    Responses API's ``event:``) kept."""
    if event.startswith(b"data:"):
        return encode_event(data)
    start = event.find(b"\ndata:")
    return encode_event(data) if start < 0 else event[: start + 1] + encode_event(data)


def json_object(data: bytes) -> dict[str, Any] | None:
    """``data`` parsed, when it is a JSON object (what every answer and stream event of the API is)."""
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def json_answer(response: Any) -> bool:
    """An answer with one JSON body (``Content-Type: application/json``), not an event stream."""
    return bool(response.headers.get("Content-Type", "").startswith("application/json"))


def stream_error(chunk: dict[str, Any], responses: bool) -> bool:
    """An error the backend sent as a stream event (``{"error": ...}``; the Responses API: ``type: error``)."""
    if responses:
        return chunk.get("type") == "error"
    return chunk.get("error") is not None and not chunk.get("choices")


def carries_output(chunk: Any) -> bool:
    """A streamed chunk with generated text or a tool call in it (not just a role or usage)."""
    if not isinstance(chunk, dict):
        return False
    if chunk.get("type") in ("response.output_text.delta", "response.function_call_arguments.delta"):
        return True
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
    return False
