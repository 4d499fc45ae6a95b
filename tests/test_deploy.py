"""deploy/compose.yaml: the gateway, the mock backend, Prometheus and Grafana wired to each other.

No Docker daemon here, so the stack is not started: these tests check that its parts name each other
consistently (ports, service names, mounted files, the settings file the gateway reads) and that Prometheus's
own ``promtool`` accepts its configuration.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from rollway.app.guards import HostOriginGuard
from rollway.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    compose = _yaml(DEPLOY / "compose.yaml")
    services: dict[str, Any] = compose["services"]
    return services


def _option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host file of each bind mount (named volumes left out)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (DEPLOY / source).resolve()
    return mounts


def _published(service: dict[str, Any]) -> dict[int, str]:
    """Container port -> host address it is published on."""
    out = {}
    for port in service.get("ports", []):
        host, _, container = port.rpartition(":")
        out[int(container)] = host.rpartition(":")[0]
    return out


def test_every_mounted_file_and_the_build_context_exist(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for target, source in _bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) is missing"
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file(), name


def test_ports_are_published_on_loopback_only(services: dict[str, Any]) -> None:
    published = [host for service in services.values() for host in _published(service).values()]
    assert published and all(host == "127.0.0.1" for host in published)


def test_the_gateway_needs_an_admin_token_and_reads_the_mounted_settings(services: dict[str, Any]) -> None:
    rollway = services["rollway"]
    command = rollway["command"]
    assert _option(command, "--host") == "0.0.0.0"
    # Compose refuses to start without the token (``:?``) rather than passing an empty one.
    assert rollway["environment"]["ROLLWAY_ADMIN_TOKEN"].startswith("${ROLLWAY_ADMIN_TOKEN:?")
    config = _bind_mounts(rollway)[_option(command, "--config")]
    assert int(_option(command, "--port")) in _published(rollway)

    settings = Settings(config_file=config)
    policy = settings.models["policy"]
    [backend] = policy.backends
    assert backend.kind == "vllm"
    url = urlsplit(backend.base_url)
    mock = services["mock"]["command"]
    assert url.hostname == "mock" and url.port == int(_option(mock, "--port"))
    assert backend.model in [mock[i + 1] for i, arg in enumerate(mock) if arg == "--model"]
    # The mock's health check probes the port it listens on (the image's own check is the gateway's).
    assert f":{url.port}/health" in " ".join(services["mock"]["healthcheck"]["test"])


def test_prometheus_scrapes_the_gateway(services: dict[str, Any]) -> None:
    mounts = _bind_mounts(services["prometheus"])
    config = _yaml(mounts["/etc/prometheus/prometheus.yml"])
    [job] = [job for job in config["scrape_configs"] if job["job_name"] == "rollway"]
    assert job["metrics_path"] == "/metrics"
    [target] = job["static_configs"][0]["targets"]
    host, _, port = target.partition(":")
    assert host == "rollway" and port == _option(services["rollway"]["command"], "--port")


def test_the_gateway_answers_the_name_prometheus_scrapes_it_by(services: dict[str, Any]) -> None:
    """The data plane is open (no gateway keys), so the Host guard is on: the service name must be allowed."""
    rollway = services["rollway"]
    environment = {k: v for k, v in rollway["environment"].items() if k != "ROLLWAY_ADMIN_TOKEN"}
    config = _bind_mounts(rollway)[_option(rollway["command"], "--config")]
    settings = Settings(
        config_file=config,
        admin_token="t0ken",
        **{k.removeprefix("ROLLWAY_").lower(): v for k, v in environment.items()},
    )
    guard = HostOriginGuard(lambda *_: None, settings)  # type: ignore[arg-type]
    target = _yaml(_bind_mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"])
    [job] = [job for job in target["scrape_configs"] if job["job_name"] == "rollway"]
    [address] = job["static_configs"][0]["targets"]
    assert guard.check_host and guard.host_allowed(address.encode())
    assert not guard.host_allowed(b"attacker.example:8080")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package 'prometheus')")
def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisions_the_prometheus_source_and_the_dashboard(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    mounts = _bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    [source] = _yaml(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus" and url.port in _published(services["prometheus"])

    [provider] = _yaml(provisioning / "dashboards" / "rollway.yaml")["providers"]
    dashboards = [target for target in mounts if target.startswith(provider["options"]["path"] + "/")]
    assert [mounts[target] for target in dashboards] == [DEPLOY / "grafana-dashboard.json"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    # A provisioned dashboard has no import step: its data source must be a variable of type datasource,
    # which Grafana fills with the default Prometheus source.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
