"""Which backend serves a call.

- Sticky per rollout: all calls of a rollout go to the backend its first call used (prefix-cache reuse), as
  long as that backend is healthy, under its ``max_concurrency``, and not loaded far above the others
  (a bounded-load rule: at most ``LOAD_FACTOR`` times the mean outstanding + ``LOAD_SLACK``).
- Otherwise least outstanding requests, weighted by ``weight``.
- Passive health: a connect error or 5xx counts as a failure; ``FAILURES_TO_EJECT`` in a row eject the
  backend for a cool-down that doubles on each relapse (up to ``MAX_COOLDOWN``). After it the backend is
  tried again by real traffic (re-probe); one success resets it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


class Router:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._health: dict[str, BackendHealth] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()

    def health(self, backend_id: str) -> BackendHealth:
        found = self._health.get(backend_id)
        if found is None:
            found = self._health[backend_id] = BackendHealth()
        return found

    def is_up(self, backend_id: str) -> bool:
        return self.health(backend_id).up(self._clock())

    def choose(self, backends: Sequence[Backend], rollout_id: str | None, exclude: set[str]) -> Backend | None:
        """The backend for the next try of a call, or None when every candidate is excluded."""
        now = self._clock()
        candidates = [b for b in backends if b.backend_id not in exclude]
        if not candidates:
            return None
        healthy = [b for b in candidates if self.health(b.backend_id).up(now)] or candidates
        open_ = [b for b in healthy if not self._full(b)] or healthy
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

    def started(self, backend_id: str) -> None:
        health = self.health(backend_id)
        health.outstanding += 1
        health.requests += 1

    def finished(self, backend_id: str, *, ok: bool, counts_as_failure: bool) -> None:
        """Record the outcome of one try. Only connect errors and 5xx count against health."""
        health = self.health(backend_id)
        health.outstanding -= 1
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
