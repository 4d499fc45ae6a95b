"""The span part of ``Store`` (``store.sql.spans``, ``store.sql.calls``): sequence ids, the gateway's calls, span writes
and reads."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter

from rollway.store.db import limits
from rollway.store.parts.keepalive import CallsInFlight
from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.schemas import Span
from rollway.store.sql import calls, convert, keyed_spans, pg_calls, sequences, spans

_SPAN_LIST: TypeAdapter[list[Span]] = TypeAdapter(list[Span])


class SpansMixin(StorePlumbing):
    span_observer: Callable[[int], None] | None  # told how many spans each add_spans wrote
    calls_in_flight: CallsInFlight  # admitted, span not written: each keeps its attempt alive (store.parts.keepalive)

    async def allocate_sequence(
        self, rollout_id: str | None, attempt_id: str | None = "latest", count: int = 1
    ) -> tuple[str | None, int]:
        """Reserve sequence ids when a request arrives: (the attempt id they belong to, the first id)."""
        return await self._write(lambda conn: sequences.allocate(conn, rollout_id, attempt_id, count))

    async def begin_call(self, rollout_id: str | None, attempt_id: str | None = None) -> calls.CallTicket:
        """An LLM call arrived: check its attempt is live, allocate its sequence id, tell its deadline. From here
        until ``record_call`` the call keeps its attempt alive (``store.parts.keepalive``)."""
        if self.direct_calls:
            ticket = await self._write_direct(lambda driver: pg_calls.begin(driver, rollout_id, attempt_id))
        else:
            ticket = await self._write(lambda conn: calls.begin(conn, rollout_id, attempt_id))
        if ticket.attempt_id is not None:
            self.calls_in_flight.add(ticket.rollout_id or "", ticket.attempt_id, ticket.sequence_id)
        return ticket

    async def record_call(self, span: Span) -> None:
        """Write the span of a call that ``begin_call`` admitted (see ``store.sql.calls.record``): the call is over."""
        now = self.clock()
        try:
            if self.direct_calls:
                await self._record_direct(span, now)
            else:
                await self._write(lambda conn: calls.record(conn, span, now))
        finally:
            if span.attempt_id is not None:
                self.calls_in_flight.remove(span.rollout_id or "", span.attempt_id, span.sequence_id or 0)

    async def _record_direct(self, span: Span, now: float) -> None:
        """``calls.record`` on PostgreSQL: the span and the heartbeat in one statement (``pg_calls.record``); the
        rare rest (a taken sequence id, an attempt to revive) in a transaction of its own."""
        assert span.sequence_id is not None
        row = (span, span.rollout_id or "", span.attempt_id or "", span.sequence_id)
        values = convert.span_values(*row, now, spans.json_text)
        inserted, touched = await self._write_direct(lambda driver: pg_calls.record(driver, values, now, row[2]))
        if not inserted:
            taken = await self._read(lambda conn: spans.taken(conn, [row]))
            raise taken
        if span.rollout_id and span.attempt_id and not touched:
            await self._write(lambda conn: calls.revive(conn, span, now))

    async def next_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        return (await self.allocate_sequence(rollout_id, attempt_id))[1]

    async def add_spans(
        self,
        items: Sequence[Span | Mapping[str, Any]],
        idempotency_key: str | None = None,
        *,
        stamped: Collection[str] = (),
        shared_sequence: bool = False,
    ) -> list[Span]:
        """Write spans (each a heartbeat); returns the ones written, with their sequence ids. With an
        ``idempotency_key``, every span of the request as stored: a retry of the request writes nothing twice,
        and the key with other spans is a ``ConflictError`` (``keyed_spans.add_keyed``); ``stamped`` names the fields
        the caller set on each try itself (e.g. the time a reward is recorded), left out of that comparison. With
        ``shared_sequence`` (Agent-lightning's spans; no idempotency key), a sequence id another span of the
        attempt holds is not a conflict: the span gets the next one and keeps the one it gave as
        ``agl_sequence_id`` (``spans._share``)."""
        if any(isinstance(s, Span) for s in items):
            batch = [s.model_copy() if isinstance(s, Span) else Span.model_validate(s) for s in items]
        else:  # plain payloads: one validator call for the batch (~25 % less than one per span)
            batch = _SPAN_LIST.validate_python(items)
        if not batch:
            return []
        limits.check_spans(batch)
        now = self.clock()
        if idempotency_key is None:
            written = await self._write(lambda conn: spans.add(conn, batch, now, shared=shared_sequence))
            new = len(written)
        else:
            key = idempotency_key
            written, new = await self._write(lambda conn: keyed_spans.add_keyed(conn, batch, now, key, stamped))
        if self.span_observer is not None:
            self.span_observer(new)
        return written

    async def add_span(self, span: Span | Mapping[str, Any], *, shared_sequence: bool = False) -> Span | None:
        """Write one span; None when a span with the same ``span_id`` is already stored for its attempt."""
        written = await self.add_spans([span], shared_sequence=shared_sequence)
        return written[0] if written else None

    async def query_spans(
        self,
        rollout_id: str | None,
        attempt_id: str = "all",
        *,
        name: str | None = None,
        after_sequence: int | None = None,
        limit: int | None = None,
    ) -> list[Span]:
        return await self._read(
            lambda conn: spans.query(
                conn, rollout_id, attempt_id, name=name, after_sequence=after_sequence, limit=limit
            )
        )
