"""The load of an RL step: many agents at once, each with its own claimed rollout, calling in a loop for a fixed
time. Streamed calls are answers of ``--tokens`` tokens paced ``--token-delay-ms`` apart (a busy GPU); non-streamed
calls take ``--latency-ms``. The backend is ``bench/paced_backend.py``, replaying the mock backend's answers with
one timer for every stream (as an engine's decode step), cheap enough that on two cores the proxies reach their
limit before it does. Per agent count, three targets in one run, one after another against the same backend:
``direct``, ``bare`` (``bench/bare_forwarder.py``) and ``rollway`` (``rollway serve`` on a fresh SQLite file,
``--workers`` per run, every agent on its own rollout path with its own rollout key, as claimed agents call). The
agents are one process of raw keep-alive connections (``Exchange``), the cheapest client there is per chunk.

The backend does the same work for every target: the direct and bare calls ask for the token ids and logprobs
that Rollway asks for on the agents' behalf, so the bytes the backend sends are the same; Rollway strips them
from what its agents get back, as it does for agents that did not ask.

Per target it prints the calls answered 200, the others by status, time to the answer's first body byte (TTFT)
and total time (p50/p99, and added over direct), the proxy's CPU (all its processes, percent of one core), its
peak RSS and the whole machine's busy CPU (percent of one core). For Rollway it also checks that every call
answered 200 has its span, and counts the fast refusals (503/429 with ``Retry-After``, with ``--max-in-flight``):
the agent waits as told and tries again.

    python bench/rl_step_bench.py [--agents 512 1024] [--mix stream|mixed] [--duration 30] [--workers 1]
        [--max-in-flight 0] [--targets direct bare rollway]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import forwarder, free_port, start  # noqa: E402
from workers_bench import children, machine_busy, tree_cpu  # noqa: E402

from rollway.admin.client import AsyncRollwayClient  # noqa: E402
from rollway.mock import MockBackendProcess  # noqa: E402
from rollway.process import GatewayProcess  # noqa: E402
from rollway.store import Store  # noqa: E402

PROMPT = [{"role": "user", "content": "Solve the task, step by step."}]
#: What Rollway adds to a vLLM chat request: the direct and bare calls ask for it themselves.
CAPTURE = {"return_token_ids": True, "logprobs": True}


@dataclass
class Agent:
    url: str
    headers: dict[str, str]


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)  # streamed calls answered 200
    later: list[float] = field(default_factory=list)  # the same, less each agent's first call
    total: dict[str, list[float]] = field(default_factory=lambda: {"stream": [], "chat": []})
    refused: list[float] = field(default_factory=list)  # time to a 503/429 answer
    statuses: Counter[int] = field(default_factory=Counter)
    answered: Counter[str] = field(default_factory=Counter)  # 200s per agent URL

    @property
    def done(self) -> int:
        return self.statuses[200]


def bodies(args: argparse.Namespace, target: str) -> dict[str, dict[str, Any]]:
    extra = CAPTURE if target != "rollway" else {}
    stream = {"max_tokens": args.tokens, "stream": True}
    chat = {"max_tokens": 16}
    common = {"model": "policy" if target == "rollway" else "mock-model", "messages": PROMPT, "ignore_eos": True}
    return {"stream": common | stream | extra, "chat": common | chat | extra}


class Exchange(asyncio.Protocol):
    """One agent's keep-alive connection, read with as little work per read as a client can do (an HTTP client
    library costs more per streamed chunk than the proxies measured here, on the same two cores): the answer's
    status and head, then bytes until its length or the chunked encoding's last chunk."""

    def __init__(self) -> None:
        self.transport: Any = None  # (uvloop's transports are not ``asyncio.Transport``s)
        self.done: asyncio.Future[tuple[int, float | None, float]] | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def send(self, request: bytes) -> asyncio.Future[tuple[int, float | None, float]]:
        """The answer's status, the seconds to its first body byte and to its end (and Retry-After, as status
        503/429 plus its value in the third place)."""
        assert self.transport is not None
        self.started, self.head, self.status = time.monotonic(), b"", 0
        self.first: float | None = None
        self.length, self.chunked, self.seen, self.tail = -1, False, 0, b""
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            return
        if not self.status:
            self.head += data
            cut = self.head.find(b"\r\n\r\n")
            if cut < 0:
                return
            head, data = self.head[:cut].lower(), self.head[cut + 4 :]
            self.status = int(head[9:12])
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name == b"content-length":
                    self.length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value:
                    self.chunked = True
                elif name == b"retry-after":
                    self.retry_after = float(value)
            if not data and self.length != 0:
                return
        if self.first is None:
            self.first = time.monotonic() - self.started
        self.seen += len(data)
        self.tail = (self.tail + data)[-7:]
        if (self.chunked and self.tail.endswith(b"0\r\n\r\n")) or (0 <= self.length <= self.seen):
            extra = getattr(self, "retry_after", 0.0) if self.status in (429, 503) else time.monotonic() - self.started
            self.done.set_result((self.status, self.first, extra))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the server closed the connection"))
        if not self.lost.done():
            self.lost.set_result(None)


def request_of(agent: Agent, body: dict[str, Any]) -> bytes:
    parts = urlsplit(agent.url)
    data = orjson.dumps(body)
    head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json"]
    head += [f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in agent.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


async def agent_loop(
    agent: Agent, kinds: list[str], calls: dict[str, dict[str, Any]], tally: Tally, deadline: float
) -> None:
    """Calls until ``deadline``, alternating the kinds of ``kinds``; a call cut off by the deadline is not counted."""
    loop = asyncio.get_running_loop()
    requests = {kind: request_of(agent, body) for kind, body in calls.items()}
    parts = urlsplit(agent.url)
    conn: Exchange | None = None
    n = 0
    try:
        while time.monotonic() < deadline:
            kind = kinds[n % len(kinds)]
            n += 1
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    if conn is None or conn.lost.done():
                        _, conn = await loop.create_connection(
                            Exchange, parts.hostname or "127.0.0.1", parts.port or 80
                        )
                    status, first, extra = await conn.send(requests[kind])
            except TimeoutError:
                return
            except OSError:
                tally.statuses[0] += 1
                conn = None
                continue
            tally.statuses[status] += 1
            if status != 200:
                if status in (429, 503) and extra:
                    tally.refused.append(time.monotonic() - conn.started)
                    await asyncio.sleep(min(extra, 5.0))
                continue
            tally.answered[agent.url] += 1
            tally.total[kind].append(extra)
            if kind == "stream" and first is not None:
                tally.ttft.append(first)
                if n > 1:
                    tally.later.append(first)
    finally:
        if conn is not None and conn.transport is not None:
            conn.transport.close()


def rss_mb(pid: int) -> float:
    total = 0.0
    for proc in [pid, *children(pid)]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


async def drive(agents: list[Agent], args: argparse.Namespace, target: str, pid: int | None) -> dict[str, Any]:
    calls = bodies(args, target)
    kinds = ["stream"] if args.mix == "stream" else ["stream", "chat"]
    tally = Tally()
    peak = 0.0

    async def sample() -> None:
        nonlocal peak
        while pid is not None:
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.5)

    before, busy = tree_cpu(pid) if pid else 0.0, machine_busy()
    started = time.monotonic()
    deadline = started + args.duration
    sampler = asyncio.create_task(sample())
    # Each agent starts at its own offset in its loop, so the kinds are mixed at every moment.
    await asyncio.gather(
        *(
            agent_loop(a, kinds[i % len(kinds) :] + kinds[: i % len(kinds)], calls, tally, deadline)
            for i, a in enumerate(agents)
        )
    )
    sampler.cancel()
    elapsed = time.monotonic() - started
    cpu = (tree_cpu(pid) - before) / elapsed if pid else None
    machine = (machine_busy() - busy) / elapsed
    return {"tally": tally, "cpu": cpu, "rss": peak if pid else None, "machine": machine}


@contextlib.contextmanager
def paced_backend(args: argparse.Namespace, tmp: str) -> Iterator[str]:
    """``bench/paced_backend.py`` replaying what the mock backend answers to the gateway's own requests (the
    calls' bodies with the token ids and logprobs asked for): its base URL."""
    answers = Path(tmp, "answers")
    answers.mkdir()
    with MockBackendProcess() as mock:
        for name, kind in (("chat.json", "chat"), ("stream.sse", "stream")):
            body = {**bodies(args, "direct")[kind], "model": "mock-model"}
            request = urllib.request.Request(
                f"{mock.url}/v1/chat/completions", orjson.dumps(body), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as answer:
                (answers / name).write_bytes(answer.read())
    port = free_port()
    command = [sys.executable, str(ROOT / "bench" / "paced_backend.py"), "--port", str(port), "--answers", str(answers)]
    command += ["--token-delay-ms", str(args.token_delay_ms), "--latency-ms", str(args.latency_ms)]
    process = start(command, "serving")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=15)


async def claimed(gateway_url: str, n: int) -> list[Agent]:
    """``n`` rollouts enqueued and claimed through the gateway's admin API, as a trainer and its runners do: each
    agent on its claim's URL with its claim's rollout key."""
    async with AsyncRollwayClient(gateway_url) as admin:
        await admin.enqueue([{"input": {"agent": i}} for i in range(n)])
        claims: list[Any] = []
        while len(claims) < n:
            claims += await admin.claim("bench", limit=min(100, n - len(claims)))
    return [
        Agent(f"{c.base_url.rstrip('/')}/chat/completions", {"Authorization": f"Bearer {c.api_key}"}) for c in claims
    ]


async def spans_of(db: str, tally: Tally, agents: list[Agent]) -> tuple[int, int]:
    """Calls answered 200 without a span of their own (complete, status 200), and the spans counted."""
    store = await Store.open(db, run_watchdog=False)
    missing = recorded = 0
    try:
        for agent in agents:
            _, rollout, _, attempt = agent.url.split("/v1/")[0].rsplit("/", 3)
            spans = await store.query_spans(rollout, attempt)
            ok = sum(
                1
                for s in spans
                if s.attributes.get("http.response.status_code") == 200 and not s.attributes.get("rollway.cancelled")
            )
            recorded += ok
            missing += max(0, tally.answered[agent.url] - ok)
    finally:
        await store.close()
    return missing, recorded


async def one(args: argparse.Namespace, n: int, backend: str, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for target in args.targets:
        if target == "direct":
            agents = [Agent(f"{backend}/v1/chat/completions", {})] * n
            results[target] = await drive(agents, args, target, None)
        elif target == "bare":
            with forwarder(backend) as (url, pid):
                results[target] = await drive([Agent(url, {})] * n, args, target, pid)
        else:
            for workers in args.workers:
                db = f"sqlite:///{tmp}/rl-{n}-{workers}.db"
                store = await Store.open(db, run_watchdog=False)
                engine = {"backend_id": "paced", "base_url": f"{backend}/v1", "kind": "vllm", "model": "mock-model"}
                await store.put_model("policy", [engine])
                await store.close()
                env = {
                    "ROLLWAY_ACCESS_LOG": "false",
                    "ROLLWAY_WORKERS": str(workers),
                    "ROLLWAY_MAX_CALLS_IN_FLIGHT": str(args.max_in_flight),
                    "ROLLWAY_VERSION_CHECK_INTERVAL": "0",
                }
                gateway = GatewayProcess(db, env=env).start()
                try:
                    assert gateway.pid is not None
                    agents = await claimed(gateway.url, n)
                    result = await drive(agents, args, target, gateway.pid)
                finally:
                    gateway.stop()
                result["spans"] = await spans_of(db, result["tally"], agents)
                results[f"rollway x{workers}"] = result
    return results


def pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def report(n: int, results: dict[str, Any], args: argparse.Namespace) -> None:
    """One Markdown table per agent count (as docs/benchmarks.md holds it), then the acceptance ratios."""
    cap = args.max_in_flight or "off"
    print(f"\n{n} agents, {args.mix}, {args.duration:g} s, Rollway's max calls in flight: {cap}\n")
    print(
        "| target | calls done | other answers | TTFT p50 / p99 | added p50 / p99 | stream total p99 "
        "| non-streamed p99 | proxy CPU | RSS | machine CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = results.get("direct")
    for name, r in results.items():
        t: Tally = r["tally"]
        other = ", ".join(f"{s or 'error'}: {c}" for s, c in sorted(t.statuses.items()) if s != 200) or "—"
        p50, p99 = pct(t.ttft, 50), pct(t.ttft, 99)
        added = "—"
        if base is not None and name != "direct":
            added = f"{ms(p50 - pct(base['tally'].ttft, 50))} / {ms(p99 - pct(base['tally'].ttft, 99))} ms"
        chat = f"{pct(t.total['chat'], 99):.2f} s" if t.total["chat"] else "—"
        cpu = f"{r['cpu'] * 100:.0f} %" if r["cpu"] is not None else "—"
        rss = f"{r['rss']:.0f} MB" if r["rss"] is not None else "—"
        print(
            f"| {name} | {t.done:,} | {other} | {ms(p50)} / {ms(p99)} ms | {added} "
            f"| {pct(t.total['stream'], 99):.2f} s | {chat} | {cpu} | {rss} | {r['machine'] * 100:.0f} % |"
        )
    print()
    for name, r in results.items():
        if "spans" in r:
            t = r["tally"]
            missing, recorded = r["spans"]
            refused = f"; fast refusals {len(t.refused):,}, p99 {ms(pct(t.refused, 99))} ms" if t.refused else ""
            print(f"{name}: {recorded:,} spans of calls answered 200, {missing} such calls without one{refused}")
    for name, r in results.items():
        t = r["tally"]
        print(f"{name}: TTFT p99 of the calls after each agent's first: {ms(pct(t.later, 99))} ms")
    bare = results.get("bare")
    if bare is not None:
        for name, r in results.items():
            if name.startswith("rollway") and bare["tally"].done:
                line = f"{name}: {r['tally'].done / bare['tally'].done:.2f}x the forwarder's calls"
                if base is not None:
                    over = pct(r["tally"].ttft, 99) - pct(base["tally"].ttft, 99)
                    bare_over = pct(bare["tally"].ttft, 99) - pct(base["tally"].ttft, 99)
                    line += f"; added TTFT p99 {ms(over)} ms, the forwarder's {ms(bare_over)} ms"
                print(line)
    workers = sorted((int(k.split("x")[1]), v["tally"].done) for k, v in results.items() if k.startswith("rollway"))
    if len(workers) > 1 and workers[0][1]:
        print(
            ", ".join(f"--workers {w}: {done / workers[0][1]:.2f}x" for w, done in workers[1:]),
            f"--workers {workers[0][0]}'s calls",
        )
    sys.stdout.flush()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--mix", choices=("stream", "mixed"), default="stream")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--token-delay-ms", type=float, default=20.0)
    parser.add_argument("--latency-ms", type=float, default=500.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument("--max-in-flight", type=int, default=0)
    parser.add_argument(
        "--targets", nargs="+", choices=("direct", "bare", "rollway"), default=["direct", "bare", "rollway"]
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, paced_backend(args, tmp) as backend:
        for n in args.agents:
            report(n, await one(args, n, backend, tmp), args)


if __name__ == "__main__":
    # A socket per agent, and as many again for the proxies' connections to the backend.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
