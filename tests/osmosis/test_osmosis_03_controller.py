"""Rollway as the controller of Osmosis 0.3 agent servers, against fake servers on loopback (aiohttp apps that
answer as a test needs: ``support.fake_agents``): admissions refused, waited out or held already, restarts seen on
``/health``, leases, results, and a store that refuses writes. The real 0.3.8 server is
``tests/osmosis/test_osmosis_03.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from rollway.osmosis import admission, dispatcher, restarts, v03, wire
from rollway.osmosis.dispatcher import Dispatcher
from rollway.settings import Settings
from rollway.store import UnavailableError
from support.fake_agents import finish, health_route, one_task, serving
from support.gateway_harness import running_gateway

pytestmark = pytest.mark.slow


async def test_a_03_server_holding_the_id_already_has_that_run_cancelled(tmp_path: Path) -> None:
    """A 0.3 server that answers the admission 409 (it holds the id: an admission sent again after its answer was
    lost with its lease) is told to cancel that run, which nothing can poll, and the attempt fails."""
    cancelled: list[Any] = []

    async def held(request: web.Request) -> web.Response:
        return web.json_response({"detail": "rollout id already in use"}, status=409)

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"cancelled": 1})

    async with serving(health_route(), web.post("/rollout", held), web.post("/rollout/cancel", cancel)) as url:
        rollout, attempt = await one_task(tmp_path, url, "held")
    assert rollout.status == "failed"
    assert cancelled == [{"ids": [attempt.attempt_id]}]
    assert "answered 409" in (attempt.metadata or {})["dispatch"]["error"]


@pytest.mark.parametrize("answer", [b"accepted", b"[]", b'{"rollout_id": "x", "status": "queued"}'])
async def test_a_03_admission_answered_202_with_no_lease_is_cancelled_there_and_fails(
    tmp_path: Path, answer: bytes
) -> None:
    """A 202 whose body is not a 0.3 admission (not JSON, not an object, no ``polling_lease_token``) leaves a run at
    the server that nothing can poll: Rollway cancels it there and fails the attempt at once, saying why."""
    cancelled: list[Any] = []

    async def admit(request: web.Request) -> web.Response:
        return web.Response(status=202, body=answer, content_type="application/json")

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"dispositions": {}})

    async with serving(health_route(), web.post("/rollout", admit), web.post("/rollout/cancel", cancel)) as url:
        rollout, attempt = await one_task(tmp_path, url, "odd", timeout=10)
    assert rollout.status == "failed" and cancelled == [{"ids": [attempt.attempt_id]}]
    assert "answered 202 with no polling lease" in (attempt.metadata or {})["dispatch"]["error"]


async def test_a_03_admission_waiting_out_429s_is_not_taken_for_lost_by_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 0.3 server that answers 429 for longer than an init may take (here 2.5 s): the admission marks itself in
    progress meanwhile, so another process's look for lost inits leaves it alone (it would be admitted twice: the
    second admission's 409 would cancel the first one's run), and it is admitted once when the server has room.
    The marks are renewed every 0.3 s here, so a first mark never renewed would be lost by the look, made once the
    429s have gone on for 3.5 s and while they go on: the server has room only once the look is done."""
    monkeypatch.setattr(admission, "ADMIT_MARK_EVERY", 0.3)
    monkeypatch.setattr(restarts, "HEALTH_TIMEOUT", 0.5)  # the probe's part of an init's 2.5 s
    first_try: list[float] = []
    admitted: list[str] = []
    past_window = asyncio.Event()  # set once the 429s have gone on for longer than an init may take
    looked = asyncio.Event()  # set once the other process has looked for lost inits: the server has room then

    async def admit(request: web.Request) -> web.Response:
        first_try.append(first_try[0] if first_try else time.monotonic())
        if time.monotonic() - first_try[0] >= 3.5:
            past_window.set()
        if not looked.is_set():
            return web.json_response({"detail": "busy"}, status=429, headers={"Retry-After": "0.2"})
        admitted.append((await request.json())["rollout_id"])
        return web.json_response({"rollout_id": admitted[-1], "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        sample: dict[str, Any] = {"reward": None, "messages": []}
        return web.json_response({"rollout_id": request.match_info["id"], "status": "success", "sample": sample})

    routes = [health_route(), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    settings: dict[str, Any] = {"agent_init_timeout": 1.0, "agent_init_retries": 0}  # an init may take 2.5 s
    async with (
        serving(*routes) as url,
        running_gateway(tmp_path, **settings) as gw,
        httpx.AsyncClient(base_url=gw.url) as admin,
    ):
        await admin.put("/admin/v1/agents/busy", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": "ro-busy", "input": "x", "agent": "busy"}]}
        )
        other = Dispatcher(Settings(**settings), gw.store)  # another gateway process on the database
        server = await gw.store.get_agent("busy")
        await asyncio.wait_for(past_window.wait(), 10)
        assert await other.lost_inits(server) == []
        assert admitted == []  # (the look was made while the admission waited)
        looked.set()
        [rollout] = await finish(gw, ["ro-busy"], timeout=20)
        [attempt] = await gw.store.list_attempts("ro-busy")
    assert rollout.status == "succeeded" and admitted == [attempt.attempt_id]
    dispatch = (attempt.metadata or {})["dispatch"]
    assert dispatch["osmosis_id"] == attempt.attempt_id and dispatch["admitting"] is None


async def test_a_03_server_whose_process_id_changes_has_its_polled_rollouts_failed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While rollouts of a 0.3 server are polled, one reader per server re-reads its ``/health``; a new
    ``process_id`` (the server restarted: its rollouts are gone) fails the attempts admitted before it at once,
    though their polls still answer ``running`` (as a new process would only say 404 at the next answer)."""
    monkeypatch.setattr(restarts, "HEALTH_EVERY", 0.3)
    ids = ["ro-r1", "ro-r2"]
    polled: set[str] = set()
    reads: list[float] = []
    process = ["p-1"]
    confirmed: list[float] = []  # the reads that answered p-1 after both rollouts were polled

    async def health(request: web.Request) -> web.Response:
        reads.append(time.monotonic())
        answer = {"status": "ok", "process_id": process[0], "lifecycle": {"accepting_rollouts": True}}
        if len(polled) == len(ids):  # both polled (so watched) before the second such read was sent
            confirmed.append(reads[-1])
            if len(confirmed) == 2:  # the server restarts: the next reads show the new process
                process[0] = "p-2"
        return web.json_response(answer)

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response(
            {"rollout_id": rollout_id, "polling_lease_token": "t", "result_wait_timeout_sec": 0.5}, status=202
        )

    async def result(request: web.Request) -> web.Response:
        polled.add(request.match_info["id"])
        await asyncio.sleep(0.5)
        return web.json_response({"rollout_id": request.match_info["id"], "status": "running"})

    routes = [web.get("/health", health), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    async with (
        serving(*routes) as url,
        running_gateway(tmp_path) as gw,
        httpx.AsyncClient(base_url=gw.url) as admin,
    ):
        await admin.put("/admin/v1/agents/flaky", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": i, "input": "x", "agent": "flaky"} for i in ids]}
        )
        rollouts = await finish(gw, ids, timeout=15)
        attempts = [(await gw.store.list_attempts(i))[0] for i in ids]
    assert [r.status for r in rollouts] == ["failed", "failed"] and process == ["p-2"]
    assert all("new process_id" in (a.metadata or {})["completion"]["error_message"] for a in attempts)
    watched = [t for t in reads if t >= confirmed[0]]  # (not the probes): one reader, never two reads at once
    assert all(later - earlier > 0.25 for earlier, later in itertools.pairwise(watched)), watched


@pytest.mark.parametrize(
    ("lease_timeout", "unpolled", "resumed"),
    [(120.0, 39.0, False), (120.0, 41.0, True), (20.0, 9.0, False), (20.0, 11.0, True), (40.0, 21.0, True)],
)
def test_a_lease_counts_as_unpolled_after_half_its_length(lease_timeout: float, unpolled: float, resumed: bool) -> None:
    """A lease not polled for longer than one poll takes (the server's 30 s wait plus 10 s) is another process's to
    resume, and so is one not polled for half its length when that is shorter: a short lease (20 s) must be
    resumed within it, not 40 s later when the server has let the rollout go."""
    lease = {"osmosis_id": "at-1", "lease": "t", "wait": 30.0, "lease_timeout": lease_timeout, "polled_at": 1000.0}
    assert v03.stale(lease, 1000.0 + unpolled) is resumed


async def test_a_03_result_with_nan_metrics_is_recorded_with_their_names(tmp_path: Path) -> None:
    """A 0.3 result whose sample's metrics hold ``NaN`` and ``-Infinity`` (as Python's json module writes them)
    is a result like any other: the attempt succeeds, and its completion keeps them as "NaN" and "-Infinity"."""

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response({"rollout_id": rollout_id, "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        sample = {"reward": 0.5, "messages": [], "metrics": {"loss": math.nan, "margin": -math.inf, "calls": 2}}
        body = {"rollout_id": request.match_info["id"], "status": "success", "sample": sample}
        return web.Response(text=json.dumps(body), content_type="application/json")

    routes = [health_route(), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    async with serving(*routes) as url:
        rollout, attempt = await one_task(tmp_path, url, "nan")
    assert rollout.status == "succeeded", attempt.metadata
    completion = (attempt.metadata or {})["completion"]
    assert completion["metrics"] == {"loss": "NaN", "margin": "-Infinity", "calls": 2}
    assert completion["reward"] == 0.5


class FailingWrites:
    """Makes ``store.<method>`` raise ``UnavailableError`` (the database down) on its next ``times`` calls, then
    pass the calls on; ``passed`` is set at the first call that succeeds after the failures."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: Any, method: str, times: int) -> None:
        self.left, self.failed, self.passed = times, 0, asyncio.Event()
        real = getattr(store, method)

        async def write(*args: Any, **kwargs: Any) -> Any:
            if self.left > 0:
                self.left -= 1
                self.failed += 1
                raise UnavailableError("the database is down")
            answer = await real(*args, **kwargs)
            self.passed.set()
            return answer

        monkeypatch.setattr(store, method, write)


async def test_a_03_admission_accepted_while_the_store_is_down_is_kept_once_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 0.3 server accepts the admission, and the two writes that record it (the lease, the ``dispatch`` record)
    fail twice each: the controller keeps polling from memory and writes them again until they pass, so no
    process would ever take the admission for lost (sending it again would get a 409 and cancel the run), and the
    run's result is recorded. The server's long poll answers only once the test lets it: nothing but the retries
    can write the lease meanwhile."""
    admitted: list[str] = []
    cancelled: list[Any] = []
    finish_run = asyncio.Event()

    async def admit(request: web.Request) -> web.Response:
        admitted.append((await request.json())["rollout_id"])
        return web.json_response({"rollout_id": admitted[-1], "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finish_run.wait(), 25)
        sample: dict[str, Any] = {"reward": 1.0, "messages": []} if finish_run.is_set() else {}
        status = "success" if finish_run.is_set() else "running"
        return web.json_response({"rollout_id": request.match_info["id"], "status": status, "sample": sample})

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"dispositions": {}})

    routes = [
        health_route(),
        web.post("/rollout", admit),
        web.get("/rollout/{id}/result", result),
        web.post("/rollout/cancel", cancel),
    ]
    async with serving(*routes) as url, running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        lease = FailingWrites(monkeypatch, gw.store, "record_lease", 2)
        record = FailingWrites(monkeypatch, gw.store, "record_dispatch", 2)
        await admin.put("/admin/v1/agents/down", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": "ro-down", "input": "x", "agent": "down"}]}
        )
        await asyncio.wait_for(lease.passed.wait(), 10)
        await asyncio.wait_for(record.passed.wait(), 10)
        assert (lease.failed, record.failed) == (2, 2)
        far = gw.store.clock() + 1e6  # however long from now another process looks, it finds nothing lost
        assert await gw.store.undispatched_attempts("down", far, far) == []
        [(kept, _)] = await gw.store.agent_leases("down")
        finish_run.set()
        [rollout] = await finish(gw, ["ro-down"], timeout=20)
        [attempt] = await gw.store.list_attempts("ro-down")
    assert rollout.status == "succeeded" and admitted == [attempt.attempt_id] and cancelled == []
    assert kept.attempt.attempt_id == attempt.attempt_id
    dispatch = (attempt.metadata or {})["dispatch"]
    assert dispatch["osmosis_id"] == attempt.attempt_id and dispatch["admitting"] is None


async def test_a_409_for_an_admission_another_process_keeps_the_lease_of_leaves_its_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admission sent again by a process that took it for lost, while the process that had it accepted was
    keeping its lease (the store came back in between), gets a 409: the run is that process's, so it is neither
    cancelled nor failed here. Here the lease is written as the 409 is answered, not polled since: its polls are
    resumed from it and the run's result is recorded."""
    monkeypatch.setattr(dispatcher, "LEASE_CHECK_INTERVAL", 0.2)
    cancelled: list[Any] = []
    tries: list[str] = []
    polled = asyncio.Event()

    async def admit(request: web.Request) -> web.Response:
        attempt_id = (await request.json())["rollout_id"]
        tries.append(attempt_id)
        lease = {"osmosis_id": attempt_id, "lease": "t", "wait": 1.0, "lease_timeout": 60.0, "polled_at": 0.0}
        assert await store.record_lease("ro-held", attempt_id, lease)  # the other process's, kept meanwhile
        return web.json_response({"detail": "rollout_id is already registered"}, status=409)

    async def result(request: web.Request) -> web.Response:
        assert request.headers[wire.LEASE_HEADER] == "t"
        polled.set()
        sample = {"reward": 1.0, "messages": []}
        return web.json_response({"rollout_id": request.match_info["id"], "status": "success", "sample": sample})

    async def cancel(request: web.Request) -> web.Response:
        cancelled.append(await request.json())
        return web.json_response({"dispositions": {}})

    routes = [
        health_route(),
        web.post("/rollout", admit),
        web.get("/rollout/{id}/result", result),
        web.post("/rollout/cancel", cancel),
    ]
    async with serving(*routes) as url, running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        store = gw.store
        await admin.put("/admin/v1/agents/held", json={"url": url})
        await admin.post(
            "/admin/v1/rollouts", json={"tasks": [{"rollout_id": "ro-held", "input": "x", "agent": "held"}]}
        )
        [rollout] = await finish(gw, ["ro-held"], timeout=20)
        [attempt] = await gw.store.list_attempts("ro-held")
    assert rollout.status == "succeeded" and polled.is_set(), attempt.metadata
    assert tries == [attempt.attempt_id] and cancelled == []


async def test_a_03_attempt_is_running_once_the_server_says_it_runs(tmp_path: Path) -> None:
    """A 0.3 attempt is ``preparing`` until its server's poll answer says the rollout runs: then it (and its
    rollout) is ``running``, before any chat call of its workflow."""
    polls: list[str] = []
    second_poll, finish_run = asyncio.Event(), asyncio.Event()

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response({"rollout_id": rollout_id, "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        polls.append(request.match_info["id"])
        if len(polls) == 1:
            return web.json_response({"rollout_id": polls[0], "status": "running"})
        second_poll.set()
        await asyncio.wait_for(finish_run.wait(), 20)
        sample = {"reward": 1.0, "messages": []}
        return web.json_response({"rollout_id": polls[0], "status": "success", "sample": sample})

    routes = [health_route(), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    async with serving(*routes) as url, running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url) as admin:
        await admin.put("/admin/v1/agents/runs", json={"url": url})
        task = {"rollout_id": "ro-runs", "input": "x", "agent": "runs"}
        await admin.post("/admin/v1/rollouts", json={"tasks": [task]})
        await asyncio.wait_for(second_poll.wait(), 10)  # the first answer ("running") was taken in before it
        running = await gw.store.get_attempt("ro-runs")
        assert (running.status, (await gw.store.get_rollout("ro-runs")).status) == ("running", "running")
        finish_run.set()
        [rollout] = await finish(gw, ["ro-runs"], timeout=20)
    assert rollout.status == "succeeded" and running.attempt_id == polls[0]


@pytest.mark.parametrize(("reward", "name"), [(math.nan, "NaN"), (math.inf, "Infinity")])
async def test_a_03_success_whose_reward_is_not_finite_fails_saying_so(
    tmp_path: Path, reward: float, name: str
) -> None:
    """A 0.3 success whose grader's reward is NaN or infinite (as Python's json module writes them) is no reward
    to train on, nor a success without one: the attempt fails, its error names the reward, and it keeps no reward
    (as a v1 report with such a reward is refused)."""

    async def admit(request: web.Request) -> web.Response:
        rollout_id = (await request.json())["rollout_id"]
        return web.json_response({"rollout_id": rollout_id, "polling_lease_token": "t"}, status=202)

    async def result(request: web.Request) -> web.Response:
        sample = {"reward": reward, "messages": [], "metrics": {"calls": 1}}
        body = {"rollout_id": request.match_info["id"], "status": "success", "sample": sample}
        return web.Response(text=json.dumps(body), content_type="application/json")

    routes = [health_route(), web.post("/rollout", admit), web.get("/rollout/{id}/result", result)]
    async with serving(*routes) as url:
        rollout, attempt = await one_task(tmp_path, url, "nanreward")
    completion = (attempt.metadata or {})["completion"]
    assert rollout.status == "failed" and completion["reward"] is None, completion
    assert f"reward of {name}" in completion["error_message"] and completion["metrics"] == {"calls": 1}
