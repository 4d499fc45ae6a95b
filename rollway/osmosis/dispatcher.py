"""The remote-agent dispatcher (Rollway as Osmosis's TrainGate, docs/remote-agents.md), owned by the app's lifespan.

A server registered with ``protocol: "0.3"``, or whose ``/health`` is an Osmosis 0.3 RolloutServer's, is admitted
and polled instead (``rollway.osmosis.v03``; ``/health`` is asked once per registration, and asked again before an
attempt is sent while the answer tells nothing: ``Dispatcher.protocol``); what follows is the v1 protocol, for
every other server.

It claims the tasks enqueued with ``agent: <name>`` for each registered agent server, within the server's
``max_concurrent`` (``store.sql.agents.claim`` counts its live rollouts in the database, so several gateway
processes on one database share the limit), mints a rollout-scoped key for the new attempt and sends
``POST {url}/v1/rollout/init``::

    {rollout_id, server_url, messages, completion_params, metadata, api_key, idempotency_key}

``server_url`` is Rollway's base URL (``ROLLWAY_PUBLIC_URL``, else ``http://host:port``): the agent calls
``{server_url}/v1/chat/completions`` and ends with ``POST {server_url}/v1/rollout/completed``
(``rollway.osmosis.callbacks``). ``api_key`` is the attempt's ``rk-`` key; ``idempotency_key`` is the attempt id,
the same on every try of one init. A 200/202 answer's ``tools`` are kept in the attempt's metadata (``dispatch``).
Connection errors, timeouts, 429 and 5xx are retried with backoff (``ROLLWAY_AGENT_INIT_RETRIES``); a 4xx or
the last failure fails the attempt, and the rollout's retry config decides what happens next. A server that
accepts and never calls back is the watchdog's: the attempt times out (``timeout_seconds``), the rollout is
requeued per its config, and this loop dispatches it again as a new attempt. An init lost with the process
sending it (a crash or restart between the claim and the recorded answer) is sent again, with the same
``idempotency_key``, by whichever process looks next (``resend_lost``): else its rollout would wait for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp
import orjson

from rollway.gateway.upstream import backoff, wait
from rollway.osmosis import admission, restarts, v03, wire
from rollway.osmosis.wire import Protocol
from rollway.settings import Settings
from rollway.store import AgentServer, AttemptedRollout, ConflictError, NotFoundError, Store, StoreError
from rollway.store.signals import Signal

log = logging.getLogger("rollway.dispatcher")

#: Seconds between looks for 0.3 attempts whose poller is gone.
LEASE_CHECK_INTERVAL = 5.0
#: Tasks claimed for one server per look when it sets no concurrency limit.
CLAIM_BATCH = 64
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def messages_of(task_input: Any) -> list[Any]:
    """The chat messages a task's ``input`` stands for: its ``messages``, or its ``prompt``/``question`` (or
    the input itself, when a string) as one user message."""
    if isinstance(task_input, list):
        return task_input
    if isinstance(task_input, str):
        return [{"role": "user", "content": task_input}]
    if isinstance(task_input, dict):
        if isinstance(task_input.get("messages"), list):
            return list(task_input["messages"])
        for key in ("prompt", "question"):
            if isinstance(task_input.get(key), str):
                return [{"role": "user", "content": task_input[key]}]
    return [{"role": "user", "content": orjson.dumps(task_input).decode()}]


def completion_params(server: AgentServer, task_input: Any) -> dict[str, Any]:
    """The server's default sampling parameters, overridden by the task's ``input.completion_params``."""
    params = dict(server.completion_params or {})
    if isinstance(task_input, dict) and isinstance(task_input.get("completion_params"), dict):
        params.update(task_input["completion_params"])
    return params


class InitFailed(Exception):
    """The agent server did not accept the rollout."""


class Dispatcher:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self._session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._inits: set[asyncio.Task[None]] = set()
        self._sending: set[str] = set()  # attempt ids whose init this process is sending
        self._next_resend = 0.0  # monotonic time of the next look for lost inits
        self._next_resume = 0.0  # monotonic time of the next look for 0.3 polls to resume
        #: The protocol of each server, by name, with the (url, updated_time) it was asked under.
        self._protocols: dict[str, tuple[tuple[str, float], Protocol]] = {}
        self._controller = v03.Controller(
            store,
            self._client,
            retries=settings.agent_init_retries,
            retry_max_wait=settings.retry_max_wait,
            record=self._record,
        )

    def _client(self) -> aiohttp.ClientSession:
        assert self._session is not None, "dispatcher not started"
        return self._session

    async def _record(self, rollout_id: str, attempt_id: str, info: dict[str, Any]) -> None:
        await self.store.record_dispatch(rollout_id, attempt_id, info)

    @property
    def server_url(self) -> str:
        if self.settings.public_url:
            return self.settings.public_url.rstrip("/")
        host = self.settings.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.settings.port}"

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.agent_init_timeout, sock_connect=5.0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self._loop_task = asyncio.create_task(self._run(), name="rollway-dispatcher")

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._inits) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._loop_task = None
        await self._controller.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            generation = self.store.queued.generation()
            full, servers = False, 0
            try:
                full, servers = await self.dispatch_once()
            except asyncio.CancelledError:
                raise
            except StoreError as exc:  # the database is down: once per interval, no traceback
                self.store.failures.log(log, "dispatch", "remote-agent dispatch failed: %s", exc.message)
            except Exception:
                log.exception("remote-agent dispatch failed")
            if full:  # a server took a whole batch: more may be waiting, look again at once
                continue
            if servers:  # woken by every enqueue, so a remote agent's task is dispatched at once
                await Signal.wait(generation, self.settings.agent_poll_interval)
            else:  # no server registered: an enqueue is a runner's task, only look again after the interval
                await asyncio.sleep(self.settings.agent_poll_interval)

    async def dispatch_once(self) -> tuple[bool, int]:
        """Claim what every registered server has room for and start its inits. Returns whether a server
        without a concurrency limit took a whole batch (so more tasks may be queued) and how many servers
        are registered."""
        full = False
        servers = await self.store.list_agents()
        for server in servers:
            limit = server.max_concurrent or CLAIM_BATCH
            try:
                batch = await self.store.claim_for_agent(server.name, limit)
            except NotFoundError:  # unregistered meanwhile
                continue
            full = full or (server.max_concurrent is None and len(batch) == limit)
            for attempted in batch:
                self._start(server, attempted)
        if servers and time.monotonic() >= self._next_resend:
            self._next_resend = time.monotonic() + self.settings.agent_init_timeout
            await self.resend_lost(servers)
        if servers and time.monotonic() >= self._next_resume:
            self._next_resume = time.monotonic() + LEASE_CHECK_INTERVAL
            await self.resume_polls(servers)
        return full, len(servers)

    async def resume_polls(self, servers: list[AgentServer]) -> None:
        """Resume the result polls of 0.3 attempts whose poller is gone (``v03.stale``)."""
        now = self.store.clock()
        for server in servers:  # (only 0.3 attempts keep a lease)
            for attempted, lease in await self.store.agent_leases(server.name):
                attempt_id = attempted.attempt.attempt_id
                if attempt_id not in self._sending and v03.stale(lease, now):
                    self._begin(attempt_id, self._resume(server, attempted, lease), "rollway-agent-poll")

    @property
    def init_window(self) -> float:
        """The longest one init (all its tries and waits, and the reads of ``/health`` that ask the protocol
        first) may take: an attempt older than this with no init outcome recorded was not being sent by any live
        process."""
        retries = self.settings.agent_init_retries
        waits = sum(max(self.settings.retry_max_wait, 0.05 * 2.0 ** (t - 1)) for t in range(1, retries + 1))
        probes = restarts.HEALTH_TIMEOUT * (retries + 1) + waits  # the protocol asked first (``protocol``)
        return float(self.settings.agent_init_timeout * (retries + 1) + waits + probes + 1.0)

    async def lost_inits(self, server: AgentServer) -> list[AttemptedRollout]:
        """The attempts of ``server`` whose init (or 0.3 admission) was lost with the process sending it: begun
        longer than ``init_window`` ago with nothing recorded, or a 0.3 admission not marked for as long, plus
        the two ``ADMIT_MARK_EVERY`` a mark may be late by (``store.sql.agents.undispatched``)."""
        started_before = self.store.clock() - self.init_window
        marked_before = started_before - 2 * admission.ADMIT_MARK_EVERY
        return await self.store.undispatched_attempts(server.name, started_before, marked_before)

    async def resend_lost(self, servers: list[AgentServer]) -> None:
        """Send again the inits lost with the process that was sending them (``lost_inits``)."""
        for server in servers:
            for attempted in await self.lost_inits(server):
                if attempted.attempt.attempt_id not in self._sending:
                    log.warning(
                        "init of rollout %s to '%s' was lost: sending it again",
                        attempted.rollout.rollout_id,
                        server.name,
                    )
                    self._start(server, attempted)

    def _start(self, server: AgentServer, attempted: AttemptedRollout) -> None:
        self._begin(attempted.attempt.attempt_id, self._dispatch(server, attempted), "rollway-agent-init")

    def _begin(self, attempt_id: str, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` for the attempt, which this process then sends or polls (no second task for it)."""
        self._sending.add(attempt_id)
        task = asyncio.create_task(work, name=name)
        self._inits.add(task)
        task.add_done_callback(self._inits.discard)
        task.add_done_callback(lambda _: self._sending.discard(attempt_id))

    async def _resume(self, server: AgentServer, attempted: AttemptedRollout, lease: dict[str, Any]) -> None:
        try:
            await self._controller.resume(server, attempted, lease)
        except StoreError as exc:
            self.store.failures.log(log, "dispatch", "result polls of '%s' failed: %s", server.name, exc.message)

    async def protocol(self, server: AgentServer) -> Protocol:
        """The protocol ``server`` speaks: the one it was registered with, else asked once per registration
        (``wire.probe``: v1 on a 404, 405 or any answer no 0.3 server gives). An answer that tells nothing for
        now (no answer, a 408, 429 or 5xx) is asked again as an init is retried (``ROLLWAY_AGENT_INIT_RETRIES``,
        the same backoff); ``InitFailed``, naming the last answer, when none tells, or at once on an answer that a
        second try would not change (401, 403, a redirect): the attempt is never sent in a protocol guessed."""
        if server.protocol is not None:  # registered with it: never asked
            return server.protocol
        known = self._protocols.get(server.name)
        if known is not None and known[0] == (server.url, server.updated_time):
            return known[1]
        assert self._session is not None, "dispatcher not started"
        tries = 0
        while True:
            tries += 1
            probed = await wire.probe(self._session, server)
            if probed.spoken is not None:
                self._protocols[server.name] = ((server.url, server.updated_time), probed.spoken)
                return probed.spoken
            if not probed.passing or tries > self.settings.agent_init_retries:
                raise InitFailed(
                    f"{probed.said} (after {tries} {'try' if tries == 1 else 'tries'}): the protocol the agent server "
                    'speaks is not known, so the rollout was not sent (a registration with "protocol" is not asked)'
                )
            await wait(max(backoff(tries, self.settings.retry_max_wait), 0.05 * 2 ** (tries - 1)))

    async def _dispatch(self, server: AgentServer, attempted: AttemptedRollout) -> None:
        rollout_id, attempt_id = attempted.rollout.rollout_id, attempted.attempt.attempt_id
        try:
            _, key = await self.store.mint_key("rollout", rollout_id=rollout_id, attempt_id=attempt_id)
            if await self.protocol(server) == "0.3":
                chat_url = f"{self.server_url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
                messages = messages_of(attempted.rollout.input)
                await self._controller.run(server, attempted, messages, chat_url, key)
                return
            payload = {
                "rollout_id": rollout_id,
                "server_url": self.server_url,
                "messages": messages_of(attempted.rollout.input),
                "completion_params": completion_params(server, attempted.rollout.input),
                "metadata": attempted.rollout.metadata or {},
                "api_key": key,
                "idempotency_key": attempt_id,
            }
            tools, tries = await self._init(server, payload)
            await self.store.record_dispatch(
                rollout_id, attempt_id, {"agent": server.name, "tools": tools, "init_tries": tries}
            )
        except (InitFailed, admission.Refused) as exc:
            log.warning("agent server '%s' refused rollout %s: %s", server.name, rollout_id, exc)
            await self._fail(rollout_id, attempt_id, {"agent": server.name, "error": str(exc)})
        except admission.HeldElsewhere as exc:  # another process's admission: its run is polled from the kept lease
            log.info("rollout %s at agent server '%s' is admitted already: %s", rollout_id, server.name, exc)
        except StoreError as exc:
            self.store.failures.log(
                log,
                "dispatch",
                "dispatch of rollout %s to agent server '%s' failed: %s",
                rollout_id,
                server.name,
                exc.message,
            )

    async def _fail(self, rollout_id: str, attempt_id: str, info: dict[str, Any]) -> None:
        try:
            await self.store.record_dispatch(rollout_id, attempt_id, info)
            await self.store.update_attempt(rollout_id, attempt_id, status="failed")
        except (ConflictError, NotFoundError):
            pass  # the attempt ended otherwise meanwhile (timed out, cancelled): nothing to fail

    async def _init(self, server: AgentServer, payload: dict[str, Any]) -> tuple[list[Any], int]:
        """POST the init, retrying what may pass on a second try: (the tools it answered, tries used)."""
        assert self._session is not None, "dispatcher not started"
        headers = {"Content-Type": "application/json"}
        if server.api_key is not None:
            headers["Authorization"] = f"Bearer {server.api_key.get_secret_value()}"
        body = orjson.dumps(payload)
        url = f"{server.url}/v1/rollout/init"
        tries = 0
        while True:
            tries += 1
            try:
                async with self._session.post(url, data=body, headers=headers, allow_redirects=False) as response:
                    raw = await response.read()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = f"no answer from {url}: {type(exc).__name__}"
            else:
                if status in (200, 201, 202):
                    return _tools(raw), tries
                said = wire.masked(raw, server, str(payload["api_key"]))  # never echo a key
                problem = f"{url} answered {status}{wire.redirected(response)}: {said}"
                if status not in RETRY_STATUSES:
                    raise InitFailed(problem)
            if tries > self.settings.agent_init_retries:
                raise InitFailed(f"{problem} (after {tries} tries)")
            await wait(max(backoff(tries, self.settings.retry_max_wait), 0.05 * 2 ** (tries - 1)))


def _tools(raw: bytes) -> list[Any]:
    try:
        answer = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return []
    tools = answer.get("tools") if isinstance(answer, dict) else None
    return tools if isinstance(tools, list) else []
