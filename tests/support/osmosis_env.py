"""A Python 3.12 virtual environment with ``osmosis-ai[server]==0.3.8`` (it needs Python >= 3.12, and Rollway's
suite runs on 3.11), cached under ``~/.cache/rollway`` between runs. ``tests/support/osmosis_scripts`` run in it.

Without it the suites that need it skip with one line, unless ``ROLLWAY_REQUIRE_OSMOSIS=1`` (CI): then the first
test that needs it builds it (about 150 MB from the package index, under a minute); see ``support.py312_env``."""

from __future__ import annotations

import os
from pathlib import Path

from support.py312_env import Py312Env, python312, script_env

__all__ = ["OSMOSIS_VERSION", "SCRIPTS", "osmosis_python", "python312", "require_osmosis", "script_env"]

OSMOSIS_VERSION = "0.3.8"
CACHE = Path(os.environ.get("ROLLWAY_OSMOSIS_CACHE", Path.home() / ".cache" / "rollway"))
SCRIPTS = Path(__file__).resolve().parent / "osmosis_scripts"
ENV = Py312Env(
    suite="Osmosis 0.3 suite",
    package=f"osmosis-ai=={OSMOSIS_VERSION}",
    requirements=(f"osmosis-ai[server]=={OSMOSIS_VERSION}", "openai>=2"),
    check="import osmosis_ai.rollout, osmosis_ai.rollout.server.app, openai",
    require_var="ROLLWAY_REQUIRE_OSMOSIS",
    venv=CACHE / f"osmosis-{OSMOSIS_VERSION}-venv",
)


def require_osmosis() -> None:
    """Called where a test module is imported: skips the whole module (one line) when the environment is not
    built, unless ``ROLLWAY_REQUIRE_OSMOSIS=1``, when its tests build it (``osmosis_python``)."""
    ENV.require()


def osmosis_python() -> str:
    """The environment's interpreter (built on first use, under a file lock)."""
    return ENV.python()
