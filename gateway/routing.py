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
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field

from rollway.store import Backend

LOAD_FACTOR = 1.25
LOAD_SLACK = 2
FAILURES_TO_EJECT = 2
BASE_COOLDOWN = 2.0
MAX_COOLDOWN = 60.0
STICKY_ENTRIES = 100_000
_NOTHING: frozenset[str] = frozenset()


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
    """A call waiting for a slot: ``pick`` is tried when a slot of one of ``backends`` frees, or at the router's
    one wake-up (a backend back from ejection, a wait asked for over: ``recheck``)."""

    alias: str
    backends: Sequence[Backend]
    pick: Pick
    recheck: Callable[[], float | None]
    backend_ids: frozenset[str] = frozenset()
    slot: asyncio.Future[Backend] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        self.backend_ids = frozenset(b.backend_id for b in self.backends)


class Router:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._health: dict[str, BackendHealth] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._waiters: deque[_Waiter] = deque()
        # The one wake-up of the waiting calls (not one timer per call): when it fires, slots are handed out once.
        self._wake: asyncio.TimerHandle | None = None

    def health(self, backend_id: str) -> BackendHealth:
        found = self._health.get(backend_id)
        if found is None:
            found = self._health[backend_id] = BackendHealth()
        return found

    def is_up(self, backend_id: str) -> bool:
        return self.health(backend_id).up(self._clock())

    def choose(self, backends: Sequence[Backend], rollout_id: str | None, exclude: Set[str]) -> Backend | None:
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
        if rollout_id is not None and len(backends) > 1:  # with one backend there is nothing to stick to
            self._remember(rollout_id, chosen.backend_id)
        return chosen

    @property
    def remembered(self) -> int:
        """Rollouts whose backend is remembered (at most ``STICKY_ENTRIES``)."""
        return len(self._sticky)

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

    def take(self, backends: Sequence[Backend], rollout_id: str | None) -> Backend | None:
        """The fast path of a call's first try: ``choose`` with nothing excluded, its slot taken; None when no
        backend has a free slot (then the call waits: ``acquire``). A free slot is never one a waiting call could
        use: those are handed out as they free (``_hand_out``)."""
        backend = self.choose(backends, rollout_id, _NOTHING)
        if backend is not None:
            self.begin_try(backend.backend_id)
        return backend

    async def acquire(
        self,
        alias: str,
        backends: Sequence[Backend],
        pick: Pick,
        timeout: float,
        recheck: Callable[[], float | None] = lambda: None,
    ) -> Backend | None:
        """A backend for the next try of a call of ``alias``, its slot taken (``started``): what ``pick`` gives at
        once, else wait, in arrival order, until ``pick`` gives one as a slot frees. None after ``timeout``
        seconds. ``recheck``: seconds until something other than a try ending may open a slot (a wait asked for
        ends), when ``pick`` is tried again. A caller cancelled while waiting leaves the queue (a slot handed to
        it meanwhile is given back).

        Invariant: after every change (a try ending, a backend back, a wait over), every free slot a waiting call
        can use has been handed out, in arrival order. So a newcomer that ``pick`` gives a slot takes none an
        earlier call could use, and does not queue behind calls waiting for other slots than the one it gets."""
        backend = pick()
        if backend is not None:
            self.begin_try(backend.backend_id)
            return backend
        if timeout <= 0:
            return None
        waiter = _Waiter(alias, backends, pick, recheck)
        self._waiters.append(waiter)
        self._wake_in(self._soonest(waiter))
        taken: Backend | None = None
        try:
            await asyncio.wait([waiter.slot], timeout=timeout)
            if waiter.slot.done():
                taken = waiter.slot.result()
            return taken
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if not waiter.slot.done():
                waiter.slot.cancel()
            elif taken is None:  # handed a slot just as the caller left: given back, to the next in line
                self.end_try(waiter.slot.result().backend_id, ok=False, counts_as_failure=False)
            if not self._waiters and self._wake is not None:
                self._wake.cancel()
                self._wake = None

    def waiting(self, alias: str | None = None) -> int:
        """Calls waiting for a slot (of ``alias``; of every alias when None)."""
        return sum(1 for waiter in self._waiters if alias is None or waiter.alias == alias)

    def _soonest(self, waiter: _Waiter) -> float | None:
        """Seconds until something other than a try ending may open a slot for ``waiter`` (None: nothing)."""
        soon = [s for s in (waiter.recheck(), self.next_recovery(waiter.backends)) if s is not None]
        return min(soon) if soon else None

    def _wake_in(self, delay: float | None) -> None:
        """Make the router's one wake-up come within ``delay`` seconds (None: no need)."""
        if delay is None or not self._waiters:
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay)
        if self._wake is not None:
            if self._wake.when() <= when:
                return
            self._wake.cancel()
        self._wake = loop.call_at(when, self._woken)

    def _woken(self) -> None:
        """The wake-up: slots handed out once for every waiting call, then the next wake-up set."""
        self._wake = None
        self._hand_out(None)
        soon = [s for s in map(self._soonest, self._waiters) if s is not None]
        if soon:
            self._wake_in(min(soon))

    def _hand_out(self, backend_id: str | None) -> None:
        """Give free slots to waiters, in arrival order: the one of ``backend_id`` when a try on it ended (to the
        first that can take it; one that takes another backend leaves it for the next); every slot some waiter
        can use when ``backend_id`` is None (something else changed). A waiter whose backends are all full is
        passed over without a ``pick``; once the freed backend is full again the scan stops."""
        served = []
        for waiter in self._waiters:
            if backend_id is not None:
                if backend_id not in waiter.backend_ids:
                    continue
                freed = next(b for b in waiter.backends if b.backend_id == backend_id)
                if self._full(freed):
                    break  # the freed slot is taken again: nothing more to hand out
            elif all(self._full(b) for b in waiter.backends):
                continue
            backend = waiter.pick()
            if backend is None:
                continue
            self.begin_try(backend.backend_id)
            waiter.slot.set_result(backend)
            served.append(waiter)
        if served:
            self._waiters = deque(waiter for waiter in self._waiters if not waiter.slot.done())

    def begin_try(self, backend_id: str) -> None:
        health = self.health(backend_id)
        health.outstanding += 1
        health.requests += 1

    def end_try(self, backend_id: str, *, ok: bool, counts_as_failure: bool) -> None:
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
            self._wake_in(health.cooldown)  # waiting calls look again when it is back

    def eject(self, backend_id: str) -> None:
        """Mark a backend down at once (its connection was refused)."""
        health = self.health(backend_id)
        health.failures += 1
        health.down_until = self._clock() + health.cooldown
        health.consecutive_failures = 0
        if self._waiters:  # with every backend of a call down, any of them will do
            self._hand_out(None)
            self._wake_in(health.cooldown)
