"""A small remote agent server speaking the Osmosis remote-rollout protocol, for Rollway (which plays
TrainGate). It answers ``POST /v1/rollout/init`` with 202 and a calculator tool, then runs a toy math agent in
the background with the official ``openai`` SDK against ``{server_url}/v1`` — every call carries
``rollout_id`` in its body — and reports with ``POST {server_url}/v1/rollout/completed``.

    python examples/remote_agent_server.py --port 9000
    rollway agents put math http://127.0.0.1:9000 --max-concurrent 8 --param model=policy

The agent asks the task's question, then asks it to check its work; the reward is 1.0 when the last answer
equals ``metadata.answer`` (0.0 otherwise, ``null`` when the task has no answer). The metrics it reports are
Osmosis's (``num_llm_calls``, ``prompt_tokens``, ``response_tokens`` — counted from the ``token_ids`` and
``prompt_token_ids`` Rollway returns — and latencies).

Inits are idempotent: a repeated ``idempotency_key`` gets the same answer and starts nothing. For tests, a
task's ``metadata.fault`` injects faults once per rollout: ``init_500_once`` (the first init answers 500),
``no_callback_once`` (the first run never reports). ``--chat-auth none`` leaves the rollout key off the chat
calls (they are then routed by the body ``rollout_id`` alone); the completion callback always sends it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

log = logging.getLogger("remote_agent_server")
ANSWER_RE = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 2 + 3"}},
            "required": ["expression"],
        },
    },
}


class RolloutRequest(BaseModel):
    """Osmosis ``RolloutRequest`` (what TrainGate — here Rollway — posts to ``/v1/rollout/init``)."""

    rollout_id: str = Field(min_length=1, max_length=256)
    server_url: str
    messages: list[dict[str, Any]]
    completion_params: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None
    idempotency_key: str | None = None
    max_turns: int = 10


@dataclass
class AgentState:
    api_key: str | None
    chat_auth: str
    inits: dict[str, dict[str, Any]] = field(default_factory=dict)  # idempotency key → answer
    faulted: set[tuple[str, str]] = field(default_factory=set)  # (rollout id, fault) already injected
    runs: set[asyncio.Task[None]] = field(default_factory=set)
    init_requests: int = 0
    completions: int = 0

    def fault_once(self, request: RolloutRequest, fault: str) -> bool:
        """True the first time ``fault`` is asked for this rollout (in ``metadata.fault``)."""
        if request.metadata.get("fault") != fault or (request.rollout_id, fault) in self.faulted:
            return False
        self.faulted.add((request.rollout_id, fault))
        return True


def parse_answer(text: str) -> int | None:
    match = ANSWER_RE.search(text)
    return int(match.group(1)) if match else None


async def run_agent(request: RolloutRequest, state: AgentState, report: bool) -> None:
    """Ask, ask again to check, and report the outcome with the reward."""
    started = time.monotonic()
    metrics: dict[str, Any] = {"num_llm_calls": 0, "prompt_tokens": 0, "response_tokens": 0, "llm_latency_ms": 0.0}
    messages: list[Any] = list(request.messages)
    params = dict(request.completion_params)
    model = params.pop("model", "default")
    question = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    chat_key = request.api_key if state.chat_auth == "key" and request.api_key else "unused"
    outcome: dict[str, Any]
    try:
        async with AsyncOpenAI(base_url=f"{request.server_url}/v1", api_key=chat_key, max_retries=2) as llm:
            answer = None
            for turn in range(2):
                if turn == 1:
                    messages.append({"role": "user", "content": f"Check your work: {question}"})
                began = time.monotonic()
                completion = await llm.chat.completions.create(
                    model=model, messages=messages, extra_body={"rollout_id": request.rollout_id}, **params
                )
                metrics["llm_latency_ms"] += (time.monotonic() - began) * 1000
                extra = completion.model_extra or {}
                metrics["num_llm_calls"] += 1
                metrics["prompt_tokens"] += len(extra.get("prompt_token_ids") or [])
                metrics["response_tokens"] += len(extra.get("token_ids") or [])
                text = completion.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                answer = parse_answer(text)
        expected = request.metadata.get("answer")
        reward = None if expected is None else (1.0 if answer == expected else 0.0)
        outcome = {"status": "COMPLETED", "finish_reason": "stop", "reward": reward}
    except Exception as exc:  # the agent's failure is the rollout's ERROR, never the server's
        outcome = {"status": "ERROR", "finish_reason": "error", "error_message": f"{type(exc).__name__}: {exc}"}
    metrics["total_latency_ms"] = (time.monotonic() - started) * 1000
    if not report:
        return
    body = {"rollout_id": request.rollout_id, "final_messages": messages, "metrics": metrics, **outcome}
    headers = {"Authorization": f"Bearer {request.api_key}"} if request.api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        for attempt in range(4):
            try:
                answer_ = await client.post(f"{request.server_url}/v1/rollout/completed", json=body, headers=headers)
            except httpx.TransportError:
                answer_ = None
            if answer_ is not None and answer_.status_code < 500:
                if answer_.status_code == 200:
                    state.completions += 1
                else:
                    log.warning("completion of %s refused: %s", request.rollout_id, answer_.text)
                return
            await asyncio.sleep(0.2 * 2**attempt)


def create_app(api_key: str | None = None, chat_auth: str = "key") -> FastAPI:
    state = AgentState(api_key=api_key, chat_auth=chat_auth)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for task in list(state.runs):
            task.cancel()

    app = FastAPI(title="Osmosis remote agent example", lifespan=lifespan)
    app.state.agent = state

    @app.post("/v1/rollout/init", status_code=202)
    async def init(request: RolloutRequest, authorization: str | None = Header(default=None)) -> Any:
        state.init_requests += 1
        if state.api_key is not None and authorization != f"Bearer {state.api_key}":
            raise HTTPException(401, "bad or missing api key")
        key = request.idempotency_key or request.rollout_id
        if key in state.inits:  # a retried init: same answer, nothing new started
            return state.inits[key]
        if state.fault_once(request, "init_500_once"):
            return JSONResponse({"detail": "injected fault: init_500_once"}, status_code=500)
        report = not state.fault_once(request, "no_callback_once")
        answer = {"rollout_id": request.rollout_id, "tools": [CALCULATOR]}
        state.inits[key] = answer
        task = asyncio.create_task(run_agent(request, state, report))
        state.runs.add(task)
        task.add_done_callback(state.runs.discard)
        return answer

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "running": len(state.runs),
            "inits": state.init_requests,
            "completed": state.completions,
        }

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000, help="0: any free port")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on init")
    parser.add_argument(
        "--chat-auth", choices=["key", "none"], default="key", help="send the rollout key on chat calls"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(create_app(args.api_key, args.chat_auth), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
