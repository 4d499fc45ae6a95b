"""A runner process for the full-loop test: claims rollouts from the admin API, runs a toy math agent through
the claim's ``base_url`` with the official ``openai`` SDK (two chat calls), reports a reward and the outcome.

    python tests/support/loop_runner.py URL TOKEN WORKER_ID
"""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

import httpx
from openai import AsyncOpenAI


async def run_agent(claim: dict[str, Any], admin: httpx.AsyncClient) -> None:
    rollout_id = claim["rollout"]["rollout_id"]
    question = claim["rollout"]["input"]["question"]
    async with AsyncOpenAI(base_url=claim["base_url"], api_key=claim["api_key"], max_retries=0) as llm:
        first = await llm.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": question}], max_tokens=16
        )
        answer = first.choices[0].message.content or ""
        check = await llm.chat.completions.create(
            model="policy",
            messages=[
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Are you sure? Reply with the final answer."},
            ],
            max_tokens=16,
        )
    final = check.choices[0].message.content or answer
    numbers = re.findall(r"-?\d+", final)
    reward = 1.0 if numbers and int(numbers[-1]) == claim["rollout"]["input"]["answer"] else 0.0
    (await admin.post(f"/admin/v1/rollouts/{rollout_id}/rewards", json={"value": reward})).raise_for_status()
    patch = {"status": "succeeded", "metadata": {"final": final}}
    (await admin.patch(f"/admin/v1/rollouts/{rollout_id}/attempts/latest", json=patch)).raise_for_status()


async def main(url: str, token: str, worker_id: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as admin:
        while True:
            response = await admin.post(
                "/admin/v1/claims", json={"worker_id": worker_id, "limit": 2, "wait_seconds": 1}
            )
            response.raise_for_status()
            claims = response.json()["claims"]
            if not claims:
                return  # the queue stayed empty for a whole long-poll: the batch is done
            await asyncio.gather(*(run_agent(c, admin) for c in claims))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
