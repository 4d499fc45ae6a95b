"""What the ``Store`` mixins (catalog, edits, agents, spans) use of ``Store``: its clock, its cipher, its write and
read paths and its waiter wake-up. Declared once here; ``Store`` provides them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection

from rollway.store.catalog import Cipher

T = TypeVar("T")


class StorePlumbing:
    clock: Callable[[], float]
    cipher: Cipher | None  # encrypts the API keys kept for others (``catalog.Cipher``), when given a secret key

    async def _write(self, op: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # provided by Store

    async def _read(self, op: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # provided by Store

    def _notify_all(self) -> None:
        raise NotImplementedError  # provided by Store
