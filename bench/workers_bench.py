"""Throughput of ``rollway serve --workers N`` under ``wrk`` (Debian package ``wrk``), on SQLite and on PostgreSQL.

The backend, by ``--backend``:

- ``static`` (default): nginx (Debian package ``nginx-light``) answering every call with an answer the mock
  backend gave once to the request the gateway sends (token ids and logprobs included): a vLLM-shaped backend
  that costs next to no CPU. On two cores whatever the backend and wrk burn is taken from the second worker, and
  the Python mock burns about 0.3 ms per call, more than half of what the gateway itself does: with it the
  best ``--workers 2`` could reach is about 2 x gateway / (gateway + backend + wrk) of one worker.
- ``mock``: ``rollway mock-backend --latency-ms 0`` itself.

Per store and per worker count a fresh database and a gateway with model aliases ``policy`` and
``policy-stream`` on that backend. ``--rollouts`` rollouts are claimed and wrk spreads its calls over them
round-robin (each by its own path, ``/rollout/<id>/attempt/<id>/v1/chat/completions``), as many agents do;
every call is recorded.

Per store, round and worker count, two wrk runs (``-c32 -t2 -d8s`` by default): non-streamed chat completions of
8 tokens, then streamed ones of 64. The worker counts alternate their order from round to round. Prints, per
store, the median req/s of each worker count, the median per-round ratio to one worker (issue #26's target:
``--workers 2`` >= 1.4x ``--workers 1``), and the CPU per non-streamed call of the gateway (supervisor and
workers), of the PostgreSQL server's processes, and of the rest of the machine (backend, wrk, the kernel's
network work, anything else; ``/proc/stat``).

    python bench/workers_bench.py [--stores sqlite postgres] [--workers 1 2] [--backend static|mock]
        [--duration 8] [--rounds 3] [--rollouts 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import cpu_seconds  # noqa: E402
from wrk_bench import MARK, wrk  # noqa: E402

from rollway.mock import MockBackendProcess  # noqa: E402
from rollway.process import GatewayProcess  # noqa: E402
from rollway.store import Store  # noqa: E402

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
PROMPT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
CHAT = {"model": "policy", "messages": PROMPT, "max_tokens": 8, "ignore_eos": True}
STREAM = {"model": "policy-stream", "messages": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
#: What the gateway adds to a vLLM chat request (``rollway.gateway.capture``): the static backend's answers are
#: the mock's answers to these.
CAPTURE = {"return_token_ids": True, "logprobs": True}
#: wrk's script: POST ``body`` to each path in turn; at the end one line with the calls completed, the run's
#: microseconds and its errors.
LUA = """local paths = {{{paths}}}
local i = 0
request = function()
  i = i % #paths + 1
  return wrk.format("POST", paths[i], {{["Content-Type"] = "application/json"}}, [==[{body}]==])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("{mark} %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""
#: nginx answering the gateway's two kinds of call with recorded answers.
NGINX = """worker_processes 1;
error_log {tmp}/nginx-error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  fastcgi_temp_path {tmp}/nginx-fastcgi;
  uwsgi_temp_path {tmp}/nginx-uwsgi;
  scgi_temp_path {tmp}/nginx-scgi;
  keepalive_requests 1000000;
  server {{
    listen 127.0.0.1:{port};
    root {tmp}/www;
    # the static module answers POST with 405: served as the file at the same path instead
    location /chat/ {{ default_type application/json; error_page 405 =200 $uri; }}
    location /stream/ {{ default_type text/event-stream; error_page 405 =200 $uri; }}
  }}
}}
"""


@dataclass
class Run:
    calls: int
    seconds: float
    errors: int
    cpu: float  # the gateway's processes
    machine: float  # every CPU of the machine, busy time
    database: float  # PostgreSQL's processes (0 on SQLite)

    @property
    def rate(self) -> float:
        return self.calls / self.seconds


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (the supervisor and its workers)."""
    total = 0.0
    for proc in [pid, *children(pid)]:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += cpu_seconds(proc)
    return total


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def database_cpu() -> float:
    """CPU seconds of the PostgreSQL server's processes on this machine."""
    total = 0.0
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError, ValueError):
            if comm.read_text().strip() == "postgres":
                total += cpu_seconds(int(comm.parent.name))
    return total


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine (``/proc/stat``: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def measure(url: str, pid: int, script: Path, args: argparse.Namespace) -> Run:
    before, busy, database = tree_cpu(pid), machine_busy(), database_cpu()
    calls, seconds, errors = wrk(url, script, args)
    return Run(calls, seconds, errors, tree_cpu(pid) - before, machine_busy() - busy, database_cpu() - database)


def post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: bytes = response.read()
        return answer


@contextlib.contextmanager
def static_backend(tmp: str) -> Iterator[tuple[str, str]]:
    """nginx answering with the mock's recorded answers: the base URLs for non-streamed and streamed calls."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed (Debian package nginx-light); or give --backend mock")
    with MockBackendProcess(latency_ms=0) as mock:
        url = f"{mock.url}/v1/chat/completions"
        chat = post(url, {**CHAT, "model": "mock-model", **CAPTURE})
        stream = post(url, {**STREAM, "model": "mock-model", **CAPTURE})
    os.chmod(tmp, 0o755)  # nginx's worker runs as another user when the master is root
    for folder, answer in (("chat", chat), ("stream", stream)):
        path = Path(tmp, "www", folder, "v1", "chat", "completions")
        path.parent.mkdir(parents=True)
        path.write_bytes(answer)
    with contextlib.closing(__import__("socket").socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conf = Path(tmp, "nginx.conf")
    conf.write_text(NGINX.format(tmp=tmp, port=port))
    server = subprocess.Popen([nginx, "-p", tmp, "-c", str(conf), "-g", "daemon off;"])
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:  # nginx says nothing when it is up: ask until it answers
            try:
                post(f"{base}/chat/v1/chat/completions", CHAT)
                break
            except OSError as exc:
                if server.poll() is not None or time.monotonic() > deadline:
                    log = Path(tmp, "nginx-error.log")
                    reason = log.read_text() if log.exists() else server.poll()
                    raise SystemExit(f"nginx did not start: {reason}") from exc
                time.sleep(0.05)
        yield f"{base}/chat/v1", f"{base}/stream/v1"
    finally:
        server.terminate()
        server.wait(10)


@contextlib.contextmanager
def mock_backend() -> Iterator[tuple[str, str]]:
    with MockBackendProcess(latency_ms=0) as mock:
        yield mock.base_url, mock.base_url


async def prepare(db: str, backends: tuple[str, str], rollouts: int) -> list[str]:
    """The aliases, and ``rollouts`` claimed rollouts: their call paths."""
    store = await Store.open(db, run_watchdog=False)
    try:
        for alias, base_url in zip(("policy", "policy-stream"), backends, strict=True):
            backend = {"backend_id": alias, "base_url": base_url, "kind": "vllm", "model": "mock-model"}
            await store.put_model(alias, [backend])
        await store.enqueue([{"input": {"bench": i}} for i in range(rollouts)])
        claims = await store.claim("bench", limit=rollouts)
        return [f"/rollout/{c.rollout.rollout_id}/attempt/{c.attempt.attempt_id}" for c in claims]
    finally:
        await store.close()


async def _pg(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN, timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextlib.contextmanager
def database(kind: str, tmp: str) -> Iterator[str]:
    """A fresh, empty database of ``kind``."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp}/rollway-{uuid.uuid4().hex[:8]}.db"
        return
    name = f"rollway_bench_{uuid.uuid4().hex[:12]}"
    asyncio.run(_pg(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        asyncio.run(_pg(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


Results = dict[str, dict[int, list[Run]]]


def run_store(kind: str, backends: tuple[str, str], tmp: str, args: argparse.Namespace) -> Results:
    results: Results = {name: {n: [] for n in args.workers} for name in ("chat", "stream")}
    with contextlib.ExitStack() as stack:
        servers: dict[int, tuple[str, int]] = {}
        scripts: dict[tuple[int, str], Path] = {}
        for n in args.workers:
            db = stack.enter_context(database(kind, tmp))
            paths = asyncio.run(prepare(db, backends, args.rollouts))
            env = {"ROLLWAY_ACCESS_LOG": "false", "ROLLWAY_WORKERS": str(n)}
            server = stack.enter_context(GatewayProcess(db, env=env))
            assert server.pid is not None
            servers[n] = (server.url, server.pid)
            quoted = ", ".join(f'"{p}/v1/chat/completions"' for p in paths)
            for name, body in (("chat", CHAT), ("stream", STREAM)):
                script = Path(tmp, f"{kind}-{n}-{name}.lua")
                script.write_text(LUA.format(paths=quoted, body=json.dumps(body), mark=MARK))
                scripts[(n, name)] = script
                post(f"{server.url}{paths[0]}/v1/chat/completions", body)  # every alias answers
        warm = argparse.Namespace(**{**vars(args), "duration": 2})
        for n, (url, pid) in servers.items():
            measure(url, pid, scripts[(n, "chat")], warm)
        for round_ in range(args.rounds):
            order = list(args.workers) if round_ % 2 == 0 else list(reversed(args.workers))
            for name in ("chat", "stream"):
                for n in order:
                    url, pid = servers[n]
                    results[name][n].append(measure(url, pid, scripts[(n, name)], args))
            print(f"{kind}: round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    return results


def report(kind: str, results: Results, args: argparse.Namespace) -> None:
    base = min(args.workers)
    print(
        f"\n{kind} ({args.backend} backend): wrk -c{args.connections} -t{args.threads} -d{args.duration}s, "
        f"{args.rounds} round(s), {args.rollouts} rollouts, medians"
    )
    header = ("req/s", "ratio", "gw ms/call", "db ms/call", "rest ms/call", "stream req/s", "ratio", "errors")
    widths = (9, 8, 12, 12, 14, 14, 8, 8)
    print(f"{'workers':<9}" + "".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for n in args.workers:
        chat, stream = results["chat"][n], results["stream"][n]
        ratios = [
            statistics.median(a.rate / b.rate for a, b in zip(runs[n], runs[base], strict=True))
            for runs in (results["chat"], results["stream"])
        ]
        gateway = statistics.median(r.cpu / r.calls for r in chat) * 1e3
        database = statistics.median(r.database / r.calls for r in chat) * 1e3
        rest = statistics.median((r.machine - r.cpu - r.database) / r.calls for r in chat) * 1e3
        errors = sum(r.errors for r in chat + stream)
        print(
            f"{n:<9}{statistics.median(r.rate for r in chat):>9,.0f}{ratios[0]:>7.2f}x{gateway:>12.3f}{database:>12.3f}"
            f"{rest:>14.3f}"
            f"{statistics.median(r.rate for r in stream):>14,.0f}{ratios[1]:>7.2f}x{errors:>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", nargs="+", choices=("sqlite", "postgres"), default=["sqlite", "postgres"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--backend", choices=("static", "mock"), default="static")
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="wrk's threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts the calls are spread over")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        backend = static_backend(tmp) if args.backend == "static" else mock_backend()
        with backend as backends:
            for kind in args.stores:
                started = time.monotonic()
                report(kind, run_store(kind, backends, tmp, args), args)
                print(f"({kind}: {time.monotonic() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
