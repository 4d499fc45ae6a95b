"""Rollway as the controller of an Osmosis 0.3 agent server (``osmosis-ai`` 0.3's ``RolloutServer``).

A 0.3 server never calls back: the controller admits a rollout and then polls for its result. It is registered
as one (``protocol: "0.3"``), or told apart from a v1 server by its ``GET /health``, which carries ``process_id``
and ``lifecycle`` (``wire.probe``). For each
attempt the dispatcher has claimed, ``Controller.run``:

1. admits it: ``POST {url}/rollout`` with ``rollout_id`` (the attempt id: a fresh one per attempt, as the server
   keeps an id reserved for 15 minutes after it ends), ``initial_messages``, ``chat_completions_url`` (the
   attempt's own route, ``{public_url}/rollout/{rid}/attempt/{aid}/v1``), ``llm_api_key`` (the attempt's ``rk-``
   key), the task's ``metadata``, its ``label`` (``input.label``, else ``metadata.label``: the server's grader
   needs a label or metadata) and ``agent_timeout_sec`` (the rollout's ``timeout_seconds``). A 202 admits it (one
   whose body holds no polling lease is cancelled there and fails the attempt: nothing could poll that run); a 429
   is waited out (its ``Retry-After``, 0.05 to 60 s) for as long as the attempt lives, with a mark in the attempt's
   ``dispatch`` (``admitting``) renewed every 5 s meanwhile, so that no other process takes the admission for lost
   and sends it again (``store.sql.agents.undispatched``); 5xx and transport errors are
   retried (``ROLLWAY_AGENT_INIT_RETRIES``); any other answer fails the attempt, a redirect too (never
   followed), and a 409 (the id is the server's already: a run whose lease was lost) also cancels it there,
   unless the store keeps a lease for the attempt (``HeldElsewhere``: another process had it admitted and polls
   it). An accepted admission is written to the store (its lease, its ``dispatch`` record) while the polls go
   on from memory, and written again until the store takes it (``rollway.osmosis.admission``);
2. polls ``GET {url}/rollout/{id}/result`` with the lease header (``X-Osmosis-Rollout-Lease``). The server answers
   at once when the rollout has ended, else after up to ``result_wait_timeout_sec`` (30 s), and each poll renews
   the lease (``polling_lease_timeout_sec``, 120 s): transport errors and 502/503/504 are retried within it. An
   answer that says the rollout runs (``running``, ``grading``) is a heartbeat of the attempt: a ``preparing``
   one becomes ``running``;
3. records the result (``wire.result_report``): ``success`` → the attempt succeeds with the grader's reward;
   ``success`` with ``remove_sample`` → it succeeds with no reward and ``remove_sample: true`` in its completion
   (the server's "drop this sample"); ``failure`` → it fails, with the server's category and message, and the
   rollout's retry config decides what follows (a failure is never a reward of 0); ``cancelled`` by the server →
   it fails. A 404 for a live id (the server restarted and lost it) or a 403 (the lease is no longer valid) fails
   it at once, rather than at the rollout's deadline, and so does a new ``process_id`` on the server's
   ``/health``, read every 5 s while its rollouts are polled (``rollway.osmosis.restarts``);
4. when the attempt ends in the store before the server says so (cancelled through the admin API, timed out),
   cancels it at the server: ``POST {url}/rollout/cancel {"ids": [id]}``.

The lease is kept in the store beside the attempt (``Store.record_lease``, encrypted with the secret key when one
is set, in no admin answer), with when it was last polled: a process that finds a live attempt's lease not polled
for longer than one poll takes (its poller died, or this process restarted) resumes the polls (``resume``), within
the lease as long as that happens within its ``polling_lease_timeout_sec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import aiohttp

from rollway.osmosis.admission import Admissions
from rollway.osmosis.restarts import Restarts
from rollway.osmosis.wire import (
    LEASE_HEADER,
    Admitted,
    headers_of,
    json_of,
    label_of,
    result_report,
)
from rollway.store import (
    AgentServer,
    AttemptedRollout,
    ConflictError,
    NotFoundError,
    RemoteCompletion,
    Store,
    StoreError,
)

log = logging.getLogger("rollway.dispatcher")

RETRY_POLL = frozenset({502, 503, 504})
#: The statuses of a result poll's answer that say the rollout runs at the server (the attempt is ``running``).
RUNNING = frozenset({"running", "grading"})
#: How long a poll may take beyond the server's own wait before it counts as lost.
POLL_SLACK = 10.0


def stale(lease: dict[str, Any], now: float) -> bool:
    """Whether nobody has polled for ``lease`` for longer than one poll takes (the server's wait plus
    ``POLL_SLACK``), or for half the lease, whichever is shorter: its poller is gone, and the half left is for
    another process to resume the polls before the server lets the rollout go. With a lease under twice a poll,
    a poll still waiting may look stale to another process, which then polls too: both renew the lease and the
    result is recorded once."""
    waited = now - float(lease.get("polled_at") or 0.0)
    wait, lease_seconds = float(lease.get("wait") or 30.0), float(lease.get("lease_timeout") or 120.0)
    return waited > min(wait + POLL_SLACK, lease_seconds / 2)


class Controller:
    """Admits, polls and records the rollouts of 0.3 agent servers (the module docstring)."""

    def __init__(
        self,
        store: Store,
        session: Callable[[], aiohttp.ClientSession],
        *,
        retries: int,
        retry_max_wait: float,
        record: Callable[[str, str, dict[str, Any]], Awaitable[None]],
    ) -> None:
        self._store, self._session = store, session
        self._admissions = Admissions(store, session, retries=retries, retry_max_wait=retry_max_wait, record=record)
        self._restarts = Restarts(session)

    async def close(self) -> None:
        """Stop reading the servers' ``/health`` (``rollway.osmosis.restarts``)."""
        await self._restarts.close()

    async def run(
        self, server: AgentServer, attempted: AttemptedRollout, messages: list[Any], chat_url: str, key: str
    ) -> None:
        """Admit the attempt, poll it to its end and record that (or cancel it at the server when it ends here
        first); ``Refused`` when the server does not take it."""
        rollout, attempt = attempted.rollout, attempted.attempt
        rollout_id, attempt_id = rollout.rollout_id, attempt.attempt_id
        metadata = rollout.metadata or {}
        body: dict[str, Any] = {
            "rollout_id": attempt_id,
            "initial_messages": messages,
            "chat_completions_url": chat_url,
            "llm_api_key": key,
            "metadata": metadata,
        }
        if (label := label_of(rollout.input, metadata)) is not None:
            body["label"] = label
        timeout = (rollout.config.timeout_seconds if rollout.config is not None else None) or None
        if timeout is not None:
            body["agent_timeout_sec"] = float(timeout)
        admitted = await self._admissions.admit(server, rollout_id, attempt_id, body)
        admission = {"agent": server.name, "protocol": "osmosis-0.3", "osmosis_id": admitted.osmosis_id}
        held = asyncio.create_task(
            self._admissions.hold(rollout_id, attempt_id, admitted, admission | {"admitting": None}),
            name="rollway-agent-hold",
        )
        await self._finish(server, rollout_id, attempt_id, admitted, held)

    async def resume(self, server: AgentServer, attempted: AttemptedRollout, lease: dict[str, Any]) -> None:
        """Poll an attempt another process admitted (or this one, before a restart) from its kept lease."""
        admitted = Admitted(
            osmosis_id=str(lease["osmosis_id"]),
            lease=str(lease["lease"]),
            wait_seconds=float(lease["wait"]),
            lease_seconds=float(lease["lease_timeout"]),
        )
        log.info("resuming the result polls of %s at agent server '%s'", admitted.osmosis_id, server.name)
        await self._finish(server, attempted.rollout.rollout_id, attempted.attempt.attempt_id, admitted)

    async def _finish(
        self,
        server: AgentServer,
        rollout_id: str,
        attempt_id: str,
        admitted: Admitted,
        held: asyncio.Task[None] | None = None,
    ) -> None:
        """Poll the admitted attempt to its end and record that; ``held`` is the admission's write
        (``Admissions.hold``), stopped once the polls end."""
        try:
            report = await self._poll(server, rollout_id, attempt_id, admitted)
            if report is not None:
                with contextlib.suppress(ConflictError, NotFoundError):  # the attempt ended otherwise meanwhile
                    await self._store.complete_remote(report, attempt_id)
        finally:
            if held is not None:
                held.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await held
            with contextlib.suppress(StoreError):  # ended: nothing left to poll (a live lease is never dropped)
                if await self._admissions.ended(rollout_id, attempt_id):
                    await self._store.record_lease(rollout_id, attempt_id, None)

    async def _poll(
        self, server: AgentServer, rollout_id: str, attempt_id: str, admitted: Admitted
    ) -> RemoteCompletion | None:
        with self._restarts.watching((server.name, server.url), headers_of(server), admitted.osmosis_id) as restarted:
            return await self._poll_until(server, rollout_id, attempt_id, admitted, restarted)

    async def _poll_until(
        self, server: AgentServer, rollout_id: str, attempt_id: str, admitted: Admitted, restarted: asyncio.Event
    ) -> RemoteCompletion | None:
        """Poll the result until the rollout ends there or here, the lease is lost, or ``restarted`` is set (the
        server's ``process_id`` changed: its rollout is gone)."""
        url = f"{server.url}/rollout/{admitted.osmosis_id}/result"
        headers = headers_of(server) | {LEASE_HEADER: admitted.lease}
        timeout = aiohttp.ClientTimeout(total=admitted.wait_seconds + POLL_SLACK)
        lease_until = time.monotonic() + admitted.lease_seconds
        failures = 0
        while True:
            sent = time.monotonic()
            raced = await self._raced_poll(url, headers, timeout, rollout_id, attempt_id, admitted, restarted)
            if raced == "ended":  # cancelled or timed out here: tell the server
                await self._admissions.cancel(server, admitted.osmosis_id)
                return None
            if raced == "restarted":
                return _lost(rollout_id, "the agent server restarted (its /health shows a new process_id)")
            status, result = raced
            if status == 200 and isinstance(result, dict):
                lease_until = sent + admitted.lease_seconds  # the server renewed it when the poll arrived
                failures = 0
                report = result_report(rollout_id, result)
                if report is not None:
                    return report
                if result.get("status") in RUNNING:
                    await self._running(rollout_id, attempt_id)
                await self._admissions.keep(rollout_id, attempt_id, admitted)
                continue
            if status == 404:
                return _lost(rollout_id, "the agent server no longer knows the rollout (restarted?)")
            if status == 403:
                return _lost(rollout_id, "the agent server refused the polling lease")
            failures += 1
            if (status != 0 and status not in RETRY_POLL) or time.monotonic() >= lease_until:
                return _lost(rollout_id, f"result polls failed ({status or 'no answer'}) until the lease ran out")
            await asyncio.sleep(min(0.25 * 2 ** (failures - 1), 8.0, max(lease_until - time.monotonic(), 0.0)))

    async def _running(self, rollout_id: str, attempt_id: str) -> None:
        """The server says the attempt's rollout runs: a heartbeat of the attempt, which moves a ``preparing``
        attempt (and its rollout) to ``running`` as a span does, before the workflow's first chat call, and keeps
        it live while the workflow makes none (``Store.heartbeat``: the latest attempt only, never one that
        ended nor that of a cancelled rollout)."""
        with contextlib.suppress(StoreError):  # ended meanwhile (the poll's race sees it), or the database is down
            await self._store.heartbeat(rollout_id, attempt_id)

    async def _raced_poll(
        self,
        url: str,
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
        rollout_id: str,
        attempt_id: str,
        admitted: Admitted,
        restarted: asyncio.Event,
    ) -> Literal["ended", "restarted"] | tuple[int, Any]:
        """One long poll raced against the attempt's end in the store and the server's restart: the poll's
        (status, body), unless the attempt ended here first (``ended``) or the server restarted before the poll
        answered (``restarted``). Whatever is left of the race is cancelled, also when the store's read fails."""
        polled = asyncio.ensure_future(self._get(url, headers, timeout))
        ended = asyncio.ensure_future(self._ended_in_store(rollout_id, attempt_id, admitted.wait_seconds))
        gone = asyncio.ensure_future(restarted.wait())
        pending: set[asyncio.Future[Any]] = {polled, ended, gone}
        try:
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if ended in done and ended.result():
                    return "ended"
                if polled in done:
                    answer: tuple[int, Any] = polled.result()
                    return answer
                if gone in done:
                    return "restarted"
                # the store saw no end within the server's wait: the poll or a restart decides
        finally:
            for task in (polled, ended, gone):
                task.cancel()

    async def _get(self, url: str, headers: dict[str, str], timeout: aiohttp.ClientTimeout) -> tuple[int, Any]:
        try:
            async with self._session().get(url, headers=headers, timeout=timeout, allow_redirects=False) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError):
            return 0, None
        return status, json_of(raw)

    async def _ended_in_store(self, rollout_id: str, attempt_id: str, within: float) -> bool:
        """Whether the attempt ends in the store within ``within`` seconds (a cancel, a timeout)."""
        deadline = time.monotonic() + within
        while True:
            if await self._admissions.ended(rollout_id, attempt_id):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self._store.wait_for_rollouts([rollout_id], min(left, 5.0))  # woken by the rollout's end


def _lost(rollout_id: str, message: str) -> RemoteCompletion:
    return RemoteCompletion(rollout_id=rollout_id, status="ERROR", finish_reason="lost", error_message=message)
