"""Remote agent servers (``/admin/v1/agents``): register, list, show, remove. Tasks enqueued with
``agent: <name>`` are dispatched to the server (Osmosis protocol) by ``rollway.osmosis.dispatcher``. A server's
``api_key`` is accepted here and never returned."""

from __future__ import annotations

from fastapi import APIRouter, Path, Response

from rollway.admin.context import Context
from rollway.admin.route import AdminRoute
from rollway.admin.schemas import AgentPage, AgentPut, AgentView
from rollway.store import AgentServer

router = APIRouter(tags=["agents"], route_class=AdminRoute)

NAME = Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")


@router.get("/agents", response_model=AgentPage)
async def list_agents(context: Context) -> AgentPage:
    return AgentPage(items=[AgentView.of(s) for s in await context.store.list_agents()])


@router.get("/agents/{name}", response_model=AgentView)
async def get_agent(context: Context, name: str = NAME) -> AgentView:
    return AgentView.of(await context.store.get_agent(name))


@router.put("/agents/{name}", response_model=AgentView)
async def put_agent(body: AgentPut, context: Context, name: str = NAME) -> AgentView:
    """Register or replace a remote agent server; its queued tasks are dispatched from now on."""
    server = AgentServer(name=name, **body.model_dump(exclude={"api_key"}), api_key=body.api_key)
    saved = await context.store.put_agent(server)
    context.store.queued.notify()  # wake the dispatcher: tasks may be waiting for this server
    return AgentView.of(saved)


@router.delete("/agents/{name}", status_code=204)
async def delete_agent(context: Context, name: str = NAME) -> Response:
    """Unregister a server; its queued tasks wait until a server of that name is registered again."""
    await context.store.delete_agent(name)
    return Response(status_code=204)
