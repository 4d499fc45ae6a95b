"""The data plane's coarse wait bounds (``gateway/bounds.py``): a wait past its bound ends in ``TimeoutError`` as
with ``asyncio.timeout``; a wait within it, and any cancellation that is not the bound's, are left as they are."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from rollway.gateway.bounds import Sweeper
from rollway.gateway.dataplane import DataPlane, Serving
from rollway.gateway.proxy import Running


async def test_a_wait_past_its_bound_is_a_timeout_and_the_task_goes_on() -> None:
    sweeper = Sweeper(every=0.01)
    sweeper.start()
    try:
        bound = sweeper.bound()
        started = time.monotonic()
        with pytest.raises(TimeoutError), bound.within(0.05):
            await asyncio.Event().wait()  # a client that never sends or reads
        assert 0.05 <= time.monotonic() - started < 2
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        assert not sweeper.waits
        with bound.within(5):  # the same task's next wait is bounded afresh
            await asyncio.sleep(0)
    finally:
        await sweeper.close()


async def test_a_wait_past_the_deadline_is_a_timeout_whatever_its_own_bound() -> None:
    sweeper = Sweeper(every=0.01)
    sweeper.start()
    try:
        with pytest.raises(TimeoutError), sweeper.bound().within(60, deadline=time.time() + 0.05):
            await asyncio.Event().wait()
    finally:
        await sweeper.close()


async def test_a_cancellation_that_is_not_the_bounds_stays_a_cancellation() -> None:
    sweeper = Sweeper(every=0.01)
    sweeper.start()
    entered = asyncio.Event()

    async def waiter() -> None:
        with sweeper.bound().within(60):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(waiter())
    try:
        await entered.wait()
        task.cancel()  # the client left, or the server is stopping
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not sweeper.waits
    finally:
        await sweeper.close()


async def test_without_a_wait_in_progress_the_sweeper_cancels_nothing() -> None:
    sweeper = Sweeper(every=0.01)
    bound = sweeper.bound()
    with bound.within(0.0):
        pass  # a wait that ended at once
    sweeper.sweep()
    assert not bound.fired and not sweeper.waits


async def test_an_error_answer_its_client_does_not_take_ends_the_request_as_a_stalled_answer_does() -> None:
    """The data plane's own error (here a 415) to a client that reads nothing: after the write timeout the
    request ends (logged, the connection left to close), as for an answer, not with an exception out of the app."""
    sweeper = Sweeper(every=0.01)
    sweeper.start()
    rejected: list[int] = []
    gateway = SimpleNamespace(
        settings=SimpleNamespace(write_timeout=0.05, gateway_auth="none", max_calls_in_flight=0),
        running=Running(),
        sweeper=sweeper,
        metrics=SimpleNamespace(observe_rejected=lambda op, status: rejected.append(status)),
    )
    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []}

    async def never(*_: Any) -> Any:  # a client that neither sends nor reads
        await asyncio.Event().wait()

    dataplane = DataPlane(never)
    dataplane.serve_with(Serving(gateway, None))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(dataplane(scope, never, never), 5)
    finally:
        await sweeper.close()
    assert rejected == [415]
