"""The control plane of one RL step: where a step's time goes besides the engine, for checkouts side by side.

A step of N agents, as ``examples/grpo/train.py`` runs one: enqueue N rollouts (groups of 8), claim them in batches,
have each agent make one chat call through its claim's URL and key (one shared HTTP client), report its reward and
its end, then pull the step's triplets from the cursor. The same N chat calls sent straight to the engine (the mock
backend, each answer taking ``--latency-ms``) are the floor. The control plane's share of a step is
``(step - straight) / step``: the time the step spends on anything but the engine.

    git worktree add /tmp/rollway-old <commit>
    python bench/step_bench.py --tree . --tree /tmp/rollway-old [--agents 32 --agents 1024] [--rounds 5]

Each checkout is installed on its own (``bench/gateway_ab.py``'s ``install``) and served by its own ``rollway
serve`` on its own SQLite file; rounds alternate the order of the checkouts. The agents, the admin client and the
straight calls run in this process, with this checkout's client. Prints, per agent count and checkout: the median
step, the median straight step, the control plane's share and its time, and each phase (enqueue, claims, agents,
pull).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gateway_ab import install  # noqa: E402

from rollway.admin.client import AsyncRollwayClient, RollwayAPIError  # noqa: E402
from rollway.mock import MockBackendProcess  # noqa: E402
from rollway.process import GatewayProcess  # noqa: E402

GROUP = 8
CLAIM_BATCH = 100  # rollouts per claim (the admin API's bound)
BODY: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": 16}


async def straight(http: httpx.AsyncClient, engine: str, agents: int) -> float:
    body = {**BODY, "model": "mock-model"}
    began = time.perf_counter()
    answers = await asyncio.gather(*(http.post(f"{engine}/chat/completions", json=body) for _ in range(agents)))
    assert all(a.status_code == 200 for a in answers)
    return time.perf_counter() - began


async def takes_reward_with_end(client: AsyncRollwayClient) -> bool:
    """Whether the server records a reward sent with an attempt's end (an older checkout answers 400)."""
    claim = await client.start_rollout({"input": "probe"}, worker_id="probe")
    try:
        await client.update_attempt(claim.rollout.rollout_id, claim.attempt.attempt_id, status="failed", reward=0.0)
    except RollwayAPIError as exc:
        if exc.status != 400:
            raise
        return False
    return True


async def step(
    client: AsyncRollwayClient, http: httpx.AsyncClient, agents: int, cursor: str | None, one_request: bool
) -> tuple[dict[str, float], str]:
    """One step through the gateway ``client`` talks to: its phases' times and the cursor after it.
    ``one_request``: each agent sends its reward with its end."""
    times: dict[str, float] = {}
    began = time.perf_counter()
    tasks = [{"input": {"n": i}, "group_size": GROUP, "mode": "train"} for i in range(agents // GROUP)]
    await client.enqueue(tasks)
    times["enqueue"] = time.perf_counter() - began

    async def agent(claim: Any) -> None:
        answer = await http.post(
            f"{claim.base_url}/chat/completions",
            json=BODY,
            headers={"Authorization": f"Bearer {claim.api_key}"},
        )
        assert answer.status_code == 200, answer.text
        rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
        if one_request:
            await client.update_attempt(rid, aid, status="succeeded", reward=0.5)
            return
        await client.add_reward(rid, 0.5, attempt_id=aid)
        await client.update_attempt(rid, aid, status="succeeded")

    claimed = time.perf_counter()
    running: list[asyncio.Task[None]] = []
    while len(running) < agents:  # each batch's agents start while the next batch is claimed
        claims = await client.claim("bench", limit=min(agents - len(running), CLAIM_BATCH), wait_seconds=5)
        running += [asyncio.create_task(agent(c)) for c in claims]
    times["claims"] = time.perf_counter() - claimed
    await asyncio.gather(*running)
    times["agents"] = time.perf_counter() - claimed - times["claims"]
    pulled = time.perf_counter()
    records = client.iter_triplets(since=cursor, page_size=500)
    count = sum([1 async for _ in records])
    assert count == agents, count
    times["pull"] = time.perf_counter() - pulled
    times["step"] = time.perf_counter() - began
    return times, records.next_cursor or ""


async def run(args: argparse.Namespace) -> None:
    async with contextlib.AsyncExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory())
        mock = stack.enter_context(MockBackendProcess(latency_ms=args.latency_ms))
        servers: dict[str, str] = {}
        for index, tree in enumerate(args.tree):
            env = install(tree, f"{scratch}/tree{index}")
            server = GatewayProcess(f"sqlite:///{scratch}/tree{index}.db", env={"ROLLWAY_ACCESS_LOG": "false", **env})
            stack.enter_context(server)
            servers[f"{index}: {tree}"] = server.url
        # The trainer's side, as the recipe holds it: per server, one admin client and one HTTP client its agents
        # share, kept across steps; the straight calls have their own (a pool's cost grows with its connections).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=2048)
        clients = {name: AsyncRollwayClient(url) for name, url in servers.items()}
        pools = {name: httpx.AsyncClient(limits=limits, timeout=120) for name in [*servers, "straight"]}
        for client in clients.values():
            await stack.enter_async_context(client)
        for pool in pools.values():
            await stack.enter_async_context(pool)
        one_request: dict[str, bool] = {}  # whether the server takes the reward with the end (newer ones do)
        for name in servers:
            backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
            await clients[name].put_model("policy", [backend])
            one_request[name] = await takes_reward_with_end(clients[name])
        cursors: dict[str, str | None] = dict.fromkeys(servers)  # each server's export, step after step
        for agents in args.agents:
            results: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            floors: list[float] = []
            for name in servers:  # warm up: connections, caches, the first claim
                _, cursors[name] = await step(clients[name], pools[name], GROUP, cursors[name], one_request[name])
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                floors.append(await straight(pools["straight"], mock.base_url, agents))
                for name in order:
                    times, cursors[name] = await step(
                        clients[name], pools[name], agents, cursors[name], one_request[name]
                    )
                    results[name].append(times)
            report(agents, floors, results)


def report(agents: int, floors: list[float], results: dict[str, list[dict[str, float]]]) -> None:
    floor = statistics.median(floors)
    print("straight to the engine, each round (ms):", [round(f * 1000) for f in floors])
    print(f"\n{agents} agents, {len(floors)} rounds; straight to the engine: {floor * 1000:.0f} ms (median)")
    head = f"{'checkout':<36}{'step ms':>9}{'control ms':>12}{'share':>7}"
    print(head + "".join(f"{p + ' ms':>12}" for p in ("enqueue", "claims", "agents", "pull")))
    for name, rows in results.items():
        median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        control = median["step"] - floor
        line = f"{name:<36}{median['step'] * 1000:>9.0f}{control * 1000:>12.0f}{control / median['step']:>7.0%}"
        print(line + "".join(f"{median[p] * 1000:>12.0f}" for p in ("enqueue", "claims", "agents", "pull")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=None, help="a checkout to serve (repeatable)")
    parser.add_argument("--agents", action="append", type=int, default=None, help="agents per step (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency-ms", type=float, default=100.0, help="the engine's time per answer")
    args = parser.parse_args()
    args.tree = args.tree or [str(ROOT)]
    args.agents = args.agents or [32, 1024]
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
