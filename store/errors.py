"""Errors raised by the store.

The store knows nothing of HTTP: each error names a kind of failure, and the web layers map
kinds to status codes in one table at their edge.

    StoreError
    ├── NotFoundError          an id that does not exist
    ├── ConflictError          a write that the current state refuses (transition, stale attempt, duplicate)
    ├── StoreValidationError   input that can never be valid (bad config, bad cursor)
    └── UnavailableError       the database cannot be reached
"""

from __future__ import annotations


class StoreError(Exception):
    """The store could not complete the operation."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0])


class NotFoundError(StoreError):
    """The requested object does not exist."""


class ConflictError(StoreError):
    """The current state of the object does not allow this write."""


class StoreValidationError(StoreError):
    """The input is invalid."""


class UnavailableError(StoreError):
    """The database is unavailable."""
