"""A cached Python 3.12 virtual environment for a real client that needs Python >= 3.12 while Rollway's suite runs
on 3.11 (Osmosis 0.3, Agent-lightning 1.0). Each lives under ``~/.cache/rollway`` between runs and its scripts run
in it as subprocesses.

Without it the suites that need it skip with one line, unless their ``ROLLWAY_REQUIRE_*`` variable is 1 (CI):
then the first test that needs it builds it, once, under a file lock so that parallel pytest processes do not
race, and a build that fails is a failure. The interpreter is ``ROLLWAY_PYTHON312``, else pyenv's 3.12.1, else
``python3.12`` on the PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from support.components import marked_ready, missing

INSTALL_TIMEOUT = 900


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
    """The environment a script in such a venv runs with: this process's, minus Rollway's own settings and the
    3.11 interpreter's ``PYTHON*``/``VIRTUAL_ENV``, which would leak into the other interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "PYTHON", "VIRTUAL_ENV"))}
    return env | {"PYTHONUNBUFFERED": "1", "OTEL_SDK_DISABLED": "true"} | extra


@dataclass(frozen=True)
class Py312Env:
    """One such environment: ``suite`` names it in skip lines, ``package`` (``name==version``) in build errors,
    ``check`` is the import statement that proves it works."""

    suite: str
    package: str
    requirements: tuple[str, ...]
    check: str
    require_var: str
    venv: Path

    @property
    def spec(self) -> str:
        return " ".join(self.requirements)

    @property
    def ready_marker(self) -> Path:
        return self.venv / ".rollway-ready"

    def ready(self) -> bool:
        return marked_ready(self.ready_marker, self.spec)

    def require(self) -> None:
        """Called where a test module is imported: skips the whole module (one line) when the environment is not
        built, unless its ``require_var`` is 1, when its tests build it (``python``)."""
        if self.ready() or os.environ.get(self.require_var) == "1":
            return
        reason = f"no {self.package} environment at {self.venv}; {self.require_var}=1 builds it (Python 3.12)"
        missing(self.suite, self.require_var, reason)

    def python(self) -> str:
        """The environment's interpreter (built on first use, under a file lock); the calling test skips when it
        cannot be had, or fails when its ``require_var`` is 1."""
        self.venv.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.venv.with_name(f"{self.venv.name}.lock")), timeout=INSTALL_TIMEOUT + 600):
            if not self.ready():
                reason = self._build()
                if reason is not None:
                    missing(self.suite, self.require_var, reason)
        return str(self.venv / "bin" / "python")

    def _build(self) -> str | None:
        """Create the environment; the reason it cannot be had, or None."""
        base = python312()
        if base is None:
            return "no Python 3.12 on this machine (set ROLLWAY_PYTHON312)"
        # Built where it stays: pip writes the venv's path into its console scripts' shebangs (agl-server,
        # agl-controller), so a venv built elsewhere and moved keeps a python but loses its commands. The ready
        # marker, written last, is what says it is complete; the file lock keeps other builders out meanwhile.
        venv = self.venv
        shutil.rmtree(venv, ignore_errors=True)
        try:
            subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
            python = str(venv / "bin" / "python")
            started = time.monotonic()
            proc = subprocess.run(
                [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *self.requirements],
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT,
            )
            if proc.returncode != 0:
                return f"pip could not install {self.package}: {proc.stderr.strip()[-1500:]}"
            check = subprocess.run(
                [python, "-c", self.check], capture_output=True, text=True, env=script_env(), timeout=120
            )
            if check.returncode != 0:
                return f"{self.package} installed but does not import: {check.stderr.strip()[-1500:]}"
            marker = {"spec": self.spec, "seconds": round(time.monotonic() - started, 1)}
            self.ready_marker.write_text(json.dumps(marker))
            return None
        except subprocess.TimeoutExpired:
            return f"installing {self.package} took longer than {INSTALL_TIMEOUT} s"
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"could not create a Python 3.12 virtual environment: {exc}"
        finally:
            if not self.ready():
                shutil.rmtree(venv, ignore_errors=True)
