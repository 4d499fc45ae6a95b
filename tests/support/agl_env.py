"""A separate virtual environment with ``agentlightning==0.3.0`` (it pins its own LiteLLM, FastAPI, OpenTelemetry
... so it cannot share Rollway's), cached under ``~/.cache/rollway`` between runs. Scripts in
``tests/support/agl_scripts`` run in it as subprocesses.

Without the environment the suites that need it skip with one line, unless ``ROLLWAY_REQUIRE_AGL=1`` (CI): then
the first test that needs it builds it (about 700 MB from the package index, a few minutes), once, under a file
lock so that parallel pytest processes do not race, and a build that fails is a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from support.components import marked_ready, missing

AGL_VERSION = "0.3.0"
INSTALL_TIMEOUT = float(os.environ.get("ROLLWAY_AGL_INSTALL_TIMEOUT", "1500"))
CACHE = Path(os.environ.get("ROLLWAY_AGL_CACHE", Path.home() / ".cache" / "rollway"))
VENV = CACHE / f"agl-{AGL_VERSION}-venv"
READY = VENV / ".rollway-ready"
REQUIRE = "ROLLWAY_REQUIRE_AGL"
SCRIPTS = Path(__file__).resolve().parent / "agl_scripts"
CHECK = "import agentlightning.store.client_server, agentlightning.runner, agentlightning.adapter"
# agentlightning 0.3.0 asks for opentelemetry >= 1.35 but redirects its OTLP exporter through a private field
# (``_endpoint``) that OpenTelemetry 1.40 stopped reading: with a newer SDK its agent-side spans go to
# localhost:4318 instead of the store. Pin the line it was released against.
REQUIREMENTS = (
    f"agentlightning=={AGL_VERSION}",
    "opentelemetry-api==1.39.1",
    "opentelemetry-sdk==1.39.1",
    "opentelemetry-exporter-otlp==1.39.1",
    "opentelemetry-exporter-otlp-proto-http==1.39.1",
    "opentelemetry-exporter-otlp-proto-grpc==1.39.1",
    "opentelemetry-exporter-otlp-proto-common==1.39.1",
    "opentelemetry-proto==1.39.1",
    "opentelemetry-semantic-conventions==0.60b1",
    "opentelemetry-instrumentation==0.60b1",
)
SPEC = " ".join(REQUIREMENTS)


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "PYTHON", "VIRTUAL_ENV"))}
    # LiteLLM (imported by agentlightning) would try to download its model cost map at import.
    env |= {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1", "OTEL_SDK_DISABLED": "false"}
    return env | extra


def _build() -> str | None:
    """Create the environment; the reason it cannot be had, or None."""
    build = CACHE / f"agl-{AGL_VERSION}-venv.build-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(build)], check=True, capture_output=True, timeout=120)
        python = str(build / "bin" / "python")
        started = time.monotonic()
        proc = subprocess.run(
            [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *REQUIREMENTS],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
        )
        if proc.returncode != 0:
            return f"pip could not install agentlightning=={AGL_VERSION}: {proc.stderr.strip()[-1500:]}"
        check = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, env=script_env(), timeout=300)
        if check.returncode != 0:
            return f"agentlightning=={AGL_VERSION} installed but does not import: {check.stderr.strip()[-1500:]}"
        (build / READY.name).write_text(json.dumps({"spec": SPEC, "seconds": round(time.monotonic() - started, 1)}))
        shutil.rmtree(VENV, ignore_errors=True)
        build.rename(VENV)  # the interpreter is a symlink and pyvenv.cfg sits beside it: a venv survives a move
        return None
    except subprocess.TimeoutExpired:
        return f"installing agentlightning=={AGL_VERSION} took longer than {INSTALL_TIMEOUT:.0f} s"
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"could not create a virtual environment for agentlightning: {exc}"
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _ready() -> bool:
    return marked_ready(READY, SPEC)


def require_agl() -> None:
    """Called where a test module is imported: skips the whole module (one line) when the environment is not
    built, unless ``ROLLWAY_REQUIRE_AGL=1``, when its tests build it (``agl_python``)."""
    if _ready() or os.environ.get(REQUIRE) == "1":
        return
    reason = f"no agentlightning=={AGL_VERSION} environment at {VENV}; {REQUIRE}=1 builds it (about 700 MB)"
    missing("Agent-lightning suite", REQUIRE, reason)


def agl_python() -> str:
    """The environment's interpreter (built on first use, under a file lock); the calling test skips when it
    cannot be had, or fails under ``ROLLWAY_REQUIRE_AGL=1``."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / f"agl-{AGL_VERSION}-venv.lock"), timeout=INSTALL_TIMEOUT + 600):
        if not _ready():
            reason = _build()
            if reason is not None:
                missing("Agent-lightning suite", REQUIRE, f"agentlightning=={AGL_VERSION} is not available: {reason}")
    return str(VENV / "bin" / "python")


def run_script(python: str, name: str, *args: str, timeout: float = 180, **env: str) -> Any:
    """Run ``tests/support/agl_scripts/<name>`` in the environment; its last stdout line is JSON, returned parsed."""
    proc = subprocess.run(
        [python, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=script_env(**env),
        cwd=str(SCRIPTS),
    )
    if proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{name} printed nothing:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])
