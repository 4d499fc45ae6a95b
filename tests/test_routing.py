"""Backend choice (``gateway.routing.Router``): sticky per rollout within a load bound, least outstanding
weighted otherwise, ``max_concurrency`` as a soft cap, passive health with a doubling cool-down."""

from __future__ import annotations

from collections import Counter

from gateway.routing import BASE_COOLDOWN, LOAD_FACTOR, LOAD_SLACK, Router
from store import Backend


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
    router.started(chosen.backend_id)
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
    router.finished(first, ok=True, counts_as_failure=False)
    assert start(router, [A, B], "r1") == other


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
    assert start(router, [small, capped_b]) in {"small", "b"}  # every one full: still served (a soft cap)


def test_failures_eject_a_backend_for_a_cooldown_that_doubles_on_relapse() -> None:
    clock = Clock()
    router = Router(clock)

    def fail(backend_id: str) -> None:
        router.started(backend_id)
        router.finished(backend_id, ok=False, counts_as_failure=True)

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
    router.started("a")
    router.finished("a", ok=True, counts_as_failure=False)  # a success resets the cool-down
    fail("a")
    fail("a")
    clock.now += BASE_COOLDOWN
    assert router.is_up("a")
    # A call that started before an ejection and ends well does not end it.
    router.started("a")
    fail("a")
    fail("a")
    router.finished("a", ok=True, counts_as_failure=False)
    assert not router.is_up("a")
    # Errors that are not the backend's fault (a 4xx, a client that left) do not count.
    for _ in range(5):
        router.started("b")
        router.finished("b", ok=False, counts_as_failure=False)
    assert router.is_up("b") and router.health("b").failures == 0


def test_with_every_backend_down_calls_still_go_somewhere() -> None:
    router = Router(Clock())
    router.eject("a")
    router.eject("b")
    assert start(router, [A, B]) in {"a", "b"}
    assert router.choose([A, B], None, {"a", "b"}) is None  # every one excluded for this call
