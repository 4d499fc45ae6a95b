"""A backend's API key, kept out of everything that leaves the gateway: the answers passed to clients and the
spans recorded. A backend that echoes its key (a debugging proxy, an error quoting the request's headers, a model
told to repeat them) has it masked, as it is and in any JSON-escaped form; in a stream, also when the key is split
across events (``KeyGuard``)."""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from rollway.gateway.streaming import DONE, RESPONSE_ENDS, json_object, with_data
from rollway.store import Backend

#: Keys shorter than this are not looked for in error bodies: masking ``null`` would break the JSON around it.
MASKED_KEY_LENGTH = 8
#: What a backend's key is replaced with, wherever it is found.
MASK = "***"


def backend_key(backend: Backend | None) -> str:
    """The backend's API key, to look for in what the backend sends back; empty for no key or a placeholder for a
    keyless server ("x", "null"), which is not a secret to look for."""
    key = backend.api_key.get_secret_value() if backend is not None and backend.api_key is not None else ""
    return key if len(key) >= MASKED_KEY_LENGTH else ""


def without_key(raw: bytes, backend: Backend | None) -> bytes:
    """A backend's body (an error, or an answer quoting its request) with the backend's API key, should the
    backend echo it (``you sent Bearer sk-...``), masked: the body is passed to the client and recorded in the
    span, neither may hold the key. ``masked`` says in which forms."""
    return masked(raw, backend_key(backend))


def masked(raw: bytes, key: str) -> bytes:
    """``raw`` with every occurrence of ``key`` replaced by ``MASK``: as it is, and as a JSON text may write it,
    any of its characters escaped (``sk\\u002d...``, ``\\/`` for ``/``), which a client's JSON parser turns back
    into the key. Valid JSON stays valid: the mask replaces the key inside its string."""
    if not key:
        return raw
    plain = key.encode()
    if plain not in raw and b"\\" not in raw:  # (an escaped key has a backslash: most bodies are passed at once)
        return raw
    return _key_pattern(key).sub(_masking, raw)


def _masking(match: re.Match[bytes]) -> bytes:
    return (match.group(1) or b"") + MASK.encode()


@functools.lru_cache(maxsize=64)
def _key_pattern(key: str) -> re.Pattern[bytes]:
    """The key written with each character as itself or as a JSON escape. A match that begins with an escape
    begins where its backslash is not itself escaped: after an even number of backslashes (group 1, kept)."""
    escaped = b"(?<!\\\\)((?:\\\\\\\\)*)(?:" + b"|".join(_escapes(key[0])) + b")"
    first = b"(?:" + escaped + b"|" + re.escape(key[0].encode()) + b")"
    return re.compile(first + b"".join(b"(?:" + b"|".join(_forms(c)) + b")" for c in key[1:]))


def _forms(char: str) -> list[bytes]:
    return [re.escape(char.encode()), *_escapes(char)]


#: JSON's two-character escapes (RFC 8259, section 7), beside ``\\uXXXX`` which can write any character.
_SHORT_ESCAPES = {
    '"': b'\\"',
    "\\": b"\\\\",
    "/": b"\\/",
    "\b": b"\\b",
    "\f": b"\\f",
    "\n": b"\\n",
    "\r": b"\\r",
    "\t": b"\\t",
}


def _escapes(char: str) -> list[bytes]:
    """Patterns of the JSON escapes of ``char``: ``\\uXXXX`` with hex digits of either case (a character beyond
    the Basic Multilingual Plane: its UTF-16 surrogate pair), and its short escape if it has one."""
    units = char.encode("utf-16-be")
    hexes = (f"{int.from_bytes(units[i : i + 2]):04x}" for i in range(0, len(units), 2))
    unicode = b"".join(
        b"\\\\u" + b"".join(f"[{d}{d.upper()}]".encode() if d.isalpha() else d.encode() for d in digits)
        for digits in hexes
    )
    short = _SHORT_ESCAPES.get(char)
    return [unicode] if short is None else [unicode, re.escape(short)]


Event = tuple[bytes, bytes | None, dict[str, Any] | None]
#: A text a client joins from a stream's events: (the choice or output item, the field) -- ``("choice", 0),
#: "content"``, ``("choice", 0), ("tool_calls", 1, "arguments")``, ``("output", 0), (type, content_index, ...)``.
Channel = tuple[Hashable, Hashable]


class KeyGuard:
    """Masks the backend's key in a stream's events, and across them.

    An event holding the key whole, as it is or JSON-escaped, is masked where it is (``masked``). A key
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
