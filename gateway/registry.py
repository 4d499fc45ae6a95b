"""Model aliases as the gateway sees them: a read-through cache over the store, plus the live state of each
alias — paused, in-flight calls, and the pause/drain/swap/resume mechanics.

A call *admits* itself to an alias and gets a ``Lease``: the alias configuration (backends, version) at that
moment. A swap replaces the configuration atomically for later calls; calls holding a lease finish on the
backends they started with, and every span records the version of its lease.

Replicas (processes sharing the database): every change to an alias moves the store's catalog revision
forward in the change's own transaction. Each call's arrival transaction reads it (``CallTicket``), and the
gateway tells the registry (``observe``) before the call takes its lease: a registry that sees a revision it
has not seen forgets its cached configuration, so a call that arrives after a swap, pause, resume or deletion
made through another replica committed is served as that change says. The TTL stays as a backstop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from store import ModelAlias, NotFoundError, Store

DEFAULT_TTL = 2.0
#: How often a call waiting on a paused alias asks the store whether the catalog changed (a resume made
#: through another replica).
PAUSE_POLL = 0.25


class AliasPaused(Exception):
    """The alias stayed paused longer than the caller may wait."""

    def __init__(self, alias: str, retry_after: float) -> None:
        super().__init__(f"model '{alias}' is paused; retry later")
        self.alias = alias
        self.retry_after = retry_after


class UnknownAlias(Exception):
    def __init__(self, alias: str, known: list[str]) -> None:
        listed = ", ".join(known) if known else "none registered"
        super().__init__(f"model '{alias}' does not exist; known models: {listed}")
        self.alias = alias


@dataclass
class AliasState:
    """The live state of one alias in this process."""

    config: ModelAlias
    loaded_at: float
    in_flight: int = 0
    waiting: int = 0  # calls waiting for it to resume
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()
        self.set_paused(self.config.paused)

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def set_paused(self, paused: bool) -> None:
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()


@dataclass
class Lease:
    """One call's hold on an alias: the configuration it runs with."""

    alias: str
    config: ModelAlias
    _state: AliasState
    _released: bool = False

    @property
    def version(self) -> str:
        return self.config.version

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._state.in_flight -= 1
        if self._state.in_flight == 0:
            self._state.idle.set()


class ModelRegistry:
    """Aliases → configuration and live state (see module docstring)."""

    def __init__(self, store: Store, *, ttl: float = DEFAULT_TTL, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
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

    async def admit(self, alias: str, wait_seconds: float) -> Lease:
        """Take a lease on ``alias``, waiting up to ``wait_seconds`` while it is paused. A resume in this process
        wakes the waiters at once; one in another process sharing the database (a replica) is seen when the
        waiter next asks the store for the catalog revision (every ``PAUSE_POLL`` seconds) or its copy of the
        alias outlives the TTL."""
        state = await self.state(alias)
        if state.paused:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_seconds
            held = state
            held.waiting += 1
            try:
                while state.paused and (left := deadline - loop.time()) > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(state.resumed.wait(), min(left, max(self._ttl, 0.01), PAUSE_POLL))
                    if state.paused:
                        await self.refresh()
                        state = await self.state(alias)
            finally:
                held.waiting -= 1
            if state.paused:
                raise AliasPaused(alias, retry_after=max(1.0, wait_seconds))
        state.in_flight += 1
        state.idle.clear()
        return Lease(alias=alias, config=state.config, _state=state)

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

    # -- control: pause, resume, drain, swap (the admin API calls these) --------------------------------

    async def pause(self, alias: str) -> ModelAlias:
        config = await self._store.set_model_paused(alias, True)
        self._install(alias, config, local=True)
        return config

    async def resume(self, alias: str) -> ModelAlias:
        config = await self._store.set_model_paused(alias, False)
        self._install(alias, config, local=True)
        return config

    async def drain(self, alias: str, timeout: float) -> bool:
        """Wait until no call of ``alias`` is in flight in this process; False on timeout."""
        state = await self.state(alias)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle.wait(), timeout)
        return state.in_flight == 0

    async def swap(self, alias: str, config: ModelAlias) -> None:
        """Install a new configuration: later calls use it, calls in flight keep theirs."""
        self._install(alias, config, local=True)

    def in_flight(self, alias: str) -> int:
        state = self._states.get(alias)
        return 0 if state is None else state.in_flight

    def waiting(self, alias: str) -> int:
        """Calls of this process waiting for ``alias`` to resume."""
        state = self._states.get(alias)
        return 0 if state is None else state.waiting
