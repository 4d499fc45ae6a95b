"""The gateway's server-sent-events decoder: the events it cuts do not depend on how the bytes were read."""

from __future__ import annotations

import random
import re

from rollway.gateway.streaming import SSEDecoder

STREAM = (
    b'data: {"a": 1}\n\n'
    b": a comment, no data\n\n"
    b'data: {"b": 2}\r\n\r\n'
    b"event: message\ndata: line one\ndata: line two\n\n"
    b'data:{"c":3}\r\n\n'
    b"data: [DONE]\n\n"
)
EVENTS = [
    (b'data: {"a": 1}\n\n', b'{"a": 1}'),
    (b": a comment, no data\n\n", None),
    (b'data: {"b": 2}\r\n\r\n', b'{"b": 2}'),
    (b"event: message\ndata: line one\ndata: line two\n\n", b"line one\nline two"),
    (b'data:{"c":3}\r\n\n', b'{"c":3}'),
    (b"data: [DONE]\n\n", b"[DONE]"),
]


def cut(reads: list[bytes]) -> tuple[list[tuple[bytes, bytes | None]], bytes]:
    decoder = SSEDecoder()
    events = [event for data in reads for event in decoder.feed(data)]
    return events, decoder.rest()


def test_one_read_gives_every_event_with_its_data() -> None:
    assert cut([STREAM]) == (EVENTS, b"")


def test_the_events_are_the_same_wherever_the_reads_split_the_bytes() -> None:
    for first in range(len(STREAM) + 1):
        for second in range(first, len(STREAM) + 1, 7):
            reads = [STREAM[:first], STREAM[first:second], STREAM[second:]]
            assert cut(reads) == (EVENTS, b""), (first, second)


def test_a_byte_at_a_time() -> None:
    assert cut([STREAM[i : i + 1] for i in range(len(STREAM))]) == (EVENTS, b"")


def test_an_unfinished_event_waits_for_its_end() -> None:
    events, rest = cut([STREAM + b'data: {"d"'])
    assert events == EVENTS and rest == b'data: {"d"'
    decoder = SSEDecoder()
    assert list(decoder.feed(b'data: {"d"')) == []
    assert list(decoder.feed(b": 4}\n")) == []
    assert list(decoder.feed(b"\n")) == [(b'data: {"d": 4}\n\n', b'{"d": 4}')]


def test_events_are_cut_as_they_are_asked_for() -> None:
    """The first event of a large read is handed on before the rest is cut (time to first token)."""
    decoder = SSEDecoder()
    events = decoder.feed(STREAM)
    assert next(events) == EVENTS[0]
    assert decoder.rest() == STREAM[len(EVENTS[0][0]) :]
    assert list(events) == EVENTS[1:]
    assert decoder.rest() == b""


def _reference(stream: bytes) -> tuple[list[tuple[bytes, bytes | None]], bytes]:
    """Events by the plain definition: each ends at the earliest blank line (LF LF or CR LF CR LF); its data is
    the ``data:`` lines' values (leading spaces dropped), joined by LF."""
    events, start = [], 0
    while (found := re.search(rb"\r\n\r\n|\n\n", stream[start:])) is not None:
        end = start + found.end()
        lines = stream[start : start + found.start()].splitlines()
        data = [line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:")]
        events.append((stream[start:end], b"\n".join(data) if data else None))
        start = end
    return events, stream[start:]


def test_line_ends_and_spaces_the_short_path_must_not_take() -> None:
    for stream in (
        b"\n\r\ndata: x\n\n\r",  # a CR LF blank line right after the event's start must not look before it
        b"data:   x\n\ndata:y\r\n\r\n",  # every leading space dropped; no space at all
        b"data: a\r\nb\r\n\r\ndata: a\rdata: b\n\n",  # CR LF lines; a lone CR ends a line too
        b"data: a\ndata: b\r\n\r\n: c\n\n",  # two lines, then a comment
    ):
        assert cut([stream]) == _reference(stream), stream
        assert cut([stream[i : i + 1] for i in range(len(stream))]) == _reference(stream), stream


def test_random_streams_split_anywhere_give_the_events_of_the_plain_definition() -> None:
    """Single-line ``data:`` events take a short path; this holds it to the definition for every kind of line
    end (LF, CR LF, a lone CR inside an event, a CR LF line closed by a bare LF), comments, other fields."""
    pieces = [b"data: ", b"data:", b"event: x", b": note", b'{"k": "v"}', b"[DONE]", b"  ", b"\n", b"\r\n", b"\r"]
    rng = random.Random(20261122)
    for _ in range(3000):
        stream = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        splits = sorted(rng.randint(0, len(stream)) for _ in range(rng.randint(0, 3)))
        reads = [stream[a:b] for a, b in zip([0, *splits], [*splits, len(stream)], strict=True)]
        assert cut(reads) == _reference(stream), (stream, splits)
