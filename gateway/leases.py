"""A call's hold on its model alias: the alias's live state in this process (``AliasState``: its configuration,
paused or not, its calls in flight per configuration), a call's ``Lease`` on the configuration it runs with, and
its ``Arrival`` (counted in flight from before it knows its configuration). ``gateway.registry`` hands them out.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollway.store import ModelAlias

#: The configuration key of calls between their arrival and their lease (their configuration is not known yet) is
#: this prefix + the catalog revision the process had seen when the call arrived: a drain that began under a
#: revision no newer than that need not wait for it (its lease comes from a configuration read after the change).
ARRIVING = "*"


def config_key(config: ModelAlias) -> str:
    """What a call is served by, as a short stable digest: the version and each backend's identity (not its
    weight, concurrency or credentials). Equal on every replica for the same stored configuration."""
    served = [config.version, [(b.backend_id, b.base_url, b.kind, b.model, b.version) for b in config.backends]]
    return hashlib.sha256(json.dumps(served).encode()).hexdigest()[:16]


@dataclass
class AliasState:
    """The live state of one alias in this process."""

    config: ModelAlias
    loaded_at: float
    waiting: int = 0  # calls waiting for it to resume
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever a lease ends
    by_key: dict[str, int] = field(default_factory=dict)  # in flight per configuration key
    key: str = ""
    leases: set[Lease] = field(default_factory=set)  # the calls holding a lease, for an update that aborts them

    def __post_init__(self) -> None:
        self.key = config_key(self.config)
        self.set_paused(self.config.paused)

    @property
    def in_flight(self) -> int:
        return sum(self.by_key.values())

    def old(self, current: str) -> int:
        """Calls in flight on a configuration other than ``current``."""
        return sum(n for key, n in self.by_key.items() if key != current)

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def set_paused(self, paused: bool) -> None:
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()

    def hold_left(self, now: float) -> float:
        """Seconds a call may still wait for the weight update holding the alias (0 when none holds it)."""
        until = self.config.hold_until
        return 0.0 if until is None else max(0.0, until - now)


@dataclass(eq=False)
class Lease:
    """One call's hold on an alias: the configuration it runs with. ``on_abort``: what ends the call when a weight
    update aborts the calls in flight (set by the call once it can be ended)."""

    alias: str
    config: ModelAlias
    _state: AliasState
    _key: str = ""
    _released: bool = False
    on_abort: Callable[[str], bool] | None = None  # whether it ended the call

    def __post_init__(self) -> None:
        self._state.leases.add(self)

    @property
    def version(self) -> str:
        return self.config.version

    def abort(self, reason: str) -> bool:
        """End the call for ``reason`` (a weight update's); whether this ended it (a call answered already, or
        ended by an earlier abort, is not counted again)."""
        if self._released or self.on_abort is None:
            return False
        return self.on_abort(reason)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        _decrement(self._state.by_key, self._key)
        self._state.leases.discard(self)
        self._state.released.set()


class Arrival:
    """A call on its way to a lease: counted as in flight (configuration unknown; ``revision``: the catalog
    revision its process had seen when it arrived) from before its arrival transaction until it holds a lease,
    waits on a paused alias, or fails (``end``)."""

    __slots__ = ("_counts", "_done", "_slot")

    def __init__(self, counts: dict[tuple[str, int], int], alias: str, revision: int) -> None:
        self._counts, self._slot, self._done = counts, (alias, revision), False
        counts[self._slot] = counts.get(self._slot, 0) + 1

    def end(self) -> None:
        if self._done:
            return
        self._done = True
        _decrement(self._counts, self._slot)


def _decrement(counts: dict[Any, int], key: Any) -> None:
    """One fewer under ``key``; a count that reaches 0 goes (snapshots list only what is in flight)."""
    if (left := counts[key] - 1) > 0:
        counts[key] = left
    else:
        del counts[key]
