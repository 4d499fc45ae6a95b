"""Backend choice (``gateway.routing.Router``): sticky per rollout within a load bound, least outstanding
weighted otherwise, ``max_concurrency`` as a cap (calls wait for a slot, first come first served), passive
health with a doubling cool-down."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import pytest

from rollway.gateway.failover import Tries
from rollway.gateway.routing import BASE_COOLDOWN, LOAD_FACTOR, LOAD_SLACK, Router
from rollway.store import Backend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backend(backend_id: str, **extra: object) -> Backend:
    return Backend.model_validate({"backend_id": backend_id, "base_url": "http://x/v1", "model": "m", **extra})


A, B = backend("a"), backend("b")


def start(router: Router, backends: list[Backend], rollout_id: str | None = None) -> str:
    chosen = router.choose(backends, rollout_id, set())
    assert chosen is not None
    router.begin_try(chosen.backend_id)
    return chosen.backend_id


def test_a_rollout_sticks_to_its_first_backend_within_the_load_bound() -> None:
    router = Router(Clock())
    first = start(router, [A, B], "r1")
    other = "b" if first == "a" else "a"
    # Its backend is now busier than the other, but within 1.25 x mean + 2: the rollout stays.
    assert [start(router, [A, B], "r1") for _ in range(2)] == [first, first]
    # A rollout of its own goes to the less loaded backend; so does a call with no rollout.
    assert start(router, [A, B], "r2") == other
    assert router.health(first).outstanding == 3 and router.health(other).outstanding == 1
    # It stays until its backend is loaded beyond LOAD_FACTOR x the mean + LOAD_SLACK; then it moves, and
    # sticks to where it moved.
    while (moved := start(router, [A, B], "r1")) == first:
        pass
    assert moved == other
    busy, idle = router.health(first).outstanding, router.health(other).outstanding - 1  # when it moved

    def within(load: int) -> bool:
        return load <= LOAD_FACTOR * (load + idle) / 2 + LOAD_SLACK

    assert not within(busy) and within(busy - 1) and busy == 8  # with the defaults: 8 against 1
    router.end_try(first, ok=True, counts_as_failure=False)
    assert start(router, [A, B], "r1") == other


def test_a_rollout_is_remembered_only_where_there_is_a_choice() -> None:
    """One backend: nothing to stick to, and nothing kept per rollout (a long run makes many)."""
    router = Router(Clock())
    for i in range(50):
        start(router, [A], f"ro-{i}")
    assert router.remembered == 0
    start(router, [A, B], "ro-x")
    assert router.remembered == 1


def test_least_outstanding_is_weighted() -> None:
    router = Router(Clock())
    heavy = backend("heavy", weight=3.0)
    picks = Counter(start(router, [A, heavy]) for _ in range(8))
    assert picks == {"heavy": 6, "a": 2}


def test_a_full_backend_is_passed_over_while_another_has_room() -> None:
    router = Router(Clock())
    small = backend("small", max_concurrency=1, weight=100.0)
    assert start(router, [small, B]) == "small"
    assert [start(router, [small, B]) for _ in range(3)] == ["b", "b", "b"]
    capped_b = backend("b", max_concurrency=3)
    assert router.choose([small, capped_b], None, set()) is None  # every one full: none (a cap, not a preference)
    router.end_try("b", ok=True, counts_as_failure=False)
    assert start(router, [small, capped_b]) == "b"


def test_a_rollout_sticks_within_the_caps_only() -> None:
    router = Router(Clock())
    one, two = backend("one", max_concurrency=1), backend("two", max_concurrency=1)
    first = start(router, [one, two], "r1")
    assert start(router, [one, two], "r1") != first  # its backend is full: the other one
    assert router.choose([one, two], "r1", set()) is None
    router.end_try(first, ok=True, counts_as_failure=False)
    assert start(router, [one, two], "r1") == first


async def acquire(router: Router, backends: Sequence[Backend], timeout: float = 30, alias: str = "m") -> str | None:
    chosen = await router.acquire(alias, backends, lambda: router.choose(backends, None, set()), timeout)
    return None if chosen is None else chosen.backend_id


async def queued(router: Router, backends: Sequence[Backend], count: int) -> list[asyncio.Task[str | None]]:
    """``count`` calls waiting for a slot, in this order."""
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(acquire(router, backends)))
        await asyncio.sleep(0)  # one turn of the loop: the call is in the queue
    assert router.waiting("m") == count
    return tasks


async def test_calls_wait_for_a_slot_and_get_it_first_come_first_served() -> None:
    router = Router(Clock())
    capped = [backend("a", max_concurrency=1)]
    assert await acquire(router, capped) == "a"
    tasks = await queued(router, capped, 3)
    served: list[int] = []
    pending = set(tasks)
    for _ in range(3):
        router.end_try("a", ok=True, counts_as_failure=False)  # the slot goes to the first in line
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        [task] = done
        assert task.result() == "a" and router.health("a").outstanding == 1
        served.append(tasks.index(task))
    assert served == [0, 1, 2]
    assert router.waiting() == 0


async def test_a_newcomer_queues_behind_the_calls_already_waiting() -> None:
    router = Router(Clock())
    capped = [backend("a", max_concurrency=2)]
    assert [await acquire(router, capped), await acquire(router, capped)] == ["a", "a"]
    [first] = await queued(router, capped, 1)
    router.end_try("a", ok=True, counts_as_failure=False)
    newcomer = asyncio.create_task(acquire(router, capped, timeout=0.05))
    assert await first == "a"
    assert await newcomer is None  # it came after the waiting call: no slot was left for it


async def test_waiting_ends_at_the_bound_and_a_call_that_leaves_gives_up_its_place() -> None:
    router = Router(Clock())
    capped = [backend("a", max_concurrency=1)]
    assert await acquire(router, capped) == "a"
    assert await acquire(router, capped, timeout=0.01) is None
    assert await acquire(router, capped, timeout=0) is None  # no wait at all
    leaving, staying = await queued(router, capped, 2)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert router.waiting() == 1
    router.end_try("a", ok=True, counts_as_failure=False)
    assert await staying == "a"
    assert router.waiting() == 0 and router.health("a").outstanding == 1


async def test_a_slot_handed_to_a_call_as_it_leaves_goes_to_the_next() -> None:
    router = Router(Clock())
    capped = [backend("a", max_concurrency=1)]
    assert await acquire(router, capped) == "a"
    leaving, staying = await queued(router, capped, 2)
    router.end_try("a", ok=True, counts_as_failure=False)  # handed to ``leaving``, which has not run yet
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert await staying == "a"
    assert router.health("a").outstanding == 1


async def test_backends_without_max_concurrency_are_unlimited_and_other_aliases_do_not_wait() -> None:
    router = Router(Clock())
    capped, free = [backend("a", max_concurrency=1)], [backend("other")]
    assert await acquire(router, capped) == "a"
    [waiting] = await queued(router, capped, 1)
    assert [await acquire(router, free, alias="n") for _ in range(50)] == ["other"] * 50
    router.end_try("other", ok=True, counts_as_failure=False)  # not a slot the waiting call can use
    assert not waiting.done()
    router.end_try("a", ok=True, counts_as_failure=False)
    assert await waiting == "a"


async def test_a_waiting_call_looks_again_when_an_ejected_backend_is_back() -> None:
    """Every healthy backend is full and the other is ejected: the call gets the ejected one once its cool-down
    ends, without a try ending."""
    router = Router()  # the real clock: the cool-down ends in real time
    a, b = backend("a", max_concurrency=1), backend("b")
    assert await acquire(router, [a]) == "a"
    router.eject("b")
    router.health("b").down_until -= BASE_COOLDOWN - 0.05  # back in 50 ms
    assert await acquire(router, [a, b], timeout=5) == "b"


async def test_many_waiting_calls_are_woken_once_not_each_by_a_timer_of_its_own() -> None:
    """500 calls wait (one backend full, the other ejected): when the ejected one is back, one wake-up hands its
    slots out, and the calls whose backends are full again are not asked to ``pick`` (linear, not quadratic)."""
    clock = Clock()
    router = Router(clock)
    a, b = backend("a", max_concurrency=64), backend("b", max_concurrency=64)
    for _ in range(64):
        router.begin_try("a")
    router.eject("b")
    router.health("b").down_until -= BASE_COOLDOWN - 1.0  # back in 1 s of the router's clock, which stands still
    picks = 0

    def pick() -> Backend | None:
        nonlocal picks
        picks += 1
        return router.choose([a, b], None, set())

    count = 500
    tasks = [asyncio.create_task(router.acquire("m", [a, b], pick, 30)) for _ in range(count)]
    await asyncio.sleep(0)  # one turn of the loop: each task has run up to its wait
    assert router.waiting() == count and picks == count  # each looked once, on arrival
    clock.now += 1.0  # b is back when the router's one wake-up (a timer of the loop, due in 1 s) comes
    pending: set[asyncio.Task[Backend | None]] = set(tasks)
    async with asyncio.timeout(10):  # b is back: its 64 slots go to 64 waiting calls
        while len(pending) > count - 64:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    assert sum(task.done() for task in tasks) == 64 and router.health("b").outstanding == 64
    assert picks <= 2 * count + 64
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert router.waiting() == 0


async def test_a_newcomer_takes_a_free_slot_no_waiting_call_can_use() -> None:
    """A call waits for a or b (both full); a newcomer of another backend list, a or c, gets c at once."""
    router = Router(Clock())
    a, b, c = backend("a", max_concurrency=1), backend("b", max_concurrency=1), backend("c", max_concurrency=4)
    router.begin_try("a")
    router.begin_try("b")
    [waiting] = await queued(router, [a, b], 1)
    assert await acquire(router, [a, c], timeout=0) == "c"
    assert not waiting.done()
    router.end_try("a", ok=True, counts_as_failure=False)
    assert await waiting == "a"


async def test_a_call_asked_to_wait_does_not_hold_back_a_fresh_call() -> None:
    """X's try on a got a 429 Retry-After and b is full: X waits, but a fresh call gets a at once; X gets a once
    its wait is over, without a try ending."""
    router = Router()  # the real clock: the wait asked for ends in real time
    a, b = backend("a", max_concurrency=8), backend("b", max_concurrency=1)
    router.begin_try("b")
    x_tries = Tries([a, b])
    x_tries.failed("a", 0.1)
    x_tries.pause(1, 10)
    x = asyncio.create_task(router.acquire("m", [a, b], lambda: x_tries.pick(router, None), 5, x_tries.next_ready))
    await asyncio.sleep(0)
    assert router.waiting() == 1
    fresh = Tries([a, b])
    got = await router.acquire("m", [a, b], lambda: fresh.pick(router, None), 0, fresh.next_ready)
    assert got is not None and got.backend_id == "a"
    taken = await asyncio.wait_for(x, 2)
    assert taken is not None and taken.backend_id == "a"


def test_failures_eject_a_backend_for_a_cooldown_that_doubles_on_relapse() -> None:
    clock = Clock()
    router = Router(clock)

    def fail(backend_id: str) -> None:
        router.begin_try(backend_id)
        router.end_try(backend_id, ok=False, counts_as_failure=True)

    fail("a")
    assert router.is_up("a")  # one failure is not enough
    fail("a")
    assert not router.is_up("a")
    assert {start(router, [A, B]) for _ in range(4)} == {"b"}
    clock.now += BASE_COOLDOWN
    assert router.is_up("a")  # re-probed by real traffic after the cool-down
    fail("a")
    fail("a")  # relapse right after: twice as long
    clock.now += BASE_COOLDOWN
    assert not router.is_up("a")
    clock.now += BASE_COOLDOWN
    assert router.is_up("a")
    router.begin_try("a")
    router.end_try("a", ok=True, counts_as_failure=False)  # a success resets the cool-down
    fail("a")
    fail("a")
    clock.now += BASE_COOLDOWN
    assert router.is_up("a")
    # A call that started before an ejection and ends well does not end it.
    router.begin_try("a")
    fail("a")
    fail("a")
    router.end_try("a", ok=True, counts_as_failure=False)
    assert not router.is_up("a")
    # Errors that are not the backend's fault (a 4xx, a client that left) do not count.
    for _ in range(5):
        router.begin_try("b")
        router.end_try("b", ok=False, counts_as_failure=False)
    assert router.is_up("b") and router.health("b").failures == 0


def test_with_every_backend_down_calls_still_go_somewhere() -> None:
    router = Router(Clock())
    router.eject("a")
    router.eject("b")
    assert start(router, [A, B]) in {"a", "b"}
    assert router.choose([A, B], None, {"a", "b"}) is None  # every one excluded for this call
