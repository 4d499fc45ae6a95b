"""TRL through Rollway, as a TRL user runs it: ``examples/trl/train_trl.py`` trains the tiny model with TRL's
``GRPOTrainer``, whose ``rollout_func`` runs the step's generations as agents through Rollway (claims, chat calls
through the claim's URL and key, the reward and the end in one request), in front of a real vLLM 0.32 in dev mode,
and updates the engine's weights in place through Rollway at every step.

The trainer runs in the vLLM environment (torch, transformers) with TRL beside it (``support.trl_env``) and
Rollway's client installed as a trainer installs it. What must hold:

- TRL learns from the rewards the agents reported to Rollway: TRL's logged reward of each step is the mean of the
  step's rewards as Rollway exported them, and the mean of the last five steps exceeds that of the first five by
  ``REWARD_MARGIN``;
- every span's version is the step that produced it, and each step after the first began with a committed update;
- vLLM's recorded logprobs agree with the trainer's recomputation under the weights being trained, within
  ``LOGPROB_MEAN`` on average per step and ``LOGPROB_MAX`` for any one token (both in float32: the example turns off
  TRL's default bf16 autocast, under which every logprob moved by ~1e-2 from the engine's).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollway.process import GatewayProcess
from support.trl_env import require_trl, trl_site
from support.vllm_env import (
    CHAT_MODEL,
    client_install,
    engine_env,
    python,
    require_vllm,
    tiny_model,
    training_engine,
)

require_vllm()
require_trl()

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
PROMPTS, GROUP = 4, 8
SEED = 0
REWARD_MARGIN = 0.2  # seen here: 0.60 over the first five steps of 20, 1.00 over the last five
LOGPROB_MEAN = 1e-4  # seen here: 4.8e-7
LOGPROB_MAX = 5e-3  # seen here: 2.6e-6
TRAIN_TIMEOUT = 600

pytestmark = [pytest.mark.real_component, pytest.mark.slow, pytest.mark.timeout(TRAIN_TIMEOUT + 600)]


def test_trl_grpo_trains_on_agents_run_through_rollway_with_weights_updated_in_place(tmp_path: Path) -> None:
    site = trl_site()
    model = tmp_path / "model"
    shutil.copytree(tiny_model(), model)  # the trainer overwrites these weights at every step
    client = client_install(tmp_path / "client")
    out = tmp_path / "run"
    with (
        training_engine(model, tmp_path) as engine,
        GatewayProcess(f"sqlite:///{tmp_path / 'gateway.db'}") as gateway,
        httpx.Client(base_url=f"{gateway.url}/admin/v1", timeout=60) as admin,
    ):
        backend = {"backend_id": "vllm", "base_url": f"{engine.url}/v1", "kind": "vllm", "model": CHAT_MODEL}
        admin.put("/models/policy", json={"backends": [backend], "version": "step-0"}).raise_for_status()
        train = [str(python()), str(ROOT / "examples" / "trl" / "train_trl.py"), "--gateway", gateway.url]
        train += ["--model-dir", str(model), "--steps", str(STEPS), "--seed", str(SEED), "--out", str(out)]
        train += ["--prompts", str(PROMPTS), "--group-size", str(GROUP)]
        run = subprocess.run(
            train,
            env=engine_env() | {"PYTHONPATH": f"{client}:{site}"},
            capture_output=True,
            text=True,
            timeout=TRAIN_TIMEOUT,
        )
        sys.stdout.write(run.stdout[-6000:])
        assert run.returncode == 0, run.stderr[-6000:]

        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r["version"], r["samples"]) for r in rows] == [
            (step, f"step-{step}", PROMPTS * GROUP) for step in range(STEPS)
        ]
        assert all(math.isclose(r["trl_reward"], r["reward_mean"], abs_tol=1e-6) for r in rows), rows
        first = statistics.fmean(r["reward_mean"] for r in rows[:5])
        last = statistics.fmean(r["reward_mean"] for r in rows[-5:])
        assert last > first + REWARD_MARGIN, (first, last)
        assert max(r["logprob_mean_abs_diff"] for r in rows) < LOGPROB_MEAN, rows
        assert max(r["logprob_max_abs_diff"] for r in rows) < LOGPROB_MAX, rows

        # What Rollway recorded: each rollout's one call under its step's version, its reward the agent's.
        rollouts = admin.get("/rollouts", params={"limit": 1000}).json()["items"]
        assert len(rollouts) == STEPS * PROMPTS * GROUP
        versions: dict[int, set[str]] = {}
        for rollout in rollouts:
            spans = admin.get(f"/rollouts/{rollout['rollout_id']}/spans").json()["items"]
            calls = [s for s in spans if "rollway.model_version" in s["attributes"]]
            assert len(calls) == 1, spans
            assert rollout["status"] == "succeeded" and rollout["mode"] == "train"
            versions.setdefault(rollout["metadata"]["step"], set()).add(calls[0]["attributes"]["rollway.model_version"])
        assert versions == {step: {f"step-{step}"} for step in range(STEPS)}
        updates = admin.get("/models/policy/updates", params={"limit": 100}).json()["items"]
        assert [(u["to_version"], u["state"]) for u in reversed(updates)] == [
            (f"step-{step}", "committed") for step in range(1, STEPS)
        ]
        assert admin.get("/models/policy").json()["version"] == f"step-{STEPS - 1}"
