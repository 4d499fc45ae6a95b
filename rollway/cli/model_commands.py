"""What ``rollway models`` does (``rollway/cli/models.py`` declares its commands and imports this lazily): the
aliases as a table that fits the terminal (three layouts, widest first, each backend's health beside it), put,
swap, pause, resume, delete and drain, and a warning for a backend the server cannot reach."""

from __future__ import annotations

from typing import Any, Literal

import click
from rich.markup import escape

from rollway.admin.client import AsyncRollwayClient
from rollway.admin.model_schemas import BackendView, ModelView
from rollway.cli.commands import Connection, err_console, out_console, print_json, run
from rollway.cli.tables import FitTable, Kind, render


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
