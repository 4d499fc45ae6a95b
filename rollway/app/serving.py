"""``rollway serve``: one server process, or ``workers`` of them on one port.

With one worker the process runs uvicorn itself. With more, it becomes a supervisor that serves nothing:

- It binds the port once, one listening socket per worker with ``SO_REUSEPORT``, so the kernel spreads new
  connections evenly across the workers (one shared socket lets whichever worker wakes first take most of them).
  The supervisor holds every socket open, so connections that arrive for a worker being restarted wait in its
  backlog and are served by its replacement.
- Each worker is a spawned process running the whole application: its own store connection, registry and
  metrics. The workers are replicas of one store (``rollway.app.replicas``), exactly as separate servers on
  one database are: a pause, drain or swap asked of any of them reaches all of them through the store.
- ``/metrics`` is merged across workers: the supervisor gives them one ``PROMETHEUS_MULTIPROC_DIR`` (a fresh
  temporary directory unless one is set), and tells prometheus_client when a worker is gone.
- A worker that ends while the group is serving (killed, crashed) is started again; one that cannot start at
  all when the group starts (the database cannot be opened, say) stops the group with its error.
- SIGTERM or SIGINT stops the group: each worker gets SIGTERM and stops as a single server does, letting its
  calls in flight finish for ``shutdown_timeout`` seconds and then ending them, each recorded.

Every server process, alone or a worker, bounds its client connections (their number, a request head's size and
the time it may take, a new connection's silence: ``rollway.app.connections``); each worker bounds its own.

The supervisor says ``Uvicorn running on …`` once every worker has started, so a script waiting for that line
finds all of them serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import logging.config
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from typing import Any

from rollway.app.connections import ConnectionLimits, fit_open_files, protocol_class
from rollway.logs import log_config
from rollway.settings import Settings

log = logging.getLogger("rollway.workers")
#: Exit status of a uvicorn server whose application did not start (``uvicorn.config.STARTUP_FAILURE``).
STARTUP_FAILURE = 3
#: Seconds a stopping group waits for its workers beyond their own shutdown (``shutdown_timeout`` plus the
#: application's grace for recording the calls it ended), before it kills them.
STOP_MARGIN = 15.0
#: Waits before starting again a worker that could not start, or that ended within ``SHORT_LIFE`` seconds of
#: its start twice in a row, by the number of such ends in a row (the last repeats).
RESTART_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0)
SHORT_LIFE = 10.0
#: ``prctl`` option: the signal a process gets when its parent ends.
PR_SET_PDEATHSIG = 1

_spawn = multiprocessing.get_context("spawn")


def tune_gc() -> None:
    """Collect less often: a server allocates many short-lived containers (JSON bodies, token id lists) and
    the default thresholds make the cyclic collector walk the live heap every few hundred allocations.
    Objects alive at start-up (modules, the app) are frozen out of collections altogether."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 50)


def server_options(settings: Settings, limits: ConnectionLimits | None = None) -> dict[str, Any]:
    """uvicorn's options for a Rollway server, whether it runs alone or as one worker of a group: the httptools
    parser with the connection limits of ``settings`` (``rollway.app.connections``), or ``limits`` as
    ``fit_open_files`` fitted them to the process."""
    return {
        "log_level": settings.log_level,
        "access_log": settings.access_log,
        "log_config": log_config(settings.log_format, settings.log_level),
        "loop": "uvloop",
        "http": protocol_class(limits or ConnectionLimits.from_settings(settings)),
        "timeout_graceful_shutdown": settings.shutdown_timeout,  # then calls in flight are ended (dataplane)
        "timeout_keep_alive": settings.keepalive_timeout,
    }


def serve(settings: Settings) -> int:
    """Serve until stopped; the process's exit status."""
    import uvicorn

    if settings.workers > 1:
        return Supervisor(settings).run()
    from rollway.app.factory import create_app

    tune_gc()
    logging.config.dictConfig(log_config(settings.log_format, settings.log_level))  # (before the first line)
    limits = fit_open_files(ConnectionLimits.from_settings(settings), "max_connections" in settings.model_fields_set)
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, **server_options(settings, limits))
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else STARTUP_FAILURE


def _worker(settings: Settings, sock: socket.socket, ready: Event, supervisor: int) -> None:
    """One worker of a group (in its own spawned process): the application on the supervisor's socket."""
    # Ctrl+C reaches the whole process group: the supervisor stops the workers itself (SIGTERM), so a worker
    # still importing does not die of the SIGINT with a traceback (uvicorn installs its own handlers later).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with(supervisor)
    import uvicorn

    from rollway.app.factory import create_app

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                ready.set()

    tune_gc()
    logging.config.dictConfig(log_config(settings.log_format, settings.log_level))  # (before the first line)
    limits = fit_open_files(ConnectionLimits.from_settings(settings), "max_connections" in settings.model_fields_set)
    config = uvicorn.Config(create_app(settings), **server_options(settings, limits))
    config.configure_logging()
    _Server(config).run([sock])


def _end_with(supervisor: int) -> None:
    """SIGTERM to this process when its supervisor ends, however it ends (Linux's ``PR_SET_PDEATHSIG``): a
    supervisor killed with SIGKILL leaves no workers serving on without it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # it ended before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class _Worker:
    """One worker process and what the supervisor knows of it."""

    def __init__(self, settings: Settings, sock: socket.socket, slot: int) -> None:
        self.slot = slot
        self.ready = _spawn.Event()
        self.started = time.monotonic()
        self.handled = False  # its end was seen and acted on
        self.process: SpawnProcess = _spawn.Process(
            target=_worker,
            args=(settings, sock, self.ready, os.getpid()),
            name=f"rollway-worker-{slot}",
            daemon=False,
        )
        self.process.start()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def signal(self, signum: int) -> None:
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def ending(self) -> str:
        """How the process ended: ``on SIGKILL`` (a signal), ``with exit status 3``."""
        code = self.process.exitcode
        if code is not None and code < 0:
            return f"on {signal.Signals(-code).name}"
        return f"with exit status {code}"


class Supervisor:
    """Runs ``settings.workers`` worker processes on one port (see the module's description)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.count = settings.workers
        self.port = settings.port  # the port bound (the one the first socket got, for port 0)
        self.sockets: list[socket.socket | None] = []  # None: the slot's socket is closed while it cannot start
        self.workers: dict[int, _Worker] = {}
        self.stopping = False
        self._signalled: list[int] = []
        self._metrics_dir: str | None = None
        self._failures: dict[int, int] = {}  # slot -> replacements in a row that could not start
        self._due: dict[int, float] = {}  # slot -> when its next replacement starts

    def run(self) -> int:
        logging.config.dictConfig(log_config(self.settings.log_format, self.settings.log_level))
        self._bind()
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        previous = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._prepare_metrics()
            if not self._start_all(wake_read):
                return 0 if self.stopping else STARTUP_FAILURE
            host, port = self.settings.host, self.port
            shown = f"[{host}]" if ":" in host else host
            log.info("%d workers serving, pids %s", self.count, ", ".join(str(w.pid) for w in self.workers.values()))
            logging.getLogger("uvicorn.error").info(f"Uvicorn running on http://{shown}:{port} (Press CTRL+C to quit)")
            self._supervise(wake_read)
            return 0
        finally:
            self._stop_all()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous)
            wake_read.close()
            wake_write.close()
            for sock in self.sockets:
                if sock is not None:
                    sock.close()
            if self._metrics_dir is not None:
                shutil.rmtree(self._metrics_dir, ignore_errors=True)

    # -- set-up ----------------------------------------------------------------------------------------------

    def _bind(self) -> None:
        """One listening socket per worker on the same address; with port 0 the first picks the port."""
        self.port = self.settings.port
        for _ in range(self.count):
            sock = self._listen()
            self.port = sock.getsockname()[1]
            self.sockets.append(sock)

    def _listen(self) -> socket.socket:
        host = self.settings.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, self.port))
        sock.listen(2048)
        sock.set_inheritable(True)
        return sock

    def _socket(self, slot: int) -> socket.socket:
        sock = self.sockets[slot]
        if sock is None:
            sock = self.sockets[slot] = self._listen()
        return sock

    def _prepare_metrics(self) -> None:
        """Counters of every worker in one directory that each scrape merges (prometheus_client's multiprocess
        mode); a directory of the group's own unless the environment names one."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._metrics_dir = tempfile.mkdtemp(prefix="rollway-metrics-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir  # the spawned workers inherit it

    def _start_all(self, wake: socket.socket) -> bool:
        """Start every worker and wait until each has started; False (the group stopped) if one could not."""
        for slot in range(self.count):
            self.workers[slot] = _Worker(self.settings, self._socket(slot), slot)
        pending = dict(self.workers)
        while pending and not self.stopping:
            sentinels = {w.process.sentinel: w for w in pending.values()}
            ready = wait([*sentinels, wake], timeout=0.2)
            self._drain(wake)
            for worker in list(pending.values()):
                if worker.ready.is_set():  # (one that ended since is seen by ``_supervise``)
                    del pending[worker.slot]
                elif worker.process.sentinel in ready:
                    worker.process.join()
                    log.error(
                        "worker %d (pid %d) could not start (it ended %s): stopping",
                        worker.slot,
                        worker.pid,
                        worker.ending(),
                    )
                    return False
        return not self.stopping

    # -- serving ---------------------------------------------------------------------------------------------

    def _supervise(self, wake: socket.socket) -> None:
        """Until a signal: wait for a worker to end or a replacement to be due, and start its replacement."""
        while not self.stopping:
            # Every worker whose end was not acted on: one that ended meanwhile has its sentinel ready at once.
            sentinels = {w.process.sentinel: w for w in self.workers.values() if not w.handled}
            timeout = max(0.0, min(self._due.values()) - time.monotonic()) if self._due else None
            ended = wait([*sentinels, wake], timeout=timeout)
            self._drain(wake)
            if self.stopping:
                return
            for sentinel in ended:
                worker = sentinels.get(sentinel) if isinstance(sentinel, int) else None
                if worker is not None:
                    self._ended(worker)
            now = time.monotonic()
            for slot, due in list(self._due.items()):
                if due <= now:
                    del self._due[slot]
                    self._replace(slot)

    def _ended(self, worker: _Worker) -> None:
        worker.handled = True
        worker.process.join()
        self._forget_metrics(worker.pid)
        lived = time.monotonic() - worker.started
        failures = self._failures.get(worker.slot, 0)
        if worker.ready.is_set() and (lived >= SHORT_LIFE or failures == 0):
            # at once; but a second short life in a row is a crash loop, which backs off
            self._failures[worker.slot] = 0 if lived >= SHORT_LIFE else 1
            log.warning("worker %d (pid %d) ended %s: starting another", worker.slot, worker.pid, worker.ending())
            self._replace(worker.slot)
            return
        wait_for = RESTART_BACKOFF[min(failures, len(RESTART_BACKOFF) - 1)]
        self._failures[worker.slot] = failures + 1
        what = "ended soon after it started" if worker.ready.is_set() else "could not start"
        log.warning(
            "worker %d (pid %d) %s (it ended %s): trying again in %.1f s; its share of new connections goes to "
            "the other workers meanwhile",
            worker.slot,
            worker.pid,
            what,
            worker.ending(),
            wait_for,
        )
        sock = self.sockets[worker.slot]
        if sock is not None:  # nobody would accept what the kernel queues on it
            sock.close()
            self.sockets[worker.slot] = None
        self._due[worker.slot] = time.monotonic() + wait_for

    def _replace(self, slot: int) -> None:
        self.workers[slot] = _Worker(self.settings, self._socket(slot), slot)

    def _forget_metrics(self, pid: int) -> None:
        """A gone worker's live gauges (calls in flight) stop counting; its counters stay in the sums."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]

    # -- stopping --------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signalled.append(signum)
        if not self.stopping:
            log.info("%s: stopping %d workers", signal.Signals(signum).name, len(self.workers))
        self.stopping = True

    @staticmethod
    def _drain(wake: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            while wake.recv(512):
                pass

    def _stop_all(self) -> None:
        """SIGTERM to every worker; wait for them to record their calls and end; kill what is left after the
        bound."""
        workers = [w for w in self.workers.values() if w.process.exitcode is None]
        for worker in workers:
            worker.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout + STOP_MARGIN
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is None:
                log.error("worker %d (pid %d) did not stop in time: killing it", worker.slot, worker.pid)
                worker.process.kill()
                worker.process.join()
