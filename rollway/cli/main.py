"""The ``rollway`` command line.

``rollway --help`` and the admin commands must start fast: at import this module needs click and nothing else
(no pydantic, no settings, no store); each command imports what it uses when it runs.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click

from rollway.cli.admin import JSON_OPTION, admin_command, parent_exists
from rollway.cli.agents import agents
from rollway.cli.export_commands import export, triplets
from rollway.cli.keys import keys
from rollway.cli.models import models

if TYPE_CHECKING:
    from rollway.cli.commands import Connection

DEFAULT_URL = "http://127.0.0.1:8080"
ROLLOUT_STATUSES = click.Choice(["queuing", "preparing", "running", "succeeded", "failed", "requeuing", "cancelled"])


class SettingsHelpGroup(click.Group):
    """A group whose help ends with every ``ROLLWAY_*`` setting, read when help is shown (not at import)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _settings_epilog(self, ctx, formatter)


class SettingsHelpCommand(click.Command):
    """A command whose help ends with every ``ROLLWAY_*`` setting, read when help is shown (not at import)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _settings_epilog(self, ctx, formatter)


def _settings_epilog(command: click.Command, ctx: click.Context, formatter: click.HelpFormatter) -> None:
    """The settings as a section like click's own (``Options:``), wrapped to the terminal's width."""
    from rollway.cli.settings_doc import TITLE, settings_rows

    click.Command.format_epilog(command, ctx, formatter)  # an epilog of its own, if it is given one
    with formatter.section(TITLE):
        formatter.write_dl(settings_rows())


@click.group(cls=SettingsHelpGroup)
@click.version_option(package_name="rollway", prog_name="rollway")
@click.option(
    "--url",
    envvar="ROLLWAY_URL",
    default=DEFAULT_URL,
    show_default=True,
    help="Gateway URL for admin commands [env: ROLLWAY_URL].",
)
@click.option("--token", envvar="ROLLWAY_ADMIN_TOKEN", default=None, help="Admin token [env: ROLLWAY_ADMIN_TOKEN].")
def main(url: str, token: str | None) -> None:
    """Rollway: an OpenAI-compatible LLM gateway for agent RL, with an embedded rollout store."""


@main.command(cls=SettingsHelpCommand)
@click.option("--host", default=None, help="Address to listen on [default: 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port to listen on [default: 8080].")
@click.option("--db", "database_url", default=None, help="Database URL or SQLite file [default: ./rollway.db].")
@click.option("--workers", default=None, help="Server processes on the port, or 'auto' (one per core) [default: 1].")
@click.option("--config", "config_file", default=None, help="YAML file with settings.")
def serve(
    host: str | None, port: int | None, database_url: str | None, workers: str | None, config_file: str | None
) -> None:
    """Start the gateway and the store on one port."""
    needs_server("serve")
    from pydantic import ValidationError

    from rollway.settings import Settings, error_summary

    given = {"host": host, "port": port, "database_url": database_url, "workers": workers, "config_file": config_file}
    overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    try:
        settings = Settings(**overrides)
        settings.check_exposure()
    except ValidationError as exc:
        click.echo(f"rollway: invalid settings: {error_summary(exc)}", err=True)
        sys.exit(2)
    except ValueError as exc:
        click.echo(f"rollway: {exc}", err=True)
        sys.exit(2)
    taken = port_in_use(settings.host, settings.port)
    if taken is not None:
        click.echo(f"rollway: {taken}", err=True)
        sys.exit(2)

    from rollway.app.serving import serve as run_server

    if settings.port:  # (port 0: the address is only known once bound; uvicorn's own line gives it)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(settings.host, settings.host)  # (all: here)
        host = f"[{host}]" if ":" in host else host
        click.echo(f"rollway: the dashboard is at http://{host}:{settings.port}/ui", err=True)
    sys.exit(run_server(settings))


#: The modules of the ``server`` extra that the serving commands import (``pip install rollway`` is the client).
SERVER_MODULES = (
    *("fastapi", "uvicorn", "pydantic_settings", "sqlalchemy", "sqlmodel", "alembic", "yaml", "orjson"),
    *("aiohttp", "cryptography", "prometheus_client"),
)


def needs_server(command: str, extra: str = "server") -> None:
    """Exit with the install command when the server's packages are missing, rather than a traceback."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except ImportError:
            return True

    missing = [name for name in SERVER_MODULES if absent(name)]
    if missing:
        click.echo(
            f"rollway: 'rollway {command}' needs the server, an extra of the client install:"
            f" pip install 'rollway[{extra}]' (not installed: {', '.join(missing)})",
            err=True,
        )
        sys.exit(2)


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None. Asked before the store is opened: uvicorn finds out
    only after start-up, when a second ``rollway serve`` has already opened (and migrated) the database of the
    first, and says so among its log lines. Bound as uvicorn binds (``SO_REUSEADDR``), so a port in TIME_WAIT
    is free."""
    import socket

    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            busy = exc.errno == errno.EADDRINUSE
            return f"cannot listen on {host}:{port}: " + (
                "the port is in use (another rollway serve?): stop that server or give another --port"
                if busy
                else exc.strerror or str(exc)
            )
    return None


@main.command("mock-backend")
@click.option(
    "--flavor",
    type=click.Choice(["vllm", "sglang"]),
    default="vllm",
    show_default=True,
    help="The engine to play: vLLM 0.32 or SGLang 0.5.23 (routes, answer shapes, token-id fields).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8001, show_default=True, help="Port to listen on (0: any free port).")
@click.option("--latency-ms", type=float, default=0.0, show_default=True, help="Wait before answering.")
@click.option("--ttft-ms", type=float, default=0.0, show_default=True, help="Time to the first token.")
@click.option("--token-delay-ms", type=float, default=0.0, show_default=True, help="Time between tokens.")
@click.option("--model", "models", multiple=True, help="A model name to serve (repeatable) [default: mock-model].")
@click.option("--strict-models", is_flag=True, help="Answer 404 for models not listed.")
@click.option(
    "--dev-mode/--no-dev-mode",
    default=True,
    show_default=True,
    help="Serve vLLM's weight routes (/collective_rpc, /pause, /weight_info ...), as VLLM_SERVER_DEV_MODE=1 does.",
)
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="Log every request.")
@click.option("--log-level", default="info", show_default=True, help="uvicorn's log level.")
def mock_backend(
    flavor: Literal["vllm", "sglang"],
    host: str,
    port: int,
    latency_ms: float,
    ttft_ms: float,
    token_delay_ms: float,
    models: tuple[str, ...],
    strict_models: bool,
    dev_mode: bool,
    access_log: bool,
    log_level: str,
) -> None:
    """Run a mock inference backend (vLLM- or SGLang-like, deterministic, no GPU); script faults over HTTP at
    /mock/*."""
    needs_server("mock-backend")
    from rollway.mock import MockConfig, serve

    config = MockConfig(
        flavor=flavor,
        models=models or ("mock-model",),
        strict_models=strict_models,
        latency_ms=latency_ms,
        ttft_ms=ttft_ms,
        token_delay_ms=token_delay_ms,
        dev_mode=dev_mode,
    )
    serve(config, host=host, port=port, log_level=log_level, access_log=access_log)


# -- admin commands (implementations in rollway/cli/commands.py, imported when a command runs) ---------------


@main.group()
def tasks() -> None:
    """Enqueue tasks."""


@admin_command(tasks, "enqueue")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "--group-size",
    type=click.IntRange(1, 4096),
    default=None,
    help="Rollouts per task (a GRPO group); for lines sharing a group_id, the size of that group.",
)
@click.option("--mode", type=click.Choice(["train", "val", "test"]), default=None, help="Mode of every task.")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=1000, show_default=True, help="Tasks per call.")
@JSON_OPTION
def tasks_enqueue(
    connection: Connection, file: str, group_size: int | None, mode: str | None, batch_size: int, as_json: bool
) -> None:
    """Enqueue the tasks of a JSON Lines FILE ('-': stdin): one per line, either a task object with "input"
    (and optionally mode, group_id, group_size, config, metadata, priority, ...) or a bare input.

    A line with a group_size (its own, or --group-size) is a task of that many rollouts, in a new group or the
    group_id it names. Lines that share a group_id and a group_size are instead the members of that group, one
    rollout each, and the group_size is the group's size: it is complete (exported) once that many members
    finished, those of the file and any that join it later (direct starts, other files). They are sent in one
    request; more lines than the size, or different sizes, are refused before anything is sent. Lines sharing a
    group_id with no size join the group, which is as large as its members."""
    from rollway.cli.commands import enqueue

    enqueue(connection, file, group_size, mode, batch_size, as_json)


@main.group()
def rollouts() -> None:
    """Inspect rollouts."""


@admin_command(rollouts, "show")
@click.argument("rollout_id")
@JSON_OPTION
def rollouts_show(connection: Connection, rollout_id: str, as_json: bool) -> None:
    """Show one rollout: its attempts, its calls (tokens, logprobs) and its reward."""
    from rollway.cli.rollouts import show_rollout

    show_rollout(connection, rollout_id, as_json)


@admin_command(rollouts, "list")
@click.option("--status", "statuses", multiple=True, type=ROLLOUT_STATUSES, help="Only these statuses (repeatable).")
@click.option("--mode", default=None, help="Only this mode.")
@click.option("--group-id", default=None, help="Only this group.")
@click.option("--model", default=None, help="Only rollouts that called this model alias.")
@click.option("--newest-first", is_flag=True, help="Newest rollouts first (pass it again with --cursor).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True, help="Rollouts per page.")
@click.option("--cursor", default=None, help="Continue after a previous page.")
@JSON_OPTION
def rollouts_list(
    connection: Connection,
    statuses: tuple[str, ...],
    mode: str | None,
    group_id: str | None,
    model: str | None,
    newest_first: bool,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List rollouts, oldest first (or newest first)."""
    from rollway.cli.rollouts import RolloutFilter, list_rollouts

    where = RolloutFilter(statuses, mode, group_id, model, "desc" if newest_first else "asc")
    list_rollouts(connection, where, limit, cursor, as_json)


main.add_command(models)
main.add_command(agents)
main.add_command(keys)
main.add_command(triplets)
main.add_command(export)


@main.command()
@click.option(
    "--out", type=click.Path(dir_okay=False), default="demo-triplets.jsonl", show_default=True, callback=parent_exists
)
@click.option(
    "--db",
    type=click.Path(dir_okay=False),
    default=None,
    callback=parent_exists,
    help="SQLite file [default: a temporary one].",
)
@click.option("--problems", type=click.IntRange(1, 1000), default=8, show_default=True, help="Math problems.")
@click.option("--group-size", type=click.IntRange(1, 64), default=4, show_default=True, help="Rollouts per problem.")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Runner workers.")
def demo(out: str, db: str | None, problems: int, group_size: int, workers: int) -> None:
    """Run the whole loop on this machine, no GPU: a mock backend, a gateway, runners with a toy math agent,
    rewards, and the triplets written to OUT."""
    needs_server("demo", extra="demo")  # the demo says itself when only openai is missing
    from rollway.cli.demo import DemoOptions, run_demo

    options = DemoOptions(
        out=Path(out), db=None if db is None else Path(db), problems=problems, group_size=group_size, workers=workers
    )
    sys.exit(run_demo(options))
