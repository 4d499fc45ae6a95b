"""Throughput and CPU per call under ``wrk`` (a C load generator, Debian package ``wrk``), for four targets in
front of one mock backend (``rollway mock-backend --latency-ms 0``, vLLM-like, its own process):

- direct:    wrk calls the mock backend;
- forwarder: through ``bench/bare_forwarder.py`` (uvicorn + aiohttp, bytes forwarded, nothing parsed or recorded);
- floor:     the same with ``--record FILE``: each call durable in SQLite and nothing else (it reads a stream whole
  before replying, so its streamed figures are those of a buffered relay);
- rollway:   ``rollway serve`` on a temporary SQLite file, model alias ``policy`` pointing at the mock, calls
  attributed by path to one claimed rollout (the set-up of ``gateway_bench.py``).

Per target and round, two wrk runs (``-c32 -t2 -d8s`` by default): non-streamed chat completions of 8 tokens, then
streamed ones of 64 tokens. Each proxy's CPU is read from ``/proc/<pid>/task/*/schedstat`` (all threads) before and
after a run and divided by the calls wrk completed, or by those calls times the chunks (SSE events carrying a
token, counted in the backend's own answer) for the streamed run. wrk cuts the calls in flight when it stops: their
CPU is counted and the calls are not, an over-count of at most ``connections`` calls per run.

``--tree PATH`` (repeatable) adds a Rollway served by another checkout (e.g. a copy of the code before a change)
as a target of its own, ``rollway@<folder>``, on its own SQLite file created by its own store code (the checkout is
installed on its own into a scratch folder, which its server imports, as in ``gateway_ab.py``): an A/B in one run,
under the same load.

``--limits-off`` adds ``rollway-limits-off``: this checkout's Rollway with every connection limit off
(``ROLLWAY_MAX_CONNECTIONS``, ``ROLLWAY_MAX_HEADER_BYTES``, ``ROLLWAY_HEADER_TIMEOUT`` and ``ROLLWAY_IDLE_TIMEOUT``
at 0: uvicorn's own httptools protocol, as before the limits), beside ``rollway`` with its defaults: the per-call
cost of the limits in one run.

Prints the medians over ``--rounds`` (targets in alternating order) and the median per-round ratios of each
Rollway and of the floor to the forwarder, of each Rollway to the floor, and of each ``--tree`` Rollway to this
checkout's (issue #26's targets: CPU per call <= 3x the forwarder's, CPU per streamed chunk <= 1.5x).

    python bench/wrk_bench.py [--duration 8] [--connections 32] [--threads 2] [--rounds 3] [--only rollway ...]
        [--tree PATH ...] [--limits-off]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gateway_ab import install, prepare  # noqa: E402
from gateway_bench import cpu_seconds, forwarder, prepare_store  # noqa: E402

from rollway.mock import MockBackendProcess  # noqa: E402
from rollway.process import GatewayProcess  # noqa: E402

TARGETS = ("direct", "forwarder", "floor", "rollway")
PROXIES = ("forwarder", "floor", "rollway")
PROMPT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
CHAT = {"model": "policy", "messages": PROMPT, "max_tokens": 8, "ignore_eos": True}
STREAM = {"model": "policy", "messages": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
MARK = "wrk-bench-result"
LIMITS_OFF = "rollway-limits-off"
#: Every connection limit off (``rollway.app.connections``): the server runs uvicorn's httptools protocol as is.
NO_LIMITS = {
    "ROLLWAY_MAX_CONNECTIONS": "0",
    "ROLLWAY_MAX_HEADER_BYTES": "0",
    "ROLLWAY_HEADER_TIMEOUT": "0",
    "ROLLWAY_IDLE_TIMEOUT": "0",
}
#: wrk's script: POST ``body``; at the end one line with the calls completed, the run's microseconds and errors.
LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("{mark} %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@dataclass
class Run:
    """One wrk run against one target."""

    calls: int
    seconds: float
    errors: int  # connect, read, write, timeouts and non-2xx answers
    cpu: float | None  # the proxy's CPU seconds over the run; None for direct

    @property
    def rate(self) -> float:
        return self.calls / self.seconds


def wrk(url: str, script: Path, args: argparse.Namespace) -> tuple[int, float, int]:
    """Run wrk; the calls it completed, the run's length in seconds and its errors."""
    command = ["wrk", f"-c{args.connections}", f"-t{args.threads}", f"-d{args.duration}s", "-s", str(script), url]
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.duration + 30, check=False)
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            calls, micros, *errors = (int(field) for field in line.split()[1:])
            return calls, micros / 1e6, sum(errors)
    raise RuntimeError(f"wrk gave no result ({out.returncode}):\n{out.stdout}\n{out.stderr}")


def measure(url: str, pid: int | None, script: Path, args: argparse.Namespace) -> Run:
    before = cpu_seconds(pid) if pid is not None else 0.0
    calls, seconds, errors = wrk(url, script, args)
    cpu = cpu_seconds(pid) - before if pid is not None else None
    return Run(calls, seconds, errors, cpu)


def post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: bytes = response.read()
        return answer


def token_chunks(answer: bytes) -> int:
    """The SSE events of a streamed chat completion that carry a token (non-empty ``delta.content``)."""
    count = 0
    for line in answer.decode().splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        event = json.loads(line[5:])
        if any(choice.get("delta", {}).get("content") for choice in event.get("choices", [])):
            count += 1
    return count


@contextlib.contextmanager
def targets(
    names: list[str], trees: list[str], tmp: str, limits_off: bool = False
) -> Iterator[tuple[str, dict[str, str], dict[str, int]]]:
    """The mock backend, the proxies in ``names``, a Rollway per checkout in ``trees`` and, with ``limits_off``, this
    checkout's Rollway with no connection limits: the backend's chat-completions URL, the targets' URLs and the
    proxies' process ids."""
    with contextlib.ExitStack() as stack:
        mock = stack.enter_context(MockBackendProcess(latency_ms=0))
        urls = {"direct": f"{mock.url}/v1/chat/completions"}
        pids: dict[str, int] = {}
        if "forwarder" in names:
            urls["forwarder"], pids["forwarder"] = stack.enter_context(forwarder(mock.url))
        if "floor" in names:
            urls["floor"], pids["floor"] = stack.enter_context(forwarder(mock.url, "--record", f"{tmp}/floor.db"))
        if "rollway" in names:
            db = f"sqlite:///{tmp}/rollway.db"
            prefix = asyncio.run(prepare_store(db, mock.base_url))
            # Access log off, as for the forwarder: each proxy is measured doing its own work only.
            server = stack.enter_context(GatewayProcess(db, env={"ROLLWAY_ACCESS_LOG": "false"}))
            assert server.pid is not None
            urls["rollway"], pids["rollway"] = f"{server.url}{prefix}/v1/chat/completions", server.pid
        extra = []
        if limits_off:
            db = f"sqlite:///{tmp}/limits-off.db"
            prefix = asyncio.run(prepare_store(db, mock.base_url))
            server = stack.enter_context(GatewayProcess(db, env={"ROLLWAY_ACCESS_LOG": "false", **NO_LIMITS}))
            assert server.pid is not None
            urls[LIMITS_OFF], pids[LIMITS_OFF] = f"{server.url}{prefix}/v1/chat/completions", server.pid
            extra.append(LIMITS_OFF)
        for index, tree in enumerate(trees):
            env = install(tree, f"{tmp}/tree{index}")
            prefix = prepare(tree, env, f"sqlite:///{tmp}/tree{index}.db", mock.base_url)
            server = stack.enter_context(
                GatewayProcess(f"sqlite:///{tmp}/tree{index}.db", env={"ROLLWAY_ACCESS_LOG": "false", **env})
            )
            assert server.pid is not None
            name = tree_name(tree)
            urls[name], pids[name] = f"{server.url}{prefix}/v1/chat/completions", server.pid
        yield urls["direct"], {name: urls[name] for name in [*names, *extra, *map(tree_name, trees)]}, pids


def tree_name(tree: str) -> str:
    return f"rollway@{Path(tree).name}"


def run(args: argparse.Namespace) -> None:
    names = [name for name in TARGETS if name in args.only]
    every = [*names, *([LIMITS_OFF] if args.limits_off else []), *map(tree_name, args.tree)]
    results: dict[str, dict[str, list[Run]]] = {kind: {name: [] for name in every} for kind in ("chat", "stream")}
    with tempfile.TemporaryDirectory() as tmp, targets(names, args.tree, tmp, args.limits_off) as (backend, urls, pids):
        scripts = {}
        for kind, body in (("chat", CHAT), ("stream", STREAM)):
            scripts[kind] = Path(tmp, f"{kind}.lua")
            scripts[kind].write_text(LUA.format(body=json.dumps(body), mark=MARK))
        chunks = token_chunks(post(backend, STREAM))
        for name, url in urls.items():  # every target answers, and streams as many token chunks as the backend
            post(url, CHAT)
            if (got := token_chunks(post(url, STREAM))) != chunks:
                raise SystemExit(f"{name} streamed {got} token chunks, the backend {chunks}")
        warm = argparse.Namespace(**{**vars(args), "duration": 1})
        for url in urls.values():
            measure(url, None, scripts["chat"], warm)
        for round_ in range(args.rounds):
            order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for kind in ("chat", "stream"):
                for name in order:
                    results[kind][name].append(measure(urls[name], pids.get(name), scripts[kind], args))
                    time.sleep(0.5)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    report(results, chunks, args)


def median_rate(runs: list[Run]) -> float:
    return statistics.median(run.rate for run in runs)


def per_call(runs: list[Run], chunks: int = 1) -> list[float]:
    return [run.cpu / (run.calls * chunks) for run in runs if run.cpu is not None]


def report(results: dict[str, dict[str, list[Run]]], chunks: int, args: argparse.Namespace) -> None:
    chat, stream = results["chat"], results["stream"]
    print(
        f"\nwrk -c{args.connections} -t{args.threads} -d{args.duration}s, {args.rounds} round(s), medians; "
        f"non-streamed: max_tokens {CHAT['max_tokens']}; streamed: {chunks} token chunks per call"
    )
    header = ("req/s", "CPU/call ms", "stream req/s", "chunks/s", "CPU/chunk µs", "errors")
    width = max(11, *(len(name) + 2 for name in chat))
    print(f"{'target':<{width}}" + "".join(f"{h:>{w}}" for h, w in zip(header, (9, 13, 14, 10, 14, 8), strict=True)))
    for name in chat:
        cpu_call, cpu_chunk = per_call(chat[name]), per_call(stream[name], chunks)
        errors = sum(run.errors for run in chat[name] + stream[name])
        print(
            f"{name:<{width}}{median_rate(chat[name]):>9,.0f}"
            f"{f'{statistics.median(cpu_call) * 1e3:.3f}' if cpu_call else '—':>13}"
            f"{median_rate(stream[name]):>14,.0f}{median_rate(stream[name]) * chunks:>10,.0f}"
            f"{f'{statistics.median(cpu_chunk) * 1e6:.1f}' if cpu_chunk else '—':>14}{errors:>8}"
        )
    rollways = [name for name in chat if name.startswith("rollway")]
    pairs: list[tuple[str, str]] = [
        (name, base) for base in ("forwarder", "floor") if base in chat for name in [*rollways, "floor"]
    ]
    # ``--tree`` and ``--limits-off`` against this checkout
    pairs += [(name, "rollway") for name in rollways[1:] if "rollway" in chat]
    pairs = [(name, base) for name, base in pairs if name in chat and name != base]
    if pairs:
        print("\nMedian per-round ratios of CPU per call and per streamed chunk (same run):")
    for name, base in pairs:
        call, chunk = ratio(chat[name], chat[base]), ratio(stream[name], stream[base])
        goal = " (targets: <= 3x, <= 1.5x)" if base == "forwarder" and name != "floor" else ""
        print(f"  {name} / {base}: per call {call:.2f}x, per streamed chunk {chunk:.2f}x{goal}")


def ratio(runs: list[Run], base: list[Run]) -> float:
    """The median of the per-round ratios of CPU per call (the chunks per call cancel out)."""
    return statistics.median(a / b for a, b in zip(per_call(runs), per_call(base), strict=True))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _reap_children() -> None:
    """Stop any child this process started that is still running (one interrupted while it started, before its
    context manager held it): SIGTERM, then SIGKILL after 10 s."""
    me = str(os.getpid())
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if stat.read_text().rsplit(")", 1)[1].split()[1] == me:
                children.append(int(stat.parent.name))
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="wrk's threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=TARGETS, default=list(TARGETS), help="measure these targets")
    parser.add_argument("--tree", action="append", default=[], help="also a Rollway served by this checkout")
    parser.add_argument(
        "--limits-off", action="store_true", help="also this checkout's Rollway with every connection limit off"
    )
    args = parser.parse_args()
    args.tree = [str(Path(tree).resolve()) for tree in args.tree]
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    # Everything is bounded: each wrk run by its own timeout, the whole run by an alarm; SIGTERM and the alarm
    # unwind like Ctrl-C, so every process started here is stopped.
    budget = 180 + args.rounds * 2 * (len(args.only) + len(args.tree) + args.limits_off) * (args.duration + 35)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (``&``)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGALRM, _interrupt)
    signal.alarm(budget)
    try:
        run(args)
    except KeyboardInterrupt as stop:
        raise SystemExit(f"stopped ({str(stop) or 'SIGINT'}); the servers it started are stopped") from None
    finally:
        signal.alarm(0)
        _reap_children()


if __name__ == "__main__":
    main()
