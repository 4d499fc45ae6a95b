"""The PostgreSQL server the tests use (``ROLLWAY_TEST_PG_URL``, by default the one on this machine): whether it
answers, and fresh databases on it, each named at random so that parallel sessions never share one: empty, or
copied from a template that holds the schema at head (copying one is a third of the time of creating a database
and migrating it)."""

from __future__ import annotations

import asyncio
import os
import uuid

PG_ADMIN_URL = os.environ.get("ROLLWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
#: A natural-language default collation, as most installations have ("B" between "a" and "b"): orders the store
#: promises (code point) must not depend on it.
ICU_EN = "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"

_state: dict[str, str | None] = {}


def pg_dsn(database: str) -> str:
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{database}"


async def pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def pg_unavailable_reason() -> str | None:
    """None when PostgreSQL answers, else why not (checked once per process)."""
    if "reason" not in _state:
        try:
            asyncio.run(pg_admin("SELECT 1"))
            _state["reason"] = None
        except Exception as exc:
            _state["reason"] = f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc!r}"
    return _state["reason"]


def create_database(template: str | None = None, prefix: str = "rollway_test") -> str:
    """A fresh database's name: a copy of ``template``, or empty (ICU en-US collation; plain when the server has
    no ICU)."""
    import asyncpg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    if template is not None:
        asyncio.run(pg_admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
        return name
    try:
        asyncio.run(pg_admin(f'CREATE DATABASE "{name}" TEMPLATE template0 {ICU_EN}'))
    except asyncpg.PostgresError:
        asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    return name


def drop_database(name: str) -> None:
    asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
