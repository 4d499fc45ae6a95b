"""What the parts of ``Store`` (the mixins of ``store.parts``) use of ``Store``: its clock, its cipher, its write
and read paths and its waiter wake-up. Declared once here; ``Store`` (``store.store``) provides them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import Connection

from rollway.store.schemas import ApiKey
from rollway.store.sql.catalog import Cipher

T = TypeVar("T")


class StorePlumbing:
    clock: Callable[[], float]
    cipher: Cipher | None  # encrypts the API keys kept for others (``catalog.Cipher``), when given a secret key
    direct_calls: bool  # PostgreSQL: the call path's writes go straight to the driver (``store.sql.pg_calls``)
    #: Told each rollout key a claim or a start minted, once it is committed (record, key): the gateway in this
    #: process caches it, so the agent's first call with it reads nothing.
    key_observer: Callable[[ApiKey, str], None] | None

    def _keys_minted(self, minted: list[tuple[ApiKey, str]]) -> None:
        if self.key_observer is not None:
            for record, plain in minted:
                self.key_observer(record, plain)

    async def _write(self, op: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # provided by Store

    async def _write_direct(self, op: Callable[[Any], Awaitable[T]]) -> T:
        raise NotImplementedError  # provided by Store (PostgreSQL only)

    async def _read(self, op: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # provided by Store

    def _notify_all(self) -> None:
        raise NotImplementedError  # provided by Store
