"""``rollway serve --workers N``: N worker processes on one port, each a replica of one store, behind one
supervisor (``rollway.app.serving``). Real processes end to end: the supervisor and its workers as a
subprocess, the mock backend, and clients that open a new connection per call, so the kernel spreads their calls
over the workers (``SO_REUSEPORT``).

Which worker serves what is read from ``/admin/v1/replicas`` (each worker is one live replica there, with its
pid and its calls in flight)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.admin.client import AsyncRollwayClient
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store import Store
from support.gateway_harness import vllm

pytestmark = pytest.mark.slow  # multi-process: supervisors and their workers

WORKERS = 2
MESSAGES = [{"role": "user", "content": "Count to three."}]
SLOW = {"ignore_eos": True, "mock": {"token_delay_ms": 50}}  # 400 tokens: 20 s, far beyond each test


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gateway.db'}"


@pytest.fixture
def group(store_url: str) -> Iterator[GatewayProcess]:
    """A group of workers on a SQLite file and on a fresh PostgreSQL database."""
    with GatewayProcess(store_url, env={"ROLLWAY_WORKERS": str(WORKERS), "ROLLWAY_SHUTDOWN_TIMEOUT": "1"}) as gw:
        yield gw


def fresh_connections(gw: GatewayProcess, timeout: float = 30) -> httpx.AsyncClient:
    """A client that opens a new connection for every request (none is kept), so its requests are spread over
    the workers as separate agents' would be."""
    return httpx.AsyncClient(
        base_url=gw.url, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0, max_connections=64)
    )


@asynccontextmanager
async def admin(gw: GatewayProcess) -> AsyncIterator[AsyncRollwayClient]:
    async with AsyncRollwayClient(gw.url) as client:
        yield client


async def replicas(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    answer = await http.get("/admin/v1/replicas")
    answer.raise_for_status()
    items: list[dict[str, Any]] = answer.json()["items"]
    return items


async def until(check: Any, what: str, timeout: float = 15.0) -> Any:
    """Poll ``check()`` until it returns something truthy: the workers report to the store every quarter second
    and nothing in another process can be awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def claim(client: AsyncRollwayClient, count: int) -> list[tuple[str, str]]:
    await client.enqueue([{"input": {"task": i}} for i in range(count)])
    claims = await client.claim("runner", limit=count)
    return [(c.rollout.rollout_id, c.attempt.attempt_id) for c in claims]


def chat_path(rollout_id: str, attempt_id: str) -> str:
    return f"/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"


async def test_calls_of_one_attempt_on_different_workers_get_gap_free_sequence_ids_in_arrival_order(
    group: GatewayProcess, mock: MockBackendProcess
) -> None:
    """Eight agents, each making six calls one after the other, every call on a new connection (so on either
    worker): each attempt's spans are numbered 1..6 in the order its calls were made, with no gap and no
    duplicate; and both workers served calls."""
    async with admin(group) as client, fresh_connections(group) as http:
        await client.put_model("policy", [vllm(mock)], version="v1")
        rollouts = await claim(client, 8)

        async def agent(rollout_id: str, attempt_id: str) -> None:
            for turn in range(6):
                messages = [{"role": "user", "content": f"turn {turn}"}]
                body = {"model": "policy", "messages": messages, "max_tokens": 4}
                answer = await http.post(chat_path(rollout_id, attempt_id), json=body)
                assert answer.status_code == 200, answer.text

        served = await replicas(http)
        await asyncio.gather(*(agent(r, a) for r, a in rollouts))
        for rollout_id, _ in rollouts:
            spans = await client.get_spans(rollout_id)
            assert [s.sequence_id for s in spans] == [1, 2, 3, 4, 5, 6]
            turns = [s.attributes["rollway.request"]["messages"][0]["content"] for s in spans]
            assert turns == [f"turn {t}" for t in range(6)]
    assert len(served) == WORKERS and len({r["pid"] for r in served}) == WORKERS


async def test_slow_calls_spread_over_every_worker_and_a_sigterm_records_each_of_them(
    group: GatewayProcess, store_url: str, mock: MockBackendProcess
) -> None:
    """Sixteen streams that will not end on their own, each on its own connection: both workers have some in
    flight (``/admin/v1/replicas``). SIGTERM to the supervisor stops the group: after the shutdown timeout
    each worker ends its calls, every one of them recorded, and the supervisor exits 0."""
    async with admin(group) as client, fresh_connections(group) as http:
        await client.put_model("policy", [vllm(mock)], version="v1")
        rollouts = await claim(client, 16)
        received: list[int] = [0] * len(rollouts)

        async def stream(index: int, rollout_id: str, attempt_id: str) -> None:
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 400, "stream": True, **SLOW}
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # the server goes away at the end
                async with http.stream("POST", chat_path(rollout_id, attempt_id), json=body) as answer:
                    assert answer.status_code == 200
                    async for line in answer.aiter_lines():
                        if line.startswith("data:"):
                            received[index] += 1
                            if '"server_shutting_down"' in line:
                                raise httpx.ReadError("told the server is shutting down")

        streams = [asyncio.create_task(stream(i, r, a)) for i, (r, a) in enumerate(rollouts)]

        async def both_busy() -> list[dict[str, Any]] | None:
            seen = await replicas(http)
            busy = sum(r["calls_in_flight"] for r in seen) == len(rollouts)
            return seen if busy and all(r["calls_in_flight"] for r in seen) else None

        seen = await until(both_busy, "every stream in flight, on both workers")
        assert len(seen) == WORKERS
        stopped = time.monotonic()
        code = await asyncio.to_thread(group.stop, 30)
        await asyncio.gather(*streams)
    assert code == 0
    assert time.monotonic() - stopped < 1 + 8  # the shutdown timeout, then promptly
    assert all(received)  # every stream had started
    store = await Store.open(store_url, run_watchdog=False)
    try:
        for rollout_id, attempt_id in rollouts:
            [span] = await store.query_spans(rollout_id, attempt_id)
            assert span.attributes["error.type"] == "shutdown"
            assert span.attributes["rollway.response_token_ids"]  # the tokens that went by before the end
    finally:
        await store.close()


async def test_metrics_are_the_sums_over_every_worker(group: GatewayProcess, mock: MockBackendProcess) -> None:
    """Twenty calls spread over the workers: each scrape, whichever worker answers it, counts all twenty."""
    async with admin(group) as client, fresh_connections(group) as http:
        await client.put_model("policy", [vllm(mock)], version="v1")
        body = {"model": "policy", "messages": MESSAGES, "max_tokens": 3}
        answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(20)))
        assert [a.status_code for a in answers] == [200] * 20
        pattern = re.compile(r'^rollway_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', re.M)
        for _ in range(6):
            text = (await http.get("/metrics")).text
            assert sum(float(v) for v in pattern.findall(text)) == 20


async def test_a_swap_through_one_worker_reaches_every_worker_with_no_failed_call(
    sqlite_url: str, mock: MockBackendProcess
) -> None:
    """Agents keep calling, spread over the workers, while the alias is swapped to a new backend and version:
    no call fails, and every call that arrives after the swap answered is served by the new configuration,
    whichever worker takes it."""
    env = {"ROLLWAY_WORKERS": str(WORKERS)}
    with GatewayProcess(sqlite_url, env=env) as gw:
        async with admin(gw) as client, fresh_connections(gw) as http:
            await client.put_model("policy", [vllm(mock, "mock-a")], version="v1")
            rollouts = await claim(client, 6)
            agents = calling_agents(http, rollouts)
            after, failures = agents.after, agents.failures  # rollouts of the calls begun after the swap answered
            await until(lambda: _calls_made(client, rollouts, 30), "calls before the swap")
            await client.swap_model("policy", [vllm(mock, "mock-b")], version="v2", drain_timeout_seconds=10)
            agents.changed.set()
            await asyncio.gather(*agents.tasks)
            assert failures == []
            assert after  # calls began after the swap
            for rollout_id, _ in rollouts:
                spans = await client.get_spans(rollout_id)
                versions = [s.attributes["rollway.model_version"] for s in spans]
                assert versions == sorted(versions)  # v1 then v2 in each attempt, never back
                assert versions.count("v2") >= after.count(rollout_id)  # each call begun after the swap: v2
                assert all(
                    s.attributes["rollway.backend_id"] == ("mock-b" if v == "v2" else "mock-a")
                    for s, v in zip(spans, versions, strict=True)
                )


@dataclass
class Agents:
    """Agents that each make 40 calls in a row, one per rollout; which calls failed, and the rollouts of the calls
    that began after ``changed`` was set (a swap or an update answered)."""

    tasks: list[asyncio.Task[None]]
    changed: asyncio.Event
    after: list[str]
    failures: list[str]


def calling_agents(http: httpx.AsyncClient, rollouts: list[tuple[str, str]]) -> Agents:
    agents = Agents([], asyncio.Event(), [], [])

    async def agent(rollout_id: str, attempt_id: str) -> None:
        for _ in range(40):
            began_after = agents.changed.is_set()
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 3}
            answer = await http.post(chat_path(rollout_id, attempt_id), json=body)
            if answer.status_code != 200:
                agents.failures.append(answer.text)
            elif began_after:
                agents.after.append(rollout_id)

    agents.tasks = [asyncio.create_task(agent(r, a)) for r, a in rollouts]
    return agents


async def _calls_made(client: AsyncRollwayClient, rollouts: list[tuple[str, str]], count: int) -> bool:
    spans = 0
    for rollout_id, _ in rollouts:
        spans += len(await client.get_spans(rollout_id))
    return spans >= count


async def test_a_worker_that_dies_is_replaced_and_the_group_keeps_serving(
    sqlite_url: str, mock: MockBackendProcess
) -> None:
    """``kill -9`` of one worker: the supervisor says so and starts another (a new live replica with a new pid),
    and calls on every connection succeed again."""
    with GatewayProcess(sqlite_url, env={"ROLLWAY_WORKERS": str(WORKERS)}) as gw:
        async with admin(gw) as client, fresh_connections(gw) as http:
            await client.put_model("policy", [vllm(mock)], version="v1")
            before = {r["pid"] for r in await replicas(http)}
            assert len(before) == WORKERS
            victim = min(before)
            os.kill(victim, signal.SIGKILL)

            async def replaced() -> set[int]:
                alive = {r["pid"] for r in await replicas(http) if _alive(r["pid"])}
                return alive if len(alive) == WORKERS and alive != before else set()

            after = await until(replaced, "a replacement worker")
            assert victim not in after and len(after - before) == 1
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 3}
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(20)))
            assert [a.status_code for a in answers] == [200] * 20
        assert any(f"(pid {victim}) ended on SIGKILL: starting another" in line for line in gw.output)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_group_whose_workers_cannot_open_the_store_stops_with_the_reason(tmp_path: Path) -> None:
    """The database cannot be opened (its directory does not exist): the workers fail their start, and the
    supervisor stops the group with status 3 (a server's start failure) and the store's reason, rather than
    starting them again and again."""
    missing = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")} | {"ROLLWAY_WORKERS": str(WORKERS)}
    command = [sys.executable, "-c", "from rollway.cli import main; main()", "serve", "--port", "0", "--db", missing]
    ended = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    output = ended.stdout + ended.stderr
    assert ended.returncode == 3, output
    assert "could not start (it ended with exit status 3): stopping" in output
    assert "rollway: " in output and "does not exist" in output  # the store's own sentence
    assert "Traceback" not in output


async def test_a_worker_stopped_alone_records_its_calls_in_flight_and_is_replaced(
    sqlite_url: str, mock: MockBackendProcess
) -> None:
    """SIGTERM to one worker (an operator's ``kill``, a container runtime's): it stops as a server does, ending
    its calls in flight after the shutdown timeout, each recorded; the supervisor starts another; the other
    worker's streams go on untouched."""
    env = {"ROLLWAY_WORKERS": str(WORKERS), "ROLLWAY_SHUTDOWN_TIMEOUT": "1"}
    with GatewayProcess(sqlite_url, env=env) as gw:
        async with admin(gw) as client, fresh_connections(gw) as http:
            await client.put_model("policy", [vllm(mock)], version="v1")
            rollouts = await claim(client, 16)
            outcomes: dict[str, str] = {}

            async def stream(rollout_id: str, attempt_id: str) -> None:
                body = {"model": "policy", "messages": MESSAGES, "max_tokens": 400, "stream": True, **SLOW}
                async with http.stream("POST", chat_path(rollout_id, attempt_id), json=body) as answer:
                    async for line in answer.aiter_lines():
                        if '"server_shutting_down"' in line:
                            outcomes[rollout_id] = "ended"
                            return
                        if line.startswith("data:"):
                            outcomes[rollout_id] = "streaming"

            streams = [asyncio.create_task(stream(r, a)) for r, a in rollouts]

            async def both_busy() -> list[dict[str, Any]] | None:
                seen = await replicas(http)
                busy = sum(r["calls_in_flight"] for r in seen) == len(rollouts)
                return seen if busy and all(r["calls_in_flight"] for r in seen) else None

            seen = await until(both_busy, "every stream in flight, on both workers")
            victim = seen[0]
            os.kill(victim["pid"], signal.SIGTERM)
            in_flight: int = victim["calls_in_flight"]

            async def ended() -> bool:
                return sum(1 for o in outcomes.values() if o == "ended") == in_flight

            await until(ended, "the stopped worker's streams ended")
            spans = {r: await client.get_spans(r) for r, _ in rollouts}
            stopped = [r for r, o in outcomes.items() if o == "ended"]
            for rollout_id in stopped:
                [span] = spans[rollout_id]
                assert span.attributes["error.type"] == "shutdown"
            assert all(not spans[r] for r, _ in rollouts if r not in stopped)  # the others still stream

            async def replaced() -> bool:
                pids = {r["pid"] for r in await replicas(http) if _alive(r["pid"])}
                return len(pids) == WORKERS and victim["pid"] not in pids

            await until(replaced, "a replacement worker")
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        assert any(f"(pid {victim['pid']}) ended on SIGTERM: starting another" in line for line in gw.output)


async def test_workers_that_die_together_are_each_replaced(sqlite_url: str, mock: MockBackendProcess) -> None:
    """``kill -9`` of every worker at once (an out-of-memory killer, a bad deploy): each slot gets a worker
    again, none is forgotten, and the group serves."""
    with GatewayProcess(sqlite_url, env={"ROLLWAY_WORKERS": str(WORKERS)}) as gw:
        async with admin(gw) as client, fresh_connections(gw) as http:
            await client.put_model("policy", [vllm(mock)], version="v1")
            before = {r["pid"] for r in await replicas(http)}
            for pid in before:
                os.kill(pid, signal.SIGKILL)

            async def replaced() -> set[int]:
                try:
                    alive = {r["pid"] for r in await replicas(http) if _alive(r["pid"])}
                except httpx.TransportError:  # no worker listening yet
                    return set()
                return alive if len(alive) == WORKERS and not alive & before else set()

            await until(replaced, "a replacement for every worker", timeout=30)
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 3}
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(20)))
            assert [a.status_code for a in answers] == [200] * 20


async def test_a_weight_update_through_one_worker_holds_and_updates_every_worker(
    sqlite_url: str, mock: MockBackendProcess
) -> None:
    """Agents keep calling, spread over the workers, while the weights are updated in place through one of them:
    no call fails, the engine reloads once, and every call that begins after the update answered is served by the
    new version, whichever worker takes it. Then an update that aborts the calls in flight ends a slow call on
    every worker at once, each recorded as an aborted span."""
    env = {"ROLLWAY_WORKERS": str(WORKERS)}
    with GatewayProcess(sqlite_url, env=env) as gw:
        async with admin(gw) as client, fresh_connections(gw) as http:
            await client.put_model("policy", [vllm(mock, "mock-a")], version="v1")
            rollouts = await claim(client, 6)
            agents = calling_agents(http, rollouts)
            after, failures = agents.after, agents.failures
            await until(lambda: _calls_made(client, rollouts, 30), "calls before the update")
            update = await client.update_weights("policy", "v2")
            agents.changed.set()
            await asyncio.gather(*agents.tasks)
            assert update.state == "committed" and update.drained
            assert failures == []
            assert after
            assert [r["path"] for r in mock.requests(path="/collective_rpc")] == ["/collective_rpc"]
            for rollout_id, _ in rollouts:
                versions = [s.attributes["rollway.model_version"] for s in await client.get_spans(rollout_id)]
                assert versions == sorted(versions)
                assert versions.count("v2") >= after.count(rollout_id)

            # A slow call on every worker, then an update that aborts them: each worker ends its own. Calls are
            # added one by one until the kernel has handed one to each worker.
            [(slow_rollout, slow_attempt)] = await claim(client, 1)
            slow: list[asyncio.Task[httpx.Response]] = []
            body = {"model": "policy", "messages": MESSAGES, **SLOW}
            while len(slow) < 20:
                slow.append(asyncio.create_task(http.post(chat_path(slow_rollout, slow_attempt), json=body)))

                async def counted() -> list[dict[str, Any]] | None:
                    seen = await replicas(http)
                    return seen if sum(r["calls_in_flight"] for r in seen) == len(slow) else None

                seen = await until(counted, "the slow calls in flight")
                if all(r["calls_in_flight"] for r in seen):
                    break
            assert len(seen) == WORKERS and all(r["calls_in_flight"] for r in seen)
            began = time.monotonic()
            aborting = await client.update_weights("policy", "v3", in_flight="abort", drain_timeout_seconds=10)
            assert aborting.state == "committed" and aborting.drained
            assert aborting.aborted_calls == len(slow)  # each worker counted the calls it ended
            answers = await asyncio.gather(*slow)
            assert time.monotonic() - began < 10  # not the 20 s the slow calls would take
            assert {a.status_code for a in answers} == {503}
            spans = await client.get_spans(slow_rollout)
            assert [s.attributes["error.type"] for s in spans] == ["aborted"] * len(slow)
