"""The plumbing of ``rollway``'s admin commands: each talks to a running gateway through the admin client
(its implementation in ``rollway/cli/commands.py``, imported when the command runs); and the check of a file
argument a command writes to (``parent_exists``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


def admin_command(group: click.Group, name: str) -> Callable[[Callable[..., None]], click.Command]:
    """A command that talks to a running gateway: it takes ``--url``/``--token`` (else the global ones) and
    receives them as its first argument, a ``Connection``."""

    def decorate(function: Callable[..., None]) -> click.Command:
        @functools.wraps(function)
        def command(url: str | None, token: str | None, **kwargs: Any) -> None:
            from rollway.cli.commands import Connection

            root = click.get_current_context().find_root().params
            function(Connection(url or root["url"], token or root["token"]), **kwargs)

        command = click.option("--token", default=None, help="Admin token (overrides the global --token).")(command)
        command = click.option("--url", default=None, help="Gateway URL (overrides the global --url).")(command)
        return group.command(name)(command)

    return decorate


JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def parent_exists(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file to write must be in a directory that exists: checked before any work (an export, a whole demo)
    is done, rather than failing with a traceback when the result is written."""
    if value is not None and value != "-":
        folder = Path(value).expanduser().parent
        if not folder.is_dir():
            raise click.BadParameter(f"the directory {folder} does not exist", ctx=ctx, param=param)
    return value
