"""What users install: one import package, ``rollway``, built from the folders the repository shows, each of its
files imported under one name, from the one real file.

The source distribution and the wheel are built from a copy of what the image copies, the wheel from the source
distribution (as ``python -m build`` builds a release). Each is installed into a fresh virtual environment, as a
user's ``pip install`` does, and so is the copy itself with ``pip install -e``; in each, every module of the package
is imported and its ``__file__`` compared with the file it must come from. The image is checked from its
Dockerfile (no Docker daemon here, so the build context is checked, not built).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

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


def test_the_tests_import_the_package_under_its_one_name() -> None:
    """pytest puts ``tests/`` on ``sys.path``, for ``tests/support``, and nothing else: not the repository, whose
    folders would be a second copy of the package (``store`` beside ``rollway.store``). A name such as ``store``
    finds at most the tests' own folder of that name."""
    for name in ("gateway", "store", "admin"):
        spec = importlib.util.find_spec(name)
        if spec is not None:
            folders = [Path(p).resolve() for p in spec.submodule_search_locations or ()]
            assert spec.origin is None and all(f.is_relative_to(ROOT / "tests") for f in folders), (name, spec)


def test_git_tracks_no_symbolic_link() -> None:
    """A link checks out as a text file on Windows (git's default there), so the repository has none."""
    listed = subprocess.run(["git", "ls-files", "--stage"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert links == []


def test_this_test_run_imports_each_package_file_from_its_one_path(pytestconfig: pytest.Config) -> None:
    """Under ``pip install -e .``, the tests import this checkout's own files, each under its one name:
    ``rollway.gateway.proxy`` is ``<checkout>/gateway/proxy.py`` with no link in between, and no file of the package
    is loaded under another name (``gateway.proxy``). Read from the modules loaded so far in this run."""
    root = pytestconfig.rootpath.resolve()
    direct = json.loads(importlib.metadata.distribution("rollway").read_text("direct_url.json") or "{}")
    if not direct.get("dir_info", {}).get("editable"):
        pytest.skip("rollway is not installed with pip install -e here; the installs below check a wheel's files")
    source = Path(url2pathname(urlsplit(direct["url"]).path)).resolve()
    assert source == root, f"the tests of {root} run the code of {source}: pip install -e {root}"
    modules = _modules_on_disk(root)
    for package in SETUPTOOLS["package-dir"]:
        importlib.import_module(package)
    importlib.import_module("rollway.gateway.proxy")
    by_file = {str(path): name for name, path in modules.items()}
    loaded: dict[str, str] = {
        name: file for name, module in list(sys.modules.items()) if (file := getattr(module, "__file__", None))
    }
    wrong = {name: file for name, file in loaded.items() if name in modules and file != str(modules[name])}
    wrong |= {name: file for name, file in loaded.items() if file in by_file and by_file[file] != name}
    assert wrong == {}
    assert loaded["rollway.gateway.proxy"] == str(root / "gateway" / "proxy.py")
    assert all(os.path.realpath(loaded[name]) == loaded[name] for name in loaded.keys() & modules.keys())


# -- the source distribution, the wheel and the editable install, each in a fresh virtual environment (pip and
# the package index: real_component) ---------------------------------------------------------------------------


def _call(args: list[str]) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the image copies (the Dockerfile's ``COPY`` lines), copied into a fresh folder, links as links: the
    project as a clone has it, without what earlier builds left in the repository (``build/``, ``*.egg-info``)."""
    copy = tmp_path_factory.mktemp("checkout")
    for name in sorted(_copied()):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, copy / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def dists(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The source distribution and the wheel built from it."""
    out = tmp_path_factory.mktemp("dist")
    _call([sys.executable, "-m", "build", "--outdir", str(out), str(checkout)])
    [sdist] = out.glob("rollway-*.tar.gz")
    [built] = out.glob("rollway-*.whl")
    return sdist, built


@pytest.fixture(scope="module")
def wheel(dists: tuple[Path, Path]) -> Path:
    return dists[1]


def _fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin" / "python"


def _installed(where: Path, *what: str) -> Path:
    """A fresh virtual environment at ``where`` with ``pip install *what`` done; its interpreter."""
    python = _fresh_venv(where)
    _call([str(python), "-m", "pip", "install", "--quiet", *what])
    return python


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield _installed(tmp_path_factory.mktemp("venv") / "env", f"{wheel}[server]")


@pytest.fixture(scope="module")
def editable_installed(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield _installed(tmp_path_factory.mktemp("venv-editable") / "env", "-e", f"{checkout}[server]")


def _purelib(python: Path) -> Path:
    return Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )


@pytest.fixture(scope="module")
def sdist_installed(
    dists: tuple[Path, Path], editable_installed: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """The source distribution installed without its dependencies, which come from the editable install's
    environment through a path in a ``.pth`` file: that environment has no ``rollway`` folder, and the ``.pth`` files
    in a folder so added (the editable install's import hook) are not read. Half a minute less than resolving and
    installing them again; the wheel's environment resolves them as a user's install does."""
    python = _installed(tmp_path_factory.mktemp("venv-sdist") / "env", "--no-deps", str(dists[0]))
    (_purelib(python) / "dependencies.pth").write_text(f"{_purelib(editable_installed)}\n")
    yield python


def _run(python: Path, code: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    return subprocess.run(
        [str(python), "-c", code], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=120
    )


@pytest.mark.real_component  # pip builds the distributions with setuptools from the package index
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


# What the client install's environment may import of the server extra: nothing.
SERVER_PACKAGES = ("fastapi", "uvicorn", "sqlalchemy", "sqlmodel", "alembic", "aiohttp", "orjson", "yaml", "asyncpg")

CLIENT_ROUND_TRIP = """
import asyncio, importlib.util, sys
from rollway import AsyncRollwayClient, RollwayClient

async def main():
    async with AsyncRollwayClient(sys.argv[1]) as client:
        [claim] = await client.claim("trainer", limit=1, wait_seconds=5)
        rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
        done = await client.update_attempt(rid, aid, status="succeeded", reward=1.0)
        print(done.status.value, (await client.get_rollout(rid)).status.value)

with RollwayClient(sys.argv[1]) as sync:
    sync.enqueue([{"input": "q"}])
asyncio.run(main())
print([name for name in sys.argv[2:] if importlib.util.find_spec(name) is not None])
"""


@pytest.mark.slow
@pytest.mark.real_component
def test_the_client_installs_without_the_server_and_works_against_one(wheel: Path, tmp_path: Path) -> None:
    """``pip install rollway`` is the client a trainer installs: the Python client and the admin commands, none of
    the server's packages; ``rollway serve`` there says which extra to install."""
    from rollway.process import GatewayProcess

    python = _installed(tmp_path / "env", str(wheel))
    with GatewayProcess(f"sqlite:///{tmp_path / 'server.db'}") as server:
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
        trip = subprocess.run(
            [str(python), "-c", CLIENT_ROUND_TRIP, server.url, *SERVER_PACKAGES],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        listed = subprocess.run(
            [str(python.parent / "rollway"), "--url", server.url, "rollouts", "list", "--json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert trip.returncode == 0, trip.stderr
    assert trip.stdout.splitlines() == ["succeeded succeeded", "[]"]
    assert listed.returncode == 0, listed.stderr
    assert [r["status"] for r in json.loads(listed.stdout)["items"]] == ["succeeded"]
    serve = subprocess.run(
        [str(python.parent / "rollway"), "serve"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert serve.returncode == 2 and "pip install 'rollway[server]'" in serve.stderr, serve.stderr
    assert "Traceback" not in serve.stderr


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


# -- every module of every install, from its one file ------------------------------------------------------------

INSTALLS = {"wheel": "installed", "sdist": "sdist_installed", "editable": "editable_installed"}

# Modules whose file is checked but which are not imported, and why. A module that needs an optional dependency
# (an extra) when imported belongs here too: these environments install no extra.
NOT_IMPORTED = {
    "rollway.store.migrations.env": "alembic's environment script: alembic runs it by path (store/migrate.py) "
    "within a migration context, which an import by name does not have",
}

# Run in each environment, outside any checkout: imports the modules named on stdin, one by one, and reports where
# each was found, where it was loaded from or why it was not, every module loaded by then, and whether the
# top-level folders' names import as packages of their own.
PROBE = """
import importlib, importlib.util, json, sys, sysconfig
report = {}
for name in json.load(sys.stdin):
    spec = importlib.util.find_spec(name)  # imports the parent packages, not the module
    entry = report[name] = {"origin": spec and spec.origin}
    try:
        entry["file"] = importlib.import_module(name).__file__
    except Exception as error:
        entry["error"] = f"{type(error).__name__}: {error}"
loaded = {name: module.__file__ for name, module in list(sys.modules.items()) if getattr(module, "__file__", None)}
tops = [name for name in ("gateway", "store", "admin") if importlib.util.find_spec(name) is not None]
print(json.dumps({"modules": report, "loaded": loaded, "top_level": tops, "purelib": sysconfig.get_path("purelib")}))
"""


def _installed_file(purelib: Path, name: str, source: Path) -> Path:
    """Where a wheel puts module ``name``, whose file in the checkout is ``source``."""
    parts = name.split(".")
    if source.name == "__init__.py":
        return purelib.joinpath(*parts, "__init__.py")
    return purelib.joinpath(*parts[:-1], f"{parts[-1]}.py")


@pytest.mark.slow
@pytest.mark.real_component
@pytest.mark.parametrize("kind", sorted(INSTALLS))
def test_every_module_is_imported_from_its_one_real_file(
    kind: str, checkout: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """From a wheel or a source distribution, ``rollway.gateway.proxy`` is ``<site-packages>/rollway/gateway/
    proxy.py``; from ``pip install -e``, it is ``<checkout>/gateway/proxy.py``; the real file in each case (no link
    in between), no file under a second name, and no ``gateway``, ``store`` or ``admin`` package of its own."""
    python: Path = request.getfixturevalue(INSTALLS[kind])
    modules = _modules_on_disk(checkout)
    result = _run(python, PROBE, tmp_path, stdin=json.dumps(sorted(modules)))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    purelib = Path(report["purelib"])
    if kind == "editable":
        expected = {name: str(path) for name, path in modules.items()}
        folders = [checkout / folder for folder in SETUPTOOLS["package-dir"].values()]
        assert not (purelib / "rollway").exists()
    else:
        expected = {name: str(_installed_file(purelib, name, path)) for name, path in modules.items()}
        folders = [purelib / "rollway"]
        in_wheel = {str(path) for path in (purelib / "rollway").rglob("*.py")}
        assert in_wheel == set(expected.values()), sorted(in_wheel ^ set(expected.values()))

    found = report["modules"]
    wrong = {name: entry["origin"] for name, entry in found.items() if entry["origin"] != expected[name]}
    wrong |= {
        name: entry["file"] for name, entry in found.items() if entry.get("file", expected[name]) != expected[name]
    }
    wrong |= {file: "a link" for file in expected.values() if os.path.realpath(file) != file}
    assert wrong == {}
    failed = {name: entry["error"] for name, entry in found.items() if "error" in entry}
    assert failed.keys() == NOT_IMPORTED.keys(), failed

    by_file = {file: name for name, file in expected.items()}
    in_package = {
        name: file
        for name, file in report["loaded"].items()
        if any(Path(file).is_relative_to(folder) for folder in folders)
    }
    assert {name: file for name, file in in_package.items() if by_file.get(file) != name} == {}
    assert report["top_level"] == []
