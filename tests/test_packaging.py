"""What users install: one import package, ``rollway``, built from the folders the repository shows.

The wheel is built and installed into a fresh virtual environment, as a user's ``pip install`` does; the image is
checked from its Dockerfile (no Docker daemon here, so the build context is checked, not built).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _copied() -> set[str]:
    """The sources of the Dockerfile's ``COPY`` lines (all but the last word of each)."""
    sources: set[str] = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"]:
            sources.update(w.rstrip("/") for w in words[1:-1] if not w.startswith("--"))
    return sources


def _source_of(package: str) -> Path:
    """The folder setuptools builds ``package`` from: its own mapping, or its parent's plus the last name."""
    mapping: dict[str, str] = SETUPTOOLS["package-dir"]
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in mapping:
            return ROOT / mapping[head] / Path(*parts[n:])
    raise AssertionError(f"{package} has no folder in package-dir")


def test_the_image_copies_every_folder_the_wheel_is_built_from() -> None:
    copied = _copied()
    assert {"pyproject.toml", "README.md"} <= copied  # the build reads both
    folders = set(SETUPTOOLS["package-dir"].values())
    assert folders <= copied, f"the Dockerfile does not copy {sorted(folders - copied)}"


def _packages_on_disk() -> set[str]:
    """Every folder with an ``__init__.py``, named as installed (``store/migrations``: ``rollway.store.migrations``)."""
    found: set[str] = set()
    for folder in ("rollway", "gateway", "store", "admin"):
        prefix = ("rollway",) if folder == "rollway" else ("rollway", folder)
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if folder == "rollway" and parts[:1] in {("gateway",), ("store",), ("admin",)}:
                continue  # the links to the top-level folders, counted from those
            if "__pycache__" not in parts:
                found.add(".".join(prefix + parts))
    return found


def test_every_package_folder_is_in_the_wheel() -> None:
    """A new sub-package must be listed, or the wheel would lack it while the editable install still finds it."""
    listed = set(SETUPTOOLS["packages"])
    on_disk = _packages_on_disk()
    assert {"rollway", "rollway.gateway", "rollway.store", "rollway.admin", "rollway.app"} <= on_disk
    assert on_disk <= listed, f"pyproject.toml does not list {sorted(on_disk - listed)}"
    for package in listed:
        assert _source_of(package).is_dir(), package


def test_the_tests_import_the_package_under_its_one_name() -> None:
    """pytest puts ``tests/`` on ``sys.path``, for ``tests/support``, and nothing else: not the repository, whose
    folders would be a second copy of the package (``store`` beside ``rollway.store``). A name such as ``store``
    finds at most the tests' own folder of that name."""
    for name in ("gateway", "store", "admin"):
        spec = importlib.util.find_spec(name)
        if spec is not None:
            folders = [Path(p).resolve() for p in spec.submodule_search_locations or ()]
            assert spec.origin is None and all(f.is_relative_to(ROOT / "tests") for f in folders), (name, spec)


def test_the_source_tree_shows_each_top_level_folder_inside_rollway() -> None:
    """``rollway/gateway`` etc. are links to the top-level folders, so mypy and a checkout see the installed names."""
    for name in ("gateway", "store", "admin"):
        link = ROOT / "rollway" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), link
        assert SETUPTOOLS["package-dir"][f"rollway.{name}"] == name


# -- the wheel in a fresh virtual environment (pip and the package index: real_component) ----------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(ROOT)],
        check=True,
        timeout=600,
    )
    [built] = out.glob("rollway-*.whl")
    return built


def _fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin" / "python"


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    python = _fresh_venv(tmp_path_factory.mktemp("venv") / "env")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], check=True, timeout=900)
    yield python


def _run(python: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    return subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.real_component  # pip builds the wheel with setuptools from the package index
def test_the_wheel_installs_one_top_level_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tops = {name.split("/")[0] for name in whl.namelist()}
        names = set(whl.namelist())
    [dist_info] = tops - {"rollway"}
    assert tops == {"rollway", dist_info} and dist_info.endswith(".dist-info"), tops
    # every room is there, the top-level folders under their installed names, with the migrations' template
    for module in ("gateway/proxy.py", "store/store.py", "admin/client.py", "app/factory.py", "cli/main.py"):
        assert f"rollway/{module}" in names, module
    assert {"rollway/py.typed", "rollway/store/migrations/script.py.mako"} <= names


@pytest.mark.slow
@pytest.mark.real_component
def test_the_installed_wheel_gives_the_public_api_and_no_other_package(installed: Path, tmp_path: Path) -> None:
    result = _run(
        installed,
        "import rollway\n"
        "from rollway import AsyncRollwayClient, RollwayClient, Settings, Store, create_app\n"
        "assert Store.__module__ == 'rollway.store.store', Store.__module__\n"
        "assert AsyncRollwayClient.__module__ == 'rollway.admin.client'\n"
        "assert RollwayClient.__module__ == 'rollway.admin.client_sync'\n"
        "assert callable(create_app) and Settings().port == 8080\n"
        "import importlib.util\n"
        "print(sorted(n for n in ('gateway', 'store', 'admin', 'agl') if importlib.util.find_spec(n)))\n",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"  # none of the old top-level names is importable
    for name in ("gateway", "store", "admin", "agl"):
        refused = _run(installed, f"import {name}", tmp_path)
        assert refused.returncode != 0 and "ModuleNotFoundError" in refused.stderr, name


@pytest.mark.slow
@pytest.mark.real_component
def test_the_installed_command_serves_its_help(installed: Path, tmp_path: Path) -> None:
    rollway = installed.parent / "rollway"
    result = subprocess.run([str(rollway), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "ROLLWAY_DATABASE_URL" in result.stdout


@pytest.mark.slow
@pytest.mark.real_component
@pytest.mark.parametrize("beside", [["openai-agents==0.24.0"], ["openai>=3"]], ids=["openai-agents", "openai-3"])
def test_the_wheel_resolves_beside_the_agent_stack(wheel: Path, beside: list[str], tmp_path: Path) -> None:
    """``pip install rollway openai-agents`` (the Agents SDK needs openai 3) and next to openai 3 itself."""
    python = _fresh_venv(tmp_path / "env")
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", str(wheel), *beside],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
    assert "rollway" in chosen
    assert int(chosen["openai"].split(".")[0]) >= 3, chosen.get("openai")
