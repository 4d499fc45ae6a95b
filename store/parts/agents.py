"""The remote-agent-server part of ``Store`` (``store.sql.agents``): a mixin over the same plumbing."""

from __future__ import annotations

from typing import Any

from rollway.store.parts.plumbing import StorePlumbing
from rollway.store.schemas import AgentServer, Attempt, AttemptedRollout, RemoteCompletion
from rollway.store.sql import agents


class AgentsMixin(StorePlumbing):
    async def put_agent(self, server: AgentServer) -> AgentServer:
        """Register (or replace) a remote agent server."""
        now = self.clock()
        return await self._write(lambda conn: agents.put(conn, server, now, self.cipher))

    async def get_agent(self, name: str) -> AgentServer:
        return await self._read(lambda conn: agents.get(conn, name, self.cipher))

    async def list_agents(self) -> list[AgentServer]:
        return await self._read(lambda conn: agents.list_all(conn, self.cipher))

    async def delete_agent(self, name: str) -> None:
        await self._write(lambda conn: agents.remove(conn, name))

    async def claim_for_agent(self, name: str, limit: int = 1) -> list[AttemptedRollout]:
        """Queued tasks of agent server ``name``, within its free concurrency slots (never a runner's task)."""
        now = self.clock()
        return await self._write(lambda conn: agents.claim(conn, name, limit, now))

    async def undispatched_attempts(
        self, name: str, started_before: float, marked_before: float | None = None
    ) -> list[AttemptedRollout]:
        """Attempts of server ``name`` whose init was lost with the process sending it (``agents.undispatched``)."""
        marked = started_before if marked_before is None else marked_before
        return await self._read(lambda conn: agents.undispatched(conn, name, started_before, marked))

    async def record_dispatch(self, rollout_id: str, attempt_id: str, info: dict[str, Any]) -> bool:
        """Merge dispatch facts (tools, tries, error) into the attempt's metadata under ``dispatch``."""
        return await self._write(lambda conn: agents.record_dispatch(conn, rollout_id, attempt_id, info))

    async def complete_remote(self, report: RemoteCompletion, attempt_id: str | None = None) -> tuple[Attempt, bool]:
        """An agent server's completion report: (the attempt, whether it was a duplicate that changed nothing)."""
        now = self.clock()
        result = await self._write(lambda conn: agents.complete(conn, report, attempt_id, now))
        if not result[1]:
            self._notify_all()
        return result

    async def record_lease(self, rollout_id: str, attempt_id: str, lease: dict[str, Any] | None) -> bool:
        """Keep (None: drop) an Osmosis 0.3 polling lease on the attempt (``agents.record_lease``)."""
        return await self._write(lambda conn: agents.record_lease(conn, rollout_id, attempt_id, lease, self.cipher))

    async def agent_leases(self, name: str) -> list[tuple[AttemptedRollout, dict[str, Any]]]:
        """The live attempts of agent server ``name`` with their polling leases (``agents.leases``)."""
        return await self._read(lambda conn: agents.leases(conn, name, self.cipher))
