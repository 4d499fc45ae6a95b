"""How a call ends, in one place: each way a call can end sets its record's fields here, and the record becomes
the call's span in ``Call.run`` (written once, durably, before the client is told the call ended).

==============  ================================  =============================================  ====================
how it ends     status                            error type                                     set by
==============  ================================  =============================================  ====================
answered        the backend's                     ``http_<status>`` for a 4xx, else none         ``mark_answered``
streamed        200                               ``stream_error``, ``response_failed``,         ``mark_stream_*``
                                                  ``stream_incomplete``, ``stream_interrupted``,
                                                  ``response_too_large``, or none
refused         the refusal's (429, 404, 503...)  ``model_paused``, ``model_busy``, ``http_<s>``  ``mark_failed``
failed          the error's                       ``http_<status>``, ``upstream_redirect``        ``mark_failed``
cancelled       (none sent)                       ``cancelled``: the client left                 ``mark_unfinished``
stalled         (as sent)                         ``client_stalled``: it stopped reading         ``mark_unfinished``
shutdown        503 unless the answer started     ``shutdown``: the server stopped first         ``mark_unfinished``
not recorded    503 (200 once a stream started)   ``not_recorded``: its span could not be saved  ``withhold``
==============  ================================  =============================================  ====================
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from rollway.gateway.errors import CallError
from rollway.gateway.record import CallRecord
from rollway.gateway.streaming import ResponsesAccumulator, StreamAccumulator


def mark_answered(record: CallRecord, status: int, raw: bytes, parsed: dict[str, Any] | None) -> None:
    """A whole answer from the backend: the completion (``parsed``), or its error body."""
    record.status_code = status
    if status < 400:
        record.response = parsed
    else:
        record.error = raw[:2000].decode(errors="replace")
        record.error_type = f"http_{status}"


def mark_failed(record: CallRecord, err: CallError) -> None:
    """The call ends with ``err``: refused before a backend answered (``err.error_type`` says why), or failed."""
    record.status_code = err.status
    record.error = err.body[:2000].decode(errors="replace")
    record.error_type = err.error_type or f"http_{err.status}"


def mark_unfinished(
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


def mark_stream_error(record: CallRecord, error: Any) -> None:
    """The backend sent an error event in the stream (passed on to the client as it came)."""
    record.error = orjson.dumps(error).decode()
    record.error_type = "stream_error"


def mark_stream_broken(
    record: CallRecord, acc: StreamAccumulator | ResponsesAccumulator, why: str, error_type: str
) -> None:
    """The backend's stream broke off (or one event grew past the limit): the tokens received so far are kept."""
    record.error, record.error_type = why, error_type
    record.response = acc.response() if acc.chunks else None


def mark_stream_ended(record: CallRecord, acc: StreamAccumulator | ResponsesAccumulator, done: bool) -> None:
    """The backend's stream ended: with its last event (``done``), or without it."""
    if isinstance(acc, ResponsesAccumulator) and acc.ended_by == "response.failed":
        record.error = orjson.dumps(acc.response().get("error") or "response.failed").decode()
        record.error_type = "response_failed"
    elif not done and record.error is None:
        ending = "response.completed" if record.operation == "responses" else "[DONE]"
        record.error = "the backend stream ended without " + ending
        record.error_type = "stream_incomplete"
    record.response = acc.response() if acc.chunks else None


def not_recorded_error() -> CallError:
    """A completion the backend gave but the store could not record: an error, not a completion."""
    return CallError.of(
        503,
        "the completion could not be recorded (the store is unavailable); it was not handed over: try again",
        "service_unavailable",
        code="not_recorded",
    )


def withhold(record: CallRecord) -> bool:
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


def aborted_error(reason: str) -> CallError:
    """The call was ended by a weight update that aborts the calls in flight: retried, it is held until the new
    weights serve it."""
    err = CallError.of(503, f"{reason}; try again", "service_unavailable", code="weights_updating")
    err.headers.append((b"retry-after", b"1"))
    return err


def shutdown_error() -> CallError:
    """The call outlived the server's graceful shutdown."""
    return CallError.of(
        503, "the server shut down before the call ended; try again", "service_unavailable", code="server_shutting_down"
    )
