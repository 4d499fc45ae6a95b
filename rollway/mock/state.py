"""What the mock backend holds (``MockState``: config, fake model, prefix cache, faults, bookkeeping) and the
watcher of a request's disconnect (``Watch``)."""

from __future__ import annotations

import asyncio
import time

from starlette.types import Receive

from rollway.mock.config import MockConfig
from rollway.mock.faults import FaultBook, RequestRecord, Stats
from rollway.mock.model import FakeModel, PrefixCache


class MockState:
    """Everything the app holds, reachable as ``app.state.mock``."""

    def __init__(self, config: MockConfig) -> None:
        self.initial_config = config
        self.config = config
        self.model = FakeModel(math_accuracy=config.math_accuracy)
        self.prefix_cache = PrefixCache(config.prefix_block_size)
        self.faults = FaultBook()
        self.stats = Stats(config.request_log_size)
        self.watches: set[Watch] = set()
        self.shutting_down = False
        #: Set unless ``config.hold``: what held requests wait for.
        self.released = asyncio.Event()
        self.released.set()
        #: The engine's own pause (``POST /pause``, ``/resume``: ``rollway.mock.weights``) and weight version.
        self.engine_resumed = asyncio.Event()
        self.engine_resumed.set()
        self.weight_version = "default"
        self.reloads = 0

    def set_config(self, config: MockConfig) -> None:
        self.config = config
        if config.hold:
            self.released.clear()
        else:
            self.released.set()
        self.model = FakeModel(math_accuracy=config.math_accuracy, weights=self.model.weights)
        if config.prefix_block_size != self.prefix_cache.block_size:
            self.prefix_cache = PrefixCache(config.prefix_block_size)

    def reload(self, path: str | None) -> None:
        """The weights reloaded (from ``path``, or the model's own folder): the fake model answers differently."""
        self.reloads += 1
        self.model.weights = f"{path or ''}#{self.reloads}"
        self.prefix_cache.clear()

    def reset(self) -> None:
        self.model.weights = ""
        self.weight_version = "default"
        self.reloads = 0
        self.engine_resumed.set()
        self.set_config(self.initial_config)
        self.faults.clear()
        self.stats.reset()
        self.prefix_cache.clear()

    def begin_shutdown(self) -> None:
        """Wake every hanging or stalled request so the server can stop."""
        self.shutting_down = True
        for watch in list(self.watches):
            watch.stop.set()


class Watch:
    """Watches ``receive`` for ``http.disconnect``; records a cancellation unless the response was complete."""

    def __init__(self, state: MockState, record: RequestRecord, receive: Receive) -> None:
        self.state, self.record = state, record
        self.stop = asyncio.Event()
        self.done = False
        self._task = asyncio.get_running_loop().create_task(self._run(receive))
        state.watches.add(self)

    async def _run(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.state.stats.cancel(self.record, time.monotonic())
        self.stop.set()

    async def until(self, event: asyncio.Event) -> bool:
        """Wait for ``event``; True when the client left (or the server stops) first."""
        if not event.is_set() and not self.stop.is_set():
            waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.stop.wait())}
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in pending:
                wait.cancel()
        return self.stop.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; True when the client left (or the server stops) meanwhile."""
        if self.stop.is_set():
            return True
        if seconds <= 0:
            return False
        try:
            async with asyncio.timeout(seconds):
                await self.stop.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.done = True
        self._task.cancel()
        self.state.watches.discard(self)
