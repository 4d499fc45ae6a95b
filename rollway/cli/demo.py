"""``rollway demo``: the whole loop on one machine, no GPU, nothing beyond loopback.

A mock vLLM-like backend and a gateway (``rollway serve``, its own SQLite file and admin token) start as
subprocesses; the model alias ``policy`` is pointed at the mock; a small math dataset is enqueued in groups;
runner workers claim rollouts and run a toy agent that talks to the claim's ``base_url`` with the plain
``openai`` SDK (two or three calls per task), reports a reward and finishes the attempt; then the rollouts are
shown and the triplets (token ids, logprobs, rewards) written as JSON Lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
import re
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from rollway.admin.client import AsyncRollwayClient, Claim, RollwayError
from rollway.cli.commands import STATUS_STYLE
from rollway.cli.exports import export_triplets
from rollway.cli.tables import FitTable, render
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store import Rollout

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionMessageParam

ALIAS = "policy"
MOCK_MODEL = "mock-model"
ANSWER_RE = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)
EXPORT_IDS_PER_CALL = 100  # rollout ids per triplets request (they go in the query string)
SYSTEM = "You are a careful calculator. Reply exactly 'The answer is N.'"


@dataclass(frozen=True)
class DemoOptions:
    out: Path = Path("demo-triplets.jsonl")
    db: Path | None = None
    problems: int = 8
    group_size: int = 4
    workers: int = 4
    seed: int = 7


@dataclass
class Outcome:
    answer: int | None
    reward: float | None
    calls: int
    error: str | None = None


def math_problems(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        problems.append({"question": f"What is {a} + {b}?", "expression": f"{a} + {b}", "answer": a + b})
    return problems


def parse_answer(text: str) -> int | None:
    match = ANSWER_RE.search(text)
    return int(match.group(1)) if match else None


def _async_openai() -> type[AsyncOpenAI]:
    """The openai SDK's client class; the SDK is not a dependency of Rollway but of its ``demo`` extra. Called
    before anything starts, so a missing SDK is one line of error, not a failed attempt per rollout."""
    try:
        from openai import AsyncOpenAI
    except ImportError:
        raise click.ClickException(
            "the demo's toy agent needs the openai SDK, which is not installed: pip install 'rollway[demo]'"
        ) from None
    return AsyncOpenAI


async def toy_agent(claim: Claim) -> Outcome:
    """Ask, ask again to check, and break a tie with a third call; the reward is 1.0 for the right sum."""
    openai_client = _async_openai()

    task = claim.rollout.input
    seed = claim.rollout.group_index or 0  # so the samples of one group differ
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
    ]
    async with openai_client(base_url=claim.base_url, api_key=claim.api_key, max_retries=2, timeout=30) as llm:

        async def ask() -> int | None:
            completion = await llm.chat.completions.create(
                model=ALIAS, messages=messages, temperature=1.0, seed=seed, max_tokens=32
            )
            text = completion.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            return parse_answer(text)

        first = await ask()
        messages.append({"role": "user", "content": f"Check your work: what is {task['expression']}?"})
        answer, calls = await ask(), 2
        if answer != first:
            messages.append({"role": "user", "content": f"Your answers differ. Last try: {task['expression']}?"})
            answer, calls = await ask(), 3
    return Outcome(answer, 1.0 if answer == task["answer"] else 0.0, calls)


async def runner(name: str, client: AsyncRollwayClient, results: dict[str, Outcome], on_done: Any) -> None:
    """A worker: claim, run the agent, report the reward and the outcome, until the queue is empty."""
    while claims := await client.claim(name, limit=1):
        claim = claims[0]
        rollout_id, attempt_id = claim.rollout.rollout_id, claim.attempt.attempt_id
        try:
            outcome = await toy_agent(claim)
        except Exception as exc:  # a broken agent fails its attempt, not the runner
            outcome = Outcome(None, None, 0, error=f"{type(exc).__name__}: {exc}")
            await client.update_attempt(rollout_id, attempt_id, status="failed", metadata={"error": outcome.error})
        else:
            await client.update_attempt(rollout_id, attempt_id, status="succeeded", reward=outcome.reward)
        results[rollout_id] = outcome
        on_done()


def _start_both(mock: MockBackendProcess, gateway: GatewayProcess) -> None:
    async def start() -> None:
        await asyncio.gather(asyncio.to_thread(mock.start), asyncio.to_thread(gateway.start))

    asyncio.run(start())


async def run_loop(options: DemoOptions, console: Console, mock: MockBackendProcess, gateway: GatewayProcess) -> int:
    async with AsyncRollwayClient(gateway.url, gateway.admin_token, timeout=30) as client:
        backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": MOCK_MODEL}
        model = await client.put_model(ALIAS, [backend], version="demo-v1")
        console.print(f" [green]✓[/] model [bold]{ALIAS}[/] → {MOCK_MODEL} (vllm), version {model.version}")

        problems = math_problems(options.problems, options.seed)
        tasks = [{"input": p, "group_size": options.group_size, "mode": "train"} for p in problems]
        enqueued = await client.enqueue(tasks)
        ids = [r.rollout_id for r in enqueued]
        console.print(f" [green]✓[/] enqueued {len(problems)} problems x {options.group_size} = {len(ids)} rollouts")

        results: dict[str, Outcome] = {}
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task(f"{options.workers} runners working", total=len(ids))
            workers = [
                runner(f"runner-{i}", client, results, lambda: progress.advance(bar)) for i in range(options.workers)
            ]
            await asyncio.gather(*workers)
        waited = await client.wait_for(ids, timeout=30)
        rollouts = sorted(waited.finished, key=lambda r: ids.index(r.rollout_id))
        console.print(render(console, outcome_table(rollouts, results)))

        stats = await client.stats()
        rewards = [o.reward for o in results.values() if o.reward is not None]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        calls = sum(o.calls for o in results.values())
        console.print(
            f" mean reward [bold]{mean:.2f}[/] ({sum(1 for r in rewards if r == 1.0)}/{len(ids)} correct); "
            f"{calls} LLM calls and {len(rewards)} rewards stored as {stats.total_spans} spans "
            f"({stats.input_tokens} prompt + {stats.output_tokens} output tokens)"
        )
        errors = [o.error for o in results.values() if o.error]
        for error in errors[:3]:
            console.print(f" [red]agent error:[/] {error}", highlight=False)

        written = await write_triplets(client, ids, options.out, console)
    return 1 if waited.pending or errors or written == 0 else 0


def outcome_table(rollouts: list[Rollout], results: dict[str, Outcome]) -> FitTable:
    table = FitTable(
        ("rollout", "id"),
        ("group", "id"),
        ("#", "name"),
        ("task", "text"),
        ("status", "name"),
        ("calls", "name"),
        ("answer", "name"),
        ("reward", "name"),
    )
    for r in rollouts:
        outcome = results.get(r.rollout_id, Outcome(None, None, 0))
        style = STATUS_STYLE.get(r.status, "")
        reward = "—" if outcome.reward is None else f"{outcome.reward:g}"
        table.add_row(
            r.rollout_id,
            r.group_id or "",
            str(r.group_index),
            escape(r.input.get("expression", "")) if isinstance(r.input, dict) else "",
            f"[{style}]{r.status}[/]",
            str(outcome.calls),
            "" if outcome.answer is None else str(outcome.answer),
            f"[green]{reward}[/]" if outcome.reward == 1.0 else reward,
        )
    return table


async def write_triplets(client: AsyncRollwayClient, rollout_ids: list[str], out: Path, console: Console) -> int:
    """Export the triplets of this run's rollouts (the database may hold earlier runs) to ``out``."""
    buffer, count = io.StringIO(), 0
    for start in range(0, len(rollout_ids), EXPORT_IDS_PER_CALL):
        chunk = rollout_ids[start : start + EXPORT_IDS_PER_CALL]
        count += await export_triplets(client, buffer, None, rollout_id=chunk)
    await asyncio.to_thread(out.write_text, buffer.getvalue(), encoding="utf-8")
    console.print(f" [green]✓[/] {count} triplets (token ids, logprobs, rewards) → [bold]{out}[/]")
    return count


def run_demo(options: DemoOptions) -> int:
    _async_openai()  # the demo extra is installed, or one line says how to install it
    console = Console()
    started = time.monotonic()
    console.print("[bold]Rollway demo[/]: the RL loop on loopback — mock backend, gateway, runners, rewards, triplets")
    with contextlib.ExitStack() as stack:
        if options.db is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollway-demo-")))
            db = folder / "demo.db"
        else:
            db = options.db.resolve()
        mock = MockBackendProcess(models=[MOCK_MODEL])
        gateway = GatewayProcess(f"sqlite:///{db}", admin_token=secrets.token_urlsafe(24))
        stack.callback(mock.stop)
        stack.callback(gateway.stop)
        try:
            with console.status("starting the mock backend and the gateway…"):
                _start_both(mock, gateway)
        except RuntimeError as exc:
            console.print(f"[red]rollway demo:[/] {escape(str(exc))}", highlight=False)
            return 1
        console.print(f" [green]✓[/] mock backend (vLLM-like) at {mock.base_url}")
        kept = "a temporary file, deleted at the end: --db FILE keeps it" if options.db is None else str(db)
        console.print(f" [green]✓[/] gateway at {gateway.url} (SQLite: {kept})")
        try:
            status = asyncio.run(run_loop(options, console, mock, gateway))
        except RollwayError as exc:
            console.print(f"[red]rollway demo:[/] {escape(str(exc))}", highlight=False)
            console.print("\n".join(list(gateway.output)[-20:]), highlight=False, markup=False)
            return 1
    console.print(f" done in {time.monotonic() - started:.1f} s")
    if options.db is not None:
        console.print(f" browse it: rollway serve --db {db}, then http://127.0.0.1:8080/ui")
    return status
