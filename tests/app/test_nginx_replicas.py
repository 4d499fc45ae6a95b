"""Replicas behind a real nginx: two ``rollway serve`` processes on one PostgreSQL database behind nginx running
the shipped ``deploy/nginx.conf``. Agents call through nginx with the official ``openai`` SDK and their claims'
rollout keys, and the trainer's admin requests go through nginx too.

- Under load, a swap through nginx fails no call, and both replicas serve the new model.
- Then one replica is killed (SIGKILL) under load and the calls fail over to the other: every call answered 200
  has its span in its attempt, in order and once; the only sequence ids without a span, and the only spans
  without a 200, are those of calls whose client saw a try fail at the kill and tried again, through nginx,
  with success.
- Once nginx's ``fail_timeout`` is over it tries the dead replica's address again and passes the call on to the
  survivor, unseen by the client; the replica started again on its address is taken back without a reload.

Skipped (one line) without nginx or without PostgreSQL; CI requires both (``ROLLWAY_REQUIRE_NGINX=1``,
``ROLLWAY_REQUIRE_POSTGRES=1``)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from rollway.admin.client import AsyncRollwayClient
from rollway.admin.schemas import Claim
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store import Span
from support.nginx_env import NGINX_CONF, NginxProcess, nginx_config, require_nginx

NGINX = require_nginx()
pytestmark = [pytest.mark.real_component, pytest.mark.postgres]

TOKEN = "admin-secret-token"
ALIAS = "policy"
AGENTS = 8
#: Calls answered in each of the three phases: on v1, on v2 before the kill, after the kill.
PHASE_CALLS = 80
#: Tries an agent gives one call, beyond its SDK's own retries of a 502: a stream cut by the kill is tried again.
TRIES = 3
#: The mock backend's pace, asked per call: ~0.13 s a call, so that each replica always has calls in flight.
PACE = {"ttft_ms": 20, "token_delay_ms": 15}
MAX_TOKENS = 8
#: deploy/nginx.conf's ``fail_timeout``: how long nginx leaves a replica out after it failed.
FAIL_TIMEOUT = float(re.findall(r"fail_timeout=(\d+)s", NGINX_CONF.read_text())[0])
#: The whole scenario, from the first admin request to the last span read.
SCENARIO_TIMEOUT = 90.0


@dataclass
class Call:
    """One agent call as its client saw it: its tries, and the answer of the one that succeeded."""

    agent: int
    tag: str  # the user message: which call a span belongs to
    stream: bool
    started: float
    ended: float = 0.0
    failed_tries: int = 0  # the SDK's retries (of a 502) and the agent's own (a stream cut short)
    errors: list[str] = field(default_factory=list)
    sequence_id: int = 0
    response_id: str = ""
    text: str = ""


@dataclass
class Swap:
    sent: float
    answered: float


class Load:
    """``AGENTS`` agents, each calling through its own claim (``base_url`` and rollout key) until ``stop``."""

    def __init__(self, claims: list[Claim]) -> None:
        self.claims = claims
        self.calls: list[Call] = []
        self.refusals: list[tuple[int, str]] = []  # every answer not 2xx the agents' SDKs saw: status, type
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self._answered = asyncio.Condition()

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._agent(i)) for i in range(len(self.claims))]

    async def until(self, count: int) -> None:
        """Wait until ``count`` calls have been answered; an agent that fails meanwhile raises its error here."""

        async def answered() -> None:
            async with self._answered:
                await self._answered.wait_for(lambda: len(self.calls) >= count)

        waiter = asyncio.create_task(answered())
        done, _ = await asyncio.wait([waiter, *self.tasks], return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            for task in done:
                task.result()
            raise AssertionError("an agent stopped before it was told to")

    async def finish(self) -> None:
        """Stop the agents after their current call, raising the first one's error."""
        self.stop.set()
        await asyncio.gather(*self.tasks)

    async def _agent(self, index: int) -> None:
        claim = self.claims[index]

        async def note(response: Any) -> None:  # each try's answer (an httpx response), the SDK's retries' too
            if response.status_code >= 300:
                self.refusals.append((response.status_code, response.headers.get("content-type", "")))

        # The SDK's own client and retries (2, of a 502 or a connection error), as an agent has them.
        http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [note]})
        async with AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, http_client=http) as client:
            number = 0
            while not self.stop.is_set():
                call = Call(index, f"agent {index} call {number}", (index + number) % 2 == 0, time.monotonic())
                for _ in range(TRIES):
                    try:
                        await _one_try(client, call)
                        break
                    except openai.APIConnectionError as exc:  # a stream cut short
                        call.failed_tries += 1
                        call.errors.append(repr(exc))
                else:
                    raise AssertionError(f"{call.tag} failed {TRIES} times through nginx: {call.errors}")
                call.ended = time.monotonic()
                async with self._answered:
                    self.calls.append(call)
                    self._answered.notify_all()
                number += 1


async def _one_try(client: AsyncOpenAI, call: Call) -> None:
    messages: Any = [{"role": "user", "content": call.tag}]
    extra = {"mock": PACE}
    if call.stream:
        streamed = await client.chat.completions.with_raw_response.create(
            model=ALIAS, messages=messages, max_tokens=MAX_TOKENS, stream=True, extra_body=extra
        )
        call.failed_tries += streamed.retries_taken
        chunks = [chunk async for chunk in streamed.parse()]
        assert len({chunk.id for chunk in chunks}) == 1, [chunk.id for chunk in chunks]
        call.response_id = chunks[0].id
        call.text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        headers = streamed.headers
    else:
        whole = await client.chat.completions.with_raw_response.create(
            model=ALIAS, messages=messages, max_tokens=MAX_TOKENS, extra_body=extra
        )
        call.failed_tries += whole.retries_taken
        completion = whole.parse()
        call.response_id = completion.id
        call.text = completion.choices[0].message.content or ""
        headers = whole.headers
    call.sequence_id = int(headers["x-rollway-sequence-id"])


async def test_replicas_behind_nginx_swap_and_fail_over_when_one_is_killed_under_load(
    pg_url: str, mock: MockBackendProcess, tmp_path: Path
) -> None:
    port = _free_port()
    public = f"http://127.0.0.1:{port}"  # nginx: what the claims hand to agents
    # No access lines from the replicas (nginx's access log has every request, with the replica that answered it):
    # their output keeps their own warnings and errors (a traceback is one line), shown if the test fails.
    env = {"ROLLWAY_PUBLIC_URL": public, "ROLLWAY_ACCESS_LOG": "false"}
    replicas = [GatewayProcess(pg_url, admin_token=TOKEN, env=env) for _ in range(2)]
    nginx: NginxProcess | None = None
    try:
        # Started together on the empty database: one migrates, the other waits for it.
        await asyncio.gather(*(asyncio.to_thread(replica.start) for replica in replicas))
        upstreams = [_address(replica) for replica in replicas]
        scratch = tmp_path / "nginx"
        config = nginx_config(NGINX_CONF.read_text(), listen=f"127.0.0.1:{port}", replicas=upstreams, scratch=scratch)
        nginx = await asyncio.to_thread(NginxProcess(NGINX, config, scratch).start)
        async with asyncio.timeout(SCENARIO_TIMEOUT):
            admin = AsyncRollwayClient(public, TOKEN)
            async with admin, httpx.AsyncClient(base_url=public, timeout=10) as http:
                await _kill_under_load(public, replicas, mock, admin, http)
                # The killed replica's address, and the same replica started again there (stopped below too).
                restarted = GatewayProcess(pg_url, port=_port(replicas[0]), admin_token=TOKEN, env=env)
                replicas.append(restarted)
                await _dead_then_back(replicas, scratch / "access.log", admin, http)
    except BaseException:
        logs: dict[str, Sequence[str]] = {replica.url: replica.output for replica in replicas}
        if nginx:
            logs["nginx"] = nginx.output
        access = tmp_path / "nginx" / "access.log"
        if access.exists():  # every answer but a 200, with the replica that gave it (upstream=, upstream_status=)
            logs["nginx: answers but 200"] = [line for line in access.read_text().splitlines() if '" 200 ' not in line]
        for name, lines in logs.items():  # shown with the failure (its captured stdout)
            print(f"--- {name} ---", *list(lines)[-40:], sep="\n")
        raise
    finally:
        if nginx is not None:
            await asyncio.to_thread(nginx.stop)
        await asyncio.gather(*(asyncio.to_thread(replica.stop) for replica in replicas))


async def _kill_under_load(
    public: str,
    replicas: list[GatewayProcess],
    mock: MockBackendProcess,
    admin: AsyncRollwayClient,
    http: httpx.AsyncClient,
) -> None:
    """Calls and admin requests through nginx; a swap under load; one replica killed under load."""
    victim, survivor = replicas
    ready = await http.get("/readyz", headers={"X-Request-Id": "through-nginx-1"})
    assert ready.status_code == 200, ready.text
    assert ready.headers["x-request-id"] == "through-nginx-1"  # the client's id reaches the replica
    await admin.put_model(ALIAS, [_backend(mock, "a")], version="v1")
    await admin.enqueue([{"input": {"agent": i}} for i in range(AGENTS)])
    claims = await admin.claim("runner-1", limit=AGENTS)
    assert len(claims) == AGENTS
    assert all(claim.base_url.startswith(f"{public}/rollout/") for claim in claims)  # agents call nginx

    load = Load(claims)
    load.start()
    try:
        await load.until(PHASE_CALLS)
        sent = time.monotonic()
        swapped = await admin.swap_model(ALIAS, [_backend(mock, "b")], version="v2", drain_timeout_seconds=20)
        swap = Swap(sent, time.monotonic())
        assert swapped.version == "v2" and swapped.drained is True  # the v1 calls of both replicas ended
        await load.until(len(load.calls) + PHASE_CALLS)
        for replica in replicas:  # a swap through nginx reached both replicas: each serves the new backend
            assert _served(await _samples(http, replica), "b") > 0, replica.url
        await _until_calls_in_flight(http, victim, 3)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        before_kill = _served(await _samples(http, survivor), "b")
        await load.until(len(load.calls) + PHASE_CALLS)
    finally:
        await load.finish()

    assert victim.returncode == -signal.SIGKILL
    assert _served(await _samples(http, survivor), "b") > before_kill  # calls after the kill went there
    retried = [call for call in load.calls if call.failed_tries]
    assert retried, "no call was in flight on the killed replica"
    # The only error answers: nginx's own 502 page (a replica gone), never one of Rollway's (JSON).
    assert all(status == 502 and kind.startswith("text/html") for status, kind in load.refusals), load.refusals
    for call in retried:  # only the kill failed calls, and each was answered on a later try
        assert call.ended > killed, (call.tag, call.errors)
    # Admin requests through nginx with one replica dead: readiness, the model, every span.
    assert (await http.get("/readyz")).status_code == 200
    assert (await admin.get_model(ALIAS)).version == "v2"
    await _check_spans(admin, load, swap)


async def _dead_then_back(
    replicas: list[GatewayProcess], access_log: Path, admin: AsyncRollwayClient, http: httpx.AsyncClient
) -> None:
    """After the kill, with one agent calling (its SDK's retries off, so that any failure shows): nginx tries
    the dead replica's address again once its ``fail_timeout`` is over, the connection is refused and nginx
    passes the call on to the survivor, the client none the wiser (a call of the load may have shown it
    already); the replica started again on its address is taken back without a reload."""
    victim, survivor, restarted = replicas
    dead, alive = _address(victim), _address(survivor)
    await admin.enqueue([{"input": {"agent": "after the kill"}}])
    [claim] = await admin.claim("runner-2")
    answered: list[int] = []
    async with AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0, timeout=30) as client:

        async def call() -> None:
            messages: Any = [{"role": "user", "content": f"after the kill {len(answered)}"}]
            raw = await client.chat.completions.with_raw_response.create(
                model=ALIAS, messages=messages, max_tokens=MAX_TOKENS, extra_body={"mock": PACE}
            )
            answered.append(int(raw.headers["x-rollway-sequence-id"]))

        # No event says when nginx's fail_timeout is over: call until its log shows a call it passed on (the
        # refused connection counts as a 502 of the dead address, the answer is the survivor's 200).
        passed_on = re.escape(f"upstream={dead}, {alive} ")
        failover = re.compile(rf'"POST /rollout/\S+/chat/completions HTTP/1.1" 200 .* {passed_on}')
        async with asyncio.timeout(FAIL_TIMEOUT + 10):
            while not failover.search(await asyncio.to_thread(access_log.read_text)):
                await call()
        await asyncio.to_thread(restarted.start)
        async with asyncio.timeout(FAIL_TIMEOUT + 10):  # nginx tries the address again after fail_timeout
            while _served(await _samples(http, restarted), "b") == 0:
                await call()
    spans = await admin.get_spans(claim.rollout.rollout_id, claim.attempt.attempt_id)
    assert [span.sequence_id for span in spans] == answered == list(range(1, len(answered) + 1))


async def _check_spans(admin: AsyncRollwayClient, load: Load, swap: Swap) -> None:
    response_ids: list[str | None] = []
    for index, claim in enumerate(load.claims):
        spans = await admin.get_spans(claim.rollout.rollout_id, claim.attempt.attempt_id)
        sequence = [span.sequence_id or 0 for span in spans]
        assert sequence == sorted(set(sequence)), sequence  # in order, each once
        by_sequence = {span.sequence_id: span for span in spans}
        calls = [call for call in load.calls if call.agent == index]  # in the agent's order
        answered = [call.sequence_id for call in calls]
        assert answered == sorted(set(answered)), answered  # each call arrived after the one before was answered
        for call in calls:
            span = by_sequence.get(call.sequence_id)
            assert span is not None, f"{call.tag}: answered 200 as sequence id {call.sequence_id}, without its span"
            _check_span(span, call, swap)
        failed = sum(call.failed_tries for call in calls)
        retried = {call.tag for call in calls if call.failed_tries}
        unanswered = [span for span in spans if span.sequence_id not in set(answered)]
        holes = set(range(1, max(sequence) + 1)) - set(sequence)
        # A try cut by the kill took at most one sequence id: its span written before the replica died (the
        # client never had the answer), or a hole (the replica died first). Nothing else leaves either.
        assert all(_tag(span) in retried for span in unanswered), [_tag(span) for span in unanswered]
        assert len(unanswered) + len(holes) <= failed, (len(unanswered), sorted(holes), failed)
        response_ids += [span.attributes.get("gen_ai.response.id") for span in spans]
    recorded = [response_id for response_id in response_ids if response_id is not None]
    assert len(recorded) == len(set(recorded))  # no answer recorded twice


def _check_span(span: Span, call: Call, swap: Swap) -> None:
    attributes = span.attributes
    assert _tag(span) == call.tag
    assert attributes["gen_ai.response.id"] == call.response_id
    assert attributes["http.response.status_code"] == 200 and attributes["rollway.stream"] is call.stream
    choice = attributes["rollway.response"]["choices"][0]
    assert (choice.get("message") or choice.get("delta") or {}).get("content") == call.text
    served = attributes["rollway.model_version"], attributes["rollway.backend_id"]
    if call.ended < swap.sent:
        assert served == ("v1", "a"), call.tag
    if call.started > swap.answered:  # whichever replica served it
        assert served == ("v2", "b"), call.tag


def _tag(span: Span) -> str:
    content: str = span.attributes["rollway.request"]["messages"][0]["content"]
    return content


def _backend(mock: MockBackendProcess, backend_id: str) -> dict[str, Any]:
    return {"backend_id": backend_id, "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}


def _address(replica: GatewayProcess) -> str:
    return replica.url.removeprefix("http://")


def _port(replica: GatewayProcess) -> int:
    return int(replica.url.rpartition(":")[2])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def _samples(http: httpx.AsyncClient, replica: GatewayProcess) -> list[Any]:
    """One replica's own metrics, asked of it directly (through nginx any replica could answer)."""
    response = await http.get(f"{replica.url}/metrics")
    response.raise_for_status()
    return [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]


def _served(samples: list[Any], backend: str) -> float:
    """Calls the replica answered with ``backend`` (every status)."""
    return float(
        sum(
            sample.value
            for sample in samples
            if sample.name == "rollway_requests_total" and sample.labels["backend"] == backend
        )
    )


async def _until_calls_in_flight(http: httpx.AsyncClient, replica: GatewayProcess, count: int) -> None:
    """Poll the replica's in-flight gauge (no event tells when calls are in flight in another process)."""
    async with asyncio.timeout(10):
        while True:
            samples = await _samples(http, replica)
            if sum(s.value for s in samples if s.name == "rollway_requests_in_flight") >= count:
                return
            await asyncio.sleep(0.01)
