"""Restarts of Osmosis 0.3 agent servers, seen on their ``GET /health``.

Each process of a 0.3 RolloutServer has its own ``process_id`` (a uuid4), and a new process knows none of the old
one's rollouts. ``Restarts`` reads the ``/health`` of each server this process polls rollouts of, every
``HEALTH_EVERY`` seconds: one reader per server, however many of its rollouts are polled here, and none once no
rollout of it is. When the ``process_id`` changes, it tells the pollers of the rollouts that were admitted before
the last read that still showed the old one, and they fail their attempts at once, rather than when their next
poll's answer (a 404) comes, up to the server's long-poll wait later. A rollout admitted in between may be the
new process's: it is left to its polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

log = logging.getLogger("rollway.dispatcher")

#: Seconds between two reads of one server's ``/health`` while rollouts of it are polled here.
HEALTH_EVERY = 5.0
#: Seconds a server has to answer one read of its ``/health``.
HEALTH_TIMEOUT = 5.0


async def health_of(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, Any]:
    """A ``GET`` of ``url`` (a server's ``/health``, redirects not followed): its status and its JSON body (None
    when it is not JSON), or (0, None) when it does not answer within ``HEALTH_TIMEOUT`` seconds."""
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT), allow_redirects=False
        ) as response:
            raw = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        return 0, None
    try:
        return status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return status, None


@dataclass
class _Watch:
    """The reader of one server's ``/health`` and the rollouts polled under it: for each, when its poll began
    and the event that tells its poller the server restarted."""

    headers: dict[str, str]  # the latest poll's: a server's api key may change while it is watched
    polled: dict[str, tuple[float, asyncio.Event]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None


class Restarts:
    """The ``/health`` readers of the 0.3 servers this process polls rollouts of (the module docstring)."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession]) -> None:
        self._session = session
        self._watches: dict[tuple[str, str], _Watch] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.contextmanager
    def watching(self, server: tuple[str, str], headers: dict[str, str], rollout: str) -> Iterator[asyncio.Event]:
        """While the poll of ``rollout`` at ``server`` (its name and url) lasts: an event set when the server's
        ``process_id`` changes. The first poll of a server starts its reader; the last one to end stops it."""
        watch = self._watches.get(server)
        if watch is None:
            watch = self._watches[server] = _Watch(headers)
            watch.task = asyncio.create_task(self._read(server, watch), name="rollway-agent-health")
            self._tasks.add(watch.task)
            watch.task.add_done_callback(self._tasks.discard)
        watch.headers = headers
        restarted = asyncio.Event()
        watch.polled[rollout] = (time.monotonic(), restarted)
        try:
            yield restarted
        finally:
            watch.polled.pop(rollout, None)
            if not watch.polled and self._watches.get(server) is watch:
                del self._watches[server]
                if watch.task is not None:
                    watch.task.cancel()

    async def _read(self, server: tuple[str, str], watch: _Watch) -> None:
        name, url = server
        known: str | None = None  # the process_id last read
        confirmed = 0.0  # when the last read that showed it was sent
        while True:
            sent = time.monotonic()
            try:
                status, health = await health_of(self._session(), f"{url}/health", watch.headers)
            except Exception:  # a read that fails otherwise is no answer: the next one may do
                log.exception("reading the /health of agent server '%s' failed", name)
                status, health = 0, None
            found = health.get("process_id") if status == 200 and isinstance(health, dict) else None
            if isinstance(found, str) and found:  # else no answer now: keep what was known
                if known is not None and found != known:
                    lost = [event for began, event in watch.polled.values() if began < confirmed]
                    log.warning("agent server '%s' restarted (a new process_id): %d rollouts lost", name, len(lost))
                    for event in lost:
                        event.set()
                known, confirmed = found, sent
            await asyncio.sleep(HEALTH_EVERY)

    async def close(self) -> None:
        """Stop every reader."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._watches.clear()
