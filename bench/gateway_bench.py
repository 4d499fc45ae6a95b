"""Hot-path benchmark of the gateway, in one run, against the mock backend in its own process:

- direct: the client calls the mock backend;
- bare:   through ``bench/bare_forwarder.py`` (uvicorn + the same aiohttp client, no parsing or recording);
- rollway: through ``rollway serve`` (attribution by path, capture, span durable on SQLite before the reply).

Prints, as medians over repetitions: latency p50/p99 at concurrency 1 (non-streaming), the latency each
proxy adds over direct, CPU time per call of each proxy process (and the ratio Rollway / bare), and time to
first token of a 200-chunk stream.

    python bench/gateway_bench.py [--calls 400] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.mock import MockBackendProcess  # noqa: E402
from store import Store  # noqa: E402

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
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def start(command: list[str], ready: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if ready in line:
            return proc
    raise RuntimeError(f"{command} did not start")


async def wait_http(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            try:
                async with session.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never answered")


async def sequential(session: aiohttp.ClientSession, url: str, calls: int) -> list[float]:
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        async with session.post(url, json=CHAT) as response:
            await response.read()
            assert response.status == 200, await response.text()
        latencies.append(time.perf_counter() - started)
    return latencies


async def ttft(session: aiohttp.ClientSession, url: str, calls: int) -> list[float]:
    firsts = []
    for _ in range(calls):
        started = time.perf_counter()
        first = None
        async with session.post(url, json=STREAM) as response:
            assert response.status == 200, await response.text()
            async for chunk in response.content.iter_any():
                if first is None and b'"content":"' in chunk.replace(b" ", b"") and b'"content":""' not in chunk:
                    first = time.perf_counter() - started
        firsts.append(first if first is not None else time.perf_counter() - started)
    return firsts


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def prepare_store(db: str, mock_url: str) -> str:
    store = await Store.open(db, run_watchdog=False)
    await store.put_model(
        "policy", [{"backend_id": "mock", "base_url": mock_url, "kind": "vllm", "model": "mock-model"}]
    )
    await store.enqueue([{"input": {"bench": True}}])
    [claim] = await store.claim("bench")
    await store.close()
    return f"/rollout/{claim.rollout.rollout_id}/attempt/{claim.attempt.attempt_id}"


async def run(args: argparse.Namespace) -> None:
    results: dict[str, list[Any]] = {k: [] for k in ("direct", "bare", "rollway")}
    cpu: dict[str, list[float]] = {"bare": [], "rollway": []}
    firsts: dict[str, list[float]] = {"direct": [], "rollway": []}
    with tempfile.TemporaryDirectory() as tmp, MockBackendProcess() as mock:
        db = f"sqlite:///{tmp}/bench.db"
        prefix = await prepare_store(db, mock.base_url)
        bare_port, rollway_port = free_port(), free_port()
        bare = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "bare_forwarder.py"),
                "--port",
                str(bare_port),
                "--upstream",
                mock.url,
            ]
        )
        rollway = start(
            [
                sys.executable,
                "-c",
                "from gateway.cli import main; main()",
                "serve",
                "--port",
                str(rollway_port),
                "--db",
                db,
            ],
            "Uvicorn running on",
            env={"PYTHONUNBUFFERED": "1"},
        )
        try:
            await wait_http(f"http://127.0.0.1:{bare_port}/v1/models")
            targets = {
                "direct": f"{mock.url}/v1/chat/completions",
                "bare": f"http://127.0.0.1:{bare_port}/v1/chat/completions",
                "rollway": f"http://127.0.0.1:{rollway_port}{prefix}/v1/chat/completions",
            }
            pids = {"bare": bare.pid, "rollway": rollway.pid}
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                for name, url in targets.items():  # warm up connections, caches, JITs of the mind
                    await sequential(session, url, 30)
                for rep in range(args.repeat):
                    for name, url in targets.items():
                        before = cpu_seconds(pids[name]) if name in pids else 0.0
                        latencies = await sequential(session, url, args.calls)
                        if name in pids:
                            cpu[name].append((cpu_seconds(pids[name]) - before) / args.calls)
                        results[name].append((pct(latencies, 0.5), pct(latencies, 0.99)))
                    for name in ("direct", "rollway"):
                        firsts[name].append(statistics.median(await ttft(session, targets[name], args.streams)))
                    print(f"repetition {rep + 1}/{args.repeat} done", file=sys.stderr)
        finally:
            for proc in (bare, rollway):
                proc.terminate()
                proc.wait(timeout=15)
    report(results, cpu, firsts, args)


def report(
    results: dict[str, list[Any]], cpu: dict[str, list[float]], firsts: dict[str, list[float]], args: argparse.Namespace
) -> None:
    med = {
        name: (statistics.median(p50 for p50, _ in v), statistics.median(p99 for _, p99 in v))
        for name, v in results.items()
    }
    ms = 1000.0
    print(f"\nGateway hot path: {args.calls} sequential non-streaming calls x {args.repeat} repetitions (medians)")
    print(f"{'target':<10}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>12}{'added p99':>12}{'CPU/call ms':>14}")
    for name in ("direct", "bare", "rollway"):
        p50, p99 = med[name]
        added = (
            "" if name == "direct" else f"{(p50 - med['direct'][0]) * ms:>12.3f}{(p99 - med['direct'][1]) * ms:>12.3f}"
        )
        cpu_ms = f"{statistics.median(cpu[name]) * ms:>14.3f}" if name in cpu else ""
        print(f"{name:<10}{p50 * ms:>10.3f}{p99 * ms:>10.3f}{added:<24}{cpu_ms}")
    ratio = statistics.median(cpu["rollway"]) / statistics.median(cpu["bare"])
    print(f"\nRollway CPU per call / bare forwarder CPU per call: {ratio:.2f}x (target <= 1.5x)")
    added_p50 = (med["rollway"][0] - med["direct"][0]) * ms
    added_p99 = (med["rollway"][1] - med["direct"][1]) * ms
    print(f"Rollway added latency: p50 {added_p50:.3f} ms (target <= 1.5), p99 {added_p99:.3f} ms (target <= 5)")
    t_direct, t_rollway = statistics.median(firsts["direct"]), statistics.median(firsts["rollway"])
    print(
        f"200-chunk stream time to first token: direct {t_direct * ms:.3f} ms, rollway {t_rollway * ms:.3f} ms, "
        f"added {(t_rollway - t_direct) * ms:.3f} ms (target <= 2)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="100 calls, 10 streams, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.streams, args.repeat = 100, 10, 1
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
