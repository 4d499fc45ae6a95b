"""The served application: health, readiness, the error envelope, settings and the ``rollway serve`` command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from rollway.app.factory import RollwayApp
from rollway.cli.main import main
from rollway.mock import MockBackendProcess
from rollway.settings import Settings
from rollway.store import Store
from support.gateway_harness import app_lifespan, running_gateway


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[RollwayApp]:
    async with app_lifespan(Settings(database_url=f"sqlite:///{tmp_path / 'app.db'}")) as application:
        yield application


@pytest.fixture
async def client(app: RollwayApp) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        yield c


async def test_healthz_and_readyz_answer(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["store"] == "ok"


async def test_readyz_reports_an_unreachable_store(
    app: RollwayApp, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken() -> None:
        raise ConnectionError("database is gone")

    monkeypatch.setattr(app.state.store, "ping", broken)
    response = await client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable"


async def test_unknown_route_answers_in_the_error_envelope(client: httpx.AsyncClient) -> None:
    response = await client.get("/no/such/route")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_settings_come_from_env_then_yaml_then_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "rollway.yaml"
    config.write_text("port: 9001\nwatchdog_interval: 2.5\nlog_level: debug\n")
    monkeypatch.setenv("ROLLWAY_CONFIG_FILE", str(config))
    monkeypatch.setenv("ROLLWAY_PORT", "9002")
    settings = Settings()
    assert settings.port == 9002  # environment beats the file
    assert settings.watchdog_interval == 2.5  # the file beats the default
    assert settings.host == "127.0.0.1"


@pytest.mark.parametrize("cores", [{0}, {0, 1, 2}])
def test_workers_auto_is_one_per_core_the_process_may_run_on(monkeypatch: pytest.MonkeyPatch, cores: set[int]) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setenv("ROLLWAY_WORKERS", "auto")
    assert Settings().workers == len(cores)
    assert Settings(workers="AUTO").workers == len(cores)
    assert Settings(workers="3").workers == 3
    with pytest.raises(ValueError, match="workers"):
        Settings(workers="many")


def test_admin_token_is_secret_in_settings() -> None:
    settings = Settings(admin_token="s3cret-token")
    assert "s3cret-token" not in repr(settings)
    assert "s3cret-token" not in settings.model_dump_json()


@pytest.mark.parametrize(
    ("host", "token", "refused"),
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        ("0.0.0.0", None, True),
        ("10.1.2.3", None, True),
        ("0.0.0.0", "t0ken", False),
    ],
)
def test_non_loopback_listen_needs_an_admin_token(host: str, token: str | None, refused: bool) -> None:
    settings = Settings(host=host, admin_token=token)
    if refused:
        with pytest.raises(ValueError, match="admin token"):
            settings.check_exposure()
    else:
        settings.check_exposure()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rollway(*args: str, cwd: Path) -> list[str]:
    return [sys.executable, "-c", "from rollway.cli import main; main()", *args]


@pytest.mark.slow
def test_rollway_serve_starts_on_a_sqlite_file_and_answers_health(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
    proc = subprocess.Popen(
        _rollway("serve", "--port", str(port), cwd=tmp_path),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # uvicorn says when it is up
            seen.append(line)
            if "Uvicorn running on" in line:
                break
        assert any("Uvicorn running on" in s for s in seen), "".join(seen)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json() == {"status": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
        assert (tmp_path / "rollway.db").exists()  # the default ./rollway.db
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=20)
    assert "Application shutdown complete" in rest  # SIGTERM shuts down gracefully (store closed)


def _serve_publicly(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    """``rollway serve --host 0.0.0.0`` with no ``ROLLWAY_*`` setting but ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")} | settings
    command = _rollway("serve", "--host", "0.0.0.0", cwd=tmp_path)
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("empty", ["", "  "])
def test_rollway_serve_refuses_an_empty_token(tmp_path: Path, empty: str) -> None:
    """Set to nothing, the token would have passed for one (listening beyond loopback, every admin call 401)."""
    done = _serve_publicly(tmp_path, ROLLWAY_ADMIN_TOKEN=empty)
    assert done.returncode == 2
    assert "admin_token" in done.stderr and "empty" in done.stderr
    assert not (tmp_path / "rollway.db").exists()


def test_rollway_serve_refuses_a_public_address_without_token(tmp_path: Path) -> None:
    done = _serve_publicly(tmp_path)
    assert done.returncode == 2
    assert "ROLLWAY_ADMIN_TOKEN" in done.stderr
    assert not (tmp_path / "rollway.db").exists()


def test_rollway_help_lists_commands_and_settings(tmp_path: Path) -> None:
    done = subprocess.run(_rollway("--help", cwd=tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "serve" in done.stdout
    for name in Settings.model_fields:
        assert f"ROLLWAY_{name.upper()}" in done.stdout


async def test_model_aliases_are_seeded_from_the_config_file_once(tmp_path: Path, mock: MockBackendProcess) -> None:
    """Aliases may be seeded from the configuration file (docs/gateway.md): created at start when absent, served at
    once; an alias the store already has (changed at run time, say) is left as it is."""
    db = f"sqlite:///{tmp_path / 'gateway.db'}"
    store = await Store.open(db, run_watchdog=False)
    await store.put_model("kept", [{"base_url": "http://127.0.0.1:1/v1", "model": "old"}], version="v9")
    await store.close()
    config = tmp_path / "rollway.yaml"
    config.write_text(
        "models:\n"
        "  policy:\n"
        "    version: v1\n"
        "    sampling: {temperature: 0.5}\n"
        "    backends:\n"
        f"      - {{base_url: '{mock.base_url}', kind: vllm, model: mock-model, api_key: sk-seeded-secret}}\n"
        "  kept:\n"
        f"    backends: [{{base_url: '{mock.base_url}', model: mock-model}}]\n"
    )
    settings = Settings(config_file=config)
    assert "sk-seeded-secret" not in repr(settings) and "sk-seeded-secret" not in settings.model_dump_json()
    async with running_gateway(tmp_path, config_file=config) as gw:
        answer = await gw.client().chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content
        policy, kept = await gw.store.get_model("policy"), await gw.store.get_model("kept")
        assert (policy.version, policy.sampling, policy.backends[0].kind) == ("v1", {"temperature": 0.5}, "vllm")
        assert (kept.version, kept.backends[0].model) == ("v9", "old")
        [request] = mock.requests(path="/v1/chat/completions", limit=1)
        assert (
            request["body"]["temperature"] == 0.5 and request["headers"]["authorization"] == "Bearer sk-seeded-secret"
        )


def test_a_seed_without_backends_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "rollway.yaml"
    config.write_text("models:\n  policy: {backends: []}\n")
    with pytest.raises(ValueError, match="backends"):
        Settings(config_file=config)


@pytest.mark.parametrize(
    "seed",
    [
        "models:\n  policy:\n    backends: [{base_url: 'http://b/v1', api_key: sk-live-SECRET123}]\n",  # no model
        "models:\n  policy:\n    backend: [{base_url: 'http://b/v1', model: m, api_key: sk-live-SECRET123}]\n",
    ],
)
def test_a_refused_config_names_the_fault_but_not_the_values(tmp_path: Path, seed: str) -> None:
    config = tmp_path / "rollway.yaml"
    config.write_text(seed)
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert "invalid settings: models.policy.backend" in result.output
    assert "sk-live-SECRET123" not in result.output


def test_rollway_serve_on_a_file_in_a_missing_directory_says_so_without_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAY_")}
    command = _rollway("serve", "--port", str(_free_port()), "--db", str(tmp_path / "missing" / "x.db"), cwd=tmp_path)
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert f"the directory {tmp_path / 'missing'} does not exist" in output
    assert "Traceback" not in output


def test_a_second_rollway_serve_on_a_taken_port_says_so_before_opening_its_database(tmp_path: Path) -> None:
    with socket.socket() as first:  # the first server
        first.bind(("127.0.0.1", 0))
        first.listen()
        port = first.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--port", str(port), "--db", str(tmp_path / "x.db")])
    assert result.exit_code == 2
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in result.output
    assert not (tmp_path / "x.db").exists()  # the store was not opened (nor migrated) for nothing


def test_a_config_file_that_is_not_yaml_is_named_without_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "rollway.yaml"
    config.write_text("port: [\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(config)], catch_exceptions=False)
    assert result.exit_code == 2
    assert f"rollway: config file {config} is not valid YAML" in result.output and "line 2" in result.output


async def test_api_docs_pages_are_off_unless_asked_for_and_the_openapi_document_is_always_served(
    tmp_path: Path,
) -> None:
    """``/docs`` and ``/redoc`` load Swagger UI and ReDoc from a CDN when opened: a third-party script on the
    admin API's origin, and a blank page on a cluster without internet. They are served only with
    ``ROLLWAY_API_DOCS``; ``/openapi.json`` (clients, the fuzz test) is served either way."""
    async with running_gateway(tmp_path, database_url=f"sqlite:///{tmp_path / 'off.db'}") as gw, gw.http() as http:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            answer = await http.get(path)
            assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error", path
        document = (await http.get("/openapi.json")).json()
        assert "/admin/v1/rollouts" in document["paths"] and document["info"]["title"] == "Rollway"
    async with running_gateway(tmp_path, api_docs=True) as gw, gw.http() as http:
        page = await http.get("/docs")
        assert page.status_code == 200 and "swagger-ui" in page.text and "/openapi.json" in page.text
        assert (await http.get("/redoc")).status_code == 200
        assert (await http.get("/openapi.json")).status_code == 200
