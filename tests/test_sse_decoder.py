"""The gateway's server-sent-events decoder: the events it cuts do not depend on how the bytes were read."""

from __future__ import annotations

from gateway.streaming import SSEDecoder

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
