"""The relay of a streamed answer: from the backend's server-sent events to the client's, chunk by chunk as they
arrive (no buffering, no conversion), while the call's record accumulates token ids, logprobs, tool calls and
usage (``gateway.streaming``) for its span."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import aiohttp

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
from rollway.gateway.upstream import key_bytes


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
    await reply.start(200, [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache"), *headers])
    decoder = SSEDecoder()
    responses = record.operation == "responses"
    n = record.request.get("n") if isinstance(record.request, dict) else None
    acc = record.accumulator = (
        ResponsesAccumulator() if responses else StreamAccumulator(record.operation, n if isinstance(n, int) else 1)
    )
    done_event: bytes | None = None
    first_output_sent = False
    secret = key_bytes(record.backend)
    try:
        async for data in response.content.iter_any():
            out: list[bytes] = []
            for raw, payload in decoder.feed(data):
                if secret and secret in raw:  # the backend echoed its key: masked, as in whole bodies
                    raw, payload = raw.replace(secret, b"***"), payload and payload.replace(secret, b"***")
                if payload is None:
                    out.append(raw)
                    continue
                if payload == DONE:
                    done_event = raw
                    continue
                chunk = json_object(payload)
                if chunk is None:  # not an event of the API: passed on as it came, nothing to record of it
                    out.append(raw)
                    continue
                if stream_error(chunk, responses):
                    outcome.stream_error(record, chunk.get("error") or chunk)
                    out.append(raw)
                    continue
                if record.ttft_seconds is None:
                    record.ttft_seconds = time.time() - record.start_time
                acc.feed(chunk)
                if responses:
                    if injected.any:
                        raw = with_data(raw, capture.shown_event(chunk, injected))
                    if chunk.get("type") in RESPONSE_ENDS:
                        done_event = raw  # the Responses API's [DONE]: the whole response, sent once recorded
                        continue
                    out.append(raw)
                elif not injected.any:
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
            if decoder.pending() > limit:  # one event without end: not held for ever
                raise ResponseTooLarge(limit)
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
        TimeoutError,
        ResponseTooLarge,
    ) as exc:
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
