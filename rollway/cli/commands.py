"""What the admin commands of ``rollway`` do (``rollway/cli/main.py`` and its neighbours ``models.py`` and
``export_commands.py`` declare them, and import this lazily):
calls through the admin client, rich tables for people, ``--json`` for scripts, progress bars on long work.

Results go to stdout; progress, notes and errors to stderr. Tables never split a word across lines
(``rollway.cli.tables``); on a terminal, messages are wrapped between words at its width, and elsewhere (a pipe,
a log file) each is one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Literal, TypeVar

import click
from rich.console import Console
from rich.markup import escape

from rollway.admin.client import AsyncRollwayClient, RollwayAPIError, RollwayError
from rollway.admin.model_schemas import BackendView, ModelView
from rollway.admin.schemas import AgentView
from rollway.cli.tables import FitTable, Kind, render
from rollway.store import Rollout

if TYPE_CHECKING:
    from rich.progress import Progress

T = TypeVar("T")
STATUS_STYLE = {
    "succeeded": "green",
    "failed": "red",
    "cancelled": "dim",
    "running": "cyan",
    "preparing": "cyan",
    "queuing": "yellow",
    "requeuing": "yellow",
}


@dataclass(frozen=True)
class Connection:
    url: str
    token: str | None

    def client(self) -> AsyncRollwayClient:
        return AsyncRollwayClient(self.url, self.token)


def out_console() -> Console:
    """Results (stdout). Markup is ours; ``:name:`` emoji codes are not read (an alias or a URL may hold one)."""
    return Console(emoji=False)


def err_console() -> Console:
    """Progress, notes and errors (stderr). On a terminal Rich wraps a message between words at its width; to
    a pipe or a file each message stays one line, whatever width Rich would assume."""
    console = Console(stderr=True, emoji=False)
    console.soft_wrap = not console.is_terminal
    return console


def run(connection: Connection, work: Callable[[AsyncRollwayClient], Awaitable[T]]) -> T:
    """Run ``work`` with a client; a failed call ends the command with status 1 and the server's message."""

    async def main() -> T:
        async with connection.client() as client:
            return await work(client)

    try:
        return asyncio.run(main())
    except RollwayAPIError as exc:
        err_console().print(
            f"[red]rollway: {exc.status} {exc.type or 'error'}:[/] {escape(exc.message)}", highlight=False
        )
        if exc.status == 401:
            given = "the admin token given (--token or ROLLWAY_ADMIN_TOKEN) was refused"
            err_console().print(
                "give the admin token with --token or ROLLWAY_ADMIN_TOKEN" if connection.token is None else given
            )
    except RollwayError as exc:
        err_console().print(
            f"[red]rollway: cannot reach {escape(connection.url)}:[/] {escape(str(exc))}", highlight=False
        )
    sys.exit(1)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, ensure_ascii=False, indent=2) + "\n")


def when(timestamp: float | None) -> str:
    """A short local time: the clock for today, else the date too."""
    if timestamp is None:
        return ""
    moment = time.localtime(timestamp)
    today = time.localtime()[:3] == moment[:3]
    return time.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M", moment)


# -- tasks ---------------------------------------------------------------------------------------------------


def read_tasks(path: str, group_size: int | None, mode: str | None) -> list[dict[str, Any]]:
    """One task per line: a task object (with ``input``) or a bare input; blank lines are skipped."""
    tasks: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        lines: IO[str] = sys.stdin if path == "-" else stack.enter_context(open(path, encoding="utf-8"))
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc.msg}") from None
            task = dict(item) if isinstance(item, dict) and "input" in item else {"input": item}
            if group_size is not None:
                task.setdefault("group_size", group_size)
            if mode is not None:
                task.setdefault("mode", mode)
            tasks.append(task)
    return tasks


def requests(tasks: list[dict[str, Any]], batch: int) -> list[list[dict[str, Any]]]:
    """The tasks in requests of up to ``batch``, in file order, except that the lines sharing a ``group_id`` and
    naming a ``group_size`` (``--group-size`` gives it to lines without one) are the members of a group of that
    size, sent together in one request where the group's first line is (even past ``batch``): alone in a
    request, a member would be a task of ``group_size`` rollouts (``store.sql.groups``). Lines of one group that
    give different sizes, a size to some and none to others, or more lines than the size are refused before
    anything is sent."""
    lines: dict[str, list[dict[str, Any]]] = {}
    for task in tasks:
        if isinstance(task.get("group_id"), str):
            lines.setdefault(task["group_id"], []).append(task)
    members: set[str] = set()
    for group_id, group in lines.items():
        size = group[0].get("group_size")
        if len(group) == 1 or all(t.get("group_size") is None for t in group):
            continue  # a lone line (its group_size rollouts), or lines joining the group as they come
        if any(t.get("group_size") != size for t in group):
            raise ValueError(
                f"the lines of group '{group_id}' must all name the same group_size (or all none; --group-size "
                "gives one to lines without it)"
            )
        if isinstance(size, int) and len(group) > size:
            raise ValueError(f"group '{group_id}' has {len(group)} lines, more than its group_size {size}")
        members.add(group_id)
    units: list[list[dict[str, Any]]] = []
    for task in tasks:
        named = task.get("group_id")
        if not isinstance(named, str) or named not in members:
            units.append([task])
        elif task is lines[named][0]:
            units.append(lines[named])  # the others come with it
    out: list[list[dict[str, Any]]] = []
    for unit in units:
        if out and len(out[-1]) + len(unit) <= batch:
            out[-1].extend(unit)
        else:
            out.append(list(unit))
    return out


def enqueue(
    connection: Connection, path: str, group_size: int | None, mode: str | None, batch: int, as_json: bool
) -> None:
    try:
        tasks = read_tasks(path, group_size, mode)
        chunks = requests(tasks, batch)
    except (OSError, ValueError) as exc:
        err_console().print(f"[red]rollway:[/] {escape(str(exc))}", highlight=False)
        sys.exit(2)

    async def work(client: AsyncRollwayClient) -> list[Rollout]:
        rollouts: list[Rollout] = []
        with progress_bar(counted=True) as progress:
            task_id = progress.add_task("Enqueuing", total=len(tasks))
            for chunk in chunks:
                rollouts.extend(await client.enqueue(chunk))
                progress.advance(task_id, len(chunk))
        return rollouts

    rollouts = run(connection, work)
    if as_json:
        print_json({"tasks": len(tasks), "rollout_ids": [r.rollout_id for r in rollouts]})
        return
    groups = {r.group_id for r in rollouts if r.group_id}
    out_console().print(
        f"Enqueued [bold]{len(tasks)}[/] tasks → [bold]{len(rollouts)}[/] rollouts"
        + (f" in {len(groups)} groups" if groups else "")
    )


def progress_bar(counted: bool) -> Progress:
    """A progress display on stderr: a bar with n/total when the total is known, else a running count."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if counted:
        columns += [BarColumn(), MofNCompleteColumn()]
    else:
        columns += [TextColumn("{task.completed} rows")]
    return Progress(*columns, TimeElapsedColumn(), console=err_console(), transient=False)


# -- models --------------------------------------------------------------------------------------------------


def models_table(models: list[ModelView], layout: Literal["wide", "stacked", "narrow"] = "wide") -> FitTable:
    """One row per backend. ``stacked``: each backend's URL under its model name, one column fewer; ``narrow``
    (for a terminal too narrow for that): four columns, each holding what the wider layouts spread over two or
    three, so that a list of models is a table at any usual width."""
    narrow = layout == "narrow"
    head: list[tuple[str, Kind]] = [("alias", "name"), ("state", "name")]
    if not narrow:
        head = [("alias", "name"), ("version", "name"), ("state", "name"), ("busy", "name"), ("backend", "id")]
        head += [("kind", "name"), ("health", "name")]
    else:
        head.append(("backend", "name"))
    tail: list[tuple[str, Kind]] = (
        [("model", "name"), ("url", "name")] if layout == "wide" else [("model / url", "name")]
    )
    table = FitTable(*head, *tail)
    for m in models:
        state = "[yellow]paused[/]" if m.state.paused else "[green]serving[/]"
        busy = str(m.state.in_flight)
        if narrow:
            state += f"\n{busy} in flight"
        if m.capture.untrainable:  # completions that came back without token ids
            state += f"\n[red]{m.capture.untrainable} untrainable[/]"
        if m.capture.without_logprobs:  # token ids, but not a logprob for every output token
            state += f"\n[red]{m.capture.without_logprobs} without logprobs[/]"
        for i, b in enumerate(m.backends):
            model, url = escape(b.model), escape(b.base_url)
            where = [model, url] if layout == "wide" else [f"{model}\n{url}"]
            end = layout != "wide" and i == len(m.backends) - 1  # a line between aliases
            if narrow:
                first = [f"{escape(m.alias)}\n[dim]v{escape(m.version)}[/]", state] if i == 0 else ["", ""]
                backend = f"{escape(b.backend_id)}\n{_kind(b)}\n{_health(b)}"
                table.add_row(*first, backend, *where, end_section=end)
                continue
            first = [escape(m.alias), escape(m.version), state, busy] if i == 0 else ["", "", "", ""]
            table.add_row(*first, escape(b.backend_id), _kind(b), _health(b), *where, end_section=end)
    return table


def _health(backend: BackendView) -> str:
    """Whether the gateway can reach and routes to the backend now: "up", "down", or "?" when it does not say."""
    if backend.up is None:
        return "?"
    return "[green]up[/]" if backend.up else "[red]down[/]"


def _kind(backend: BackendView) -> str:
    """The backend's kind; an ``auto`` one's as detected ("vllm (auto)"), or "auto (?)" until it is."""
    if backend.kind != "auto":
        return escape(backend.kind)
    return f"{escape(backend.detected_kind)} (auto)" if backend.detected_kind else "auto (?)"


def show_models(models: list[ModelView], as_json: bool) -> None:
    if as_json:
        print_json([m.model_dump(mode="json") for m in models])
        return
    console = out_console()
    layouts = (models_table(models), models_table(models, "stacked"), models_table(models, "narrow"))
    console.print(render(console, *layouts))


def backend_spec(
    base_url: str,
    kind: str | None,
    model: str,
    api_key: str | None,
    backend_id: str | None,
    weight: float | None,
    max_concurrency: int | None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"base_url": base_url, "model": model} | ({} if kind is None else {"kind": kind})
    extra = {"api_key": api_key, "backend_id": backend_id, "weight": weight, "max_concurrency": max_concurrency}
    return spec | {k: v for k, v in extra.items() if v is not None}


def model_action(connection: Connection, action: str, alias: str | None, as_json: bool) -> None:
    """``list`` the aliases, or ``pause`` / ``resume`` / ``delete`` one."""

    async def work(client: AsyncRollwayClient) -> list[ModelView]:
        if action == "list":
            return await client.list_models()
        assert alias is not None
        if action == "pause":
            return [await client.pause_model(alias)]
        if action == "resume":
            return [await client.resume_model(alias)]
        if action == "delete":
            await client.delete_model(alias)
            return []
        raise ValueError(f"unknown model action {action!r}")

    models = run(connection, work)
    if action == "delete":
        err_console().print(f"deleted model {alias}", highlight=False)
    elif not models and not as_json:
        err_console().print("no models yet: register one with rollway models put ALIAS --backend URL", highlight=False)
    else:
        show_models(models, as_json)


def drain_model(connection: Connection, alias: str, timeout: float, as_json: bool) -> None:
    """Wait for the alias's calls in flight (every replica); exit 1 if some are left when the time is up."""
    model = run(connection, lambda c: c.drain_model(alias, timeout))
    show_models([model], as_json)
    if not model.drained:
        left = f"{model.state.in_flight} call(s) in flight, or a replica had not reported yet"
        err_console().print(f"{alias} not drained within {timeout:g}s ({left})", highlight=False)
        raise SystemExit(1)


def put_model(connection: Connection, alias: str, backend: dict[str, Any], version: str | None, as_json: bool) -> None:
    model = run(connection, lambda c: c.put_model(alias, [backend], version=version))
    show_models([model], as_json)
    warn_unanswered(model)


def warn_unanswered(model: ModelView) -> None:
    """A warning on stderr for each backend the server cannot reach (or, of kind ``auto``, could not ask what
    engine it is): it is stored all the same (an engine still starting is usual), but its calls fail until it
    answers."""
    for backend in model.backends:
        if backend.up is False or (backend.kind == "auto" and backend.detected_kind is None):
            click.echo(
                f"warning: the backend {backend.base_url} did not answer the server: '{model.alias}' is stored, and "
                "its calls fail (502) until the engine answers",
                err=True,
            )


def swap_model(
    connection: Connection,
    alias: str,
    backend: dict[str, Any] | None,
    version: str | None,
    drain_timeout: float | None,
    as_json: bool,
) -> None:
    backends = None if backend is None else [backend]
    model = run(
        connection, lambda c: c.swap_model(alias, backends, version=version, drain_timeout_seconds=drain_timeout)
    )
    show_models([model], as_json)
    warn_unanswered(model)


# -- keys ----------------------------------------------------------------------------------------------------


def mint_key(
    connection: Connection, scope: Literal["gateway", "admin"], name: str | None, expires: float | None, as_json: bool
) -> None:
    minted = run(connection, lambda c: c.mint_key(scope, name=name, expires_in_seconds=expires))
    if as_json:
        print_json(minted.model_dump(mode="json"))
        return
    sys.stdout.write(minted.key + "\n")
    err_console().print(
        f"key_id {minted.key_id} ({minted.scope}); the key is shown only once — store it now", highlight=False
    )


def revoke_key(connection: Connection, key_id: str) -> None:
    run(connection, lambda c: c.revoke_key(key_id))
    err_console().print(f"revoked {key_id}", highlight=False)


# -- triplets ------------------------------------------------------------------------------------------------


# -- remote agent servers ------------------------------------------------------------------------------------


def show_agents(agents: list[AgentView], as_json: bool) -> None:
    if as_json:
        print_json([a.model_dump(mode="json") for a in agents])
        return
    table = FitTable(
        ("name", "name"),
        ("url", "name"),
        ("max concurrent", "text"),
        ("api key", "text"),
        ("completion params", "text"),
    )
    for a in agents:
        params = json.dumps(a.completion_params) if a.completion_params else ""
        table.add_row(
            escape(a.name), escape(a.url), str(a.max_concurrent or "∞"), "set" if a.has_api_key else "", escape(params)
        )
    console = out_console()
    console.print(render(console, table))


def agents_put(connection: Connection, name: str, as_json: bool, **fields: Any) -> None:
    agent = run(connection, lambda client: client.put_agent(name, **fields))
    show_agents([agent], as_json)


def agents_list(connection: Connection, as_json: bool) -> None:
    show_agents(run(connection, lambda client: client.list_agents()), as_json)


def agents_delete(connection: Connection, name: str) -> None:
    run(connection, lambda client: client.delete_agent(name))
    err_console().print(f"Removed agent server [bold]{escape(name)}[/]")
