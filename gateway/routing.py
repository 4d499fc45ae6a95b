"""Which backend serves a call.

- ``max_concurrency`` is a cap on the tries in flight to a backend from this process. When every healthy
  backend a call may use is at its cap, the call waits for a slot (``acquire``): waiters are served first come
  first served, each handed a slot as a try on one of its backends ends (no polling), until a bound, after
  which the caller refuses the call. Backends without ``max_concurrency`` are unlimited.
- Sticky per rollout: all calls of a rollout go to the backend its first call used (prefix-cache reuse), as
  long as that backend is healthy, under its ``max_concurrency``, and not loaded far above the others
  (a bounded-load rule: at most ``LOAD_FACTOR`` times the mean outstanding + ``LOAD_SLACK``).
- Otherwise least outstanding requests, weighted by ``weight``.
- Passive health: a connect error or 5xx counts as a failure; ``FAILURES_TO_EJECT`` in a row eject the
  backend for a cool-down that doubles on each relapse (up to ``MAX_COOLDOWN``). After it the backend is
  tried again by real traffic (re-probe); one success resets it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from store import Backend

LOAD_FACTOR = 1.25
LOAD_SLACK = 2
FAILURES_TO_EJECT = 2
BASE_COOLDOWN = 2.0
MAX_COOLDOWN = 60.0
STICKY_ENTRIES = 100_000


@dataclass
class BackendHealth:
    outstanding: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    cooldown: float = BASE_COOLDOWN
    requests: int = 0
    failures: int = 0

    def up(self, now: float) -> bool:
        return now >= self.down_until


#: Picks a backend for a call and reports it, or None when none may take it now.
Pick = Callable[[], Backend | None]


@dataclass(eq=False)
class _Waiter:
    """A call waiting for a slot: ``pick`` is tried each time a try on one of ``backend_ids`` ends."""

    alias: str
    backend_ids: frozenset[str]
    pick: Pick
    slot: asyncio.Future[Backend] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Router:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._health: dict[str, BackendHealth] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._waiters: deque[_Waiter] = deque()

    def health(self, backend_id: str) -> BackendHealth:
        found = self._health.get(backend_id)
        if found is None:
            found = self._health[backend_id] = BackendHealth()
        return found

    def is_up(self, backend_id: str) -> bool:
        return self.health(backend_id).up(self._clock())

    def choose(self, backends: Sequence[Backend], rollout_id: str | None, exclude: set[str]) -> Backend | None:
        """The backend for the next try of a call, or None when every candidate is excluded or every healthy one
        (every one, when none is healthy) is at its ``max_concurrency``."""
        now = self._clock()
        candidates = [b for b in backends if b.backend_id not in exclude]
        if not candidates:
            return None
        healthy = [b for b in candidates if self.health(b.backend_id).up(now)] or candidates
        open_ = [b for b in healthy if not self._full(b)]
        if not open_:
            return None
        if rollout_id is not None:
            sticky_id = self._sticky.get(rollout_id)
            sticky = next((b for b in open_ if b.backend_id == sticky_id), None)
            if sticky is not None and self._within_bound(sticky, open_):
                self._sticky.move_to_end(rollout_id)
                return sticky
        chosen = min(open_, key=lambda b: (self.health(b.backend_id).outstanding + 1) / b.weight)
        if rollout_id is not None:
            self._remember(rollout_id, chosen.backend_id)
        return chosen

    def _full(self, backend: Backend) -> bool:
        limit = backend.max_concurrency
        return limit is not None and self.health(backend.backend_id).outstanding >= limit

    def _within_bound(self, backend: Backend, pool: Sequence[Backend]) -> bool:
        mean = sum(self.health(b.backend_id).outstanding for b in pool) / len(pool)
        return self.health(backend.backend_id).outstanding <= LOAD_FACTOR * mean + LOAD_SLACK

    def _remember(self, rollout_id: str, backend_id: str) -> None:
        self._sticky[rollout_id] = backend_id
        self._sticky.move_to_end(rollout_id)
        if len(self._sticky) > STICKY_ENTRIES:
            self._sticky.popitem(last=False)

    def next_recovery(self, backends: Sequence[Backend]) -> float | None:
        """Seconds until the first of ``backends`` that is ejected is routed to again (None: none is ejected)."""
        now = self._clock()
        left = [self.health(b.backend_id).down_until - now for b in backends if not self.health(b.backend_id).up(now)]
        return min(left) if left else None

    async def acquire(
        self,
        alias: str,
        backends: Sequence[Backend],
        pick: Pick,
        timeout: float,
        recheck: Callable[[], float | None] = lambda: None,
    ) -> Backend | None:
        """A backend for the next try of a call of ``alias``, its slot taken (``started``): what ``pick`` gives at
        once, unless calls are already waiting for one of ``backends`` (they go first); else wait, in arrival
        order, until ``pick`` gives one as a try ends. None after ``timeout`` seconds. ``recheck``: seconds until
        something other than a try ending may open a slot (a wait asked for ends), when ``pick`` is tried again.
        A caller cancelled while waiting leaves the queue (a slot handed to it meanwhile is given back)."""
        ids = frozenset(b.backend_id for b in backends)
        if not any(ids & waiter.backend_ids for waiter in self._waiters):
            backend = pick()
            if backend is not None:
                self.started(backend.backend_id)
                return backend
        if timeout <= 0:
            return None
        waiter = _Waiter(alias, ids, pick)
        self._waiters.append(waiter)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        taken: Backend | None = None
        try:
            while (left := deadline - loop.time()) > 0:
                soon = [s for s in (recheck(), self.next_recovery(backends)) if s is not None]
                await asyncio.wait([waiter.slot], timeout=min([left, *soon]))
                if not waiter.slot.done() and soon:
                    self._hand_out(None)
                if waiter.slot.done():
                    taken = waiter.slot.result()
                    return taken
            return None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if not waiter.slot.done():
                waiter.slot.cancel()
            elif taken is None:  # handed a slot just as the caller left: given back, to the next in line
                self.finished(waiter.slot.result().backend_id, ok=False, counts_as_failure=False)

    def waiting(self, alias: str | None = None) -> int:
        """Calls waiting for a slot (of ``alias``; of every alias when None)."""
        return sum(1 for waiter in self._waiters if alias is None or waiter.alias == alias)

    def _hand_out(self, backend_id: str | None) -> None:
        """Give slots to waiters in arrival order: one to the first that can take it when a try on ``backend_id``
        ended; to every one that can when ``backend_id`` is None (something else changed)."""
        served = []
        for waiter in self._waiters:
            if backend_id is not None and backend_id not in waiter.backend_ids:
                continue
            backend = waiter.pick()
            if backend is None:
                continue
            self.started(backend.backend_id)
            waiter.slot.set_result(backend)
            served.append(waiter)
            if backend_id is not None:
                break  # one try ended: one slot
        for waiter in served:
            self._waiters.remove(waiter)

    def started(self, backend_id: str) -> None:
        health = self.health(backend_id)
        health.outstanding += 1
        health.requests += 1

    def finished(self, backend_id: str, *, ok: bool, counts_as_failure: bool) -> None:
        """Record the outcome of one try (its slot goes to the first call waiting for it). Only connect errors and
        5xx count against health."""
        health = self.health(backend_id)
        health.outstanding -= 1
        self._record(health, ok=ok, counts_as_failure=counts_as_failure)
        if self._waiters:
            self._hand_out(backend_id)

    def _record(self, health: BackendHealth, *, ok: bool, counts_as_failure: bool) -> None:
        if ok:
            health.consecutive_failures = 0
            if health.up(self._clock()):  # a success of a call that started before an ejection does not end it
                health.cooldown = BASE_COOLDOWN
                health.down_until = 0.0  # a later ejection is a new one, not a relapse
            return
        if not counts_as_failure:
            return
        health.failures += 1
        health.consecutive_failures += 1
        if health.consecutive_failures >= FAILURES_TO_EJECT:
            now = self._clock()
            was_down = health.down_until > 0 and now - health.down_until < health.cooldown
            health.cooldown = min(MAX_COOLDOWN, health.cooldown * 2) if was_down else BASE_COOLDOWN
            health.down_until = now + health.cooldown
            health.consecutive_failures = 0

    def eject(self, backend_id: str) -> None:
        """Mark a backend down at once (its connection was refused)."""
        health = self.health(backend_id)
        health.failures += 1
        health.down_until = self._clock() + health.cooldown
        health.consecutive_failures = 0
