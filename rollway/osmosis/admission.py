"""Admissions to an Osmosis 0.3 agent server (``rollway.osmosis.v03``): ``POST {url}/rollout`` with its 429s waited
out under a mark that keeps other processes from sending it again, its 5xx retried, a 409 told apart from a run
another process polls; the accepted admission's lease written to the store until the store takes it; and a
rollout cancelled at the server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from rollway.gateway.upstream import backoff, wait
from rollway.osmosis.wire import Admitted, admitted_of, headers_of, masked, redirected
from rollway.store import AgentServer, NotFoundError, Store, StoreError
from rollway.store.states import ATTEMPT_TERMINAL, FINISHED

log = logging.getLogger("rollway.dispatcher")

#: Seconds between the marks of an admission waiting out 429s (``Admissions._mark``).
ADMIT_MARK_EVERY = 5.0
#: The longest wait before an accepted admission's write, refused by the store, is tried again (``Admissions.hold``).
HOLD_RETRY_MAX = 2.0


class Refused(Exception):
    """The agent server did not take (or lost) the rollout: the attempt fails with this message."""


class HeldElsewhere(Exception):
    """The agent server holds the attempt's id already, and the store keeps its lease: another process had the
    admission accepted and polls that run (or will resume its polls), so this one leaves the attempt alone."""


class Admissions:
    """What the controller asks of an agent server's admission route and keeps in the store about an admission."""

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
        self._retries, self._retry_max_wait = retries, retry_max_wait
        self._record = record  # the dispatcher's record of dispatch facts in the attempt's metadata

    def lease_of(self, admitted: Admitted) -> dict[str, Any]:
        """The lease as the store keeps it, with when it was last polled: a process that finds it not polled for
        longer than a poll takes (this one gone) resumes the polls (``rollway.osmosis.v03.stale``)."""
        return {
            "osmosis_id": admitted.osmosis_id,
            "lease": admitted.lease,
            "wait": admitted.wait_seconds,
            "lease_timeout": admitted.lease_seconds,
            "polled_at": self._store.clock(),
        }

    async def keep(self, rollout_id: str, attempt_id: str, admitted: Admitted) -> None:
        """Keep the lease in the store after a poll (``lease_of``)."""
        with contextlib.suppress(StoreError):  # the database is down: the polls go on, the next one keeps it
            await self._store.record_lease(rollout_id, attempt_id, self.lease_of(admitted))

    async def hold(self, rollout_id: str, attempt_id: str, admitted: Admitted, admission: dict[str, Any]) -> None:
        """Write an accepted admission to the store: its lease, then its record in the attempt's ``dispatch``
        (which clears the ``admitting`` mark). A write the store refuses (the database down for a while) is tried
        again, 0.1 s later, then up to every ``HOLD_RETRY_MAX`` seconds, for as long as the polls go on from
        memory (the controller stops this once they end): until the lease is written, another process would take
        the admission for lost (``store.sql.agents.undispatched``) and send it again, and that 409 would cancel
        the run polled here."""
        failures = 0
        kept = False
        while True:
            try:
                if not kept:
                    kept = await self._store.record_lease(rollout_id, attempt_id, self.lease_of(admitted))
                    if not kept:  # the attempt is gone
                        return
                await self._record(rollout_id, attempt_id, admission)
                return
            except NotFoundError:  # the rollout is gone: nothing to keep
                return
            except StoreError as exc:
                failures += 1
                self._store.failures.log(
                    log,
                    "dispatch",
                    "keeping the admission of %s failed (try %d; polled meanwhile): %s",
                    attempt_id,
                    failures,
                    exc.message,
                )
                await asyncio.sleep(min(0.1 * 2 ** (failures - 1), HOLD_RETRY_MAX))

    async def admit(self, server: AgentServer, rollout_id: str, attempt_id: str, body: dict[str, Any]) -> Admitted:
        url = f"{server.url}/rollout"
        data = orjson.dumps(body)
        tries = 0
        marked: float | None = None  # when this process last marked the admission as its own (``_mark``)
        while True:
            tries += 1
            try:
                async with self._session().post(
                    url, data=data, headers=headers_of(server), allow_redirects=False
                ) as response:
                    raw = await response.read()
                    status = response.status
                    retry_after = response.headers.get("Retry-After")
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem, status = f"no answer from {url}: {type(exc).__name__}", 0
            else:
                said = masked(raw, server, body["llm_api_key"])
                if status == 202:
                    if (admitted := admitted_of(raw, attempt_id)) is not None:
                        return admitted
                    await self.cancel(server, attempt_id)  # a run there that nothing can poll
                    raise Refused(f"{url} answered 202 with no polling lease (cancelled there): {said}")
                problem = f"{url} answered {status}{redirected(response)}: {said}"
                if status == 429:  # no room now: wait as told, for as long as the attempt lives
                    marked = await self._wait_out(server, rollout_id, attempt_id, _clamped(retry_after), marked)
                    tries -= 1
                    continue
                if status == 409:  # the id is the server's already: a run this process cannot poll (no lease)
                    if await self._leased(server, attempt_id):
                        raise HeldElsewhere(f"{problem} (its lease is kept in the store: the run is polled from it)")
                    await self.cancel(server, attempt_id)
                    raise Refused(f"{problem} (cancelled there: its lease was lost)")
                if status < 500:
                    raise Refused(problem)
            if marked is not None:  # a 429 came first: the retries keep the mark too
                marked = await self._mark(server, rollout_id, attempt_id, marked)
            if tries > self._retries:
                raise Refused(f"{problem} (after {tries} tries)")
            await wait(max(backoff(tries, self._retry_max_wait), 0.05 * 2 ** (tries - 1)))

    async def _wait_out(
        self, server: AgentServer, rollout_id: str, attempt_id: str, seconds: float, marked: float | None
    ) -> float:
        """Wait out a 429 for ``seconds`` (``Refused`` once the attempt has ended), marking the admission as this
        process's meanwhile: when it was last marked."""
        marked = await self._mark(server, rollout_id, attempt_id, marked)
        await self._still_live(rollout_id, attempt_id)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, ADMIT_MARK_EVERY))
            marked = await self._mark(server, rollout_id, attempt_id, marked)
        return marked

    async def _mark(self, server: AgentServer, rollout_id: str, attempt_id: str, marked: float | None) -> float:
        """Record in the attempt's ``dispatch`` that this process is admitting it (``admitting``: the store's clock
        time), unless it did less than ``ADMIT_MARK_EVERY`` seconds ago: an admission that waits out 429s for
        longer than an init may take is not taken for lost and sent again by another process, which would get a
        409 and cancel the run this one is about to have (``store.sql.agents.undispatched``). Returns when the
        admission was last marked."""
        now = self._store.clock()
        if marked is not None and now - marked < ADMIT_MARK_EVERY:
            return marked
        mark = {"agent": server.name, "protocol": "osmosis-0.3", "admitting": now}
        with contextlib.suppress(StoreError):  # the database is down: only another process's resend needs it
            await self._record(rollout_id, attempt_id, mark)
        return now

    async def _leased(self, server: AgentServer, attempt_id: str) -> bool:
        """Whether the store keeps a polling lease for the attempt: a process whose admission of it was accepted
        wrote it (``hold``), perhaps after this one took the admission for lost. A store that cannot be read
        says nothing: the ``StoreError`` goes up and the run is not cancelled (a run nobody polls is ended by the
        server when its lease runs out; cancelling another process's run would lose its trajectory)."""
        return any(held.attempt.attempt_id == attempt_id for held, _ in await self._store.agent_leases(server.name))

    async def _still_live(self, rollout_id: str, attempt_id: str) -> bool:
        """Whether the attempt has not ended in the store; raises ``Refused`` once it has."""
        if await self.ended(rollout_id, attempt_id):
            raise Refused("the attempt ended while the agent server had no room for it")
        return True

    async def ended(self, rollout_id: str, attempt_id: str) -> bool:
        """Whether the attempt has ended in the store (or its rollout: cancelled, say)."""
        try:
            rollout = await self._store.get_rollout(rollout_id)
            attempt = await self._store.get_attempt(rollout_id, attempt_id)
        except NotFoundError:
            return True
        return rollout.status in FINISHED or attempt.status in ATTEMPT_TERMINAL

    async def cancel(self, server: AgentServer, osmosis_id: str) -> None:
        try:
            async with self._session().post(
                f"{server.url}/rollout/cancel",
                data=orjson.dumps({"ids": [osmosis_id]}),
                headers=headers_of(server),
                timeout=aiohttp.ClientTimeout(total=5),
                allow_redirects=False,
            ) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("cancel of %s at agent server '%s' failed: %s", osmosis_id, server.name, type(exc).__name__)


def _clamped(retry_after: str | None) -> float:
    try:
        seconds = float(retry_after) if retry_after is not None else 1.0
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.05), 60.0)
