"""What the admin commands of ``rollway`` do (``rollway/cli/main.py`` declares them and imports this lazily), and
what they share (the connection, the consoles, ``run``): calls through the admin client, rich tables for people,
``--json`` for scripts, progress bars on long work. ``rollway models`` is ``model_commands.py``'s, the exports
``exports.py``'s, the rollouts ``rollouts.py``'s.

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

from rich.console import Console
from rich.markup import escape

from rollway.admin.client import AsyncRollwayClient, RollwayAPIError, RollwayError
from rollway.admin.schemas import AgentView
from rollway.cli.tables import FitTable, render
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
        ("protocol", "name"),
        ("max concurrent", "text"),
        ("api key", "text"),
        ("completion params", "text"),
    )
    for a in agents:
        params = json.dumps(a.completion_params) if a.completion_params else ""
        table.add_row(
            escape(a.name),
            escape(a.url),
            a.protocol or "auto",  # auto: told from the server's /health
            str(a.max_concurrent or "∞"),
            "set" if a.has_api_key else "",
            escape(params),
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
