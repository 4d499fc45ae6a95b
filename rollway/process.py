"""Rollway servers in subprocesses on free loopback ports, ready once uvicorn says ``Uvicorn running on …``
(the port is read from that line, so there is no race for a free port): ``ServerProcess`` runs any
``rollway`` command; ``GatewayProcess`` runs ``rollway serve`` (the demo, tests that need a gateway outside
their own event loop). The mock backend's ``MockBackendProcess`` builds on the same class."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Self

RUNNING_RE = re.compile(r"Uvicorn running on (https?://\S+)")


class ServerProcess:
    """``rollway *args`` as a child process; ``url`` is where it listens, ``output`` its recent log lines."""

    name = "server"

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, startup_timeout: float = 60.0):
        self.args = list(args)
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.url = ""
        self.output: deque[str] = deque(maxlen=500)
        self._ready = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def child_env(self) -> dict[str, str]:
        return {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}

    def command(self) -> list[str]:
        """The child's argv: ``rollway *args`` (a subclass may run another server)."""
        return [sys.executable, "-c", "from rollway.cli import main; main()", *self.args]

    def start(self) -> Self:
        self._proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.child_env(),
        )
        self._reader = threading.Thread(target=self._read, name=f"rollway-{self.name}-output", daemon=True)
        self._reader.start()
        if not self._ready.wait(self.startup_timeout) or not self.url:
            output = "\n".join(self.output)
            self.stop()
            raise RuntimeError(f"the {self.name} did not start:\n{output}")
        return self

    def _read(self) -> None:
        """Keep draining the child's output (a full pipe would block it); set ``url`` from uvicorn's line."""
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.output.append(line.rstrip("\n"))
            if not self.url:
                match = RUNNING_RE.search(line)
                if match:
                    self.url = match.group(1)
                    self._ready.set()
        self._ready.set()  # the process ended: wake start()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful), SIGKILL after ``timeout``; the exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
        self._proc = None
        return proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class GatewayProcess(ServerProcess):
    """A gateway on ``database_url`` (e.g. ``sqlite:///tmp/x.db``). The child sees none of the caller's
    ``ROLLWAY_*`` variables, only ``admin_token`` and ``env``."""

    name = "gateway"

    def __init__(
        self,
        database_url: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_token: str | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        super().__init__(
            ["serve", "--host", host, "--port", str(port), "--db", database_url],
            env=env,
            startup_timeout=startup_timeout,
        )
        self.admin_token = admin_token

    def child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
        env |= {"PYTHONUNBUFFERED": "1", "ROLLWAY_LOG_LEVEL": "info"}
        if self.admin_token is not None:
            env["ROLLWAY_ADMIN_TOKEN"] = self.admin_token
        return env | self.env
