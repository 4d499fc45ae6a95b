"""Bounded connections (``rollway.app.connections``): what the limits cost per call, and what a storm of new
connections does to the calls already in flight. Each figure for three ``rollway serve`` processes in one run, on
one mock backend (``rollway mock-backend``, its own process):

- off: every connection limit 0 (uvicorn's own httptools protocol, as before the limits);
- on:  the defaults (64 KiB heads, 10 s header and idle timeouts, 10,000 connections);
- cap: the defaults with ``ROLLWAY_MAX_CONNECTIONS=--cap`` (256), below the storm, so that most of it is refused.

0. The protocol alone: keep-alive requests fed straight to one connection of uvicorn's httptools protocol and of
   ``BoundedHttpToolsProtocol`` (an ASGI app that answers at once), in this process, rounds alternating: the
   limits' own work per request, which the servers' figures below are too noisy to show.
1. Per call: ``wrk -c32 -t2`` against ``GET /healthz`` (the cheapest route: the protocol's share of a call is the
   largest there) of each server in turn, rounds in alternating order; the server's CPU (``schedstat``, all
   threads) per call completed. (``bench/wrk_bench.py --limits-off`` gives the same for chat completions.)
2. Storm: 8 streamed chat calls in flight (the mock paces 400 tokens at 20 ms), then a subprocess opens
   ``--storm`` connections as fast as it can and sends on each a chat completion of 8 tokens attributed to a
   rollout (``--storm-kind chat``, the default: every call recorded), a streamed one of 40 tokens paced at 500 ms
   (``streams``: 20 s each, cut when the storm lets go of its connections; slow, so that the mock keeps up),
   ``GET /v1/models`` (``calls``) or nothing (``idle``). Recorded: the in-flight streams' longest gap between two
   chunks in the storm's window (without a storm it is the pacing, ~20 ms), ``/healthz``'s latency probed every
   50 ms meanwhile, the server's CPU over the window (and per storm connection, less what the streams and the
   probe cost in the second before the storm), and how the storm's connections were answered (200, 503, none).

    python bench/connection_bench.py [--rounds 3] [--duration 5] [--storm 2000] [--storm-kind chat|streams|calls|idle]
        [--cap 256] [--skip-micro] [--skip-wrk] [--skip-storm]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import cpu_seconds, prepare_store  # noqa: E402
from wrk_bench import MARK, NO_LIMITS, wrk  # noqa: E402

from rollway.mock import MockBackendProcess  # noqa: E402
from rollway.process import GatewayProcess  # noqa: E402

LUA = """done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("{mark} %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""
STREAM = {
    "model": "policy",
    "messages": [{"role": "user", "content": "Count."}],
    "max_tokens": 400,
    "ignore_eos": True,
    "stream": True,
    "mock": {"token_delay_ms": 20},
}
IN_FLIGHT = 8
#: The storm's client, in a process of its own so that its work does not slow the streams' client: opens the
#: connections, optionally sends a request on each, holds them ``hold`` seconds, then reports how each was answered.
STORM = r"""
import json, resource, selectors, socket, sys, time
host, port, count, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
hold, prefix = float(sys.argv[5]), sys.argv[6]
body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
if kind == "streams":
    body |= {"max_tokens": 40, "ignore_eos": True, "stream": True, "mock": {"token_delay_ms": 500}}
body = json.dumps(body).encode()
chat = b"POST %s/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" % prefix.encode()
chat += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 256)), hard))
started = time.monotonic()
socks = []
for _ in range(count):
    sock = socket.create_connection((host, port))
    if kind == "calls":
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    elif kind in ("chat", "streams"):
        sock.sendall(chat)
    sock.setblocking(False)
    socks.append(sock)
opened = time.monotonic() - started
answers = {}
selector = selectors.DefaultSelector()
for sock in socks:
    selector.register(sock, selectors.EVENT_READ)
deadline = time.monotonic() + hold
while time.monotonic() < deadline and len(answers) < count:
    for key, _ in selector.select(timeout=0.05):
        try:
            data = key.fileobj.recv(256)
        except OSError:
            data = b""
        answers[key.fileobj] = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
        selector.unregister(key.fileobj)
counts = {}
for sock in socks:
    status = answers.get(sock, "open")
    counts[status] = counts.get(status, 0) + 1
    sock.close()
print(json.dumps({"opened_s": opened, "answers": counts}))
"""


@contextlib.contextmanager
def servers(tmp: str, cap: int) -> Iterator[tuple[dict[str, GatewayProcess], dict[str, str]]]:
    """The three servers on one mock backend, and each one's attributed path prefix for chat calls."""
    settings = {"off": NO_LIMITS, "on": {}, "cap": {"ROLLWAY_MAX_CONNECTIONS": str(cap)}}
    with contextlib.ExitStack() as stack:
        mock = stack.enter_context(MockBackendProcess(latency_ms=0))
        running, prefixes = {}, {}
        for name, env in settings.items():
            db = f"sqlite:///{tmp}/{name}.db"
            prefixes[name] = asyncio.run(prepare_store(db, mock.base_url))
            running[name] = stack.enter_context(GatewayProcess(db, env={"ROLLWAY_ACCESS_LOG": "false", **env}))
        yield running, prefixes


class _Transport(asyncio.Transport):
    """A connection that keeps nothing of what is written to it but whether an answer ended."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = 0
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if bytes(data).endswith(b"}"):  # the body of the answer, its last write
            self.answers += 1

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def _requests(protocol: type[asyncio.Protocol], calls: int) -> float:
    """CPU seconds per request of ``calls`` keep-alive requests fed to one connection of ``protocol`` (an ASGI app
    that answers at once): the protocol's own work per call, and the task it starts."""
    import uvicorn
    from uvicorn.server import ServerState

    config = uvicorn.Config(_app, http=protocol, lifespan="off", log_level="warning", access_log=False)
    config.load()
    server = protocol(config=config, server_state=ServerState(), app_state={})  # type: ignore[call-arg]
    transport = _Transport()
    server.connection_made(transport)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sk-rw-0123456789\r\nUser-Agent: AsyncOpenAI/Python 1.99.0\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    started = time.process_time()  # this process's CPU: what other processes on the machine take is not counted
    for _ in range(calls):
        answered = transport.answers
        server.data_received(request)
        # the answer's task runs on the loop's next turns (an Event would add its own cost to each request)
        while transport.answers == answered:  # noqa: ASYNC110
            await asyncio.sleep(0)
    elapsed = time.process_time() - started
    server.connection_lost(None)
    return elapsed / calls


def protocol_cost(args: argparse.Namespace) -> dict[str, list[float]]:
    """µs per request of uvicorn's httptools protocol and of ``BoundedHttpToolsProtocol`` with the default
    limits, in one process, rounds alternating (``--micro-rounds`` of ``--micro-calls`` requests each)."""
    import uvloop

    from rollway.app.connections import ConnectionLimits, protocol_class
    from rollway.settings import Settings

    protocols = {
        "off": protocol_class(ConnectionLimits()),
        "on": protocol_class(ConnectionLimits.from_settings(Settings())),
    }
    results: dict[str, list[float]] = {name: [] for name in protocols}

    async def rounds() -> None:
        for protocol in protocols.values():  # warm
            await _requests(protocol, 2000)
        for round_ in range(args.micro_rounds):
            order = list(protocols) if round_ % 2 == 0 else list(reversed(protocols))
            for name in order:
                results[name].append(await _requests(protocols[name], args.micro_calls) * 1e6)

    uvloop.run(rounds())
    return results


def per_call(running: dict[str, GatewayProcess], args: argparse.Namespace, tmp: str) -> dict[str, list[float]]:
    """CPU µs per ``GET /healthz`` of each server, per round."""
    script = Path(tmp, "get.lua")
    script.write_text(LUA.format(mark=MARK))
    results: dict[str, list[float]] = {name: [] for name in running}
    warm = argparse.Namespace(**{**vars(args), "duration": 1})
    for server in running.values():
        wrk(f"{server.url}/healthz", script, warm)
    for round_ in range(args.rounds):
        order = list(running) if round_ % 2 == 0 else list(reversed(running))
        for name in order:
            server = running[name]
            assert server.pid is not None
            before = cpu_seconds(server.pid)
            calls, _, errors = wrk(f"{server.url}/healthz", script, args)
            results[name].append((cpu_seconds(server.pid) - before) / calls * 1e6)
            if errors:
                print(f"{name}: {errors} wrk errors", file=sys.stderr)
            time.sleep(0.5)
        print(f"wrk round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    return results


async def storm(server: GatewayProcess, prefix: str, args: argparse.Namespace) -> dict[str, Any]:
    """One storm against ``server`` while ``IN_FLIGHT`` streams run (the module's description)."""
    assert server.pid is not None
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    gaps: list[float] = []
    window: list[float] = []  # the storm's start and end, monotonic
    probes: list[float] = []

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=IN_FLIGHT + 4)) as client:

        async def stream() -> None:
            last = None
            url = f"{server.url}{prefix}/v1/chat/completions"
            async with client.stream("POST", url, json=STREAM) as response:
                async for _ in response.aiter_lines():
                    now = time.monotonic()
                    if last is not None and len(window) == 1:
                        gaps.append(now - last)
                    last = now

        async def probe() -> None:
            async with httpx.AsyncClient(timeout=30) as prober:
                while len(window) < 2:
                    start = time.monotonic()
                    with contextlib.suppress(httpx.HTTPError):
                        await prober.get(f"{server.url}/healthz")
                    if window:
                        probes.append(time.monotonic() - start)
                    await asyncio.sleep(0.05)

        streams = [asyncio.create_task(stream()) for _ in range(IN_FLIGHT)]
        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.5)  # the streams are flowing
        quiet = cpu_seconds(server.pid), time.monotonic()
        await asyncio.sleep(1.0)  # the server's CPU without a storm: the streams and the probe
        cpu = cpu_seconds(server.pid)
        window.append(time.monotonic())
        quiet_rate = (cpu - quiet[0]) / (window[0] - quiet[1])
        command = [sys.executable, "-c", STORM, host, port, str(args.storm), args.storm_kind, str(args.hold), prefix]
        done = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
        out, _ = await done.communicate()
        window.append(time.monotonic())
        cpu = cpu_seconds(server.pid) - cpu
        await prober
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    report: dict[str, Any] = json.loads(out)
    report |= {
        "max_gap_ms": max(gaps, default=0.0) * 1e3,
        "healthz_max_ms": max(probes, default=0.0) * 1e3,
        "healthz_median_ms": statistics.median(probes) * 1e3 if probes else 0.0,
        "cpu_s": cpu,
        "window_s": window[1] - window[0],
        "storm_cpu_us": (cpu - quiet_rate * (window[1] - window[0])) / args.storm * 1e6,
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--storm", type=int, default=2000, help="connections the storm opens")
    parser.add_argument("--storm-kind", choices=("idle", "calls", "chat", "streams"), default="chat")
    parser.add_argument("--hold", type=float, default=5.0, help="longest the storm holds its connections")
    parser.add_argument("--cap", type=int, default=256, help="ROLLWAY_MAX_CONNECTIONS of the 'cap' server")
    parser.add_argument("--micro-rounds", type=int, default=10)
    parser.add_argument("--micro-calls", type=int, default=20_000)
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-wrk", action="store_true")
    parser.add_argument("--skip-storm", action="store_true")
    args = parser.parse_args()
    if not args.skip_wrk and shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    if not args.skip_micro:
        cost = protocol_cost(args)
        print(f"\nthe protocol alone, in-process: {args.micro_rounds} rounds of {args.micro_calls} keep-alive requests")
        for name, values in cost.items():
            print(f"{name:<8}{min(values):>8.2f} µs per request (least), {statistics.median(values):.2f} (median)")
        paired = statistics.median(a - b for a, b in zip(cost["on"], cost["off"], strict=True))
        print(
            f"  on - off: {(min(cost['on']) - min(cost['off'])) * 1e3:+.0f} ns per request (least), "
            f"{paired * 1e3:+.0f} ns (median of the per-round differences)"
        )
    if args.skip_wrk and args.skip_storm:
        return
    with tempfile.TemporaryDirectory() as tmp, servers(tmp, args.cap) as (running, prefixes):
        if not args.skip_wrk:
            cost = per_call(running, args, tmp)
            print(f"\nGET /healthz, wrk -c{args.connections} -t{args.threads} -d{args.duration}s, {args.rounds} rounds")
            print(f"{'server':<8}{'CPU/call µs (median)':>22}{'per round':>40}")
            for name, values in cost.items():
                rounds = " ".join(f"{value:.1f}" for value in values)
                print(f"{name:<8}{statistics.median(values):>22.1f}{rounds:>40}")
            for name in ("on", "cap"):
                ratio = statistics.median(a / b for a, b in zip(cost[name], cost["off"], strict=True))
                print(f"  {name} / off, paired per round: {ratio:.3f}x")
        if not args.skip_storm:
            print(f"\nstorm: {args.storm} connections ({args.storm_kind}) while {IN_FLIGHT} streams are in flight")
            for name, server in running.items():
                result = asyncio.run(storm(server, prefixes[name], args))
                print(
                    f"{name:<5} opened in {result['opened_s']:.2f} s; longest gap of a stream in flight "
                    f"{result['max_gap_ms']:.0f} ms; /healthz median {result['healthz_median_ms']:.1f} ms, max "
                    f"{result['healthz_max_ms']:.0f} ms; server CPU {result['cpu_s']:.2f} s over "
                    f"{result['window_s']:.1f} s, {result['storm_cpu_us']:.0f} µs per storm connection beyond the "
                    f"streams' own; answers {result['answers']}"
                )
                time.sleep(3.0)  # the storm's calls end (the mock stops generating them) before the next server's


if __name__ == "__main__":
    main()
