"""A Python 3.12 virtual environment with ``agentlightning==1.0.2`` (it needs Python >= 3.12, and Rollway's suite
runs on 3.11), cached under ``~/.cache/rollway`` between runs. ``tests/support/agl1_scripts`` run in it: the
agent class the local controller spawns and the trainer-side script driving the real ``AglRolloutManager``.

Without it the suites that need it skip with one line, unless ``ROLLWAY_REQUIRE_AGL1=1`` (CI): then the first
test that needs it builds it (about 60 MB from the package index, under a minute); see ``support.py312_env``.
The wheel imports ``numpy`` in ``agentlightning.verl.agl_rollout_manager`` without declaring it, so it is listed
here; ``openai`` is for the agent."""

from __future__ import annotations

import os
from pathlib import Path

from support.py312_env import Py312Env, script_env

__all__ = ["AGL1_VERSION", "SCRIPTS", "agl1_python", "require_agl1", "script_env"]

AGL1_VERSION = "1.0.2"
CACHE = Path(os.environ.get("ROLLWAY_AGL1_CACHE", Path.home() / ".cache" / "rollway"))
SCRIPTS = Path(__file__).resolve().parent / "agl1_scripts"
ENV = Py312Env(
    suite="Agent-lightning 1.0 suite",
    package=f"agentlightning=={AGL1_VERSION}",
    requirements=(f"agentlightning=={AGL1_VERSION}", "numpy", "openai>=2,<3"),
    check="import agentlightning.verl.agl_rollout_manager, agentlightning.server, openai",
    require_var="ROLLWAY_REQUIRE_AGL1",
    venv=CACHE / f"agentlightning-{AGL1_VERSION}-venv",
)


def require_agl1() -> None:
    """Called where a test module is imported: skips the whole module (one line) when the environment is not
    built, unless ``ROLLWAY_REQUIRE_AGL1=1``, when its tests build it (``agl1_python``)."""
    ENV.require()


def agl1_python() -> str:
    """The environment's interpreter (built on first use, under a file lock)."""
    return ENV.python()
