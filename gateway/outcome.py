"""How a call ends, in one place: each way a call can end sets its record's fields here, and the record becomes
the call's span in ``Gateway.finish`` (written once, durably, before the client is told the call ended).

==============  =================================  ================================================  ===================
how it ends     status                             error type                                        who says so
==============  =================================  ================================================  ===================
answered        the backend's                      ``http_<status>`` for a 4xx, else none            ``answered``
streamed        200                                ``stream_error``, ``response_failed``,            ``stream_broke``,
                                                   ``stream_incomplete``, ``stream_interrupted``,    ``stream_ended``
                                                   ``response_too_large``, or none
refused         the refusal's (429, 404, 503 ...)  ``model_paused``, ``model_busy``, ``http_<s>``    ``failed``
failed          the error's                        ``http_<status>``                                 ``failed``
cancelled       (none sent)                        ``cancelled``: the client left                    ``unfinished``
stalled         (as sent)                          ``client_stalled``: it stopped reading            ``unfinished``
shutdown        503 unless the answer started      ``shutdown``: the server stopped first            ``unfinished``
not recorded    503 (200 once a stream started)    ``not_recorded``: its span could not be written   ``withheld``
==============  =================================  ================================================  ===================
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from rollway.gateway.errors import CallError
from rollway.gateway.record import CallRecord
from rollway.gateway.streaming import ResponsesAccumulator, StreamAccumulator


def ended(record: CallRecord) -> bool:
    """Whether the call's span is written (or being written): it ends once."""
    return record.end_time is not None


def answered(record: CallRecord, status: int, raw: bytes, parsed: dict[str, Any] | None) -> None:
    """A whole answer from the backend: the completion (``parsed``), or its error body."""
    record.status_code = status
    if status < 400:
        record.response = parsed
    else:
        record.error = raw[:2000].decode(errors="replace")
        record.error_type = f"http_{status}"


def failed(record: CallRecord, err: CallError, error_type: str | None = None) -> None:
    """The call ends with ``err``: refused before a backend answered (``error_type`` says why), or failed."""
    record.status_code = err.status
    record.error = err.body[:2000].decode(errors="replace")
    record.error_type = error_type or f"http_{err.status}"


def unfinished(
    record: CallRecord, error_type: str, error: str | None = None, *, cancelled: bool = False, status: int | None = None
) -> None:
    """The call ended before its answer did (its client left or stalled, the server stopped): why, and the tokens
    of a stream that went by. ``cancelled``: its client left (no status: nothing was sent); ``status``: the one
    its client is sent instead of an answer that had not started."""
    if cancelled:
        record.cancelled, record.end_time = True, time.time()
    if status is not None:
        record.status_code = status
    record.error_type = error_type
    if error is not None:
        record.error = error
    if record.accumulator is not None and record.accumulator.chunks:
        record.response = record.accumulator.response()


def stream_error(record: CallRecord, error: Any) -> None:
    """The backend sent an error event in the stream (passed on to the client as it came)."""
    record.error = orjson.dumps(error).decode()
    record.error_type = "stream_error"


def stream_broke(record: CallRecord, acc: StreamAccumulator | ResponsesAccumulator, why: str, error_type: str) -> None:
    """The backend's stream broke off (or one event grew past the limit): the tokens received so far are kept."""
    record.error, record.error_type = why, error_type
    record.response = acc.response() if acc.chunks else None


def stream_ended(record: CallRecord, acc: StreamAccumulator | ResponsesAccumulator, done: bool) -> None:
    """The backend's stream ended: with its last event (``done``), or without it."""
    if isinstance(acc, ResponsesAccumulator) and acc.ended_by == "response.failed":
        record.error = orjson.dumps(acc.response().get("error") or "response.failed").decode()
        record.error_type = "response_failed"
    elif not done and record.error is None:
        ending = "response.completed" if record.operation == "responses" else "[DONE]"
        record.error = "the backend stream ended without " + ending
        record.error_type = "stream_incomplete"
    record.response = acc.response() if acc.chunks else None


def not_recorded() -> CallError:
    """A completion the backend gave but the store could not record: an error, not a completion."""
    return CallError.of(
        503,
        "the completion could not be recorded (the store is unavailable); it was not handed over: try again",
        "service_unavailable",
        code="not_recorded",
    )


def withheld(record: CallRecord) -> bool:
    """Whether ``record``, whose span the store could not write, is a completion that is then not handed over
    (``not_recorded``: a 503, or a stream that ends in that error event instead of its end). If so the record
    says so, for the metrics and the exported copy of its span: error type ``not_recorded``, status 503 unless
    its 200 already went out with the stream."""
    if record.error is not None or record.cancelled or (record.status_code or 0) >= 400:
        return False
    record.error_type = "not_recorded"
    if record.accumulator is None:
        record.status_code = 503
    return True


def shutting_down() -> CallError:
    return CallError.of(
        503, "the server shut down before the call ended; try again", "service_unavailable", code="server_shutting_down"
    )
