"""The weight-update part of ``Store``: begin, note and end an alias's weight update, and read them back
(``store.sql.updates``; the operation itself is the gateway's, ``gateway.updates``)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.schemas import InFlightPolicy, UpdateForm, UpdateState, WeightUpdate
from rollway.store.sql import updates


class UpdatesMixin(StorePlumbing):
    async def begin_update(
        self,
        alias: str,
        *,
        to_version: str | None,
        form: UpdateForm,
        in_flight: InFlightPolicy,
        by: str,
        note: str | None = None,
        timeout: float,
    ) -> WeightUpdate:
        """Record an open update of ``alias`` and hold the alias for it, until ``timeout`` seconds from now at
        most (then it expires)."""
        now = self.clock()
        return await self._write(
            lambda conn: updates.begin(
                conn,
                alias,
                to_version=to_version,
                form=form,
                in_flight=in_flight,
                by=by,
                note=note,
                now=now,
                deadline=now + timeout,
            )
        )

    async def record_update(self, update_id: str, **values: Any) -> WeightUpdate:
        return await self._write(lambda conn: updates.record(conn, update_id, **values))

    async def count_aborted_calls(self, update_id: str, calls: int) -> None:
        """Add ``calls`` this replica ended for an open update to its record's ``aborted_calls``."""
        await self._write(lambda conn: updates.count_aborted(conn, update_id, calls))

    async def finish_update(
        self,
        update_id: str,
        state: UpdateState,
        *,
        error: str | None = None,
        relabel: Collection[str] = (),
        **values: Any,
    ) -> WeightUpdate:
        now = self.clock()
        return await self._write(
            lambda conn: updates.finish(conn, update_id, state, now, error=error, relabel=relabel, **values)
        )

    async def get_update(self, update_id: str) -> WeightUpdate:
        return await self._read(lambda conn: updates.get(conn, update_id))

    async def list_updates(self, alias: str | None = None, limit: int = 50) -> list[WeightUpdate]:
        return await self._read(lambda conn: updates.page(conn, alias, limit))

    async def open_updates(self) -> list[WeightUpdate]:
        return await self._read(updates.open_updates)
