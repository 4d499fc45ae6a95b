"""The database's failures, as the store tells them: which exceptions are the database's trouble (and become an
``UnavailableError``), whether writes are going through at the moment (``WriteHealth``, read by ``/readyz``), and
their log lines, one per kind of failure per interval (``FailureLog``).

A database that is down, full, locked or restarting fails in many shapes: SQLAlchemy's ``DBAPIError`` family
(``OperationalError``, asyncpg's ``InterfaceError: another operation is in progress``, ...), the driver's own
exceptions where SQLAlchemy does not wrap them (asyncpg's on connect, ``sqlite3.OperationalError`` from the
writer's own statements) and the socket's (``ConnectionResetError``, ``ConnectionRefusedError``). ``unavailable``
turns each into one ``UnavailableError`` naming the driver's message; what is the request's own fault (a conflict,
a value too large for its column) or a bug (SQL the database refuses as such) is left as it is.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, ProgrammingError

from rollway.store.errors import UnavailableError

#: A failed write makes the store not ready for this long, unless a write succeeds first.
FAILURE_WINDOW = 5.0
#: A write waiting on the database's write lock (another process's) longer than this makes the store not ready.
LOCK_WAIT_BOUND = 2.0
#: At most one log line per kind of failure in this many seconds; the next one counts those left out.
LOG_INTERVAL = 10.0


def _driver(exc: BaseException) -> bool:
    """An exception of the PostgreSQL driver that SQLAlchemy did not wrap (one raised on connect)."""
    return type(exc).__module__.split(".", 1)[0] == "asyncpg"


#: What SQLite says when the database, not the statement, is at fault (its other ``OperationalError``s -- no such
#: table, a syntax error -- are the code's).
_SQLITE_TROUBLE = ("locked", "busy", "disk", "full", "readonly", "unable to open", "i/o", "malformed", "not a database")


def _sqlite_trouble(exc: BaseException) -> bool:
    return any(word in str(exc).lower() for word in _SQLITE_TROUBLE)


def unavailable(exc: BaseException) -> UnavailableError | None:
    """``exc`` as the store's ``UnavailableError`` when it is the database's trouble, else None (leave it)."""
    if isinstance(exc, UnavailableError):
        return exc
    if isinstance(exc, IntegrityError | DataError | ProgrammingError):
        return None  # the request's (a conflict, a value that does not fit) or the code's, not the database's
    reason: BaseException = exc
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        reason = exc.orig
    if isinstance(reason, sqlite3.Error):
        if not (isinstance(reason, sqlite3.OperationalError) and _sqlite_trouble(reason)):
            return None  # no such table, a syntax error, a misused connection: a bug, not an outage
    elif isinstance(exc, DBAPIError) or _driver(reason):
        pass  # the PostgreSQL driver's: the server is down, restarting, or dropped the connection
    elif not isinstance(reason, ConnectionError | TimeoutError) or type(reason).__module__.startswith("aiohttp"):
        return None  # a socket error of something else (a backend's, aiohttp's) is not the database's
    text = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
    return UnavailableError(f"the database is unavailable: {type(reason).__name__}{': ' + text if text else ''}")


@dataclass
class WriteHealth:
    """Whether writes go through: the time of the last write that failed and of the last that succeeded, and
    when the write waiting longest for the database's write lock began (the writer's ``waiting_since``)."""

    clock: Callable[[], float] = time.monotonic
    waiting_since: Callable[[], float | None] = lambda: None
    last_failure: float | None = None
    last_success: float | None = None
    reason: str = ""

    def succeeded(self) -> None:
        self.last_success = self.clock()

    def failed(self, reason: str) -> None:
        self.last_failure, self.reason = self.clock(), reason

    def failing(self) -> bool:
        """The last write failed and none succeeded since (however long ago)."""
        return self.last_failure is not None and (self.last_success is None or self.last_success < self.last_failure)

    def problem(self) -> str | None:
        """Why the store cannot write now, or None: a write failed within ``FAILURE_WINDOW`` seconds with none
        succeeding since, or one has waited for the database longer than ``LOCK_WAIT_BOUND`` with none completing
        meanwhile."""
        now = self.clock()
        if self.failing() and self.last_failure is not None and now - self.last_failure < FAILURE_WINDOW:
            return f"a write failed {now - self.last_failure:.1f} s ago: {self.reason}"
        since = self.waiting_since()
        # A write slow under load is no outage while others complete: only one waiting with none done meanwhile.
        stuck = since is not None and now - since > LOCK_WAIT_BOUND
        if stuck and since is not None and (self.last_success is None or self.last_success < since):
            return f"a write has waited {now - since:.1f} s for the database"
        return None


@dataclass
class FailureLog:
    """Log lines of failures that repeat (every call's while the database is down): the first of each kind is
    logged, then at most one per ``interval`` seconds, saying how many were left out since the last."""

    interval: float = LOG_INTERVAL
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    _left_out: dict[str, int] = field(default_factory=dict)

    def log(
        self, logger: logging.Logger, kind: str, msg: str, *args: Any, level: int = logging.ERROR, **kwargs: Any
    ) -> bool:
        """Log ``msg % args`` unless a line of ``kind`` was logged within the interval (then count it); True if
        logged."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return False
        self._last[kind] = now
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg += " (and %d more like it in the last %.0f s, not logged)"
            args = (*args, left_out, now - (last or now))
        logger.log(level, msg, *args, **kwargs)
        return True
