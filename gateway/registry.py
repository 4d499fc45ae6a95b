"""Model aliases as the gateway sees them: a read-through cache over the store, plus the live state of each
alias — paused, in-flight calls, and the pause/drain/swap/resume mechanics.

A call *admits* itself to an alias and gets a ``Lease``: the alias configuration (backends, version) at that
moment. A swap replaces the configuration atomically for later calls; calls holding a lease finish on the
backends they started with, and every span records the version of its lease (the ``version`` of the lease's
backend that served it, when that backend has one).

Replicas (processes sharing the database): every change to an alias moves the store's catalog revision
forward in the change's own transaction. Each call's arrival transaction reads it (``CallTicket``), and the
gateway tells the registry (``observe``) before the call takes its lease: a registry that sees a revision it
has not seen forgets its cached configuration, so a call that arrives after a swap, pause, resume or deletion
made through another replica committed is served as that change says. The TTL stays as a backstop.

Drain counts the calls of every replica: each process reports its calls in flight per alias and per
configuration (``rollway.app.replicas``), and ``drain`` waits until every live replica has reported since the
drain began and none of them, this one included, still has a call of the alias (or, after a swap, of an
earlier configuration of it). A call counts from before its arrival transaction (``arrival``) — a call that
read the catalog before a change may still take a lease on the old configuration — until it ends; while it
has no lease yet, only for drains that began under a newer catalog revision than it arrived under.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rollway.gateway.errors import AliasPaused, UnknownAlias
from rollway.gateway.kinds import BackendKinds, Capture, TrainableWatch
from rollway.gateway.leases import ARRIVING, AliasState, Arrival, Lease, config_key
from rollway.store import Backend, ModelAlias, NotFoundError, Store, StoreError, StoreValidationError
from rollway.store.replicas import ReplicaReport

DEFAULT_TTL = 2.0
#: How often a call waiting on a paused alias asks the store whether the catalog changed (a resume made
#: through another replica).
PAUSE_POLL = 0.25
#: How often a drain reads the other replicas' reports, and how much longer than its timeout its reads may take.
DRAIN_POLL = 0.1
DRAIN_GRACE = 1.0


class ModelRegistry:
    """Aliases → configuration and live state (see module docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], float] = time.monotonic,
        replica_id: str | None = None,
    ) -> None:
        self._store = store
        self.replica_id = replica_id  # this process in the replicas' reports (None: not reporting)
        self._arriving: dict[tuple[str, int], int] = {}  # (alias, revision seen) → calls not leased yet
        self._ttl = ttl
        self._clock = clock
        self._states: dict[str, AliasState] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._revision: int | None = None  # the catalog revision last seen
        self._listeners: list[Callable[[], None]] = []
        # Moves on every invalidation and local change: a reload that began before one is thrown away (what it
        # read may be older than the change) and done again.
        self._generation = 0
        self._poll_lock = asyncio.Lock()
        self._polled_at = float("-inf")
        self.kinds = BackendKinds()  # what engine each ``auto`` backend is
        self.watch = TrainableWatch()  # completions without token ids, per alias

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever ``observe`` sees the catalog change (the key cache forgets its keys)."""
        self._listeners.append(callback)

    def observe(self, revision: int) -> bool:
        """The store's catalog revision, as a call's arrival read it: when it is newer than the last one seen
        (or none was), forget every cached configuration and tell the listeners. True when it changed."""
        if self._revision is not None and revision <= self._revision:
            return False
        self._revision = revision
        self.invalidate()
        for callback in self._listeners:
            callback()
        return True

    def paused(self, alias: str) -> bool:
        """Whether ``alias`` is paused as this process last saw it (False when it is not loaded)."""
        state = self._states.get(alias)
        return state is not None and state.paused

    async def state(self, alias: str) -> AliasState:
        """The alias's state, reloaded from the store when older than the TTL (other processes may change it)."""
        state = self._states.get(alias)
        if state is not None and self._clock() - state.loaded_at < self._ttl:
            return state
        lock = self._locks.setdefault(alias, asyncio.Lock())
        async with lock:
            state = self._states.get(alias)
            if state is not None and self._clock() - state.loaded_at < self._ttl:
                return state
            generation = -1
            while generation != self._generation:  # read again if the cache was invalidated meanwhile
                generation = self._generation
                try:
                    config: ModelAlias | None = await self._store.get_model(alias)
                except NotFoundError:
                    config = None
            if config is None:
                self._states.pop(alias, None)
                self._locks.pop(alias, None)  # any name a client sends: an unknown one must leave nothing behind
                known = [m.alias for m in await self._store.list_models()]
                raise UnknownAlias(alias, known)
            return self._install(alias, config)

    def _install(self, alias: str, config: ModelAlias, *, local: bool = False) -> AliasState:
        if local:  # a change made here: a reload that read before it must not land after it
            self._generation += 1
        state = self._states.get(alias)
        if state is None:
            state = AliasState(config=config, loaded_at=self._clock())
            self._states[alias] = state
        else:
            if config is not state.config:
                state.key = config_key(config)
            state.config = config
            state.loaded_at = self._clock()
            state.set_paused(config.paused)
        return state

    def invalidate(self, alias: str | None = None) -> None:
        """Forget cached configuration (all aliases when ``alias`` is None); live state is kept."""
        self._generation += 1
        for name, state in self._states.items():
            if alias is None or name == alias:
                state.loaded_at = float("-inf")

    def arrival(self, alias: str) -> Arrival:
        """Count a call of ``alias`` as in flight from now (before its arrival transaction) until ``admit`` or
        ``Arrival.end``: the replicas' reports must include calls that read the catalog before a change."""
        return Arrival(self._arriving, alias, -1 if self._revision is None else self._revision)

    async def admit(self, alias: str, wait_seconds: float, arrival: Arrival | None = None) -> Lease:
        """Take a lease on ``alias``, waiting up to ``wait_seconds`` while it is paused. A resume in this process
        wakes the waiters at once; one in another process sharing the database (a replica) is seen when the
        waiter next asks the store for the catalog revision (every ``PAUSE_POLL`` seconds) or its copy of the
        alias outlives the TTL. ``arrival`` ends when the call holds its lease, starts to wait, or fails."""
        try:
            return await self._admit(alias, wait_seconds, arrival)
        finally:
            if arrival is not None:
                arrival.end()

    async def _admit(self, alias: str, wait_seconds: float, arrival: Arrival | None) -> Lease:
        state = await self.state(alias)
        if state.paused:
            if arrival is not None:
                arrival.end()  # it will lease what is current when the alias resumes: not a call to drain
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_seconds
            held = state
            held.waiting += 1
            try:
                # A weight update's hold may outlast the pause bound: the call waits for whichever ends later.
                while state.paused and (left := max(deadline - loop.time(), state.hold_left(time.time()))) > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(state.resumed.wait(), min(left, max(self._ttl, 0.01), PAUSE_POLL))
                    if state.paused:
                        await self.refresh()
                        state = await self.state(alias)
            finally:
                held.waiting -= 1
            if state.paused:
                raise AliasPaused(alias, retry_after=max(1.0, wait_seconds))
        state.by_key[state.key] = state.by_key.get(state.key, 0) + 1
        return Lease(alias=alias, config=state.config, _state=state, _key=state.key)

    async def refresh(self) -> None:
        """Ask the store for the catalog revision and ``observe`` it: one read per half ``PAUSE_POLL`` however
        many waiting calls ask."""
        loop = asyncio.get_running_loop()
        async with self._poll_lock:
            if loop.time() - self._polled_at < PAUSE_POLL / 2:
                return
            revision = await self._store.catalog_revision()
            self._polled_at = loop.time()
        self.observe(revision)

    # -- control: put, swap, delete, pause, resume, drain (the admin API calls these, one per route) ------

    async def pause(self, alias: str) -> ModelAlias:
        config = await self._store.set_model_paused(alias, True)
        self._install(alias, config, local=True)
        return config

    async def resume(self, alias: str) -> ModelAlias:
        config = await self._store.set_model_paused(alias, False)
        self._install(alias, config, local=True)
        return config

    async def drain(self, alias: str, timeout: float, *, old_only: bool = False) -> bool:
        """Wait until no call of ``alias`` is in flight in any replica (``old_only``: none on a configuration
        other than the stored one — what a swap waits for); False on timeout (the store's reads get at most
        ``DRAIN_GRACE`` seconds more). Another replica's report counts once it was written after the drain
        began (see ``rollway.app.replicas``)."""
        try:
            async with asyncio.timeout(timeout + DRAIN_GRACE):
                return await self._drain(alias, timeout, old_only)
        except TimeoutError:
            return False

    async def _drain(self, alias: str, timeout: float, old_only: bool) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        config = await self._store.get_model(alias)  # NotFoundError for an alias that does not exist
        since = await self._store.catalog_revision()
        self.observe(since)  # from here on, calls of this process lease a configuration read after the change
        state = await self.state(alias)
        current = config_key(config) if old_only else None
        while True:
            remote = await self._remote(alias, current, since)
            local = (state.in_flight if current is None else state.old(current)) + self._arrived(alias, since)
            if local == 0 and remote == 0:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            state.released.clear()  # a hint only (other drains clear it too): never wait longer than the poll
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, DRAIN_POLL)):
                    await state.released.wait()

    def _arrived(self, alias: str, since: int) -> int:
        """Calls of this process not leased yet that arrived before it saw revision ``since``."""
        return sum(n for (name, revision), n in self._arriving.items() if name == alias and revision < since)

    async def _remote(self, alias: str, current: str | None, since: int) -> int:
        """The other replicas' calls of ``alias`` (of configurations other than ``current`` when given), or 1
        while one of them has not reported since revision ``since`` (or their reports cannot be read)."""
        reports = await self._peers()
        if reports is None or any(report.revision < since for report in reports):
            return 1
        return sum(_count(report, alias, current, since) for report in reports)

    async def _peers(self) -> list[ReplicaReport] | None:
        """The other live replicas' last reports ([] when this registry does not report); None: unreadable."""
        if self.replica_id is None:
            return []
        try:
            return await self._store.live_replicas(exclude=self.replica_id)
        except StoreError:
            return None

    async def in_flight_everywhere(
        self, models: list[ModelAlias], *, since: int | None = None
    ) -> dict[str, tuple[int, int]]:
        """Per alias: calls in flight in every live replica (the others as of their last reports; calls not
        leased yet included), and of those the calls leased on an earlier configuration than ``models``.

        ``since`` (a catalog revision): a replica that has not reported since it, or reports that cannot be read,
        count as at least one call of each alias, as in a drain: a count of 0 then means every live replica has
        reported nothing in flight since that revision."""
        peers = await self._peers()
        reports = peers or []
        unknown = since is not None and peers is None
        counts: dict[str, tuple[int, int]] = {}
        for model in models:
            current = config_key(model)
            state = self._states.get(model.alias)
            total = self._arrived(model.alias, sys.maxsize)
            old = 0
            if state is not None:
                total, old = total + state.in_flight, state.old(current)
            for report in reports:
                n = _count(report, model.alias, None, sys.maxsize)
                total += max(n, 1) if since is not None and report.revision < since else n
            old += sum(_count(report, model.alias, current, -1) for report in reports)
            counts[model.alias] = (max(total, 1) if unknown else total, old)
        return counts

    def snapshot(self) -> dict[str, dict[str, int]]:
        """This process's calls in flight: alias → configuration key (for calls not leased yet, ``ARRIVING`` +
        the revision seen when they arrived) → calls."""
        counts = {alias: dict(state.by_key) for alias, state in self._states.items() if state.by_key}
        for (alias, revision), n in self._arriving.items():
            counts.setdefault(alias, {})[f"{ARRIVING}{revision}"] = n
        return counts

    async def detect(self, model: ModelAlias) -> None:
        """Ask each ``auto`` backend of ``model`` what engine it is (when the alias is put or swapped)."""
        await asyncio.gather(*(self.kinds.resolve(b) for b in model.backends if b.kind == "auto"))

    def detected_kinds(self) -> dict[str, str]:
        return dict(self.kinds.detected())

    async def reachable(self, backends: list[Backend]) -> dict[str, bool]:
        """By backend id: whether each one's address accepts a connection now (``BackendKinds.reachable``), all
        tried at once."""
        answers = await asyncio.gather(*(self.kinds.reachable(b) for b in backends))
        return {b.backend_id: up for b, up in zip(backends, answers, strict=True)}

    def capture(self, alias: str) -> Capture:
        return self.watch.counts(alias)

    def install(self, alias: str, config: ModelAlias) -> None:
        """Install a configuration just stored: later calls use it, calls in flight keep theirs."""
        self._install(alias, config, local=True)

    async def put(
        self,
        alias: str,
        backends: Sequence[Backend | dict[str, Any]],
        *,
        version: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> ModelAlias:
        """Create or replace ``alias`` (a replaced alias gets version + 1 unless one is given): stored, installed
        for the calls that come next, and each of its ``auto`` backends asked what engine it is."""
        model = await self._store.put_model(alias, list(backends), version=version, sampling=sampling)
        self.install(alias, model)
        await self.detect(model)
        return model

    async def swap(
        self,
        alias: str,
        backends: Sequence[Backend] | None = None,
        *,
        version: str | None = None,
        drain_timeout: float | None = None,
    ) -> tuple[ModelAlias, bool | None]:
        """New backends (None: the same ones) and/or a new version for new calls, the alias's sampling kept; a
        new backend that does not say its kind takes the alias's. With ``drain_timeout``, then wait until the
        calls still running on an earlier configuration, in every replica, have finished: whether they did."""
        current = await self._store.get_model(alias)
        chosen = current.backends if backends is None else [_kind_kept(b, current) for b in backends]
        model = await self.put(alias, chosen, version=version, sampling=current.sampling)
        if drain_timeout is None:
            return model, None
        return model, await self.drain(alias, drain_timeout, old_only=True)

    async def delete(self, alias: str) -> None:
        """Delete ``alias``: calls in flight finish, later ones are refused as for any unknown alias."""
        await self._store.delete_model(alias)
        self.invalidate(alias)

    def abort(self, alias: str, reason: str) -> int:
        """End this process's calls of ``alias`` in flight (a weight update that aborts them): each writes its
        span as aborted. How many this ended (each call is counted once, by the abort that ended it)."""
        state = self._states.get(alias)
        if state is None:
            return 0
        return sum(lease.abort(reason) for lease in list(state.leases))

    def held(self, alias: str) -> bool:
        """Whether a weight update holds ``alias`` as this process last saw it."""
        state = self._states.get(alias)
        return state is not None and state.paused and state.config.update_id is not None

    def in_flight(self, alias: str) -> int:
        state = self._states.get(alias)
        return 0 if state is None else state.in_flight

    def waiting(self, alias: str) -> int:
        """Calls of this process waiting for ``alias`` to resume."""
        state = self._states.get(alias)
        return 0 if state is None else state.waiting


def _kind_kept(backend: Backend, current: ModelAlias) -> Backend:
    """A swapped-in backend that does not say its kind has the alias's (a vllm alias swapped to new weights
    stays vllm: its token ids are still captured), when the alias's backends agree on one."""
    if "kind" in backend.model_fields_set:
        return backend
    kinds = {b.kind for b in current.backends}
    if len(kinds) != 1:
        raise StoreValidationError(
            f"model '{current.alias}' has backends of several kinds: give each new backend's kind"
        )
    return backend.model_copy(update={"kind": kinds.pop()})


def _count(report: ReplicaReport, alias: str, current: str | None, since: int) -> int:
    """A report's calls of ``alias``: leased ones on a configuration other than ``current`` (all when None),
    and calls not leased yet that arrived under a revision older than ``since``."""
    total = 0
    for key, n in report.in_flight.get(alias, {}).items():
        if key.startswith(ARRIVING):
            total += n if _revision_of(key) < since else 0
        elif current is None or key != current:
            total += n
    return total


def _revision_of(key: str) -> int:
    try:
        return int(key[len(ARRIVING) :])
    except ValueError:  # not one this version writes: count it
        return -1
