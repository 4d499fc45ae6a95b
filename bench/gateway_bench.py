"""Hot-path benchmark of the gateway, in one run, against the mock backend in its own process:

- direct: the client calls the mock backend;
- bare:   through ``bench/bare_forwarder.py`` (uvicorn + the same aiohttp client, no parsing or recording);
- bare+sqlite: the bare forwarder also recording each call durably in SQLite and nothing else (a sequence number
  in its own transaction at arrival, the request and answer bytes committed before the reply: what the product's
  contract asks of any recording gateway, with none of Rollway's parsing) — the floor for Rollway's CPU;
- rollway: through ``rollway serve`` (attribution by path, capture, span durable on SQLite before the reply).

Prints, as medians over repetitions: latency p50/p99 at concurrency 1 (non-streaming), the latency each
proxy adds over direct, CPU time per call of each proxy process (and the ratio Rollway / bare), and time to
first token of a 200-chunk stream (Rollway's against direct and direct+capture; the bare forwarder's against
direct, the floor of one more hop on the machine).

    python bench/gateway_bench.py [--calls 400] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store import Store

ROOT = Path(__file__).resolve().parents[1]
CHAT = {
    "model": "policy",
    "messages": [{"role": "user", "content": "What is 2 + 2? Answer briefly."}],
    "max_tokens": 16,
}
STREAM = {
    "model": "policy",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 200,
    "min_tokens": 200,
    "ignore_eos": True,
    "stream": True,
}
#: What the gateway adds to a request for a vLLM backend (token ids, logprobs, usage): the backend does more
#: work for it, so "direct+capture" is the fair baseline for the gateway's own overhead.
CAPTURE = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """CPU time of all the process's threads, in nanoseconds from the scheduler (``/proc/<pid>/task/*/schedstat``;
    utime + stime from ``/proc/<pid>/stat`` count in clock ticks, 10 ms: a quarter of what 400 calls of the
    bare forwarder cost). Threads that ended are not counted; neither server ends threads while serving."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            total_ns += int((task / "schedstat").read_text().split()[0])
    if total_ns:  # else no scheduler statistics on this kernel: clock ticks
        return total_ns / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def start(command: list[str], ready: str) -> subprocess.Popen[str]:
    """Start a server process and return once it prints ``ready``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if ready in line:
            return proc
    raise RuntimeError(f"{command} did not start")


async def sequential(session: aiohttp.ClientSession, url: str, calls: int, body: dict[str, Any]) -> list[float]:
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        async with session.post(url, json=body) as response:
            await response.read()
            assert response.status == 200, await response.text()
        latencies.append(time.perf_counter() - started)
    return latencies


def _first_content(chunk: bytes) -> bool:
    compact = chunk.replace(b" ", b"")
    return b'"content":"' in compact and b'"content":""' not in compact


async def ttft(session: aiohttp.ClientSession, url: str, calls: int, body: dict[str, Any]) -> list[float]:
    firsts = []
    for _ in range(calls):
        started = time.perf_counter()
        first = None
        async with session.post(url, json=body) as response:
            assert response.status == 200, await response.text()
            async for chunk in response.content.iter_any():
                if first is None and _first_content(chunk):
                    first = time.perf_counter() - started
        firsts.append(first if first is not None else time.perf_counter() - started)
    return firsts


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def prepare_store(db: str, mock_url: str) -> str:
    store = await Store.open(db, run_watchdog=False)
    backend = {"backend_id": "mock", "base_url": mock_url, "kind": "vllm", "model": "mock-model"}
    await store.put_model("policy", [backend])
    await store.enqueue([{"input": {"bench": True}}])
    [claim] = await store.claim("bench")
    await store.close()
    return f"/rollout/{claim.rollout.rollout_id}/attempt/{claim.attempt.attempt_id}"


TARGETS = ("direct", "direct+capture", "bare", "bare+sqlite", "rollway")
PROXIES = ("bare", "bare+sqlite", "rollway")
STREAMED = ("direct", "direct+capture", "bare", "rollway")  # bare+sqlite reads a stream whole before replying


async def measure(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]) -> dict[str, Any]:
    chat = {name: {**CHAT, **CAPTURE} if name == "direct+capture" else CHAT for name in TARGETS}
    paced = {**STREAM, "mock": {"token_delay_ms": args.token_delay_ms}} if args.token_delay_ms else STREAM
    stream = {name: {**paced, **CAPTURE} if name == "direct+capture" else paced for name in TARGETS}
    latency: dict[str, list[tuple[float, float]]] = {name: [] for name in TARGETS}
    cpu: dict[str, list[float]] = {name: [] for name in PROXIES}
    firsts: dict[str, list[float]] = {name: [] for name in STREAMED}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for name in TARGETS:  # warm up connections and caches
            await sequential(session, urls[name], 30, chat[name])
        for repetition in range(args.repeat):
            for name in TARGETS:
                before = cpu_seconds(pids[name]) if name in pids else 0.0
                latencies = await sequential(session, urls[name], args.calls, chat[name])
                if name in pids:
                    cpu[name].append((cpu_seconds(pids[name]) - before) / args.calls)
                latency[name].append((pct(latencies, 0.5), pct(latencies, 0.99)))
            for name in firsts:
                firsts[name].append(statistics.median(await ttft(session, urls[name], args.streams, stream[name])))
            print(f"repetition {repetition + 1}/{args.repeat} done", file=sys.stderr)
    return {"latency": latency, "cpu": cpu, "firsts": firsts}


@contextlib.contextmanager
def forwarder(upstream: str, *options: str) -> Iterator[tuple[str, int]]:
    """``bench/bare_forwarder.py`` in front of ``upstream`` (with ``options``, e.g. ``--record FILE``): its
    chat-completions URL and process id."""
    port = free_port()
    command = [sys.executable, str(ROOT / "bench" / "bare_forwarder.py"), "--port", str(port), "--upstream", upstream]
    process = start([*command, *options, "--announce"], "forwarding")
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions", process.pid
    finally:
        process.terminate()
        process.wait(timeout=15)


@contextlib.asynccontextmanager
async def proxies(mock: MockBackendProcess, tmp: str) -> AsyncIterator[tuple[dict[str, str], dict[str, int]]]:
    """The bare forwarder (plain, and recording in ``tmp``) and ``rollway serve`` (on a SQLite file in ``tmp``,
    one claimed rollout, calls attributed by path) in front of ``mock``: their chat-completions URLs and process
    ids, by name."""
    db = f"sqlite:///{tmp}/bench.db"
    prefix = await prepare_store(db, mock.base_url)
    with forwarder(mock.url) as bare, forwarder(mock.url, "--record", f"{tmp}/floor.db") as floor:
        # Access log off, as for the bare forwarder: both proxies are measured doing their own work only.
        rollway = GatewayProcess(db, env={"ROLLWAY_ACCESS_LOG": "false"}).start()
        try:
            assert rollway.pid is not None
            served = {
                "bare": bare,
                "bare+sqlite": floor,
                "rollway": (f"{rollway.url}{prefix}/v1/chat/completions", rollway.pid),
            }
            yield {name: url for name, (url, _) in served.items()}, {name: pid for name, (_, pid) in served.items()}
        finally:
            rollway.stop()


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, MockBackendProcess() as mock:
        async with proxies(mock, tmp) as (proxy_urls, pids):
            direct = f"{mock.url}/v1/chat/completions"
            urls = {"direct": direct, "direct+capture": direct, **proxy_urls}
            results = await measure(args, urls, pids)
    report(results, args)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    latency, cpu, firsts = results["latency"], results["cpu"], results["firsts"]
    med = {name: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for name, v in latency.items()}
    ms = 1000.0
    print(f"\nGateway hot path: {args.calls} sequential non-streaming calls x {args.repeat} repetitions (medians)")
    print(f"{'target':<16}{'p50 ms':>10}{'p99 ms':>10}{'CPU/call ms':>14}")
    for name in TARGETS:
        cpu_ms = f"{statistics.median(cpu[name]) * ms:>14.3f}" if name in cpu else ""
        print(f"{name:<16}{med[name][0] * ms:>10.3f}{med[name][1] * ms:>10.3f}{cpu_ms}")
    bare = statistics.median(cpu["bare"])
    ratio, floor = statistics.median(cpu["rollway"]) / bare, statistics.median(cpu["bare+sqlite"]) / bare
    print(f"\nRollway CPU per call / bare forwarder CPU per call: {ratio:.2f}x (target <= 1.5x)")
    print(f"Durable SQLite recording alone (bare+sqlite) / bare forwarder: {floor:.2f}x (the floor)")
    for base in ("direct", "direct+capture"):
        added = [(med["rollway"][i] - med[base][i]) * ms for i in (0, 1)]
        print(
            f"Rollway added latency vs {base}: p50 {added[0]:.3f} ms (target <= 1.5), "
            f"p99 {added[1]:.3f} ms (target <= 5)"
        )
    t_rollway = statistics.median(firsts["rollway"])
    for base in ("direct", "direct+capture"):
        t_base = statistics.median(firsts[base])
        print(
            f"200-chunk stream, time to first token: {base} {t_base * ms:.3f} ms, rollway {t_rollway * ms:.3f} ms, "
            f"added {(t_rollway - t_base) * ms:.3f} ms (target <= 2)"
        )
    # The floor on this machine: what one more process in the path costs without any of Rollway's work (the
    # bare forwarder asks for no capture, so it compares with direct).
    t_bare, t_direct = statistics.median(firsts["bare"]), statistics.median(firsts["direct"])
    print(
        f"200-chunk stream, time to first token: bare forwarder {t_bare * ms:.3f} ms, "
        f"added {(t_bare - t_direct) * ms:.3f} ms vs direct"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--token-delay-ms",
        type=float,
        default=0.0,
        help="the mock backend's pause between streamed tokens (0: as fast as it can write them)",
    )
    parser.add_argument("--quick", action="store_true", help="100 calls, 10 streams, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.streams, args.repeat = 100, 10, 1
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
