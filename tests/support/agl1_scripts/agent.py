"""The agent an Agent-lightning 1.0.2 local controller spawns for a rollout (``config.local.agent_class`` =
``agent:Agent``, with this folder on ``PYTHONPATH``).

The controller runs ``sys.executable -c "...; sys.exit(_run_local_reconciler_worker('agent:Agent'))"``, which
imports this module, calls ``Agent().run()`` and exits 0 when it returns, 1 when it raises (``SystemExit`` goes
through, with its own code). The environment says where to go: ``AGL_OPENAI_BASE_URL`` (the rollout's proxy base,
``.../proxy/rollout/{rid}/attempt/0/mode/{train|val}/openai/v1``), ``AGL_EVENT_URL``
(``.../api/rollouts/{rid}/attempt/0/events``), ``AGL_KEY``, plus the rollout's ``config.local.env_map``: the trainer
script maps ``AGL_INPUT`` to the whole rollout input, JSON.

The input chooses the behaviour:

- ``prompt``: the user message (default ``"Say hello."``); ``max_tokens`` (default 16).
- ``behaviour``: ``go`` (one chat call, then a reward), ``two_calls`` (a second call that carries the first answer
  back, then a reward), ``stream`` (one ``stream=True`` call, accumulated, then a reward), ``fail`` (one call,
  then exit 3 with no reward).
- ``on_error``: ``fail`` (default: a failed chat call ends the agent with exit 1) or ``ignore`` (it prints the
  error and exits 0 without a reward; agl-server answers 400 to ``stream``, which a test may want to see as a
  succeeded rollout with no reward).
- ``note``: if set, a ``note`` event ``{"text": note}`` is posted before the reward (a type of event the server
  only passes through).

The reward is ``reward_of(answer)``: the fraction of the last answer's characters that are letters, rounded to six
places, so that a test can recompute it from the recorded response."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

EXIT_FAIL = 3


def reward_of(answer: str) -> float:
    """The reward for an answer: the fraction of its characters that are letters (0.0 for an empty one)."""
    return round(sum(ch.isalpha() for ch in answer) / len(answer), 6) if answer else 0.0


class Agent:
    """One rollout: chat calls through the rollout's proxy URL, then a reward event."""

    def __init__(self) -> None:
        self.input: dict[str, Any] = json.loads(os.environ.get("AGL_INPUT") or "{}")
        self.key = os.environ.get("AGL_KEY", "")
        self.event_url = os.environ["AGL_EVENT_URL"]
        # No retries: a 429 or 5xx from the server is the agent's outcome, for a test to see.
        base_url = os.environ["AGL_OPENAI_BASE_URL"]
        self.client = openai.OpenAI(base_url=base_url, api_key=self.key or "none", max_retries=0)

    def run(self) -> None:
        behaviour = self.input.get("behaviour") or "go"
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": self.input.get("prompt") or "Say hello."}
        ]
        try:
            if behaviour == "stream":
                answer = self._stream(messages)
            else:
                answer = self._chat(messages)
                if behaviour == "two_calls":
                    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
                    answer = self._chat(messages)
        except openai.APIError as exc:
            print(f"agent: chat call failed: {exc!r}", file=sys.stderr)
            if self.input.get("on_error") == "ignore":
                return
            raise
        print(f"agent: behaviour={behaviour} answer={answer!r}")
        if behaviour == "fail":
            raise SystemExit(EXIT_FAIL)
        if self.input.get("note"):
            self._post_event("note", {"text": self.input["note"]})
        self._post_event("reward", {"value": reward_of(answer)})

    def _chat(self, messages: list[ChatCompletionMessageParam]) -> str:
        answer = self.client.chat.completions.create(
            model="auto", messages=messages, max_tokens=int(self.input.get("max_tokens") or 16)
        )
        return answer.choices[0].message.content or ""

    def _stream(self, messages: list[ChatCompletionMessageParam]) -> str:
        chunks = self.client.chat.completions.create(
            model="auto", messages=messages, max_tokens=int(self.input.get("max_tokens") or 16), stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    def _post_event(self, event_type: str, data: dict[str, Any]) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        answer = httpx.post(self.event_url, json={"event_type": event_type, "data": data}, headers=headers, timeout=30)
        answer.raise_for_status()
