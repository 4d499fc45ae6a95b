"""Schema upgrades: a store opened on an empty or older database brings it to the newest revision."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS = Path(__file__).parents[1] / "migrations"  # store/migrations
PG_MIGRATION_LOCK = 0x526F6C6C  # advisory lock key: one process migrates at a time


def _config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def _upgrade(connection: Connection, revision: str) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK})
    command.upgrade(_config(connection), revision)


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def upgrade(engine: AsyncEngine | Engine, revision: str = "head") -> None:
    """Upgrade the schema to ``revision`` in one transaction (SQLite: under the write lock, in a thread)."""
    if isinstance(engine, AsyncEngine):
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade, revision)
        return

    def run() -> None:
        with engine.begin() as conn:
            _upgrade(conn, revision)

    await asyncio.to_thread(run)


async def current_revision(engine: AsyncEngine | Engine) -> str | None:
    if isinstance(engine, AsyncEngine):
        async with engine.connect() as conn:
            return await conn.run_sync(_current)

    def run() -> str | None:
        with engine.connect() as conn:
            return _current(conn)

    return await asyncio.to_thread(run)
