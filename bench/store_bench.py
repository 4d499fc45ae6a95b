"""Store micro-benchmarks: enqueue, claim and span writes on SQLite and PostgreSQL.

Run from the repository root::

    python bench/store_bench.py                 # full sizes, both engines, 3 repetitions
    python bench/store_bench.py --quick         # small sizes, a fast smoke check
    python bench/store_bench.py --engines sqlite --repeat 5

Every repetition opens a fresh, empty database (a temporary SQLite file; a temporary PostgreSQL database
created on ``--pg-url`` and dropped afterwards) and runs the phases in order on it:

1. enqueue: one ``enqueue`` call with N tasks (seconds);
2. claim: sequential ``claim(worker_id, limit=1)`` calls (claims/s);
3. spans, batched: ``add_spans`` in batches to a few attempts (spans/s);
4. spans, single, concurrent: many coroutines each calling ``add_span`` for its own attempt (spans/s);
5. spans, single, sequential: one ``add_span`` at a time (spans/s).

Span payloads look like a recorded LLM call (two token id lists of 100-300 ids, a messages list; about 4 KB
of JSON) and are built outside the timed region; they are passed as plain dicts, so the store's pydantic
validation is measured. Batched and sequential payloads are built just before each call, so only the
payloads in flight are alive (the concurrent phase builds its 5,000 up front).
The median over the repetitions is reported; targets apply to SQLite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollway.app.serving import tune_gc
from rollway.store import Store

DEFAULT_PG_URL = os.environ.get("ROLLWAY_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@dataclass(frozen=True)
class Sizes:
    enqueue: int
    claims: int
    batched_spans: int
    batch_size: int
    batched_attempts: int
    concurrent_spans: int
    concurrency: int
    sequential_spans: int
    tune_gc: bool = True


FULL = Sizes(
    enqueue=10_000,
    claims=2_000,
    batched_spans=20_000,
    batch_size=500,
    batched_attempts=4,
    concurrent_spans=5_000,
    concurrency=64,
    sequential_spans=1_000,
)
QUICK = Sizes(
    enqueue=2_000,
    claims=300,
    batched_spans=4_000,
    batch_size=500,
    batched_attempts=2,
    concurrent_spans=1_000,
    concurrency=64,
    sequential_spans=200,
)


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    target: float | None = None  # SQLite target

    def passes(self, value: float) -> bool:
        if self.target is None:
            return True
        return value >= self.target if self.higher_is_better else value <= self.target


METRICS = [
    Metric("enqueue_s", "enqueue {enqueue:,} tasks (1 call)", "s", False, 1.0),
    Metric("claim_rate", "claim x{claims:,}, sequential", "claims/s", True, 1_000.0),
    Metric("spans_batched", "add_spans {batched_spans:,} (batches of {batch_size})", "spans/s", True, 20_000.0),
    Metric("spans_concurrent", "add_span {concurrent_spans:,}, {concurrency} concurrent", "spans/s", True),
    Metric("group_commit", "  group-commit batch (mean ops)", "ops/commit", True),
    Metric("spans_sequential", "add_span {sequential_spans:,}, sequential", "spans/s", True),
]


@dataclass
class EngineResult:
    engine: str
    runs: list[dict[str, float]] = field(default_factory=list)
    skipped: str | None = None

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs)

    def spread(self, key: str) -> tuple[float, float]:
        values = [r[key] for r in self.runs]
        return min(values), max(values)


# -- payloads -------------------------------------------------------------------------------------------


def llm_span(rng: random.Random, rollout_id: str, attempt_id: str, index: int) -> dict[str, Any]:
    """A span shaped like one recorded chat completion."""
    prompt_ids = [rng.randrange(150_000) for _ in range(rng.randint(100, 300))]
    completion_ids = [rng.randrange(150_000) for _ in range(rng.randint(100, 300))]
    start = 1_800_000_000.0 + index
    messages = [
        {"role": "system", "content": "You are a careful agent that solves tasks step by step."},
        {"role": "user", "content": f"Task {index}: find the file that defines the store writer."},
        {"role": "assistant", "content": "I will list the repository and read the store package."},
        {"role": "tool", "content": "store/writer.py store/engine.py store/spans.py " * 4},
    ]
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": uuid.UUID(int=rng.getrandbits(128)).hex,
        "span_id": f"{rng.getrandbits(64):016x}",
        "name": "chat.completions",
        "status": {"status_code": "OK"},
        "start_time": start,
        "end_time": start + 0.8,
        "attributes": {
            "gen_ai.system": "openai",
            "gen_ai.request.model": "qwen2.5-7b-instruct",
            "gen_ai.request.temperature": 0.7,
            "gen_ai.request.max_tokens": 1024,
            "gen_ai.response.model": "Qwen/Qwen2.5-7B-Instruct",
            "gen_ai.response.finish_reasons": ["stop"],
            "gen_ai.usage.input_tokens": len(prompt_ids),
            "gen_ai.usage.output_tokens": len(completion_ids),
            "rollway.prompt_token_ids": prompt_ids,
            "rollway.response_token_ids": completion_ids,
            "rollway.messages": messages,
            "rollway.response": {
                "role": "assistant",
                "content": "The writer lives in store/writer.py; it batches operations into one commit.",
            },
            "rollway.backend_id": "be-1a2b3c4d",
            "rollway.latency_ms": 812.5,
        },
        "resource": {"service.name": "rollway-gateway"},
    }


# -- databases -------------------------------------------------------------------------------------------


async def pg_admin(admin_url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def pg_reachable(admin_url: str) -> str | None:
    try:
        await pg_admin(admin_url, "SELECT 1")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.asynccontextmanager
async def fresh_database(engine: str, pg_url: str) -> AsyncIterator[str]:
    if engine == "sqlite":
        with tempfile.TemporaryDirectory(prefix="rollway-bench-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'bench.db'}"
        return
    name = f"rollway_bench_{uuid.uuid4().hex[:12]}"
    await pg_admin(pg_url, f'CREATE DATABASE "{name}"')
    try:
        base, _, _ = pg_url.rpartition("/")
        yield f"{base}/{name}"
    finally:
        await pg_admin(pg_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- phases ----------------------------------------------------------------------------------------------


async def run_once(url: str, sizes: Sizes, seed: int, log: Callable[[str], None]) -> dict[str, float]:
    rng = random.Random(seed)
    if sizes.tune_gc:
        tune_gc()  # the collector settings `rollway serve` runs with
    result: dict[str, float] = {}
    store = await Store.open(url, run_watchdog=False)
    try:
        # 1. enqueue
        tasks = [
            {"input": {"question": f"q{i}", "answer": i}, "mode": "train", "metadata": {"source": "bench"}}
            for i in range(sizes.enqueue)
        ]
        t0 = time.perf_counter()
        queued = await store.enqueue(tasks)
        result["enqueue_s"] = time.perf_counter() - t0
        assert len(queued) == sizes.enqueue
        del tasks, queued  # keep the live heap small (see phase 3)

        # 2. claim, one at a time
        attempts: list[tuple[str, str]] = []
        t0 = time.perf_counter()
        for _ in range(sizes.claims):
            got = await store.claim("bench-worker", limit=1)
            attempts.extend((c.rollout.rollout_id, c.attempt.attempt_id) for c in got)
        elapsed = time.perf_counter() - t0
        assert len(attempts) == sizes.claims, len(attempts)
        result["claim_rate"] = sizes.claims / elapsed
        gc.collect()
        need = sizes.batched_attempts + sizes.concurrency + 1
        assert len(attempts) >= need, f"claims ({len(attempts)}) must cover the attempts spans use ({need})"

        # 3. spans, batched. Each batch is built just before its call, outside the timed region, so only the
        # batch in flight is alive (as in a gateway): a heap holding every payload makes the cyclic GC's full
        # collections, which the store's allocations trigger, far more expensive than they are in service.
        targets = attempts[: sizes.batched_attempts]
        elapsed = 0.0
        for start in range(0, sizes.batched_spans, sizes.batch_size):
            stop = min(start + sizes.batch_size, sizes.batched_spans)
            # round-robin: each batch touches every attempt
            batch = [llm_span(rng, *targets[i % len(targets)], i) for i in range(start, stop)]
            t0 = time.perf_counter()
            written = await store.add_spans(batch)
            elapsed += time.perf_counter() - t0
            assert len(written) == len(batch)
            del batch, written
        result["spans_batched"] = sizes.batched_spans / elapsed

        # 4. spans, single, concurrent (each coroutine writes to its own attempt, like agents do); the payloads
        # are built up front here, so they are all alive while the clock runs.
        workers = attempts[sizes.batched_attempts : sizes.batched_attempts + sizes.concurrency]
        per_worker = [
            [llm_span(rng, *workers[w], i) for i in range(w, sizes.concurrent_spans, sizes.concurrency)]
            for w in range(sizes.concurrency)
        ]

        async def write_all(items: list[dict[str, Any]]) -> None:
            for item in items:
                assert await store.add_span(item) is not None

        stats = store.writer.stats
        ops0, tx0 = stats.operations, stats.transactions
        gc.collect()
        t0 = time.perf_counter()
        await asyncio.gather(*(write_all(items) for items in per_worker))
        result["spans_concurrent"] = sizes.concurrent_spans / (time.perf_counter() - t0)
        result["group_commit"] = (stats.operations - ops0) / max(1, stats.transactions - tx0)
        del per_worker

        # 5. spans, single, sequential (each payload built just before its call, outside the timed region)
        one = attempts[sizes.batched_attempts + sizes.concurrency]
        elapsed = 0.0
        for i in range(sizes.sequential_spans):
            item = llm_span(rng, *one, i)
            t0 = time.perf_counter()
            assert await store.add_span(item) is not None
            elapsed += time.perf_counter() - t0
        result["spans_sequential"] = sizes.sequential_spans / elapsed
    finally:
        await store.close()
    log(
        "    "
        + "  ".join(
            f"{m.key}={result[m.key]:.3f}" if m.unit == "s" else f"{m.key}={result[m.key]:,.0f}"
            for m in METRICS
            if m.key in result and m.key != "group_commit"
        )
        + f"  group_commit={result.get('group_commit', 0):.1f}"
    )
    return result


async def bench(engines: list[str], sizes: Sizes, repeat: int, pg_url: str) -> list[EngineResult]:
    results = []
    for engine in engines:
        res = EngineResult(engine)
        results.append(res)
        if engine == "postgres":
            reason = await pg_reachable(pg_url)
            if reason:
                res.skipped = f"PostgreSQL not reachable at {pg_url} ({reason}); skipped"
                print(f"note: {res.skipped}", flush=True)
                continue
        print(f"{engine}: {repeat} repetition(s)", flush=True)
        for i in range(repeat):
            async with fresh_database(engine, pg_url) as url:
                print(f"  run {i + 1}/{repeat}", flush=True)
                res.runs.append(await run_once(url, sizes, seed=i, log=lambda s: print(s, flush=True)))
    return results


# -- report ----------------------------------------------------------------------------------------------


def fmt(metric: Metric, value: float) -> str:
    if metric.unit == "s":
        return f"{value:.3f} s"
    if metric.key == "group_commit":
        return f"{value:.1f}"
    return f"{value:,.0f}/s"


def report(results: list[EngineResult], sizes: Sizes, repeat: int) -> bool:
    from rich.console import Console
    from rich.table import Table

    shown = [r for r in results if r.runs]
    table = Table(title=f"Rollway store benchmark: median of {repeat} run(s)")
    table.add_column("measurement")
    for r in shown:
        table.add_column(f"{r.engine} median", justify="right")
        table.add_column(f"{r.engine} min..max", justify="right", style="dim")
    table.add_column("SQLite target", justify="right")
    table.add_column("SQLite", justify="center")
    all_pass = True
    for m in METRICS:
        row = [m.label.format(**sizes.__dict__)]
        for r in shown:
            lo, hi = r.spread(m.key)
            row += [fmt(m, r.median(m.key)), f"{fmt(m, lo)} .. {fmt(m, hi)}"]
        if m.target is None:
            row += ["-", "-"]
        else:
            row.append(("≤ " if not m.higher_is_better else "≥ ") + fmt(m, m.target))
            sqlite = next((r for r in shown if r.engine == "sqlite"), None)
            if sqlite is None:
                row.append("n/a")
            else:
                ok = m.passes(sqlite.median(m.key))
                all_pass &= ok
                row.append("[green]PASS[/green]" if ok else "[red]FAIL[/red]")
        table.add_row(*row)
    console = Console(width=max(140, Console().width))
    console.print(table)
    console.print(
        f"python {platform.python_version()}, {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs; group commit is always 1 on PostgreSQL (one transaction per operation)"
    )
    for r in results:
        if r.skipped:
            console.print(f"note: {r.skipped}")
    return all_pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (a fast check, not a measurement)")
    parser.add_argument("--engines", default="sqlite,postgres", help="comma-separated: sqlite,postgres")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per engine (the median is shown)")
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="PostgreSQL admin URL (a database is made)")
    parser.add_argument(
        "--default-gc", action="store_true", help="keep Python's default GC thresholds instead of `rollway serve`'s"
    )
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"sqlite", "postgres"}
    if unknown or not engines:
        parser.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    sizes = dataclasses.replace(QUICK if args.quick else FULL, tune_gc=not args.default_gc)
    load_before = os.getloadavg()
    results = asyncio.run(bench(engines, sizes, args.repeat, args.pg_url))
    load_after = os.getloadavg()
    if not any(r.runs for r in results):
        print("nothing was measured")
        return 1
    report(results, sizes, args.repeat)
    print(
        "load average (1/5/15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
            *load_before, *load_after
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
