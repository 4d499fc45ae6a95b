"""A/B of Rollway checkouts on the gateway hot path: CPU per call of each, side by side in one run.

On a shared 2-core VM, CPU per call drifts by 10 % or more between minutes, so two runs of ``gateway_bench.py`` at
different times cannot tell a 5 % change. This starts the mock backend, the bare forwarder and one
``rollway serve`` per checkout (``--tree``, e.g. a ``git worktree`` of another commit; each on its own SQLite
file created by that checkout's own store code), then measures them in rounds, alternating the order, and
compares each checkout with the first *within the same round* (paired ratios: drift between rounds cancels).

    git worktree add /tmp/rollway-old <commit>
    python bench/gateway_ab.py --tree . --tree /tmp/rollway-old [--rounds 16] [--calls 500] [--floor]

``--floor`` adds the bare forwarder recording every call durably in SQLite and nothing else
(``bare_forwarder.py --record``: a sequence number at arrival, the bytes before the reply, each in its own
transaction): the least any recording gateway on SQLite can cost per call.

Prints per target: median CPU per call over the rounds, the median (and interquartile range) of the per-round
ratio to the bare forwarder, and of the per-round ratio to the first tree; and median p50 latency.

Each checkout is installed on its own into a scratch folder (``pip install --no-deps --target``, the folders of
a wheel: ``rollway/`` with ``gateway/``, ``store/`` and ``admin/`` inside), and its servers run with that folder
first on ``PYTHONPATH``; the running environment gives the dependencies. A checkout itself on ``PYTHONPATH`` does
not do: its ``rollway/`` holds no ``gateway/``, so ``rollway.gateway`` would come from whatever checkout the
running environment has installed. The servers also run with ``PYTHONSAFEPATH=1``: ``python -c`` otherwise puts
the working directory first on ``sys.path``, so started from a checkout every server would import *that*
checkout. Before a server starts, a probe with the same environment tells which ``rollway.gateway`` it imports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import CHAT, cpu_seconds, forwarder, pct, sequential  # noqa: E402

from rollway.mock import MockBackendProcess  # noqa: E402
from rollway.process import GatewayProcess  # noqa: E402

SAFE = {"PYTHONSAFEPATH": "1"}  # no working directory on sys.path (Python 3.11+)
PREPARE = (
    "import asyncio, sys; sys.path.insert(0, {tree!r} + '/bench'); import gateway_bench; "
    "print(asyncio.run(gateway_bench.prepare_store({db!r}, {mock!r})))"
)


def _python(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"python -c failed ({out.returncode}):\n{out.stderr}")
    return out.stdout


def install(tree: str, into: str) -> dict[str, str]:
    """Install ``tree`` on its own into the folder ``into``; the environment under which a child imports it."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", into, tree], check=True)
    env = {"PYTHONPATH": into, **SAFE}
    imported = _python("import rollway.gateway as g; print(g.__file__)", env).strip()
    if not Path(imported).resolve().is_relative_to(Path(into).resolve()):
        raise SystemExit(f"a server for {tree} would import {imported}: not the checkout asked for")
    return env


def prepare(tree: str, env: dict[str, str], db: str, mock_url: str) -> str:
    """Create ``db`` with ``tree``'s own store code (schema, pragmas; imported under ``env``, from ``install``); the
    attempt path prefix."""
    return _python(PREPARE.format(tree=tree, db=db, mock=mock_url), env).strip().splitlines()[-1]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


async def run(args: argparse.Namespace) -> None:
    trees: list[str] = args.tree
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory())
        mock = stack.enter_context(MockBackendProcess())
        urls, pids = {}, {}
        urls["bare"], pids["bare"] = stack.enter_context(forwarder(mock.url))
        if args.floor:
            urls["bare+sqlite"], pids["bare+sqlite"] = stack.enter_context(
                forwarder(mock.url, "--record", f"{scratch}/floor.db")
            )
        for index, tree in enumerate(trees):
            env = install(tree, f"{scratch}/tree{index}")
            db = f"sqlite:///{scratch}/tree{index}.db"
            prefix = prepare(tree, env, db, mock.base_url)
            server = GatewayProcess(db, env={"ROLLWAY_ACCESS_LOG": "false", **env}).start()
            stack.callback(server.stop)
            assert server.pid is not None
            name = f"{index}: {tree}"
            urls[name], pids[name] = f"{server.url}{prefix}/v1/chat/completions", server.pid
        results = await measure(urls, pids, args)
    report(results, list(urls), args)


async def measure(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    cpu: dict[str, list[float]] = {name: [] for name in urls}
    p50: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for name in urls:  # warm up connections and caches
            await sequential(session, urls[name], 100, CHAT)
        for round_ in range(args.rounds):
            order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for name in order:
                before = cpu_seconds(pids[name])
                latencies = await sequential(session, urls[name], args.calls, CHAT)
                cpu[name].append((cpu_seconds(pids[name]) - before) / args.calls)
                p50[name].append(pct(latencies, 0.5))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    return {"cpu": cpu, "p50": p50}


def report(results: dict[str, Any], names: list[str], args: argparse.Namespace) -> None:
    cpu, p50 = results["cpu"], results["p50"]
    first = names[2] if args.floor else names[1]
    print(f"\nGateway A/B: {args.calls} sequential non-streaming calls per target per round, {args.rounds} rounds")
    print(f"{'target':<40}{'CPU/call ms':>12}{'/ bare (IQR)':>22}{'/ tree 0 (IQR)':>22}{'p50 ms':>9}")
    for name in names:
        to_bare = quartiles([a / b for a, b in zip(cpu[name], cpu["bare"], strict=True)])
        to_first = quartiles([a / b for a, b in zip(cpu[name], cpu[first], strict=True)])
        label = name if len(name) <= 39 else f"{name[:3]}...{name[-33:]}"
        print(
            f"{label:<40}{statistics.median(cpu[name]) * 1000:>12.3f}"
            f"{to_bare[1]:>10.3f} ({to_bare[0]:.2f}-{to_bare[2]:.2f})"
            f"{to_first[1]:>10.3f} ({to_first[0]:.2f}-{to_first[2]:.2f})"
            f"{statistics.median(p50[name]) * 1000:>9.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="a Rollway checkout (repeat; first = base)")
    parser.add_argument("--rounds", type=int, default=16, help="an even number runs both orders equally often")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--floor", action="store_true", help="also the bare forwarder recording durably in SQLite")
    args = parser.parse_args()
    args.tree = [str(Path(tree).resolve()) for tree in args.tree]
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
