"""A clock the tests move by hand, so timeouts are tested without sleeping."""

from __future__ import annotations


class FakeClock:
    """A clock the tests move by hand, so timeouts are tested without sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
