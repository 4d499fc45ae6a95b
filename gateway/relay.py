"""The relay of a streamed answer: from the backend's server-sent events to the client's, chunk by chunk as they
arrive (no buffering, no conversion), while the call's record accumulates token ids, logprobs, tool calls and
usage (``gateway.streaming``) for its span."""

from __future__ import annotations

import time
from collections.abc import Iterator

from rollway.envelope import envelope
from rollway.gateway import capture, outcome
from rollway.gateway.capture import Injected
from rollway.gateway.endings import StreamEnd
from rollway.gateway.errors import ResponseTooLarge, UpstreamFailure
from rollway.gateway.masking import Event, KeyGuard, backend_key
from rollway.gateway.record import CallRecord
from rollway.gateway.reply import Headers, Reply
from rollway.gateway.streaming import (
    DONE,
    RESPONSE_ENDS,
    ResponsesAccumulator,
    SSEDecoder,
    StreamAccumulator,
    carries_output,
    encode_event,
    stream_error,
    with_data,
)
from rollway.gateway.upstream import Answer

#: The headers of every streamed answer besides its content type.
STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


class StreamRelay:
    """Passes one streamed answer on to the client as its events come (stripped of what the gateway asked for and
    the client did not: ``capture.shown``), and accumulates them into the call's record.

    The stream's end is not sent here: ``relay`` returns it (``StreamEnd``) for the call to send once the span is
    on disk — ``[DONE]``, or the Responses API's last event. A stream that breaks off ends with an error event
    instead, the tokens received so far recorded. One event longer than ``limit`` bytes is not held for ever."""

    def __init__(self, record: CallRecord, answer: Answer, injected: Injected, reply: Reply, limit: int) -> None:
        self.record, self.answer, self.injected, self.reply, self.limit = record, answer, injected, reply, limit
        self.responses = record.operation == "responses"
        n = record.request.get("n") if isinstance(record.request, dict) else None
        self.acc = record.accumulator = (
            ResponsesAccumulator()
            if self.responses
            else StreamAccumulator(record.operation, n if isinstance(n, int) else 1)
        )
        self.decoder = SSEDecoder()
        self.guard = KeyGuard(backend_key(record.backend))  # the backend's key, should it echo it: masked
        self.done_event: bytes | None = None  # the stream's last event, held until the span is written
        self.first_output_sent = False
        # What every event is read with, the same for the whole stream (``_take`` unpacks it once per read).
        self._fixed = (record, injected, self.responses, injected.any, self.acc.feed)

    async def relay(self, headers: Headers) -> StreamEnd:
        """Send the answer's head and its events, up to (not including) its end, which is returned."""
        self.record.status_code = 200
        content_type = self.answer.headers.get("Content-Type", "")  # the backend's, with its charset
        content_type = content_type if content_type.startswith("text/event-stream") else "text/event-stream"
        # A reverse proxy in front (nginx) passes the events on as they come rather than buffering the answer.
        await self.reply.start(200, [(b"content-type", content_type.encode()), *STREAM_HEADERS, *headers])
        decoder, guard, limit, reply, take = self.decoder, self.guard, self.limit, self.reply, self._take
        try:
            async for data in self.answer.chunks():
                events = guard.feed(decoder.feed(data))
                out, stopped = take(events)
                while stopped:  # the first token: it goes out at once, before the rest of the read is parsed
                    await reply.body(b"".join(out), more=True)
                    out, stopped = take(events)
                if out:
                    await reply.body(b"".join(out), more=True)
                if decoder.pending() > limit:  # one event without end: not held for ever
                    raise ResponseTooLarge(limit)
            out, _ = take(iter(guard.flush()))
            if out:
                await reply.body(b"".join(out), more=True)
        except ResponseTooLarge as exc:
            return self._broken(exc)
        except Exception as exc:
            failure = self.answer.failure(exc)  # the backend's stream broke off, as its transport says
            if failure is None:
                raise
            return self._broken(failure)
        outcome.mark_stream_ended(self.record, self.acc, self.done_event is not None)
        return StreamEnd(self.done_event or b"")

    def _take(self, events: Iterator[Event]) -> tuple[list[bytes], bool]:
        """The next events of a read: each accumulated, and what the client gets of them (to send in one write).
        Until the first token is out, it stops after the event that carries it (True): a read may hold many
        events, and the client's time to first token should not wait for the rest of them to be parsed."""
        record, injected, responses, rewritten, accumulate = self._fixed
        early = not self.first_output_sent
        out: list[bytes] = []
        for raw, payload, chunk in events:
            if chunk is None:
                if payload == DONE:
                    self.done_event = raw
                else:  # no data, or not an event of the API: passed on as it came, nothing to record of it
                    out.append(raw)
                continue
            if stream_error(chunk, responses):
                outcome.mark_stream_error(record, chunk.get("error") or chunk)
                out.append(raw)
                continue
            if record.ttft_seconds is None:
                record.ttft_seconds = time.time() - record.start_time
            accumulate(chunk)
            if responses:
                if rewritten:
                    raw = with_data(raw, capture.shown_event(chunk, injected))
                if chunk.get("type") in RESPONSE_ENDS:
                    self.done_event = raw  # the Responses API's [DONE]: the whole response, sent once recorded
                    continue
                out.append(raw)
            elif not rewritten:
                out.append(raw)
            elif (shown := capture.shown(chunk, injected)) is not None:
                out.append(encode_event(shown))
            if early and out and carries_output(chunk):
                self.first_output_sent = True
                return out, True
        return out, False

    def _broken(self, exc: UpstreamFailure | ResponseTooLarge) -> StreamEnd:
        """The backend's stream broke off, or one event grew past the limit: what was held back (less than the
        backend's key) is recorded, and the client's stream ends with the error."""
        for _, _, chunk in self.guard.flush():
            if chunk is not None and not stream_error(chunk, self.responses):
                self.acc.feed(chunk)
        error_type = "response_too_large" if isinstance(exc, ResponseTooLarge) else "stream_interrupted"
        outcome.mark_stream_broken(self.record, self.acc, str(exc), error_type)
        event = envelope(self.record.error or "", "upstream_error", code=self.record.error_type)
        return StreamEnd(encode_event(event))
