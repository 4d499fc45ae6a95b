"""TRL (``trl==1.16.0``, with ``accelerate`` and ``datasets``) for the TRL training test, installed beside the vLLM
environment's torch and transformers: a folder of packages (``pip install --no-deps --target``) that the trainer
process puts on ``PYTHONPATH``, cached under ``~/.cache/rollway`` between runs. ``--no-deps`` with a pinned list,
because a resolving install would pull a second torch (a CUDA build of several GB) over the environment's CPU one.

The folder's name ends in ``site-packages``: ``datasets`` fingerprints a dataset with ``dill``, which pickles a
module by reference only when its file lies under the interpreter's prefix or a ``site-packages`` folder, and by
value (failing on pyarrow's ``MonthDayNano``) otherwise.

Without it the TRL test skips with one line, unless ``ROLLWAY_REQUIRE_TRL=1`` (CI): then the test builds it
(about 280 MB from the package index, under a minute), once, under a file lock, and a build that fails is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from filelock import FileLock

from support.components import marked_ready, missing
from support.vllm_env import CACHE, engine_env, python

TRL_VERSION = "1.16.0"
INSTALL_TIMEOUT = 900
#: What TRL and ``datasets`` need that the vLLM environment lacks, each at the version a resolving install picked
#: here beside transformers 5.19 and torch 2.13.
REQUIREMENTS = (
    f"trl=={TRL_VERSION}",
    "accelerate==1.16.0",
    "datasets==5.2.0",
    "pyarrow==26.0.1",
    "pandas==3.1.1",
    "multiprocess==0.70.19",
    "dill==0.4.1",
    "xxhash==4.1.0",
    "pytz==2026.6",
    "tzdata==2026.6",
    "python-dateutil==4.0.0",
)
SPEC = " ".join(REQUIREMENTS)
HOME = CACHE / f"trl-{TRL_VERSION}"
SITE = HOME / "site-packages"
READY = HOME / ".rollway-ready"
REQUIRE = "ROLLWAY_REQUIRE_TRL"
CHECK = "import trl, datasets; from trl import GRPOTrainer; datasets.Dataset.from_list([{'a': [1]}])"


def _ready() -> bool:
    return marked_ready(READY, SPEC)


def _build() -> str | None:
    """Install the packages; the reason they cannot be had, or None."""
    build = HOME.with_name(f"{HOME.name}.build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    site = build / "site-packages"
    command = [str(python()), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps"]
    try:
        proc = subprocess.run(
            [*command, "--target", str(site), *REQUIREMENTS],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
            env=engine_env(),
        )
        if proc.returncode != 0:
            return f"pip could not install trl=={TRL_VERSION}: {proc.stderr.strip()[-1500:]}"
        env = engine_env() | {"PYTHONPATH": str(site), "TRL_EXPERIMENTAL_SILENCE": "1"}
        check = subprocess.run([str(python()), "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
        if check.returncode != 0:
            return f"trl=={TRL_VERSION} installed but does not work: {check.stderr.strip()[-1500:]}"
        (build / READY.name).write_text(json.dumps({"spec": SPEC}))
        shutil.rmtree(HOME, ignore_errors=True)
        build.rename(HOME)
        return None
    except subprocess.TimeoutExpired:
        return f"installing trl=={TRL_VERSION} took longer than {INSTALL_TIMEOUT} s"
    finally:
        shutil.rmtree(build, ignore_errors=True)


def require_trl() -> None:
    """Called where a test module is imported: skips the whole module (one line) when the packages are not
    installed, unless ``ROLLWAY_REQUIRE_TRL=1``, when its test installs them (``trl_site``)."""
    if _ready() or os.environ.get(REQUIRE) == "1":
        return
    missing("TRL suite", REQUIRE, f"no trl=={TRL_VERSION} at {SITE}; {REQUIRE}=1 installs it (about 280 MB)")


def trl_site() -> Path:
    """The packages' folder (built on first use, under a file lock); the calling test skips when it cannot be had,
    or fails under ``ROLLWAY_REQUIRE_TRL=1``."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / f"trl-{TRL_VERSION}.lock"), timeout=INSTALL_TIMEOUT + 600):
        if not _ready():
            reason = _build()
            if reason is not None:
                missing("TRL suite", REQUIRE, reason)
    return SITE
