"""An Osmosis 0.3 RolloutServer made with the SDK (``osmosis-ai[server]==0.3.8``), as a user writes one: a
workflow that makes one chat call through the rollout's chat URL and key, and a grader. Run in the Osmosis
environment (``support.osmosis_env``)::

    python rollout_server.py PORT API_KEY

What a task asks for, in its metadata (the workflow and the grader read it):

- ``reward``: the grader's reward (else 1.0 when the answer is not empty);
- ``behaviour``: ``fail`` (the workflow raises), ``remove`` (the grader drops the sample), ``stream`` (the call
  streams), ``hang`` (the workflow waits for a cancel, writing ``started-<id>`` into ``$MARKS`` first), ``go``
  (it writes ``started-<id>``, then makes its call once the test writes ``go-<id>``).

``$RESULT_WAIT`` sets the server's long-poll wait (``result_wait_timeout_sec``, 30 s by default).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
from openai import AsyncOpenAI
from osmosis_ai.rollout import AgentWorkflow, Grader, LocalBackend, get_rollout_context
from osmosis_ai.rollout.context import AgentWorkflowContext, GraderContext
from osmosis_ai.rollout.server.app import create_rollout_server

MARKS = Path(os.environ.get("MARKS", "."))


def wait_for_file(path: Path) -> None:
    """Until the test writes ``path`` (from another process: there is no event to await)."""
    while not path.exists():
        time.sleep(0.05)


class OneCall(AgentWorkflow):  # type: ignore[misc]  # the SDK is untyped here (not installed beside mypy)
    async def run(self, ctx: AgentWorkflowContext[Any]) -> list[dict[str, Any]]:
        rollout = get_rollout_context()
        assert rollout is not None
        behaviour = (ctx.metadata or {}).get("behaviour")
        if behaviour == "fail":
            raise RuntimeError("the agent failed on purpose")
        if behaviour == "hang":
            (MARKS / f"started-{rollout.rollout_id}").write_text("")
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                (MARKS / f"cancelled-{rollout.rollout_id}").write_text("")
                raise
        if behaviour == "go":
            (MARKS / f"started-{rollout.rollout_id}").write_text("")
            go = MARKS / f"go-{rollout.rollout_id}"
            await asyncio.to_thread(wait_for_file, go)
        llm = AsyncOpenAI(base_url=rollout.chat_completions_url, api_key=rollout.api_key, max_retries=0)
        model = (ctx.metadata or {}).get("model", "policy")
        if behaviour == "stream":
            stream = await llm.chat.completions.create(
                model=model,
                messages=ctx.prompt,
                max_tokens=12,
                stream=True,
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            answer = await llm.chat.completions.create(model=model, messages=ctx.prompt, max_tokens=12)
            text = answer.choices[0].message.content or ""
        await llm.close()
        return [*ctx.prompt, {"role": "assistant", "content": text}]


class FromMetadata(Grader):  # type: ignore[misc]  # as above
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        metadata = ctx.metadata or {}
        if metadata.get("behaviour") == "remove":
            ctx.sample.remove_sample = True
            return
        said = ctx.sample.messages[-1].get("content") if ctx.sample.messages else ""
        ctx.set_reward(float(metadata.get("reward", 1.0 if said else 0.0)))


if __name__ == "__main__":
    port, key = int(sys.argv[1]), sys.argv[2]
    wait = float(os.environ.get("RESULT_WAIT", "30"))
    backend = LocalBackend(workflow=OneCall, grader=FromMetadata)
    app = create_rollout_server(backend=backend, api_key=key, result_wait_timeout_sec=wait)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
