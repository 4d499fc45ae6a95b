"""The ``rollway`` command line."""

from __future__ import annotations

import sys
from typing import Any

import click
from pydantic import ValidationError

from gateway.settings import Settings


def _settings_help() -> str:
    lines = ["\b", "Settings (environment variables; also keys of the --config YAML file):"]
    for name, field in Settings.model_fields.items():
        default = "unset" if field.default is None else repr(field.default)
        lines.append(f"  ROLLWAY_{name.upper():<20} {field.description or ''} [default: {default}]")
    return "\n".join(lines)


@click.group(epilog=_settings_help())
@click.version_option(package_name="rollway", prog_name="rollway")
def main() -> None:
    """Rollway: an OpenAI-compatible LLM gateway for agent RL, with an embedded rollout store."""


@main.command(epilog=_settings_help())
@click.option("--host", default=None, help="Address to listen on [default: 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port to listen on [default: 8080].")
@click.option("--db", "database_url", default=None, help="Database URL or SQLite file [default: ./rollway.db].")
@click.option("--config", "config_file", default=None, help="YAML file with settings.")
def serve(host: str | None, port: int | None, database_url: str | None, config_file: str | None) -> None:
    """Start the gateway and the store on one port."""
    overrides: dict[str, Any] = {
        k: v
        for k, v in {"host": host, "port": port, "database_url": database_url, "config_file": config_file}.items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)
        settings.check_exposure()
    except (ValidationError, ValueError) as exc:
        click.echo(f"rollway: {exc}", err=True)
        sys.exit(2)

    import uvicorn

    from gateway.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        loop="uvloop",
        http="httptools",
        timeout_graceful_shutdown=10,
    )


@main.command("mock-backend")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8001, show_default=True, help="Port to listen on (0: any free port).")
@click.option("--latency-ms", type=float, default=0.0, show_default=True, help="Wait before answering.")
@click.option("--ttft-ms", type=float, default=0.0, show_default=True, help="Time to the first token.")
@click.option("--token-delay-ms", type=float, default=0.0, show_default=True, help="Time between tokens.")
@click.option("--model", "models", multiple=True, help="A model name to serve (repeatable) [default: mock-model].")
@click.option("--strict-models", is_flag=True, help="Answer 404 for models not listed.")
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="Log every request.")
@click.option("--log-level", default="info", show_default=True, help="uvicorn's log level.")
def mock_backend(
    host: str,
    port: int,
    latency_ms: float,
    ttft_ms: float,
    token_delay_ms: float,
    models: tuple[str, ...],
    strict_models: bool,
    access_log: bool,
    log_level: str,
) -> None:
    """Run a mock inference backend (vLLM-like, deterministic, no GPU); script faults over HTTP at /mock/*."""
    from gateway.mock import MockConfig, serve

    config = MockConfig(
        models=models or ("mock-model",),
        strict_models=strict_models,
        latency_ms=latency_ms,
        ttft_ms=ttft_ms,
        token_delay_ms=token_delay_ms,
    )
    serve(config, host=host, port=port, log_level=log_level, access_log=access_log)
