"""The store's failures as clients see them: a PostgreSQL stopped (cleanly, or at once as in a crash) and started
under load (a private cluster the test makes, never the machine's), a SQLite write lock held by another process and
a full disk. Every failure is a 503 in OpenAI's envelope, on every route, on a connection that stays open;
``/readyz`` says not ready while writes fail; everything serves again without a restart; the failures are logged
once per kind per interval."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollway.admin.client import AsyncRollwayClient
from rollway.mock import MockBackendProcess
from rollway.process import GatewayProcess
from rollway.store.db.faults import FailureLog
from support.gateway_harness import running_gateway

pytestmark = pytest.mark.slow  # a private PostgreSQL cluster stopped and started, a write lock held by another process

TOKEN = "admin-secret-token"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateCluster:
    """A PostgreSQL cluster of the test's own (``initdb`` into a temporary directory, a free loopback port), to
    stop and start at will. As root it runs as the ``postgres`` user (``initdb`` refuses root)."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="rollway-pg-"))
        self.port = _free_port()
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [*self.prefix, str(self.bindir / tool), *args]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.root / "data"), "-U", "postgres", "-A", "trust", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.root / "data"), "-l", str(self.root / "log"), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """``fast``: the server ends its sessions and shuts down cleanly; ``immediate``: it quits at once, as in a
        crash, without a word to its clients (crash recovery runs at the next start)."""
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with_data = self.root / "data" / "postmaster.pid"
        if with_data.exists():
            subprocess.run([*self.prefix, str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m",
                            "immediate", "-w", "stop"], capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def cluster() -> Any:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.skip("no initdb (/usr/lib/postgresql/*/bin/initdb): cannot make a private PostgreSQL cluster")
    made = PrivateCluster(Path(found[-1]).parent)
    try:
        made.init()
        made.start()
        yield made
    finally:
        made.remove()


def _answer(response: httpx.Response) -> tuple[int, str]:
    """(status, what the body is): ``ok``, ``envelope``, or ``other: ...`` (plain text, a traceback)."""
    if response.status_code == 200:
        return 200, "ok"
    try:
        body = response.json()
    except ValueError:
        return response.status_code, f"other: {response.headers.get('content-type')} {response.text[:80]!r}"
    is_envelope = isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]
    json_type = response.headers.get("content-type", "").startswith("application/json")
    return response.status_code, "envelope" if is_envelope and json_type else f"other: {body!r:.80}"


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_postgresql_stopped_under_load_is_503_envelopes_then_serves_again(
    cluster: PrivateCluster, mock: MockBackendProcess, mode: str
) -> None:
    gateway = GatewayProcess(cluster.url, admin_token=TOKEN, env={"ROLLWAY_ACCESS_LOG": "false"})  # its own lines
    await asyncio.to_thread(gateway.start)
    try:
        async with AsyncRollwayClient(gateway.url, TOKEN) as admin:
            backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
            await admin.put_model("policy", [backend])
        answers: list[tuple[float, str, int, str]] = []  # (time, route, status, what)
        broken: list[str] = []  # a connection error: keep-alive broken by an error answer
        phase = {"stop": False}
        ports: dict[int, set[int]] = {}  # agent → the client ends of the connections it used
        admin_headers = {"Authorization": f"Bearer {TOKEN}"}

        async def agent(i: int) -> None:
            async with httpx.AsyncClient(
                base_url=gateway.url, timeout=30, limits=httpx.Limits(max_connections=1)
            ) as http:
                while not phase["stop"] and len(answers) < 20_000:
                    route = ("chat", "chat", "stream", "admin", "readyz")[i % 5]
                    try:
                        if route == "chat":
                            response = await http.post("/v1/chat/completions", json=CHAT)
                        elif route == "stream":
                            response = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
                        elif route == "admin":
                            response = await http.get("/admin/v1/models", headers=admin_headers)
                        else:
                            response = await http.get("/readyz")
                    except httpx.TransportError as exc:
                        broken.append(f"{route}: {exc!r}")
                        await asyncio.sleep(0.05)
                        continue
                    ports.setdefault(i, set()).add(
                        response.extensions["network_stream"].get_extra_info("client_addr")[1]
                    )
                    status, what = _answer(response)
                    if route == "stream" and status == 200:  # ends with [DONE], or with the error event
                        done = response.text.rstrip().endswith("data: [DONE]") or '"error"' in response.text
                        what = "ok" if done else f"other: {response.text[-80:]!r}"
                    answers.append((time.monotonic(), route, status, what))
                    await asyncio.sleep(0.01)

        agents = [asyncio.create_task(agent(i)) for i in range(10)]
        try:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(cluster.stop, mode)
            stopped = time.monotonic()
            await asyncio.sleep(3.0)
            restarting = time.monotonic()
            await asyncio.to_thread(cluster.start)
            started = time.monotonic()
            while time.monotonic() - started < 20:  # bounded: the first call that succeeds after the restart
                if any(t > started and r == "chat" and s == 200 for t, r, s, _ in answers[-50:]):
                    break
                await asyncio.sleep(0.05)
            recovered = time.monotonic() - started
            await asyncio.sleep(2.0)
        finally:
            phase["stop"] = True
            await asyncio.gather(*agents)
        during = Counter((r, s, w) for t, r, s, w in answers if stopped + 0.5 < t < restarting)
        wrong = Counter((r, s, w) for _, r, s, w in answers if s not in (200, 503) or w not in ("ok", "envelope"))
        assert not wrong, wrong
        assert not broken, broken[:5]
        assert all(len(used) == 1 for used in ports.values()), ports  # no error answer closed its connection
        assert during and all(s == 503 for (_, s, _) in during), during  # the outage: 503 envelopes only
        assert {r for r, _, _ in during} == {"chat", "stream", "admin", "readyz"}
        assert recovered < 10, f"no call succeeded within {recovered:.1f} s of the restart"
        settled = [(r, s) for t, r, s, _ in answers if t > started + recovered + 1.0]
        assert settled and all(s == 200 for _, s in settled), Counter(settled)
        assert not [line for line in gateway.output if "Exception in ASGI application" in line]  # none unhandled
        failed_writes = [line for line in gateway.output if "store write failed" in line]
        assert 1 <= len(failed_writes) <= 2, failed_writes  # hundreds of failures, one line per 10 s
        assert not any("Traceback" in line for line in failed_writes)
    finally:
        await asyncio.to_thread(gateway.stop)


HOLD_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


async def test_readyz_is_503_while_another_process_holds_the_write_lock(
    tmp_path: Path, mock: MockBackendProcess
) -> None:
    async with running_gateway(tmp_path) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
        await gw.store.put_model("policy", [backend])
        assert (await http.get("/readyz")).status_code == 200
        holder = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLD_LOCK, str(tmp_path / "gateway.db"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert holder.stdin is not None and holder.stdout is not None
        try:
            assert (await holder.stdout.readline()).strip() == b"locked"
            call = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))  # its write waits for the lock
            for _ in range(50):  # polled as a load balancer does, for at most 10 s
                ready = await http.get("/readyz")
                if ready.status_code != 200:
                    break
                await asyncio.sleep(0.2)
            assert ready.status_code == 503, ready.text
            assert "waited" in ready.json()["error"]["message"]
            assert not call.done()
        finally:
            holder.stdin.write(b"go\n")
            await holder.stdin.drain()
            await holder.wait()
        assert (await call).status_code == 200  # the write went through once the lock was let go
        assert (await http.get("/readyz")).status_code == 200


@pytest.fixture
def small_disk() -> Any:
    """An 8 MiB tmpfs, mounted for the test (as root; skipped when that is refused)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    disk = Path(tempfile.mkdtemp(prefix="rollway-full-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        disk.rmdir()
        pytest.skip(f"mounting a tmpfs was refused: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        disk.rmdir()


async def test_a_full_disk_is_503_and_not_ready_until_space_comes_back(
    tmp_path: Path, small_disk: Path, mock: MockBackendProcess
) -> None:
    async with (
        running_gateway(tmp_path, database_url=f"sqlite:///{small_disk / 'gateway.db'}") as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        backend = {"backend_id": "mock", "base_url": mock.base_url, "kind": "vllm", "model": "mock-model"}
        await gw.store.put_model("policy", [backend])
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        filler = small_disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:  # the rest of the disk
            with pytest.raises(OSError):
                while True:
                    os.write(fd, b"\0" * 65536)
        finally:
            os.close(fd)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}
        statuses: Counter[int] = Counter()
        for _ in range(20):  # until the write-ahead log cannot grow
            response = await http.post("/v1/chat/completions", json=big)
            statuses[response.status_code] += 1
            if response.status_code != 200:
                assert response.status_code == 503, response.text
                assert response.json()["error"]["type"] == "service_unavailable"
                break
        assert statuses[503] == 1, statuses
        ready = await http.get("/readyz")
        assert ready.status_code == 503 and "cannot write" in ready.json()["error"]["message"], ready.text
        os.unlink(filler)
        assert (await http.post("/v1/chat/completions", json=big)).status_code == 200  # no restart
        assert (await http.get("/readyz")).status_code == 200


def test_failure_log_says_one_line_per_kind_per_interval_with_the_count_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    failures = FailureLog(interval=10.0, clock=lambda: now[0])
    logger = logging.getLogger("rollway.test")
    with caplog.at_level(logging.ERROR, logger="rollway.test"):
        for _ in range(50):  # a burst: one line
            failures.log(logger, "write", "write failed: %s", "disk full")
            now[0] += 0.1
        failures.log(logger, "read", "read failed")  # another kind is not held back by the first
        now[0] += 6.0
        failures.log(logger, "write", "write failed: %s", "disk full")  # the next interval: the count of the rest
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "write failed: disk full",
        "read failed",
        "write failed: disk full (and 49 more like it in the last 11 s, not logged)",
    ]


def test_only_the_databases_own_trouble_is_unavailable() -> None:
    """An outage (locked, full, a refused or dropped connection) is a 503; a bug in a statement, or another
    socket's error (a backend's), is not the database's and stays what it is."""
    import sqlite3 as sqlite

    import aiohttp
    from sqlalchemy.exc import OperationalError

    from rollway.store.db.faults import unavailable

    outages = [
        sqlite.OperationalError("database is locked"),
        sqlite.OperationalError("database or disk is full"),
        OperationalError("INSERT ...", {}, sqlite.OperationalError("unable to open database file")),
        ConnectionRefusedError(111, "Connection refused"),
        ConnectionResetError(104, "Connection reset by peer"),
    ]
    bugs = [
        sqlite.OperationalError("no such table: spans"),
        OperationalError("SELECT ...", {}, sqlite.OperationalError('near "SELEC": syntax error')),
        aiohttp.ClientOSError(104, "Connection reset by peer"),
        FileNotFoundError(2, "No such file or directory"),
        ValueError("not a database problem"),
    ]
    assert all(unavailable(exc) is not None for exc in outages)
    assert [unavailable(exc) for exc in bugs] == [None] * len(bugs)
