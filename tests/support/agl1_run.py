"""Running Agent-lightning 1.0.2's real clients against a server from a test: its local controller (``agl-controller
runner_type=local``, which spawns ``agl1_scripts/agent.py``'s ``Agent`` per rollout) and the trainer side
(``agl1_scripts/trainer.py``, the real ``AglRolloutManager``). Both run in the environment of ``support.agl1_env``
and talk to ``url`` (the AGL API base, where ``/api/rollouts`` and ``/proxy/rollout/...`` live) with ``key``.

    with Controller(url, key, tmp_path):
        result = run_trainer(url, key, model="M", endpoints=[backend_v1], inputs=[{"behaviour": "go"}])
    assert result["rollouts"][0]["rollout_state"] == "succeeded"

The controller polls ``GET /api/rollouts?state_in=queuing&state_in=running&limit=50`` every ``poll_interval``;
each agent process takes a few seconds to import ``openai`` before its first call, so a batch of five takes about
8 s end to end on this machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any

from support.agl1_env import SCRIPTS, agl1_python, script_env


class Controller:
    """``agl-controller runner_type=local`` as a subprocess; a context manager that stops it with SIGTERM (the
    controller then kills its live agents and PATCHes their rollouts failed) and SIGKILL if that takes too long.
    ``agent_url`` is ``agl_server.agent_url``, the base handed to agents when it differs from ``url``."""

    def __init__(
        self, url: str, key: str, workdir: Path, *, poll_interval: float = 0.3, agent_url: str | None = None
    ) -> None:
        bin_dir = Path(agl1_python()).parent
        self.workdir = workdir
        self.log_path = workdir / "agl-controller.log"
        self.command = [
            str(bin_dir / "agl-controller"),
            "runner_type=local",
            f"agl_server.url={url}",
            f"agl_server.key={key}",
            f"local_runner.poll_interval={poll_interval}",
            f"hydra.run.dir={workdir / 'agl-controller-hydra'}",
        ]
        if agent_url is not None:
            self.command.append(f"agl_server.agent_url={agent_url}")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Controller:
        # The agents inherit the controller's environment: PYTHONPATH is how they find ``agent:Agent``.
        env = script_env(PYTHONPATH=str(SCRIPTS))
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=env,
                cwd=str(self.workdir),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def stop(self, timeout: float = 15) -> int | None:
        """Stop it; its exit code (None if it was never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def run_trainer(
    url: str,
    key: str,
    *,
    model: str,
    endpoints: list[str],
    inputs: list[dict[str, Any]],
    n: int = 1,
    val: bool = False,
    hooks: bool = False,
    drain: bool = False,
    max_retries: int = 0,
    rollout_timeout: float = 120,
    timeout: float = 180,
) -> dict[str, Any]:
    """Run ``trainer.py`` once (one iteration's rollouts; a controller must be running) and return its JSON: see
    that script for the fields. ``hooks`` loads ``agl1_scripts/hooks.py``; ``drain`` adds the async trainer's
    resume, pause and drain. A failed run raises with its output."""
    command = [agl1_python(), str(SCRIPTS / "trainer.py"), "--url", url, "--key", key, "--model", model]
    command += [arg for endpoint in endpoints for arg in ("--endpoint", endpoint)]
    command += [arg for item in inputs for arg in ("--input", json.dumps(item))]
    command += ["--n", str(n), "--max-retries", str(max_retries), "--rollout-timeout", str(rollout_timeout)]
    if val:
        command.append("--val")
    if drain:
        command.append("--drain")
    if hooks:
        command += ["--hooks", str(SCRIPTS / "hooks.py")]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=script_env(), cwd=SCRIPTS)
    except subprocess.TimeoutExpired as exc:
        # The manager polls until every rollout is terminal and has no deadline of its own: no controller, or one
        # whose PATCHes do not land, ends here.
        raise AssertionError(f"trainer.py still running after {timeout} s:\n{exc.stderr!s}"[-6000:]) from None
    if proc.returncode != 0:
        raise AssertionError(f"trainer.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result
