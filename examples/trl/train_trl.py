"""TRL's ``GRPOTrainer`` with its generations made through Rollway, by agents, on Rollway's public client only.

TRL's ``rollout_func`` hook hands a step's prompts to a function that returns each completion's prompt ids,
completion ids and the logprobs they were sampled with. Here that function:

1. has the engine serve the trainer's current weights, once per optimiser step: ``save_pretrained`` into the
   engine's model folder, then ``update_weights`` (Rollway holds new calls, drains, has vLLM reload in place,
   bumps the version to ``step-N`` and resumes);
2. enqueues each prompt as a GRPO group (TRL hands a prompt over ``num_generations`` times in a row), mode
   ``train``, the step in the task's metadata;
3. runs one agent per claim, all at once on one HTTP pool: a chat call through the claim's URL and key, its reward
   scored from the answer's token ids, then the reward and the end in one request;
4. pulls the step's triplets (the engine's token ids and logprobs, and the agent's reward, as Rollway recorded
   them), checks that every one was made by this step's weights, and hands them to TRL in the prompts' order.

TRL's reward function reads the reward the agents reported (``rollway_reward``, a field TRL forwards from the
rollout function), so the reward lives where the agent computed it and Rollway's dashboard and exports show it.
The reward is the one ``examples/grpo/train.py`` uses: the share of answer tokens that start a word.

Each step also recomputes the engine's logprobs under the trainer's weights, as a check that the engine served
the weights being trained (``logprob_max_abs_diff`` in the metrics). Run it where torch, transformers and TRL
(with ``accelerate`` and ``datasets``) are installed, with Rollway's client beside them::

    python examples/trl/train_trl.py --gateway http://127.0.0.1:8080 --model-dir /path/to/model --steps 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
from pathlib import Path
from typing import Any

import httpx
import torch
from datasets import Dataset
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from rollway import AsyncRollwayClient, RollwayClient

WORDS = "the a model agent reward token policy value step tool answer question train data loop first last".split()  # noqa: SIM905


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080", help="Rollway's address")
    parser.add_argument("--token", default=os.environ.get("ROLLWAY_ADMIN_TOKEN"), help="the admin token, if set")
    parser.add_argument("--alias", default="policy", help="the model alias the agents call")
    parser.add_argument("--model-dir", type=Path, required=True, help="the folder the engine serves the model from")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (TRL's num_generations)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("trl-run"), help="where the metrics go")
    return parser.parse_args()


def word_starts(tokens: list[str]) -> float:
    """The reward: the share of tokens that start a word (byte-level BPE marks a leading space with 'Ġ')."""
    return sum(token.startswith("Ġ") for token in tokens) / len(tokens) if tokens else 0.0


def response_logprobs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The model's log-probability of each response token after the prompt and the tokens before it."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


class RollwayRollouts:
    """TRL's ``rollout_func``: the step's completions, made by agents through Rollway (the module docstring)."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any) -> None:
        self.args, self.tokenizer = args, tokenizer
        self.synced_step = 0  # the engine starts on the weights the trainer loaded
        self.version = f"step-{self.synced_step}"
        self.history: list[dict[str, Any]] = []

    def __call__(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        step = trainer.state.global_step
        if step != self.synced_step:
            trainer.model.save_pretrained(self.args.model_dir, safe_serialization=True)
            with RollwayClient(self.args.gateway, self.args.token) as admin:
                self.version = admin.update_weights(self.args.alias, f"step-{step}", note=f"trl step {step}").to_version
            self.synced_step = step
        samples = asyncio.run(self._rollouts(prompts, step))
        differences: list[float] = []
        with torch.no_grad():  # the engine served the weights being trained: its logprobs are the trainer's
            for t in samples:
                mine = response_logprobs(trainer.model, list(t.prompt_token_ids), list(t.response_token_ids))
                differences += (mine - torch.tensor(t.response_logprobs)).abs().tolist()
        row = {
            "step": step,
            "version": self.version,
            "samples": len(samples),
            "reward_mean": statistics.fmean(float(t.reward or 0.0) for t in samples),
            "logprob_mean_abs_diff": statistics.fmean(differences),
            "logprob_max_abs_diff": max(differences),
        }
        self.history.append(row)
        print(json.dumps(row), flush=True)
        return {
            "prompt_ids": [list(t.prompt_token_ids) for t in samples],
            "completion_ids": [list(t.response_token_ids) for t in samples],
            "logprobs": [list(t.response_logprobs) for t in samples],
            "rollway_reward": [float(t.reward) for t in samples],
        }

    async def _rollouts(self, prompts: list[Any], step: int) -> list[Any]:
        args = self.args
        groups = [list(run) for _, run in itertools.groupby(prompts, key=lambda p: json.dumps(p, sort_keys=True))]
        rng = random.Random(f"{args.seed}:{step}")
        tasks = [
            {
                "input": {"messages": group[0], "index": index, "seed": rng.randrange(2**31)},
                "group_size": len(group),
                "mode": "train",
                "metadata": {"step": step},
            }
            for index, group in enumerate(groups)
        ]
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with (
            AsyncRollwayClient(args.gateway, args.token) as client,
            httpx.AsyncClient(limits=limits, timeout=120) as http,  # every agent's calls share one pool
        ):
            rollouts = await client.enqueue(tasks)

            async def agent(claim: Any) -> None:
                rollout = claim.rollout
                # openai 3 annotates http_client with its own httpx fork's type; an httpx.AsyncClient is what it uses.
                llm = AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, http_client=http, max_retries=3)  # type: ignore[arg-type]
                answer = await llm.chat.completions.create(
                    model=args.alias,
                    messages=rollout.input["messages"],
                    max_tokens=args.max_tokens,
                    temperature=1.0,
                    seed=rollout.input["seed"] + (rollout.group_index or 0),  # each member samples its own
                    extra_body={"return_token_ids": True},  # vLLM's: the answer's token ids, to score them
                )
                ids = (answer.choices[0].model_extra or {}).get("token_ids") or []
                reward = word_starts(self.tokenizer.convert_ids_to_tokens(ids))
                await client.update_attempt(
                    rollout.rollout_id, claim.attempt.attempt_id, status="succeeded", reward=reward
                )

            running: list[asyncio.Task[None]] = []
            while len(running) < len(rollouts):  # a claim may hand over fewer than asked
                claims = await client.claim(
                    "trl", limit=len(rollouts) - len(running), wait_seconds=10, metadata={"step": step}
                )
                running += [asyncio.create_task(agent(claim)) for claim in claims]
            await asyncio.gather(*running)
            ids = [r.rollout_id for r in rollouts]
            samples = {t.rollout_id: t async for t in client.iter_triplets(rollout_id=ids)}
        if len(samples) != len(rollouts):
            raise SystemExit(f"step {step}: {len(samples)} samples of {len(rollouts)} rollouts")
        stale = {str(t.model_version) for t in samples.values()} - {self.version}
        if stale:
            raise SystemExit(f"step {step}: samples of version {sorted(stale)}, expected {self.version}")
        order = {r.rollout_id: (r.input["index"], r.group_index or 0) for r in rollouts}
        return sorted(samples.values(), key=lambda t: order[t.rollout_id])


def main() -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.x
    args = options()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    def rollway_reward(completions: list[Any], rollway_reward: list[float], **_: Any) -> list[float]:
        return rollway_reward  # what each agent reported to Rollway

    rng = random.Random(args.seed)
    prompts = [
        {"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))}]}
        for _ in range(args.steps * args.prompts)
    ]
    config = GRPOConfig(
        output_dir=str(args.out),
        use_cpu=True,
        bf16=False,  # the engine serves float32 here: the trainer's forward passes are float32 too (TRL's default
        # is bf16 autocast, which moves every logprob by ~1e-2 from the engine's)
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
    )
    rollouts = RollwayRollouts(args, tokenizer)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rollway_reward,
        args=config,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
        rollout_func=rollouts,
    )
    trainer.train()
    logged = [row for row in trainer.state.log_history if "reward" in row]
    for row, trl in zip(rollouts.history, logged, strict=True):
        row["trl_reward"], row["trl_loss"] = trl["reward"], trl.get("loss")
    with (args.out / "metrics.jsonl").open("w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rollouts.history)
    first = statistics.fmean(r["reward_mean"] for r in rollouts.history[:5])
    last = statistics.fmean(r["reward_mean"] for r in rollouts.history[-5:])
    print(f"reward {first:.3f} (first five steps) → {last:.3f} (last five)")


if __name__ == "__main__":
    main()
