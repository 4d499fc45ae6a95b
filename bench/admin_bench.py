"""Control-plane benchmarks: triplet export and claims through the admin routes, on SQLite.

Run from the repository root::

    python bench/admin_bench.py                 # 10,000 finished rollouts x 4 calls, 5 repetitions
    python bench/admin_bench.py --quick         # 1,000 rollouts, a fast smoke check
    python bench/admin_bench.py --rollouts 20000 --repeat 3

The app is the real one (``rollway.app.factory.create_app``, lifespan run, the server's GC tuning applied) on a
temporary SQLite file; requests go through ``httpx.ASGITransport`` (no sockets). The store is filled directly
through the ``Store`` API, outside the clock: ``enqueue`` (groups of 4), ``claim``, ``add_spans`` with four
LLM-call spans per rollout shaped like the gateway's records (a multi-turn conversation: the prompt grows
200 → 300 → 400 → 500 token ids, 60 response token ids with logprobs per call, the request's ``messages``
and the response body) plus one reward span, then ``update_attempt(status="succeeded")``.

Timed (each repeated, median reported):

1. ``GET /admin/v1/triplets?limit=N`` (JSON, one page of every rollout);
2. the same with ``format=jsonl`` (the streamed body read to its end);
3. ``format=jsonl&merge=true``;
4. ``format=jsonl&limit=1000`` pages following ``next_cursor`` until an empty page;
5. sequential ``POST /admin/v1/claims {"limit": 1}`` on a queue of fresh tasks (claims/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from rollway.app.factory import create_app
from rollway.app.serving import tune_gc
from rollway.settings import Settings
from rollway.store import AttemptedRollout, ConflictError, Store

CALLS = 4
GROUP = 4
TARGET_SECONDS = 3.0
WORDS = ["the", "agent", "reads", "a", "file", "then", "runs", "tests", "and", "reports", "what", "failed", "why"]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def rollout_spans(rng: random.Random, rollout_id: str, attempt_id: str) -> list[dict[str, Any]]:
    """Four LLM calls of one conversation (each prompt extends the previous one) and a final reward."""
    prompt = [rng.randrange(150_000) for _ in range(200)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text(rng, 40)},
        {"role": "user", "content": text(rng, 80)},
    ]
    spans = []
    for turn in range(CALLS):
        response = [rng.randrange(150_000) for _ in range(60)]
        reply = {"role": "assistant", "content": text(rng, 40)}
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "policy",
            "gen_ai.response.model": "Qwen/Qwen2.5-7B-Instruct",
            "gen_ai.response.id": f"chatcmpl-{uuid.UUID(int=rng.getrandbits(128)).hex}",
            "gen_ai.response.finish_reasons": ["stop"],
            "gen_ai.usage.input_tokens": len(prompt),
            "gen_ai.usage.output_tokens": len(response),
            "http.response.status_code": 200,
            "rollway.request": {"model": "policy", "messages": list(messages), "temperature": 1.0},
            "rollway.response": {
                "id": "chatcmpl-x",
                "object": "chat.completion",
                "model": "Qwen/Qwen2.5-7B-Instruct",
                "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(response)},
            },
            "rollway.prompt_token_ids": prompt,
            "rollway.response_token_ids": response,
            "rollway.response_logprobs": [round(-rng.random() * 3, 4) for _ in response],
            "rollway.backend_id": "be-1",
            "rollway.model_version": "v1",
            "rollway.trainable": True,
            "rollway.stream": False,
            "rollway.retry_count": 0,
            "rollway.ttft_seconds": 0.05,
        }
        spans.append(
            {
                "rollout_id": rollout_id,
                "attempt_id": attempt_id,
                "trace_id": uuid.UUID(int=rng.getrandbits(128)).hex,
                "span_id": f"{rng.getrandbits(64):016x}",
                "name": "chat policy",
                "status": {"status_code": "OK"},
                "start_time": 1_800_000_000.0 + turn,
                "end_time": 1_800_000_000.5 + turn,
                "attributes": attributes,
            }
        )
        observation = [rng.randrange(150_000) for _ in range(40)]
        prompt = [*prompt, *response, *observation]
        messages = [*messages, reply, {"role": "tool", "content": text(rng, 30)}]
    spans.append(
        {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "trace_id": uuid.UUID(int=rng.getrandbits(128)).hex,
            "span_id": f"{rng.getrandbits(64):016x}",
            "name": "rollway.reward",
            "attributes": {"rollway.reward.name": "primary", "rollway.reward.value": float(rng.random() > 0.5)},
        }
    )
    return spans


async def fill(store: Store, rollouts: int, rng: random.Random) -> None:
    await store.enqueue([{"group_size": GROUP, "input": {"task": i}} for i in range(rollouts // GROUP)])
    claimed: list[AttemptedRollout] = []
    while len(claimed) < rollouts:
        try:
            claimed.extend(await store.claim("filler", limit=1000))
        except ConflictError as exc:  # not expected (ids are redrawn on collision), but a fill must not stop
            print(f"claim batch refused, retried: {exc}")
    for start in range(0, len(claimed), 100):
        batch = claimed[start : start + 100]
        spans = [s for c in batch for s in rollout_spans(rng, c.rollout.rollout_id, c.attempt.attempt_id)]
        await store.add_spans(spans)
        await asyncio.gather(*(store.update_attempt(c.rollout.rollout_id, status="succeeded") for c in batch))


def megabytes(path: Path) -> float:
    return os.path.getsize(path) / 1e6


async def timed(fn: Callable[[], Awaitable[int]]) -> tuple[float, int]:
    start = time.perf_counter()
    count = await fn()
    return time.perf_counter() - start, count


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--claims", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1,000 rollouts, 200 claims, 3 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.claims, args.repeat = 1_000, 200, 3
    n = args.rollouts - args.rollouts % GROUP

    with tempfile.TemporaryDirectory(prefix="rollway-admin-bench-") as tmp:
        app = create_app(Settings(database_url=f"sqlite:///{Path(tmp) / 'bench.db'}"))
        async with app.lifespan():
            store: Store = app.state.store
            tune_gc()
            started = time.perf_counter()
            await fill(store, n, random.Random(7))
            print(f"filled {n:,} finished rollouts x {CALLS} calls in {time.perf_counter() - started:.1f} s")
            print(f"database file {megabytes(Path(tmp) / 'bench.db'):,.0f} MB (plus WAL)")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://rollway", timeout=300) as client:
                await report(client, n, args)


async def report(client: httpx.AsyncClient, n: int, args: argparse.Namespace) -> None:
    async def json_page() -> int:
        response = await client.get("/admin/v1/triplets", params={"limit": n})
        response.raise_for_status()
        return response.content.count(b'"sequence_id":')  # rows, without parsing the body (the client's work)

    def jsonl(**params: Any) -> Callable[[], Awaitable[int]]:
        async def pull() -> int:
            lines = 0
            async with client.stream("GET", "/admin/v1/triplets", params={"format": "jsonl", **params}) as response:
                response.raise_for_status()
                async for chunk in response.aiter_bytes():
                    lines += chunk.count(b"\n")
            return lines

        return pull

    async def paged() -> int:
        total, cursor = 0, None
        while True:
            params: dict[str, Any] = {"format": "jsonl", "limit": 1000}
            if cursor:
                params["since"] = cursor
            response = await client.get("/admin/v1/triplets", params=params)
            response.raise_for_status()
            if not response.content:
                return total
            total += response.content.count(b"\n")
            cursor = response.headers["x-rollway-next-cursor"]

    cases = [
        (f"triplets, JSON, limit={n:,}", json_page),
        (f"triplets, JSON Lines, limit={n:,}", jsonl(limit=n)),
        (f"merged rows, JSON Lines, limit={n:,}", jsonl(limit=n, merge="true")),
        ("triplets, JSON Lines, pages of 1,000 via cursor", paged),
    ]
    print(f"\n{'measurement':<52} {'median':>9} {'min':>9} {'max':>9}  rows")
    for label, fn in cases:
        results = [await timed(fn) for _ in range(args.repeat)]
        times = [t for t, _ in results]
        verdict = "met" if statistics.median(times) <= TARGET_SECONDS else "NOT MET"
        print(
            f"{label:<52} {statistics.median(times):8.2f}s {min(times):8.2f}s {max(times):8.2f}s"
            f"  {results[0][1]:,}  (target {TARGET_SECONDS:.0f} s: {verdict})"
        )

    rates = []
    for _ in range(args.repeat):
        created = await client.post("/admin/v1/rollouts", json={"tasks": [{"input": i} for i in range(args.claims)]})
        created.raise_for_status()
        start = time.perf_counter()
        for _ in range(args.claims):
            response = await client.post("/admin/v1/claims", json={"worker_id": "bench", "limit": 1})
            response.raise_for_status()
            assert len(response.json()["claims"]) == 1
        rates.append(args.claims / (time.perf_counter() - start))
    print(
        f"{f'POST /claims limit=1, sequential (x{args.claims:,})':<52} {statistics.median(rates):7,.0f}/s"
        f" {min(rates):7,.0f}/s {max(rates):7,.0f}/s"
    )
    print(
        f"\n{platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs,"
        f" load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
