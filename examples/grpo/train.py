"""GRPO through Rollway, in plain PyTorch and transformers, on Rollway's public Python API only.

Each step:

1. enqueue ``--prompts`` tasks, each a GRPO group of ``--group-size`` rollouts (``AsyncRollwayClient.enqueue``);
2. run the agents: claim the step's rollouts in batches, and for each one make a chat call through the claim's
   URL and key (one shared HTTP client for all of them), score it and report the reward and the end;
3. pull the step's samples (``iter_triplets`` from the last step's cursor): the prompt's token ids, the
   response's token ids and the engine's logprobs of them, the reward and the version that produced them;
4. check that the engine's logprobs agree with the trainer's under the same weights (a stale sample would not);
5. take a GRPO step (group-normalised advantages, the PPO clipped ratio against the engine's logprobs);
6. save the weights into the engine's model folder and update them in place (``update_weights``: Rollway holds
   new calls, drains, has the engine reload, gives the alias the next version and resumes).

The reward is one the tiny test model can learn: the share of the answer's tokens that start a word. Every step
writes a line of metrics (``--out``/metrics.jsonl) and the reward curve (``--out``/reward_curve.svg).

On this repository's tiny model, with a vLLM started with ``VLLM_SERVER_DEV_MODE=1`` and ``rollway serve`` in
front of it (examples/grpo/README.md)::

    python examples/grpo/train.py --gateway http://127.0.0.1:8080 --alias policy --model-dir /path/to/model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollway import AsyncRollwayClient

WORDS = "the a model agent reward token policy value step tool answer question train data loop first last".split()  # noqa: SIM905


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080", help="Rollway's address")
    parser.add_argument("--token", default=None, help="Rollway's admin token, if it has one")
    parser.add_argument("--alias", default="policy", help="the model alias the agents call")
    parser.add_argument("--model-dir", type=Path, required=True, help="the folder the engine serves the model from")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help="tasks per step (each a GRPO group)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--epochs", type=int, default=2, help="optimiser passes over each step's samples")
    parser.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the ratio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("grpo-run"), help="where metrics and the curve go")
    return parser.parse_args()


def word_starts(tokens: list[str]) -> float:
    """The reward: the share of tokens that start a word (byte-level BPE marks a leading space with 'Ġ')."""
    return sum(token.startswith("Ġ") for token in tokens) / len(tokens) if tokens else 0.0


# -- the agents ------------------------------------------------------------------------------------------------


async def run_agents(
    client: AsyncRollwayClient, http: httpx.AsyncClient, count: int, step: int, args: argparse.Namespace, tokenizer: Any
) -> None:
    """Claim the step's ``count`` rollouts and run an agent on each, all at once."""

    async def agent(claim: Any) -> None:
        rollout, attempt = claim.rollout, claim.attempt
        # openai 3 annotates its http_client with its own httpx fork's type; an httpx.AsyncClient is what it uses.
        llm = AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, http_client=http, max_retries=3)  # type: ignore[arg-type]
        answer = await llm.chat.completions.create(
            model=args.alias,
            messages=rollout.input["messages"],
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=rollout.input["seed"] + (rollout.group_index or 0),  # each member of a group samples its own
            extra_body={"return_token_ids": True},  # vLLM's: the answer's token ids, to score them
        )
        ids = (answer.choices[0].model_extra or {}).get("token_ids") or []
        reward = word_starts(tokenizer.convert_ids_to_tokens(ids))
        await client.update_attempt(rollout.rollout_id, attempt.attempt_id, status="succeeded", reward=reward)

    running: list[asyncio.Task[None]] = []
    while len(running) < count:
        claims = await client.claim(f"runner-{step}", limit=count - len(running), wait_seconds=10)
        running += [asyncio.create_task(agent(claim)) for claim in claims]
    await asyncio.gather(*running)


def tasks(step: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(f"{args.seed}:{step}")
    out = []
    for prompt in range(args.prompts):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
        out.append(
            {
                "input": {"messages": [{"role": "user", "content": words}], "seed": rng.randrange(2**31)},
                "group_size": args.group_size,
                "mode": "train",
                "metadata": {"step": step, "prompt": prompt},
            }
        )
    return out


# -- the trainer -----------------------------------------------------------------------------------------------


def response_logprobs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The model's log-probability of each response token after the prompt and the tokens before it."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


def grpo_step(model: Any, optimizer: Any, samples: list[Any], args: argparse.Namespace) -> dict[str, float]:
    """One GRPO update on the step's samples; the agreement of the engine's logprobs with the trainer's first."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for sample in samples:
        by_group[sample.group_id].append(sample.reward)
    advantages = []
    for sample in samples:
        rewards = by_group[sample.group_id]
        spread = statistics.pstdev(rewards)
        advantages.append((sample.reward - statistics.fmean(rewards)) / (spread + 1e-4))
    differences = []
    with torch.no_grad():
        for sample in samples:
            mine = response_logprobs(model, sample.prompt_token_ids, sample.response_token_ids)
            differences += (mine - torch.tensor(sample.response_logprobs)).abs().tolist()
    losses = []
    for _ in range(args.epochs):
        optimizer.zero_grad()
        total = 0.0
        for sample, advantage in zip(samples, advantages, strict=True):
            new = response_logprobs(model, sample.prompt_token_ids, sample.response_token_ids)
            ratio = torch.exp(new - torch.tensor(sample.response_logprobs))
            clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
            loss = -torch.min(ratio * advantage, clipped * advantage).mean() / len(samples)
            loss.backward()
            total += float(loss)
        optimizer.step()
        losses.append(total)
    return {
        "logprob_mean_abs_diff": statistics.fmean(differences),
        "logprob_max_abs_diff": max(differences),
        "logprob_tokens": len(differences),
        "loss": losses[-1],  # the last pass: the first is 0 at a ratio of 1 (advantages sum to 0 per group)
    }


def curve(path: Path, rewards: list[float]) -> None:
    """The reward curve as a small SVG (no plotting library needed)."""
    width, height, pad = 480, 240, 32
    low, high = min([*rewards, 0.0]), max([*rewards, 1.0])
    span = (high - low) or 1.0
    step = (width - 2 * pad) / max(len(rewards) - 1, 1)
    points = " ".join(
        f"{pad + i * step:.1f},{height - pad - (r - low) / span * (height - 2 * pad):.1f}"
        for i, r in enumerate(rewards)
    )
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><rect width="100%" height="100%" fill="white"/>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#888"/>'
        f'<text x="{pad}" y="{pad - 10}">mean reward per step ({low:.2f} to {high:.2f})</text>'
        f'<text x="{width - pad}" y="{height - 10}" text-anchor="end">step {len(rewards) - 1}</text>'
        f'<polyline fill="none" stroke="#2563eb" stroke-width="2" points="{points}"/></svg>\n'
    )


async def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    args.out.mkdir(parents=True, exist_ok=True)
    history: list[dict[str, Any]] = []
    count = args.prompts * args.group_size
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with (
        AsyncRollwayClient(args.gateway, args.token) as client,
        httpx.AsyncClient(limits=limits, timeout=120) as http,  # every agent's calls share one pool
    ):
        version = (await client.get_model(args.alias)).version
        start = client.iter_triplets(since="now")  # samples of earlier runs are not this run's
        async for _ in start:
            pass
        cursor = start.next_cursor
        for step in range(args.steps):
            began = time.monotonic()
            await client.enqueue(tasks(step, args))
            await run_agents(client, http, count, step, args, tokenizer)
            rolled = time.monotonic() - began
            records = client.iter_triplets(since=cursor)
            samples = [t async for t in records if t.response_token_ids and t.reward is not None]
            cursor = records.next_cursor
            if len(samples) != count:
                raise SystemExit(f"step {step}: {len(samples)} samples, expected {count}")
            stale = {str(t.model_version) for t in samples} - {version}
            if stale:
                raise SystemExit(f"step {step}: samples of version {sorted(stale)}, expected {version}")
            stats = grpo_step(model, optimizer, samples, args)
            model.save_pretrained(args.model_dir, safe_serialization=True)
            update_began = time.monotonic()
            update = await client.update_weights(args.alias, f"step-{step + 1}", note=f"grpo step {step}")
            row = {
                "step": step,
                "version": version,
                "reward_mean": statistics.fmean(float(t.reward or 0.0) for t in samples),
                "rollout_seconds": rolled,
                "update_seconds": time.monotonic() - update_began,
                "update_held_seconds": update.held_seconds,
                **stats,
            }
            history.append(row)
            print(json.dumps(row), flush=True)
            version = update.to_version
    with (args.out / "metrics.jsonl").open("w") as out:
        out.writelines(json.dumps(row) + "\n" for row in history)
    curve(args.out / "reward_curve.svg", [row["reward_mean"] for row in history])
    return history


def main() -> None:
    args = options()
    history = asyncio.run(train(args))
    first = statistics.fmean(r["reward_mean"] for r in history[:5])
    last = statistics.fmean(r["reward_mean"] for r in history[-5:])
    worst = max(r["logprob_max_abs_diff"] for r in history)
    print(f"reward {first:.3f} (first five steps) → {last:.3f} (last five); logprob max |Δ| {worst:.2e}")
    if not math.isfinite(last):
        raise SystemExit("the reward is not finite")


if __name__ == "__main__":
    main()
