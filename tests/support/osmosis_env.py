"""A Python 3.12 virtual environment with ``osmosis-ai[server]==0.3.8`` (it needs Python >= 3.12, and Rollway's
suite runs on 3.11), cached under ``~/.cache/rollway`` between runs. ``tests/support/osmosis_scripts`` run in it.

Without it the suites that need it skip with one line, unless ``ROLLWAY_REQUIRE_OSMOSIS=1`` (CI): then the first
test that needs it builds it (about 150 MB from the package index, under a minute), once, under a file lock, and a
build that fails is a failure. The interpreter is ``ROLLWAY_PYTHON312``, else pyenv's 3.12.1, else
``python3.12`` on the PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from filelock import FileLock

from support.components import marked_ready, missing

OSMOSIS_VERSION = "0.3.8"
REQUIREMENTS = (f"osmosis-ai[server]=={OSMOSIS_VERSION}", "openai>=2")
SPEC = " ".join(REQUIREMENTS)
CACHE = Path(os.environ.get("ROLLWAY_OSMOSIS_CACHE", Path.home() / ".cache" / "rollway"))
VENV = CACHE / f"osmosis-{OSMOSIS_VERSION}-venv"
READY = VENV / ".rollway-ready"
REQUIRE = "ROLLWAY_REQUIRE_OSMOSIS"
INSTALL_TIMEOUT = 900
SCRIPTS = Path(__file__).resolve().parent / "osmosis_scripts"
CHECK = "import osmosis_ai.rollout, osmosis_ai.rollout.server.app, openai"


def python312() -> str | None:
    """An interpreter of Python 3.12 on this machine, or None."""
    candidates = [os.environ.get("ROLLWAY_PYTHON312")]
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        root = ""
    if root:
        candidates.append(f"{root}/versions/3.12.1/bin/python3.12")
    candidates.append(shutil.which("python3.12"))
    return next((c for c in candidates if c and Path(c).is_file()), None)


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "PYTHON", "VIRTUAL_ENV"))}
    return env | {"PYTHONUNBUFFERED": "1", "OTEL_SDK_DISABLED": "true"} | extra


def _ready() -> bool:
    return marked_ready(READY, SPEC)


def _build() -> str | None:
    """Create the environment; the reason it cannot be had, or None."""
    base = python312()
    if base is None:
        return "no Python 3.12 on this machine (set ROLLWAY_PYTHON312)"
    build = VENV.with_name(f"{VENV.name}.build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    try:
        subprocess.run([base, "-m", "venv", str(build)], check=True, capture_output=True, timeout=120)
        python = str(build / "bin" / "python")
        proc = subprocess.run(
            [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *REQUIREMENTS],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
        )
        if proc.returncode != 0:
            return f"pip could not install osmosis-ai=={OSMOSIS_VERSION}: {proc.stderr.strip()[-1500:]}"
        check = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, env=script_env(), timeout=120)
        if check.returncode != 0:
            return f"osmosis-ai=={OSMOSIS_VERSION} installed but does not import: {check.stderr.strip()[-1500:]}"
        (build / READY.name).write_text(json.dumps({"spec": SPEC}))
        shutil.rmtree(VENV, ignore_errors=True)
        build.rename(VENV)
        return None
    except subprocess.TimeoutExpired:
        return f"installing osmosis-ai=={OSMOSIS_VERSION} took longer than {INSTALL_TIMEOUT} s"
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"could not create a Python 3.12 virtual environment: {exc}"
    finally:
        shutil.rmtree(build, ignore_errors=True)


def require_osmosis() -> None:
    """Called where a test module is imported: skips the whole module (one line) when the environment is not
    built, unless ``ROLLWAY_REQUIRE_OSMOSIS=1``, when its tests build it (``osmosis_python``)."""
    if _ready() or os.environ.get(REQUIRE) == "1":
        return
    reason = f"no osmosis-ai=={OSMOSIS_VERSION} environment at {VENV}; {REQUIRE}=1 builds it (Python 3.12)"
    missing("Osmosis 0.3 suite", REQUIRE, reason)


def osmosis_python() -> str:
    """The environment's interpreter (built on first use, under a file lock)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / f"osmosis-{OSMOSIS_VERSION}-venv.lock"), timeout=INSTALL_TIMEOUT + 600):
        if not _ready():
            reason = _build()
            if reason is not None:
                missing("Osmosis 0.3 suite", REQUIRE, reason)
    return str(VENV / "bin" / "python")
