"""What users install: one import package, ``rollway``, built from the folders the repository shows.

The wheel is built and installed into a fresh virtual environment, as a user's ``pip install`` does; the image is
checked from its Dockerfile (no Docker daemon here, so the build context is checked, not built).
"""

from __future__ import annotations

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


def _modules_on_disk(root: Path) -> dict[str, Path]:
    """Every module of the package in the tree at ``root``, by its installed name, and its file (``gateway/proxy.py``:
    ``rollway.gateway.proxy``; ``store/migrations/__init__.py``: ``rollway.store.migrations``)."""
    mapping: dict[str, str] = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in mapping.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            name = ".".join((package, *parts)).removesuffix(".__init__")
            assert name not in found, f"{name} is both {found[name]} and {path}"
            found[name] = path
    return found


def _packages_on_disk() -> set[str]:
    """Every folder with an ``__init__.py``, named as installed (``store/migrations``: ``rollway.store.migrations``)."""
    return {name for name, path in _modules_on_disk(ROOT).items() if path.name == "__init__.py"}


def test_every_package_folder_is_in_the_wheel() -> None:
    """A new sub-package must be listed, or the wheel would lack it while the editable install still finds it."""
    listed = set(SETUPTOOLS["packages"])
    on_disk = _packages_on_disk()
    assert {"rollway", "rollway.gateway", "rollway.store", "rollway.admin", "rollway.app"} <= on_disk
    assert on_disk <= listed, f"pyproject.toml does not list {sorted(on_disk - listed)}"
    for package in listed:
        assert _source_of(package).is_dir(), package


def test_each_top_level_folder_is_the_only_folder_of_its_package() -> None:
    """``gateway/``, ``store/`` and ``admin/`` are where ``rollway.gateway``, ``rollway.store`` and ``rollway.admin``
    come from, and from nowhere else: nothing of those names in ``rollway/`` (a link there, or the text file a
    checkout without links makes of one, would give their files a second path) and no link in the package's
    folders."""
    for name in ("gateway", "store", "admin"):
        assert SETUPTOOLS["package-dir"][f"rollway.{name}"] == name
        assert (ROOT / name).is_dir() and not (ROOT / name).is_symlink(), name
        assert not os.path.lexists(ROOT / "rollway" / name), f"rollway/{name}"
        assert not os.path.lexists(ROOT / "rollway" / f"{name}.py"), f"rollway/{name}.py"
    folders = set(SETUPTOOLS["package-dir"].values())
    links = [
        str(path.relative_to(ROOT)) for folder in folders for path in (ROOT / folder).rglob("*") if path.is_symlink()
    ]
    assert links == []


def test_git_tracks_no_symbolic_link() -> None:
    """A link checks out as a text file on Windows (git's default there), so the repository has none."""
    listed = subprocess.run(["git", "ls-files", "--stage"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert links == []


# -- the wheel in a fresh virtual environment -------------------------------------------------------------------


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
def test_the_installed_command_serves_its_help(installed: Path, tmp_path: Path) -> None:
    rollway = installed.parent / "rollway"
    result = subprocess.run([str(rollway), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "ROLLWAY_DATABASE_URL" in result.stdout


@pytest.mark.slow
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
