"""Training through Rollway, as a user runs it: ``examples/grpo/train.py`` (plain PyTorch and transformers, on
Rollway's public Python client) trains the tiny model in front of a real vLLM 0.32 started with
``VLLM_SERVER_DEV_MODE=1``, behind ``rollway serve`` on SQLite, and updates the engine's weights in place through
Rollway's weight-update operation at every step.

The trainer runs in the vLLM environment (it has torch and transformers), with Rollway installed there as a
trainer installs its client: ``pip install --no-deps --target``. What must hold:

- the reward rises: the mean of the last five steps exceeds that of the first five by ``REWARD_MARGIN``;
- every span's version is the step that produced it (its rollout's ``metadata.step``), and every step's update is
  recorded as committed;
- vLLM's recorded logprobs agree with the trainer's recomputation under the same weights within
  ``LOGPROB_MAX`` (seen here in float32: max 2.6e-4).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollway.process import GatewayProcess
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

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
SEED = 0
REWARD_MARGIN = 0.3
LOGPROB_MEAN = 1e-4
LOGPROB_MAX = 5e-3
TRAIN_TIMEOUT = 900

pytestmark = [pytest.mark.real_component, pytest.mark.timeout(TRAIN_TIMEOUT + 400)]


def test_grpo_through_rollway_trains_the_model_with_its_weights_updated_in_place(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model(), model)  # the trainer overwrites these weights at every step
    site = client_install(tmp_path / "client")
    out = tmp_path / "run"
    with (
        training_engine(model, tmp_path) as engine,
        GatewayProcess(f"sqlite:///{tmp_path / 'gateway.db'}") as gateway,
        httpx.Client(base_url=f"{gateway.url}/admin/v1", timeout=60) as admin,
    ):
        backend = {"backend_id": "vllm", "base_url": f"{engine.url}/v1", "kind": "vllm", "model": CHAT_MODEL}
        admin.put("/models/policy", json={"backends": [backend], "version": "step-0"}).raise_for_status()
        command = [str(python()), str(ROOT / "examples" / "grpo" / "train.py"), "--gateway", gateway.url]
        command += ["--model-dir", str(model), "--steps", str(STEPS), "--seed", str(SEED), "--out", str(out)]
        run = subprocess.run(
            command,
            env=engine_env() | {"PYTHONPATH": str(site)},
            capture_output=True,
            text=True,
            timeout=TRAIN_TIMEOUT,
        )
        sys.stdout.write(run.stdout[-6000:])
        assert run.returncode == 0, run.stderr[-6000:]

        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(STEPS))
        first = statistics.fmean(r["reward_mean"] for r in rows[:5])
        last = statistics.fmean(r["reward_mean"] for r in rows[-5:])
        assert last > first + REWARD_MARGIN, (first, last)
        assert max(r["logprob_mean_abs_diff"] for r in rows) < LOGPROB_MEAN, rows
        assert max(r["logprob_max_abs_diff"] for r in rows) < LOGPROB_MAX, rows
        assert (out / "reward_curve.svg").read_text().startswith("<svg")

        # Every span was made by the version of its step, as the store recorded it (not as the trainer says).
        rollouts = admin.get("/rollouts", params={"limit": 1000}).json()["items"]
        assert len(rollouts) == STEPS * 4 * 8
        versions: dict[int, set[str]] = {}
        for rollout in rollouts:
            spans = admin.get(f"/rollouts/{rollout['rollout_id']}/spans").json()["items"]
            calls = [s for s in spans if "rollway.model_version" in s["attributes"]]
            assert len(calls) == 1, spans
            step = rollout["metadata"]["step"]
            versions.setdefault(step, set()).add(calls[0]["attributes"]["rollway.model_version"])
        assert versions == {step: {f"step-{step}"} for step in range(STEPS)}
        updates = admin.get("/models/policy/updates", params={"limit": 100}).json()["items"]
        assert [(u["to_version"], u["state"]) for u in reversed(updates)] == [
            (f"step-{step + 1}", "committed") for step in range(STEPS)
        ]
        assert all(u["engine_versions"] == {"vllm": u["to_version"]} for u in updates)
        assert admin.get("/models/policy").json()["version"] == f"step-{STEPS}"
    weight_info = [r for r in rows if r["update_held_seconds"] is not None]
    assert len(weight_info) == STEPS
