"""Servers in subprocesses on free loopback ports, ready once their log says they serve: ``ServerProcess`` runs
any ``rollway`` command, ready at uvicorn's ``Uvicorn running on …`` (the port is read from that line, so there is
no race for a free port); ``GatewayProcess`` runs ``rollway serve`` (the demo, tests that need a gateway outside
their own event loop). The mock backend's ``MockBackendProcess`` builds on the same class, and so can a server
that is not Rollway's: a subclass names its command (``command``), the log line that says it serves (``ready``)
and whether it runs in a process group of its own (``own_group``)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
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
    #: Start the child in a session of its own, so that ``stop`` signals its whole process group: a server that
    #: forks workers (nginx) stops with them, and a signal meant for the caller's group does not reach it.
    own_group = False

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, startup_timeout: float = 60.0):
        self.args = list(args)
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.url = ""
        self.output: deque[str] = deque(maxlen=500)
        self._ready = threading.Event()  # set once the child said it serves, or ended
        self._serving = False  # the child said it serves
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

    def ready(self, line: str) -> str | None:
        """Whether the child's log ``line`` says it serves: the URL it serves at (uvicorn's line names it; ``""``
        for a server whose line does not, its address being the caller's), else None."""
        match = RUNNING_RE.search(line)
        return match.group(1) if match else None

    def start(self) -> Self:
        self._proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.child_env(),
            start_new_session=self.own_group,
        )
        self._reader = threading.Thread(target=self._read, name=f"rollway-{self.name}-output", daemon=True)
        self._reader.start()
        if not self._ready.wait(self.startup_timeout) or not self._serving:
            output = "\n".join(self.output)
            self.stop()
            raise RuntimeError(f"the {self.name} did not start:\n{output}")
        return self

    def _read(self) -> None:
        """Keep draining the child's output (a full pipe would block it); watch it for the line that says the
        child serves (``ready``)."""
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.output.append(line.rstrip("\n"))
            if not self._serving:
                url = self.ready(line)
                if url is not None:
                    self.url, self._serving = url, True
                    self._ready.set()
        self._ready.set()  # the process ended: wake start()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful), SIGKILL after ``timeout``; the exit status. With ``own_group`` each signal goes to
        the whole group, even once the child itself has ended (what it forked may not have)."""
        proc = self._proc
        if proc is None:
            return None
        if self.own_group or proc.poll() is None:
            self._signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
        self._proc = None
        return proc.returncode

    def _signal(self, proc: subprocess.Popen[str], signum: int) -> None:
        if not self.own_group:
            proc.send_signal(signum)
            return
        with contextlib.suppress(ProcessLookupError):  # the whole group has already gone
            os.killpg(proc.pid, signum)

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
