"""Shared fixtures. Every store contract test runs against SQLite (a real file) and, when reachable, the real
PostgreSQL on this machine (a fresh database per test). Set ROLLWAY_TEST_PG_URL to point elsewhere."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollway.mock import MockBackendProcess
from rollway.store import Store

PG_ADMIN_URL = os.environ.get("ROLLWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


class FakeClock:
    """A clock the tests move by hand, so timeouts are tested without sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _pg_dsn(database: str) -> str:
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{database}"


async def _pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


_pg_state: dict[str, str | None] = {}
ICU_EN = "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"


def pg_unavailable_reason() -> str | None:
    """None when PostgreSQL answers, else why not (checked once per session)."""
    if "reason" not in _pg_state:
        try:
            asyncio.run(_pg_admin("SELECT 1"))
            _pg_state["reason"] = None
        except Exception as exc:
            _pg_state["reason"] = f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc!r}"
    return _pg_state["reason"]


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database (dropped afterwards)."""
    reason = pg_unavailable_reason()
    if reason and os.environ.get("ROLLWAY_REQUIRE_POSTGRES") == "1":
        pytest.fail(reason)  # CI: PostgreSQL is there, so its cases must run
    if reason:
        pytest.skip(reason)
    import asyncpg

    name = f"rollway_test_{uuid.uuid4().hex[:12]}"
    try:
        # A natural-language default collation, as most installations have ("B" between "a" and "b"): orders
        # the store promises (code point) must not depend on it. Plain when the server has no ICU.
        asyncio.run(_pg_admin(f'CREATE DATABASE "{name}" TEMPLATE template0 {ICU_EN}'))
    except asyncpg.PostgresError:
        asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield _pg_dsn(name)
    finally:
        asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database of each engine."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'rollway.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(store_url: str, clock: FakeClock) -> AsyncIterator[Store]:
    """An open store on a fresh database, watchdog loop off (tests call ``sweep(force=True)``)."""
    opened = await Store.open(store_url, clock=clock, run_watchdog=False)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture(scope="session")
def mock_process() -> Iterator[MockBackendProcess]:
    """One vLLM-like mock backend process for the session (``mock`` resets it per test)."""
    with MockBackendProcess() as process:
        yield process


@pytest.fixture
def mock(mock_process: MockBackendProcess) -> MockBackendProcess:
    mock_process.reset()
    return mock_process


@pytest.fixture(scope="session")
def sglang_mock_process() -> Iterator[MockBackendProcess]:
    """One SGLang-like mock backend process for the session (``sglang_mock`` resets it per test)."""
    with MockBackendProcess(flavor="sglang") as process:
        yield process


@pytest.fixture
def sglang_mock(sglang_mock_process: MockBackendProcess) -> MockBackendProcess:
    sglang_mock_process.reset()
    return sglang_mock_process
