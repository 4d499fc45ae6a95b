"""The attempt updates a client's agents send at once, sent as one request.

A training step's agents end together: each reports its reward and its end (``update_attempt``) within a few
milliseconds of the others. Sent one request each, the burst costs every agent a request on the client's
connection pool (httpx's pool work grows with the requests waiting on it) and one on the server. Here an update
that names its attempt joins a queue; one request at a time carries everything queued
(``PATCH /admin/v1/attempts``), so the first update goes at once and the ones that arrive while it is on the
wire go together next. No timer holds an update back, and each caller gets its own attempt or its own error, as
a request of its own would give it.

A server without the batch route (an older one answers 404 or 405) gets each update alone from then on.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollway.admin.client_transport import Transport, path_segment
from rollway.admin.client_types import RollwayAPIError
from rollway.admin.schemas import AttemptResults
from rollway.store import Attempt

#: The most updates one request carries (the server's bound).
MAX_BATCH = 1000


class AttemptBatcher:
    def __init__(self, transport: Transport) -> None:
        self._t = transport
        self._queued: list[tuple[dict[str, Any], asyncio.Future[Attempt]]] = []
        self._sender: asyncio.Task[None] | None = None
        self.batches = True  # the server takes the batch route (until it answers that it has none)

    async def submit(self, change: dict[str, Any]) -> Attempt:
        """Send ``change`` (an ``AttemptChange``'s JSON) with whatever else is queued; its attempt, or its error
        raised."""
        if not self.batches:
            return await self._alone(change)
        future: asyncio.Future[Attempt] = asyncio.get_running_loop().create_future()
        self._queued.append((change, future))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_queued())
        return await future

    async def _send_queued(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued[:MAX_BATCH], self._queued[MAX_BATCH:]
                try:
                    answer = await self._t.model(
                        AttemptResults,
                        "PATCH",
                        "/attempts",
                        json={"updates": [change for change, _ in batch]},
                        # Each names its attempt and keys its reward: the same batch again changes nothing.
                        repeatable=True,
                    )
                except RollwayAPIError as exc:
                    if exc.status in (404, 405):
                        self.batches = False
                        await asyncio.gather(*(self._settle_alone(change, future) for change, future in batch))
                    else:
                        _fail(batch, exc)
                    continue
                except Exception as exc:  # a connection error after the retries: every caller's
                    _fail(batch, exc)
                    continue
                for (_, future), result in zip(batch, answer.results, strict=True):
                    if future.done():  # its caller left
                        continue
                    if result.attempt is not None:
                        future.set_result(result.attempt)
                    else:
                        error = (result.error or {}).get("error") or {}
                        future.set_exception(_error(result.status, error, answer_body=result.error))
        finally:
            self._sender = None

    async def _alone(self, change: dict[str, Any]) -> Attempt:
        body = {k: v for k, v in change.items() if k not in ("rollout_id", "attempt_id", "idempotency_key")}
        key = change.get("idempotency_key")
        return await self._t.model(
            Attempt,
            "PATCH",
            f"/rollouts/{path_segment(change['rollout_id'])}/attempts/{path_segment(change['attempt_id'])}",
            json=body,
            headers=None if key is None else {"Idempotency-Key": key},
            repeatable=True,
        )

    async def _settle_alone(self, change: dict[str, Any], future: asyncio.Future[Attempt]) -> None:
        try:
            attempt = await self._alone(change)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
        else:
            if not future.done():
                future.set_result(attempt)


def _fail(batch: list[tuple[dict[str, Any], asyncio.Future[Attempt]]], exc: Exception) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)


def _error(status: int, error: dict[str, Any], *, answer_body: Any) -> RollwayAPIError:
    return RollwayAPIError(
        status,
        str(error.get("message") or "error"),
        type=error.get("type"),
        code=error.get("code"),
        param=error.get("param"),
        method="PATCH",
        url="/admin/v1/attempts",
        body=answer_body,
    )
