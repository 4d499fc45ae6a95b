"""Configuration: ``ROLLWAY_*`` environment variables, then an optional YAML file, then defaults.

Built once at start (``Settings()``) and passed to ``create_app``; nothing reads the environment at import.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from rollway.store import Backend, StoreValidationError
from rollway.store.sql.catalog import Cipher


class ModelSeed(BaseModel):
    """A model alias the configuration creates at start when the store does not have it yet."""

    model_config = ConfigDict(extra="forbid")

    backends: list[Backend] = Field(min_length=1)
    version: str | None = None
    sampling: dict[str, Any] | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROLLWAY_", extra="forbid")

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8080, ge=0, le=65535, description="port to listen on")
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="server processes on the port, each a replica of the store, or 'auto': one per core this "
        "process may run on (docs/deployment.md)",
    )
    database_url: str = Field(
        default="sqlite:///./rollway.db",
        description="sqlite:///path/to/file.db (default) or postgresql://user@host:port/db",
    )
    admin_token: SecretStr | None = Field(
        default=None, description="bearer token for the admin API; required to listen beyond loopback"
    )
    secret_key: SecretStr | None = Field(
        default=None,
        description="a Fernet key that encrypts the backends' and agent servers' API keys in the database (several, "
        "comma-separated: the first encrypts, each decrypts); unset: they are stored in clear",
    )
    pg_pool_size: int = Field(
        default=20,
        ge=1,
        le=1000,
        description="PostgreSQL connections each process keeps open (each worker, each replica): keep processes "
        "times this below the server's max_connections",
    )
    sqlite_synchronous: Literal["NORMAL", "FULL", "EXTRA"] = Field(
        default="NORMAL",
        description="NORMAL survives a killed process; FULL also survives power loss, at a cost per commit",
    )
    watchdog_interval: float = Field(default=1.0, gt=0, description="seconds between watchdog sweeps")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="the server's log level (critical, error, warning, info, debug)"
    )
    access_log: bool = Field(
        default=True, description="log one line per HTTP request (every LLM call is recorded as a span anyway)"
    )
    gateway_auth: Literal["none", "keys"] = Field(
        default="none", description="'keys': data-plane calls need a gateway key (sk-rw-...) or a rollout key (rk-...)"
    )
    connect_timeout: float = Field(default=5.0, gt=0, description="seconds to connect to a backend")
    read_timeout: float = Field(
        default=600.0, gt=0, description="seconds a backend may stay silent before the call fails with 504"
    )
    body_timeout: float = Field(
        default=60.0, gt=0, description="seconds a client has to send its whole request body before a 408"
    )
    write_timeout: float = Field(
        default=300.0,
        gt=0,
        description="seconds a client may leave the answer unread (a stalled or suspended reader) before its call ends",
    )
    shutdown_timeout: int = Field(
        default=10,
        ge=0,
        description="seconds a stopping server (SIGTERM) lets calls in flight finish; then it ends them, each "
        "recorded and its client told",
    )
    keepalive_timeout: int = Field(
        default=75,
        ge=1,
        description="seconds an idle client connection is kept open between requests (agents that pause "
        "between calls keep their pooled connection)",
    )
    idle_timeout: float = Field(
        default=10.0,
        ge=0,
        description="seconds a new client connection may stay silent before its first request; then it is closed "
        "(0: no limit)",
    )
    header_timeout: float = Field(
        default=10.0,
        ge=0,
        description="seconds a client has to send a request's head (request line and headers) once it starts it; "
        "then 408 and the connection is closed (0: no limit)",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=0,
        description="largest request head (request line and headers) accepted; past it 431 and the connection is "
        "closed (0: no limit)",
    )
    max_connections: int = Field(
        default=10_000,
        ge=0,
        description="client connections each process holds at once (0: no limit); past it a new connection gets 503 "
        "and is closed at once; lowered to fit the process's open-file limit (docs/deployment.md)",
    )
    max_response_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description="largest answer (a whole body, or one stream event) taken from a backend; beyond it the call "
        "fails with 502 response_too_large",
    )
    max_calls_in_flight: int = Field(
        default=0,
        ge=0,
        description="most LLM calls this process runs at once (0: no limit); past it a call is refused at once with "
        "503 and Retry-After (the OpenAI SDKs retry it), nothing recorded, instead of queueing",
    )
    score_missing_logprobs: bool = Field(
        default=True,
        description="when a vLLM or SGLang engine gives a completion's token ids without a logprob for every output "
        "token (Responses tool calls and streams, SGLang's streamed chat), have the same engine score the output "
        "before the span is written: the span then says rollway.logprobs_source=scored",
    )
    upstream_retries: int = Field(default=3, ge=0, le=10, description="retries on connect errors, 5xx and 429")
    retry_max_wait: float = Field(default=10.0, ge=0, description="longest wait before one retry (Retry-After cap)")
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="largest request body accepted")
    pause_wait_seconds: float = Field(
        default=30.0, ge=0, description="how long a call waits on a paused model before 429"
    )
    version_check_interval: float = Field(
        default=30.0,
        ge=0,
        description="seconds between asking each vLLM/SGLang engine for its weight version, to flag one that differs "
        "from the version its calls are recorded under (0: never)",
    )
    public_url: str | None = Field(
        default=None, description="the URL agents reach this server at (for claim base_urls); default: as requested"
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="host names requests may be addressed to (Host), comma-separated, besides loopback names, "
        "ROLLWAY_PUBLIC_URL's and the machine's (with an admin token, also IP addresses); '.example.org' allows its "
        "subdomains, '*' any name (docs/security.md)",
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="'text': key=value lines; 'json': one JSON object per line (both with request_id)"
    )
    api_docs: bool = Field(
        default=False,
        description="serve /docs and /redoc, the OpenAPI document as pages; they load Swagger UI and ReDoc from a "
        "CDN when opened (off: no third-party script on this origin; /openapi.json is served either way)",
    )
    metrics_token: SecretStr | None = Field(
        default=None, description="when set, GET /metrics needs 'Authorization: Bearer <this token>'; else open"
    )
    otlp_export_endpoint: str | None = Field(
        default=None,
        description="send the gateway's spans to this OTLP/HTTP collector (e.g. http://collector:4318/v1/traces)",
    )
    otlp_export_queue: int = Field(
        default=10_000, ge=1, description="spans waiting for export beyond this are dropped (and counted)"
    )
    otlp_export_batch: int = Field(default=512, ge=1, le=10_000, description="most spans sent in one export request")
    otlp_export_interval: float = Field(default=1.0, gt=0, description="seconds between exports of a partial batch")
    otlp_export_timeout: float = Field(default=5.0, gt=0, description="seconds one export request may take")
    agent_init_retries: int = Field(
        default=3, ge=0, le=10, description="retries of a remote agent server's /v1/rollout/init (5xx, 429, no answer)"
    )
    agent_init_timeout: float = Field(
        default=10.0, gt=0, description="seconds a remote agent server has to answer init"
    )
    agent_poll_interval: float = Field(
        default=0.5, gt=0, description="longest wait before the dispatcher looks for remote-agent tasks again"
    )
    agl_model: str | None = Field(
        default=None,
        description="the model every call through Agent-lightning 1.0's /proxy/... is sent to (its "
        "default_proxy.model_name); unset: the one model registered through /api/models",
    )
    agl_train_temperature: float = Field(
        default=1.0, ge=0, description="temperature of every train-mode call through /proxy/... (Agent-lightning 1.0)"
    )
    agl_val_temperature: float = Field(
        default=0.7, ge=0, description="temperature of every val-mode call through /proxy/... (Agent-lightning 1.0)"
    )
    models: dict[str, ModelSeed] = Field(
        default_factory=dict,
        description="model aliases created at start when the store lacks them (YAML: alias: {backends, version, "
        "sampling}); an existing alias is left as it is",
    )
    config_file: Path | None = Field(default=None, description="optional YAML file with these settings")

    @field_validator("workers", mode="before")
    @classmethod
    def _cores(cls, value: Any) -> Any:
        """``auto``: one worker per core the process may run on (its CPU affinity, which a container's cpuset
        narrows), at most the field's bound."""
        if isinstance(value, str) and value.strip().lower() == "auto":
            affinity = getattr(os, "sched_getaffinity", None)  # (Linux; elsewhere every core counts)
            return min(len(affinity(0)) if affinity else os.cpu_count() or 1, 64)
        return value

    @field_validator("admin_token", "metrics_token", "secret_key")
    @classmethod
    def _not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        """A token set to nothing (``ROLLWAY_ADMIN_TOKEN=``) is a mistake, not a token: refused, so that it can
        neither pass for one (listening beyond loopback) nor lock every caller out."""
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is set but empty: give a token, or leave it unset")
        return value

    @field_validator("public_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        """An http(s) URL with a host: claims' base_urls are built from it, and the Host/Origin guard allows it."""
        if value is not None:
            url = urlsplit(value)
            try:
                _ = url.port  # a port that is not a number raises here
            except ValueError:
                raise ValueError("has a port that is not a number") from None
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError("must be an http:// or https:// URL with a host, e.g. http://rollway.internal:8080")
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _host_list(cls, value: Any) -> Any:
        """A list (YAML) or a comma-separated string (the environment), as lower-case names."""
        names = value.split(",") if isinstance(value, str) else value
        if isinstance(names, list):
            return [str(name).strip().lower().rstrip(".") for name in names if str(name).strip()]
        return value

    @field_validator("secret_key")
    @classmethod
    def _fernet_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            try:
                Cipher(value.get_secret_value())
            except StoreValidationError as exc:
                raise ValueError(exc.message) from None
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_path(init_settings(), env_settings())
        if path is not None:
            try:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
            except yaml.YAMLError as exc:  # said as a setting's error is, not as PyYAML's traceback
                raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from exc
        return tuple(sources)

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_exposure(self) -> None:
        """Refuse to listen on a non-loopback address without an admin token."""
        if not self.is_loopback() and self.admin_token is None:
            raise ValueError(
                f"refusing to listen on {self.host} without an admin token: set ROLLWAY_ADMIN_TOKEN "
                "(or listen on 127.0.0.1)"
            )


def settings_rows() -> list[tuple[str, str]]:
    """Every setting as its environment variable and its description with its default (``rollway --help``,
    which reads the same from this file's source instead: ``rollway.cli.settings_doc``)."""
    rows = []
    for name, field in Settings.model_fields.items():
        value = field.get_default(call_default_factory=True)
        default = "unset" if value is None else repr(value)
        rows.append((f"ROLLWAY_{name.upper()}", f"{field.description or ''} [default: {default}]".lstrip()))
    return rows


def error_summary(exc: ValidationError) -> str:
    """What is wrong with the settings, without the values given (a backend's ``api_key`` may be among them)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'settings'}: {error['msg']}"
        for error in exc.errors(include_url=False, include_input=False)
    )


def _config_path(*layers: dict[str, Any]) -> Path | None:
    for layer in layers:
        if layer.get("config_file"):
            path = Path(layer["config_file"])
            if not path.is_file():
                raise ValueError(f"config file {path} does not exist")
            return path
    return None
