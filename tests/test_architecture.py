"""The layering of the repository: store/ knows no HTTP, admin/ and gateway/ do not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("store", {"fastapi", "starlette", "uvicorn", "httpx", "aiohttp", "gateway", "admin", "litellm"}),
        ("admin", {"gateway", "agl"}),
        ("agl", {"gateway"}),
    ],
)
def test_package_does_not_import_forbidden_layers(package: str, forbidden: set[str]) -> None:
    offenders = {path: names & forbidden for path, names in _imports(package).items() if names & forbidden}
    assert offenders == {}


def test_gateway_only_composes_admin_in_the_app_and_the_cli_commands() -> None:
    # app.py mounts the admin router; the CLI's admin commands and the demo are clients of the admin API.
    users = {path for path, names in _imports("gateway").items() if "admin" in names}
    assert users <= {"gateway/app.py", "gateway/commands.py", "gateway/demo.py"}


def test_the_admin_client_does_not_pull_in_the_server() -> None:
    server = {"fastapi", "starlette", "uvicorn", "aiohttp"}
    clients = {path: names & server for path, names in _imports("admin").items() if "/client" in path}
    assert clients and all(not names for names in clients.values()), clients
