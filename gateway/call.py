"""One LLM call, from the moment it has its sequence id until its span is written and its client told how it
ended: ``Call`` owns it, and ``Call.run`` is the one way through.

``run`` answers the call (``_answer``: the alias lease, the backend's answer through ``Gateway.connect``, the
answer relayed as a stream or passed whole), turns whatever ended it into the record's fields and an ``Ending``
(``_ending``: an answer, an error, the client gone or stalled, the server stopping), writes the span
(``_write_span``, the only place a call's span is written), and then sends the ending. Every way a call ends goes
through those three steps once, so each call gets exactly one span, and a completion reaches its client only
once that span is on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from rollway.gateway import capture, outcome
from rollway.gateway.attribution import Attribution
from rollway.gateway.capture import Injected
from rollway.gateway.endings import Abandoned, Ending, ErrorAnswer, NoAnswer, WholeAnswer
from rollway.gateway.errors import AliasPaused, CallError, ClientStalled, UnknownAlias
from rollway.gateway.leases import Arrival, Lease
from rollway.gateway.masking import without_key
from rollway.gateway.proxy import Gateway
from rollway.gateway.record import CallRecord, Trace
from rollway.gateway.relay import StreamRelay
from rollway.gateway.reply import Headers, Reply
from rollway.gateway.streaming import json_object
from rollway.gateway.upstream import Answer
from rollway.store import StoreError
from rollway.store.db.faults import unavailable

log = logging.getLogger("rollway.gateway")
#: How long a call ended by the server's shutdown waits for its client to take the news.
SHUTDOWN_WRITE_TIMEOUT = 1.0


class Call:
    """One call of the data plane: its record (the span to be), its hold on its alias, and how it ends."""

    def __init__(self, gateway: Gateway, record: CallRecord, path: str, arrival: Arrival | None) -> None:
        self.gateway = gateway
        self.record = record
        self.path = path  # the API path sent to the backend (``chat/completions``, ...)
        self._arrival = arrival  # counted in flight until the call holds its lease (``Arrival``)
        self._lease: Lease | None = None
        self._in_flight: Any = None  # the alias's in-flight gauge child, while the call holds its lease
        self._watch: ClientWatch | None = None  # while the call is being answered: what a weight update cancels
        self._aborted: str | None = None  # why a weight update ended the call

    @classmethod
    async def begin(
        cls, gateway: Gateway, operation: str, path: str, body: dict[str, Any], who: Attribution, trace: Trace | None
    ) -> Call:
        """A call arriving: its alias known, its attempt live, its sequence id taken (in arrival order). Bad input
        (an unknown alias, an unknown or stale rollout) is refused here with nothing recorded; a call that is
        begun gets exactly one span (``run``)."""
        alias = body["model"]
        try:
            await gateway.registry.state(alias)  # unknown alias → UnknownAlias, before any sequence id is taken
        except UnknownAlias:
            chosen = await gateway.agent_models.model_of(who.rollout_id) if who.rollout_id else None
            if chosen is None or chosen == alias:
                raise
            alias, body = chosen, body | {"model": chosen}  # the agent server's model (``agent_models``)
            await gateway.registry.state(alias)
        arrival = gateway.registry.arrival(alias)  # in flight for a drain from before the catalog is read
        try:
            ticket = await gateway.store.begin_call(who.rollout_id, who.attempt_id)
            gateway.registry.observe(ticket.catalog_revision)  # a change made through another replica: reload
        except BaseException:
            arrival.end()
            raise
        record = CallRecord(
            operation=operation,
            alias=alias,
            request=body,
            stream=bool(body.get("stream")),
            start_time=time.time(),
            rollout_id=ticket.rollout_id,
            attempt_id=ticket.attempt_id,
            sequence_id=ticket.sequence_id,
            deadline=ticket.deadline,
            osmosis=who.osmosis,
            tags=dict(who.tags),
        )
        if trace is not None:
            record.trace_id, record.parent_id = trace.trace_id, trace.parent_id
            record.trace_flags, record.trace_state = trace.flags, trace.state
        if gateway.registry.paused(alias) and (gateway.settings.pause_wait_seconds > 0 or gateway.registry.held(alias)):
            # It waits for its lease in ``run``, where a client that leaves ends it; not a call to drain meanwhile,
            # since it leases what is current when the alias resumes.
            arrival.end()
            return cls(gateway, record, path, None)
        return cls(gateway, record, path, arrival)

    async def run(self, reply: Reply, receive: Any, headers: Headers) -> None:
        """Answer the call through ``reply``, write its span, then send the end of its answer. A client that
        disconnects (``receive``) cancels the call at once, and with it the backend's request; ``headers`` (the
        call's ids) go with every answer, errors included."""
        gateway, record = self.gateway, self.record
        reply.deadline = record.deadline  # a client that does not read is not waited for past it either
        watch = ClientWatch(receive)
        gateway.running.add()
        try:
            self._watch = watch
            try:
                ending = await self._answer(body=record.request, reply=reply, headers=headers)
                # Logprobs the engine left out, scored while the call holds its lease (the same weights), before
                # the span is written; a client that leaves meanwhile ends the call as before its answer's end.
                await gateway.scorer.fill(record)
            except (Exception, asyncio.CancelledError) as exc:
                ending = self._ending(exc, watch, reply, headers)
            finally:
                self._watch = None  # answered: a weight update's abort has nothing left to end
            try:
                withheld = await self._write_span()
                await ending.send(reply, withheld)
            except asyncio.CancelledError:
                if not watch.gone:  # the server is stopping
                    raise
                watch.uncancel()  # the client left as its answer ended: the span is written, nobody to tell
        finally:
            watch.stop()
            self._release()
            gateway.running.remove()

    async def _answer(self, body: dict[str, Any], reply: Reply, headers: Headers) -> Ending:
        """Everything up to the end of the answer, which is returned: the lease, the backend's answer, its head and
        (for a stream) its events."""
        gateway, record = self.gateway, self.record
        await self._admit()
        assert self._lease is not None
        answer, backend, injected, whole = await gateway.connect(record, self._lease, self.path, body)
        ok = answer.status < 500
        try:
            if whole is None:
                # (a backend may answer a streamed request with one JSON body, e.g. embeddings: passed as such)
                relay = StreamRelay(record, answer, injected, reply, gateway.settings.max_response_bytes)
                ending: Ending = await relay.relay(headers)
            else:
                ending = self._whole(answer, whole, injected, headers)
        except BaseException:
            answer.close()  # closing (not releasing) the connection tells the backend to stop generating
            raise
        else:
            answer.release()
        finally:
            gateway.router.end_try(backend.backend_id, ok=ok, counts_as_failure=not ok)
        return ending

    async def _admit(self) -> None:
        """The call's lease on its alias, waiting while the alias is paused; a refusal is the call's end."""
        gateway, record = self.gateway, self.record
        alias = record.alias or ""
        try:
            lease = await gateway.registry.admit(alias, gateway.settings.pause_wait_seconds, self._arrival)
        except AliasPaused as exc:
            raise exc.refusal() from None
        except UnknownAlias as exc:  # deleted while the call waited for it to resume (the others are not listed)
            raise exc.refusal(listed=False) from None
        except StoreError as exc:  # the store failed while the call re-read the paused alias
            raise CallError.of(503, exc.message, "service_unavailable") from None
        except Exception as exc:  # anything else on the way (a database error the store did not wrap)
            log.exception(
                "call %s/%s seq %s failed before it was sent", record.rollout_id, record.attempt_id, record.sequence_id
            )
            raise CallError.of(500, f"internal error: {type(exc).__name__}", "server_error") from None
        finally:
            self._arrival = None  # ``admit`` ended it
        record.model_version = lease.version
        self._lease, self._in_flight = lease, gateway.metrics.count_in_flight(alias)
        lease.on_abort = self._abort

    def _abort(self, reason: str) -> bool:
        """A weight update ends the call (``ModelRegistry.abort``): its task is cancelled and its span says why.
        Whether this ended it: not when it was answered already, or ended by an abort before."""
        if self._watch is None or self._aborted is not None:
            return False
        self._aborted = reason
        self._watch.cancel()
        return True

    def _whole(self, answer: Answer, whole: bytes, injected: Injected, headers: Headers) -> WholeAnswer:
        """A whole answer (read by ``connect``), as the client gets it; a backend echoing its key (an answer
        quoting the request) has it masked."""
        record = self.record
        raw = without_key(whole, record.backend)
        record.ttft_seconds = time.time() - record.start_time
        out, parsed = raw, None
        if answer.status < 400:
            parsed = json_object(raw)
            if parsed is None:
                raise CallError.of(
                    502, "the backend's answer is not a JSON object", "upstream_error", code="bad_response"
                )
            if record.osmosis:
                shown = capture.answer(parsed, injected, record.operation) if injected.any else parsed
                out = orjson.dumps(capture.with_traingate_fields(shown, parsed, record.operation))
            elif injected.any:
                out = orjson.dumps(capture.answer(parsed, injected, record.operation))
        outcome.mark_answered(record, answer.status, raw, parsed)
        content_type = answer.headers.get("Content-Type", "application/json").encode()
        return WholeAnswer(answer.status, content_type, headers, out)

    def _ending(self, exc: BaseException, watch: ClientWatch, reply: Reply, headers: Headers) -> Ending:
        """What ended the call before its answer did, in the record, and what its client is sent of it."""
        record = self.record
        if isinstance(exc, asyncio.CancelledError):
            watch.uncancel()
            if self._aborted is not None and not watch.gone:  # a weight update ended it
                err = outcome.aborted_error(self._aborted)
                outcome.mark_unfinished(record, "aborted", err.body.decode(), status=None if reply.started else 503)
                return ErrorAnswer(err, headers)
            if watch.gone:  # the client left
                outcome.mark_unfinished(record, "cancelled", cancelled=True)
                return NoAnswer()
            # The server's graceful shutdown ran out of time with the call in flight: its span says so (with the
            # tokens that went by) and its client is told, if it takes it within ``SHUTDOWN_WRITE_TIMEOUT``. The
            # lifespan waits for these calls before it closes the store (``Running.ended``).
            err = outcome.shutdown_error()
            status = None if reply.started else err.status
            outcome.mark_unfinished(record, "shutdown", err.body.decode(), status=status)
            return ErrorAnswer(err, headers, patience=SHUTDOWN_WRITE_TIMEOUT)
        if isinstance(exc, ClientStalled):
            outcome.mark_unfinished(record, "client_stalled", str(exc))
            return Abandoned(exc)
        assert isinstance(exc, Exception)
        err = call_error(exc, self.gateway)
        outcome.mark_failed(record, err)
        return ErrorAnswer(err, headers)

    async def _write_span(self) -> bool:
        """Write the call's span, durably, before its client is told the call ended: the one place a call's span
        is written. Whether the call's completion is withheld because the store could not write it (the store
        logs the database's failure itself; ``outcome.withhold``)."""
        gateway, record = self.gateway, self.record
        record.end_time = record.end_time or time.time()
        span = record.span()
        try:
            await gateway.store.record_call(span)
        except StoreError as exc:
            ids = (record.rollout_id, record.attempt_id, record.sequence_id, record.alias)
            message = "span of call %s/%s seq %s (model %s) not written: %s"
            gateway.store.failures.log(log, "span not written", message, *ids, exc.message)
            withheld = outcome.withhold(record)
            gateway.observe(record, record.span() if withheld else span, written=False)
            return withheld
        except asyncio.CancelledError:
            # The server stopped while the span was being written: the store's writer goes on with the write (it
            # is shielded from its caller), so the call is counted and exported as its span says all the same.
            gateway.observe(record, span, written=True)
            raise
        gateway.observe(record, span, written=True)
        return False

    def _release(self) -> None:
        """The call is over: its lease on the alias (or its arrival, if it never got one) given back."""
        if self._arrival is not None:
            self._arrival.end()
        if self._lease is not None:
            self._lease.release()
            self._in_flight.dec()
            self._lease = None


def call_error(exc: Exception, gateway: Gateway) -> CallError:
    """The answer to an exception of a call: itself if it is one; a store error (or a database failure the store
    did not name, 503) by its kind; anything else a 500 in the envelope, logged (once per kind per interval)."""
    if isinstance(exc, CallError):
        return exc
    failure = exc if isinstance(exc, StoreError) else unavailable(exc)
    if failure is not None:
        return CallError.of_store(failure)
    gateway.store.failures.log(log, f"call:{type(exc).__name__}", "call failed", exc_info=exc)
    return CallError.of(500, f"internal error: {type(exc).__name__}", "server_error")


class ClientWatch:
    """Cancels the task running a call when its client disconnects, until ``stop``.

    The call is not a task of its own: starting one costs a turn of the event loop before the request goes
    upstream. A watcher task reads the request's ``receive`` (the body is read already: what comes next is the
    disconnect) and cancels the call's task."""

    def __init__(self, receive: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.gone = False
        self._over = False
        self._watcher = asyncio.ensure_future(_disconnected(receive))
        self._watcher.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if self._over or watcher.cancelled() or watcher.exception() is not None:
            return
        self.gone = True
        self._task.cancel()

    def cancel(self) -> None:
        """Cancel the call's task as its client's leaving would (a weight update that aborts it)."""
        if not self._over:
            self._task.cancel()

    def uncancel(self) -> None:
        """The call's task takes the cancellation that reached it (the client's, or the server's at shutdown) and
        goes on to end the call."""
        self._task.uncancel()

    def stop(self) -> None:
        self._over = True
        self._watcher.cancel()


async def _disconnected(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
