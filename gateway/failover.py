"""Where one call's next try may go, and how long to wait before it: the retry bookkeeping of a call across the
backends of its alias (``gateway.proxy`` sends the tries, ``gateway.routing`` picks among what is left).

- A backend that failed (connect error, 5xx, 429) is passed over while another backend of the alias has not
  failed; once each has, the round starts again (after a backoff).
- A backend that answered 429 with ``Retry-After`` (capped by ``ROLLWAY_RETRY_MAX_WAIT``) is not tried again
  before that time. The call fails over at once to a backend that is not asking to wait; when every backend
  is asking, it waits for the first of them to be ready (the shortest remaining wait) and tries that one.
- Other failures wait a backoff with full jitter before the next try.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rollway.gateway.upstream import backoff
from rollway.store import Backend

if TYPE_CHECKING:
    from rollway.gateway.routing import Router


class Tries:
    """One call's failed backends and the waits its backends asked for."""

    def __init__(self, backends: Sequence[Backend], clock: Callable[[], float] = time.monotonic) -> None:
        self.backends = backends
        self._ids = [b.backend_id for b in backends]
        self._clock = clock
        self._failed: set[str] = set()
        self._until: dict[str, float] = {}  # backend → when the wait it asked for ends (clock time)
        self._asked = False  # the last failure asked to wait (Retry-After)

    def asking(self) -> set[str]:
        """The backends still asking this call to wait: never tried before their time."""
        now = self._clock()
        return {backend_id for backend_id, until in self._until.items() if until > now}

    def passed_over(self) -> set[str]:
        """The backends the next try avoids while another will do: asking to wait, or failed this round."""
        return self._failed | self.asking()

    def pick(self, router: Router, rollout_id: str | None) -> Backend | None:
        """The backend of the next try, among those with a free slot: never one asking to wait, one that failed
        this round only when no other has room; None when none has room."""
        return router.choose(self.backends, rollout_id, self.passed_over()) or router.choose(
            self.backends, rollout_id, self.asking()
        )

    def next_ready(self) -> float | None:
        """Seconds until the first backend asking to wait is ready again (None: none is asking)."""
        now = self._clock()
        waits = [until - now for until in self._until.values() if until > now]
        return min(waits) if waits else None

    def failed(self, backend_id: str, retry_after: float | None = None) -> None:
        """A try on ``backend_id`` failed; ``retry_after``: the seconds its 429 asked for (already capped)."""
        self._failed.add(backend_id)
        self._asked = retry_after is not None
        if retry_after:
            self._until[backend_id] = self._clock() + retry_after

    def pause(self, attempt: int, max_wait: float) -> float:
        """Seconds to wait before retry number ``attempt``: none to fail over from a backend that asked to wait to
        one that does not; the shortest remaining wait when every backend asks to wait; else a backoff."""
        now = self._clock()
        asking = {backend_id: until for backend_id, until in self._until.items() if until > now}
        ready = [backend_id for backend_id in self._ids if backend_id not in asking]
        if not ready:
            soonest = min(asking.values())
            for backend_id, until in asking.items():  # ready once the wait is over, even if the timer fires early
                if until <= soonest:
                    del self._until[backend_id]
            self._failed.clear()
            return soonest - now
        if all(backend_id in self._failed for backend_id in ready):
            self._failed.clear()  # every backend not asking to wait has failed: a new round
            return backoff(attempt, max_wait)
        return 0.0 if self._asked else backoff(attempt, max_wait)
