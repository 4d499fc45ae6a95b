"""``RollwayClient``: the admin client for synchronous code (trainers, scripts, notebooks).

It runs one ``AsyncRollwayClient`` on a private event loop in a daemon thread and waits for each call, so the
two clients behave identically (same retries, same errors, same typed results) and calling it from any
thread — or from code that has its own event loop running — is safe.

    with RollwayClient("http://127.0.0.1:8080", token="...") as client:
        rollouts = client.enqueue([{"input": {"q": "1 + 1"}}])
        done = client.wait_for([r.rollout_id for r in rollouts], timeout=300)
        for triplet in client.iter_triplets():
            ...
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from rollway.admin.client import DEFAULT_URL, AsyncRollwayClient
from rollway.admin.client_exports import ExportRecords
from rollway.admin.client_types import MergedTriplet, Triplet
from rollway.store import Rollout

P = ParamSpec("P")
T = TypeVar("T")


def _blocking(
    method: Callable[Concatenate[AsyncRollwayClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[RollwayClient, P], T]:
    """The async client's method, run on the private loop and waited for."""

    def call(self: RollwayClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.run(method(self.aio, *args, **kwargs))

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


def _iterating(
    method: Callable[Concatenate[AsyncRollwayClient, P], AsyncIterator[T]],
) -> Callable[Concatenate[RollwayClient, P], Iterator[T]]:
    """The async client's iterator, stepped on the private loop."""

    def call(self: RollwayClient, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self.iterate(method(self.aio, *args, **kwargs))

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


def _exporting(
    method: Callable[Concatenate[AsyncRollwayClient, P], ExportRecords[T]],
) -> Callable[Concatenate[RollwayClient, P], SyncExportRecords[T]]:
    """The async client's export, stepped on the private loop, with its cursor."""

    def call(self: RollwayClient, /, *args: P.args, **kwargs: P.kwargs) -> SyncExportRecords[T]:
        return SyncExportRecords(self, method(self.aio, *args, **kwargs))

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class SyncExportRecords(Generic[T]):
    """An export's records for synchronous code (``for``), ``next_cursor``, ``deduped_calls``,
    ``removed_samples`` and ``removed_groups``, as ``ExportRecords`` has them."""

    def __init__(self, client: RollwayClient, records: ExportRecords[T]) -> None:
        self._records = records
        self._items = client.iterate(records)

    @property
    def next_cursor(self) -> str | None:
        return self._records.next_cursor

    @property
    def deduped_calls(self) -> int:
        return self._records.deduped_calls

    @property
    def removed_samples(self) -> int:
        return self._records.removed_samples

    @property
    def removed_groups(self) -> int:
        return self._records.removed_groups

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._items)

    def close(self) -> None:
        self._items.close()


class RollwayClient:
    """The admin API for synchronous code; the same arguments as ``AsyncRollwayClient``. Close it (or use
    ``with``) to stop its thread."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollway-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def build() -> AsyncRollwayClient:
            return AsyncRollwayClient(url, token, **kwargs)

        try:
            self.aio = self.run(build())
        except BaseException:
            self._stop()
            raise
        self.url = self.aio.url

    @classmethod
    def from_env(cls, **kwargs: Any) -> RollwayClient:
        """``ROLLWAY_URL`` (default http://127.0.0.1:8080) and ``ROLLWAY_ADMIN_TOKEN``."""
        return cls(os.environ.get("ROLLWAY_URL", DEFAULT_URL), os.environ.get("ROLLWAY_ADMIN_TOKEN"), **kwargs)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the async client on its loop and return its result (or raise its error)."""
        if self._closed:
            coro.close()
            raise RuntimeError("this RollwayClient is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a RollwayClient cannot be called from its own loop; use client.aio there")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def iterate(self, items: AsyncIterator[T]) -> Generator[T, None, None]:
        """Step an async iterator of the async client on its loop."""

        async def step() -> list[T]:
            try:
                return [await anext(items)]
            except StopAsyncIteration:
                return []

        try:
            while batch := self.run(step()):
                yield batch[0]
        finally:
            close = getattr(items, "aclose", None)
            if close is not None and not self._closed:
                self.run(close())

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.run(self.aio.aclose())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> RollwayClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # tasks, claims, rollouts
    enqueue = _blocking(AsyncRollwayClient.enqueue)
    start_rollout = _blocking(AsyncRollwayClient.start_rollout)
    claim = _blocking(AsyncRollwayClient.claim)
    list_rollouts = _blocking(AsyncRollwayClient.list_rollouts)
    iter_rollouts = _iterating(AsyncRollwayClient.iter_rollouts)
    get_rollout = _blocking(AsyncRollwayClient.get_rollout)
    cancel = _blocking(AsyncRollwayClient.cancel)
    new_attempt = _blocking(AsyncRollwayClient.new_attempt)
    update_attempt = _blocking(AsyncRollwayClient.update_attempt)
    heartbeat = _blocking(AsyncRollwayClient.heartbeat)
    add_reward = _blocking(AsyncRollwayClient.add_reward)
    add_spans = _blocking(AsyncRollwayClient.add_spans)
    get_spans = _blocking(AsyncRollwayClient.get_spans)
    get_unattributed_spans = _blocking(AsyncRollwayClient.get_unattributed_spans)
    wait = _blocking(AsyncRollwayClient.wait)
    wait_for = _blocking(AsyncRollwayClient.wait_for)
    get_group = _blocking(AsyncRollwayClient.get_group)
    # resources
    add_resources = _blocking(AsyncRollwayClient.add_resources)
    update_resources = _blocking(AsyncRollwayClient.update_resources)
    get_resources = _blocking(AsyncRollwayClient.get_resources)
    list_resources = _blocking(AsyncRollwayClient.list_resources)
    # models
    list_models = _blocking(AsyncRollwayClient.list_models)
    get_model = _blocking(AsyncRollwayClient.get_model)
    put_model = _blocking(AsyncRollwayClient.put_model)
    delete_model = _blocking(AsyncRollwayClient.delete_model)
    pause_model = _blocking(AsyncRollwayClient.pause_model)
    resume_model = _blocking(AsyncRollwayClient.resume_model)
    drain_model = _blocking(AsyncRollwayClient.drain_model)
    swap_model = _blocking(AsyncRollwayClient.swap_model)
    # weight updates
    update_weights = _blocking(AsyncRollwayClient.update_weights)
    begin_update = _blocking(AsyncRollwayClient.begin_update)
    commit_update = _blocking(AsyncRollwayClient.commit_update)
    abort_update = _blocking(AsyncRollwayClient.abort_update)
    get_update = _blocking(AsyncRollwayClient.get_update)
    list_updates = _blocking(AsyncRollwayClient.list_updates)
    # remote agent servers
    list_agents = _blocking(AsyncRollwayClient.list_agents)
    get_agent = _blocking(AsyncRollwayClient.get_agent)
    put_agent = _blocking(AsyncRollwayClient.put_agent)
    delete_agent = _blocking(AsyncRollwayClient.delete_agent)
    # keys, stats
    mint_key = _blocking(AsyncRollwayClient.mint_key)
    revoke_key = _blocking(AsyncRollwayClient.revoke_key)
    stats = _blocking(AsyncRollwayClient.stats)
    # triplets
    iter_triplet_records = _exporting(AsyncRollwayClient.iter_triplet_records)
    iter_triplets = _exporting(AsyncRollwayClient.iter_triplets)
    iter_merged_triplets = _exporting(AsyncRollwayClient.iter_merged_triplets)
    iter_export = _exporting(AsyncRollwayClient.iter_export)


__all__ = ["MergedTriplet", "Rollout", "RollwayClient", "Triplet"]
