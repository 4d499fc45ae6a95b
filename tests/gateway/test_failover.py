"""One call's retry plan across the backends of its alias (``gateway.failover.Tries``): a backend asking to
wait (429 + Retry-After) is not tried before its time, the call fails over at once to one that is not asking,
and waits for the first to be ready when every backend is asking."""

from __future__ import annotations

from rollway.gateway.failover import Tries
from rollway.gateway.routing import Router
from rollway.store import Backend
from support.clock import FakeClock

MAX_WAIT = 10.0


def backends(*ids: str, **extra: object) -> list[Backend]:
    return [Backend.model_validate({"backend_id": i, "base_url": "http://x/v1", "model": "m", **extra}) for i in ids]


def test_a_backend_asking_to_wait_is_failed_over_at_once() -> None:
    clock = FakeClock()
    tries = Tries(backends("a", "b"), clock)
    tries.failed("a", retry_after=3.0)
    assert tries.pause(1, MAX_WAIT) == 0.0
    assert tries.passed_over() == {"a"} and tries.asking() == {"a"}
    assert tries.next_ready() == 3.0


def test_when_every_backend_asks_to_wait_the_call_waits_for_the_shortest() -> None:
    clock = FakeClock()
    tries = Tries(backends("a", "b"), clock)
    tries.failed("a", retry_after=3.0)
    clock.advance(0.5)
    tries.failed("b", retry_after=1.0)
    assert tries.pause(2, MAX_WAIT) == 1.0  # b's, the sooner one
    clock.advance(0.999)  # (a timer may fire a little early: b counts as ready all the same)
    assert tries.passed_over() == {"a"}
    router = Router(clock)
    picked = tries.pick(router, None)
    assert picked is not None and picked.backend_id == "b"


def test_a_single_backend_is_waited_for() -> None:
    tries = Tries(backends("a"), FakeClock())
    tries.failed("a", retry_after=2.0)
    assert tries.pause(1, MAX_WAIT) == 2.0
    assert tries.passed_over() == set()


def test_failures_without_a_wait_back_off_and_go_round_the_backends() -> None:
    clock = FakeClock()
    tries = Tries(backends("a", "b"), clock)
    tries.failed("a")  # a 5xx, a connect error or a 429 without Retry-After
    assert 0 <= tries.pause(1, MAX_WAIT) <= 0.1
    assert tries.passed_over() == {"a"}
    tries.failed("b")
    assert 0 <= tries.pause(2, MAX_WAIT) <= 0.2
    assert tries.passed_over() == set()  # a new round


def test_a_failed_backend_comes_before_one_asking_to_wait() -> None:
    clock = FakeClock()
    tries = Tries(backends("a", "b"), clock)
    tries.failed("a")  # 503
    tries.failed("b", retry_after=5.0)
    assert 0 <= tries.pause(2, MAX_WAIT) <= 0.2  # a backoff, not b's 5 s
    assert tries.passed_over() == {"b"}


def test_the_pick_takes_a_failed_backend_with_room_over_waiting_for_a_full_one() -> None:
    router = Router(FakeClock())
    a, b = backends("a", "b", max_concurrency=1)
    tries = Tries([a, b], FakeClock())
    router.begin_try("b")  # b is full (another call)
    tries.failed("a")
    assert tries.pause(1, MAX_WAIT) >= 0
    picked = tries.pick(router, None)
    assert picked is not None and picked.backend_id == "a"
    router.begin_try("a")
    assert tries.pick(router, None) is None  # both full: the call waits for a slot
