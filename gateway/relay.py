"""The relay of a streamed answer: from the backend's server-sent events to the client's, chunk by chunk as they
arrive (no buffering, no conversion), while the call's record accumulates token ids, logprobs, tool calls and
usage (``gateway.streaming``) for its span."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from rollway.envelope import envelope
from rollway.gateway import capture, outcome
from rollway.gateway.call import Reply
from rollway.gateway.capture import Injected
from rollway.gateway.errors import ResponseTooLarge
from rollway.gateway.record import CallRecord
from rollway.gateway.streaming import (
    DONE,
    RESPONSE_ENDS,
    ResponsesAccumulator,
    SSEDecoder,
    StreamAccumulator,
    carries_output,
    encode_event,
    json_object,
    stream_error,
    with_data,
)
from rollway.gateway.upstream import MASK, backend_key, masked

#: The headers of every streamed answer besides its content type.
STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


async def stream(
    finish: Callable[[CallRecord], Awaitable[bool]],
    limit: int,
    record: CallRecord,
    response: aiohttp.ClientResponse,
    injected: Injected,
    reply: Reply,
    headers: list[tuple[bytes, bytes]],
) -> None:
    """Pass ``response``'s events on to the client as they come (stripped of what the gateway asked for and the
    client did not: ``capture.shown``), accumulate them into the call's record, and write its span (``finish``)
    before the stream's end goes out: ``[DONE]`` (or the Responses API's last event) only once the span is on
    disk; a stream that breaks off ends with an error event, with the tokens received so far recorded. One event
    longer than ``limit`` bytes is not held for ever."""
    record.status_code = 200
    content_type = response.headers.get("Content-Type", "")  # the backend's, with its charset
    content_type = content_type if content_type.startswith("text/event-stream") else "text/event-stream"
    # A reverse proxy in front (nginx) passes the events on as they come rather than buffering the answer.
    await reply.start(200, [(b"content-type", content_type.encode()), *STREAM_HEADERS, *headers])
    decoder = SSEDecoder()
    responses = record.operation == "responses"
    n = record.request.get("n") if isinstance(record.request, dict) else None
    acc = record.accumulator = (
        ResponsesAccumulator() if responses else StreamAccumulator(record.operation, n if isinstance(n, int) else 1)
    )
    done_event: bytes | None = None
    first_output_sent = False
    guard = KeyGuard(backend_key(record.backend))  # the backend's key, should it echo it: masked
    reads = aiter(response.content.iter_any())
    rewritten = injected.any  # (read once: the same for every event)
    accumulate = acc.feed
    try:
        while True:
            data = await anext(reads, None)
            out: list[bytes] = []
            for raw, payload, chunk in guard.flush() if data is None else guard.feed(decoder.feed(data)):
                if chunk is None:
                    if payload == DONE:
                        done_event = raw
                    else:  # no data, or not an event of the API: passed on as it came, nothing to record of it
                        out.append(raw)
                    continue
                if stream_error(chunk, responses):
                    outcome.stream_error(record, chunk.get("error") or chunk)
                    out.append(raw)
                    continue
                if record.ttft_seconds is None:
                    record.ttft_seconds = time.time() - record.start_time
                accumulate(chunk)
                if responses:
                    if rewritten:
                        raw = with_data(raw, capture.shown_event(chunk, injected))
                    if chunk.get("type") in RESPONSE_ENDS:
                        done_event = raw  # the Responses API's [DONE]: the whole response, sent once recorded
                        continue
                    out.append(raw)
                elif not rewritten:
                    out.append(raw)
                elif (shown := capture.shown(chunk, injected)) is not None:
                    out.append(encode_event(shown))
                if not first_output_sent and out and carries_output(chunk):
                    # Until the first token is out, every event goes out as soon as it is read: a read may
                    # hold many events, and time to first token should not wait for the rest of them.
                    first_output_sent = True
                    await reply.body(b"".join(out), more=True)
                    out = []
            if out:
                await reply.body(b"".join(out), more=True)
            if data is None:
                break
            if decoder.pending() > limit:  # one event without end: not held for ever
                raise ResponseTooLarge(limit)
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
        TimeoutError,
        ResponseTooLarge,
    ) as exc:
        for _, _, chunk in guard.flush():  # held back (less than the key): recorded, the client gets the error
            if chunk is not None and not stream_error(chunk, responses):
                acc.feed(chunk)
        if isinstance(exc, ResponseTooLarge):
            outcome.stream_broke(record, acc, str(exc), "response_too_large")
        else:
            outcome.stream_broke(record, acc, f"the backend stream broke: {type(exc).__name__}", "stream_interrupted")
        event = envelope(record.error or "", "upstream_error", code=record.error_type)
        await finish(record)
        await reply.body(encode_event(event), more=False)
        return
    outcome.stream_ended(record, acc, done_event is not None)
    if not await finish(record) and record.error is None:
        # The tokens went by, but the completion is not on disk: the client must not take it as one.
        await reply.body(b"data: " + outcome.not_recorded().body + b"\n\n", more=False)
        return
    await reply.body(done_event or b"", more=False)


Event = tuple[bytes, bytes | None, dict[str, Any] | None]
#: A text a client joins from a stream's events: (the choice or output item, the field) -- ``("choice", 0),
#: "content"``, ``("choice", 0), ("tool_calls", 1, "arguments")``, ``("output", 0), (type, content_index, ...)``.
Channel = tuple[Hashable, Hashable]


class KeyGuard:
    """Masks the backend's key in a stream's events, and across them.

    An event holding the key whole, as it is or JSON-escaped, is masked where it is (``upstream.masked``). A key
    split across events only appears in the text a client joins from them (a choice's ``content``, a tool call's
    ``arguments``, a Responses API text delta), decoded: so each such text is followed, and while its end could
    be the beginning of the key (the longest end of it that begins the key, however short), the events from the
    one holding that end on are held back. The text going on with the rest of the key: the key's parts are
    masked in the held events (the first part becomes ``***``, the others nothing) and they go out; going on
    otherwise, they go out as they came. A text no longer followed once its choice finishes, its output item
    moves on (a client joins each field, each tool call's arguments, on its own: another field's text does not end
    it); the stream's end (``[DONE]``, the Responses API's last event, the end of the body) lets everything out.

    So a stream without the key's beginning at the end of a text goes out event by event as before; an event
    ending in a beginning of the key waits for the next event of its choice. Token ids and logprobs are not
    text and are not rewritten: they stay with their event."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._held: deque[_Held] = deque()
        self._tails: dict[Channel, list[_Piece]] = {}

    def feed(self, events: Iterable[tuple[bytes, bytes | None]]) -> Iterator[Event]:
        """The events that can go out now, in order, each with its data parsed (a JSON object, else None)."""
        if not self.key:  # nothing to look for: each event as it came, its data parsed
            for raw, payload in events:
                yield raw, payload, None if payload is None or payload == DONE else json_object(payload)
            return
        for raw, payload in events:
            raw, payload = masked(raw, self.key), None if payload is None else masked(payload, self.key)
            held = _Held(raw, payload, _parsed(payload))
            self._held.append(held)
            if held.chunk is not None:
                self._follow(held, held.chunk)
            elif payload == DONE:
                self._tails.clear()
            yield from self._release()

    def flush(self) -> list[Event]:
        """Every event still held back: the stream is over, the texts end there."""
        self._tails.clear()
        return list(self._release())

    def _release(self) -> Iterator[Event]:
        waiting = {id(piece.held) for pieces in self._tails.values() for piece in pieces}
        while self._held and id(self._held[0]) not in waiting:
            yield self._held.popleft().event()

    def _follow(self, held: _Held, chunk: dict[str, Any]) -> None:
        if chunk.get("type") in RESPONSE_ENDS:
            self._tails.clear()
            return
        for group, field, holder, name in list(_texts(chunk)):
            self._extend((group, field), _Piece(held, holder, name))
        for group in _ended(chunk):
            for channel in [c for c in self._tails if c[0] == group]:
                del self._tails[channel]

    def _extend(self, channel: Channel, piece: _Piece) -> None:
        pieces = [*self._tails.pop(channel, ()), piece]
        joined = "".join(p.text for p in pieces)
        begun = len(joined) - len(piece.text)  # the text held back before this piece
        at = joined.find(self.key)
        if 0 <= at < begun:  # the key, begun in events held back, ends in this one: masked, the events go out
            _mask(pieces, at, len(self.key))
            pieces, joined = [piece], piece.text
        held_back = _beginning(joined, self.key)
        if held_back:
            self._tails[channel] = _last(pieces, held_back)


@dataclass(eq=False)
class _Held:
    """An event read and not passed on yet: its bytes, its data, its data parsed (rewritten when masked)."""

    raw: bytes
    payload: bytes | None
    chunk: dict[str, Any] | None
    rewritten: bool = False

    def event(self) -> Event:
        if self.rewritten and self.chunk is not None:
            self.raw, self.payload = with_data(self.raw, self.chunk), orjson.dumps(self.chunk)
        return self.raw, self.payload, self.chunk


@dataclass
class _Piece:
    """An event's part of a text: the string ``holder[name]`` in its data, from ``start`` on."""

    held: _Held
    holder: dict[str, Any]
    name: Any
    start: int = 0

    @property
    def text(self) -> str:
        text: str = self.holder[self.name]
        return text[self.start :]


def _parsed(payload: bytes | None) -> dict[str, Any] | None:
    return None if payload is None or payload == DONE else json_object(payload)


def _texts(chunk: dict[str, Any]) -> Iterator[tuple[Hashable, Hashable, dict[str, Any], Any]]:
    """The texts in one event a client joins with the same texts of the next: (its choice or output item, its
    field, the object holding the string, the string's key there)."""
    kind = chunk.get("type")
    if isinstance(kind, str):  # the Responses API: one delta per event
        if kind.endswith(".delta") and isinstance(chunk.get("delta"), str):
            field = (kind, chunk.get("content_index"), chunk.get("summary_index"))
            yield ("output", chunk.get("output_index", chunk.get("item_id"))), field, chunk, "delta"
        return
    for place, choice in enumerate(chunk.get("choices") or ()):
        if not isinstance(choice, dict):
            continue
        group = ("choice", choice.get("index", place))
        if isinstance(choice.get("text"), str):  # a text completion's
            yield group, "text", choice, "text"
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        for name, value in delta.items():
            if isinstance(value, str) and name != "role":  # content, reasoning_content, refusal, ...
                yield group, name, delta, name
            elif isinstance(value, dict):  # a legacy function_call's name and arguments
                yield from ((group, (name, part), value, part) for part in value if _text(value[part]))
            elif name == "tool_calls" and isinstance(value, list):
                for at, call in enumerate(value):
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict):
                        place = call.get("index", at)
                        yield from ((group, (name, place, p), function, p) for p in function if _text(function[p]))


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _ended(chunk: dict[str, Any]) -> Iterator[Hashable]:
    """The choices and output items whose texts end with this event."""
    kind = chunk.get("type")
    if isinstance(kind, str):
        if not kind.endswith(".delta") and ("output_index" in chunk or "item_id" in chunk):
            yield ("output", chunk.get("output_index", chunk.get("item_id")))
        return
    for place, choice in enumerate(chunk.get("choices") or ()):
        if isinstance(choice, dict) and choice.get("finish_reason") is not None:
            yield ("choice", choice.get("index", place))


def _beginning(text: str, key: str) -> int:
    """The length of the longest end of ``text`` that begins ``key`` (shorter than the key), 0 if none."""
    at = text.find(key[0], max(0, len(text) - len(key) + 1))
    while at >= 0:
        if key.startswith(text[at:]):
            return len(text) - at
        at = text.find(key[0], at + 1)
    return 0


def _last(pieces: list[_Piece], length: int) -> list[_Piece]:
    """The pieces holding the last ``length`` characters of their joined text."""
    kept: list[_Piece] = []
    for piece in reversed(pieces):
        size = len(piece.text)
        if length <= size:
            kept.append(_Piece(piece.held, piece.holder, piece.name, piece.start + size - length))
            break
        kept.append(piece)
        length -= size
    return kept[::-1]


def _mask(pieces: list[_Piece], at: int, length: int) -> None:
    """Mask the characters ``at`` to ``at + length`` of the pieces' joined text, in the events holding them: the
    first piece of the key says ``***``, the others lose their part."""
    offset, first = 0, True
    for piece in pieces:
        size = len(piece.text)
        low, high = max(at, offset), min(at + length, offset + size)
        if low < high:
            whole: str = piece.holder[piece.name]
            cut_from, cut_to = piece.start + low - offset, piece.start + high - offset
            piece.holder[piece.name] = whole[:cut_from] + (MASK if first else "") + whole[cut_to:]
            piece.held.rewritten, first = True, False
        offset += size
