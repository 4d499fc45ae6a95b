"""CPU per call under concurrent load: the bare forwarder and Rollway, in one run, against the mock backend in
its own process (``gateway_bench.py`` measures one call at a time; this asks whether Rollway's per-call cost
shrinks towards the forwarder's when calls overlap and the store commits them in groups).

For each concurrency: ``--calls`` non-streaming calls kept ``c`` at a time, ``--repeat`` times per proxy;
prints the median CPU per call of each proxy process (all threads, from the scheduler), the ratio, and the
calls per second reached. ``--latency-ms`` makes the mock backend take that long per call (real backends
take tens of milliseconds or more, which keeps many calls in flight at once).

    python bench/gateway_load.py [--concurrency 1 8 32] [--calls 2000] [--repeat 3] [--latency-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import CHAT, cpu_seconds, proxies  # noqa: E402

from rollway.mock import MockBackendProcess  # noqa: E402


async def load(session: aiohttp.ClientSession, url: str, body: dict[str, Any], calls: int, concurrency: int) -> None:
    """``calls`` calls, ``concurrency`` in flight at a time."""
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url, json=body) as response:
                await response.read()
                assert response.status == 200, await response.text()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def run(args: argparse.Namespace) -> None:
    body = {**CHAT, "mock": {"latency_ms": args.latency_ms}} if args.latency_ms else CHAT
    with tempfile.TemporaryDirectory() as tmp, MockBackendProcess() as mock:
        async with proxies(mock, tmp) as (urls, pids):
            print(f"{args.calls} non-streaming calls x {args.repeat}, mock latency {args.latency_ms} ms (medians)")
            print(f"{'concurrency':>11}{'bare ms/call':>14}{'calls/s':>9}{'rollway ms/call':>17}{'calls/s':>9}", end="")
            print(f"{'ratio':>7}")
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for concurrency in args.concurrency:
                    cpu: dict[str, float] = {}
                    rate: dict[str, float] = {}
                    for name, url in urls.items():
                        await load(session, url, body, min(200, args.calls), concurrency)  # warm up
                        per_call, per_second = [], []
                        for _ in range(args.repeat):
                            before, started = cpu_seconds(pids[name]), time.perf_counter()
                            await load(session, url, body, args.calls, concurrency)
                            per_call.append((cpu_seconds(pids[name]) - before) / args.calls)
                            per_second.append(args.calls / (time.perf_counter() - started))
                        cpu[name], rate[name] = statistics.median(per_call), statistics.median(per_second)
                    print(
                        f"{concurrency:>11}{cpu['bare'] * 1000:>14.3f}{rate['bare']:>9.0f}"
                        f"{cpu['rollway'] * 1000:>17.3f}{rate['rollway']:>9.0f}{cpu['rollway'] / cpu['bare']:>7.2f}"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
