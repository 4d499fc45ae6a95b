"""Shared fixtures. Every store contract test runs against SQLite (a real file) and, when reachable, the real
PostgreSQL on this machine (a fresh database per test). Set ROLLWAY_TEST_PG_URL to point elsewhere.

``gw`` is the gateway of the end-to-end tests; a module says what it serves by overriding ``gateway_settings``
and ``gateway_aliases`` (fixtures of the same names), and marks its tests ``in_process`` when they need no real
server (nothing streamed, no connection looked at, the address handed to no other process); ``in_process(False)``
keeps one test of such a module on uvicorn."""

from __future__ import annotations

import asyncio
import compileall
import os
import shutil
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollway.mock import MockBackendProcess
from rollway.store import Store
from support.clock import FakeClock
from support.gateway_harness import Alias, RunningGateway, running_gateway
from support.postgres import create_database, drop_database, pg_dsn, pg_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]

# The gateways the tests start (in this process and as subprocesses, which inherit it) do not ask their engines for
# their weight version in the background: many tests assert exactly which requests reached the mock engine, and a
# periodic ``GET /weight_info`` would land among them at a moment of its own. The check after a weight update still
# runs; the tests of the periodic check set their interval themselves.
os.environ.setdefault("ROLLWAY_VERSION_CHECK_INTERVAL", "0")

#: ``-n auto``'s workers per core (``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides the count): most tests spend much
#: of their time waiting on subprocesses, sockets and PostgreSQL rather than on a core.
WORKERS_PER_CORE = 2

#: Modules whose tests share an expensive module or session fixture (or import): under xdist each runs on one
#: worker, one test after the other, so that the fixture is made once. (``xdist_group`` would say this in each
#: module, but pytest-xdist 3.8 cannot group under pytest 9.2: it renames items through an attribute pytest no
#: longer reads.)
ONE_WORKER = {
    "tests/engines/test_vllm_engine.py": "two vLLM servers for the session",
    "tests/ui/test_ui_browser.py": "Chromium and a gateway filled by the demo's loop",
    "tests/ui/test_ui_malformed_spans.py": "Chromium and a gateway process",
    "tests/admin/test_trainer_exports.py": "a finished demo run",
    "tests/cli/test_cli.py": "a gateway process",
    "tests/test_packaging.py": "a wheel built in the source tree, and its install",
    "tests/gateway/test_gateway_swap.py": "two mock backend processes",
    "tests/mock/test_mock_backend.py": "a mock backend process",
    "tests/gateway/test_gateway_litellm.py": "LiteLLM's import, seconds of CPU",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package's modules once, before the run (in xdist's controller, before its workers start).
    Most tests start Python processes of their own (servers, runners, the command line), each importing the
    package from this checkout; where ``PYTHONDONTWRITEBYTECODE`` is set, as in some CI images, none of them
    would write its bytecode, and each would compile every module again (~0.35 s of CPU per process, measured)."""
    if hasattr(session.config, "workerinput"):
        return
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in sorted(set(setuptools["package-dir"].values())):
        compileall.compile_dir(ROOT / folder, quiet=1)
    build_required_environments()


def build_required_environments() -> None:
    """Build the cached environments the run is required to use (``ROLLWAY_REQUIRE_*=1``) before any test starts:
    on a fresh machine each takes minutes, which would otherwise count against the first test's timeout (and
    against every test waiting on its lock). A build that fails here is left to the tests that need it, which try
    again and fail with its reason; a cached environment costs a check."""
    from support import agl1_env, agl_env, osmosis_env, trl_env

    builders = {
        "ROLLWAY_REQUIRE_AGL": agl_env.agl_python,
        "ROLLWAY_REQUIRE_AGL1": agl1_env.agl1_python,
        "ROLLWAY_REQUIRE_OSMOSIS": osmosis_env.osmosis_python,
        "ROLLWAY_REQUIRE_TRL": trl_env.trl_site,
    }
    for variable, build in builders.items():
        if os.environ.get(variable) == "1":
            try:
                build()
            except (Exception, pytest.skip.Exception, pytest.fail.Exception):  # the tests that need it report it
                continue


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return WORKERS_PER_CORE * len(os.sched_getaffinity(0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``-n`` (and no other ``--dist``): each test goes to the next free worker, but the tests of a module in
    ``ONE_WORKER``, which go to one worker together."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]  # xdist ships no types

    class Scheduling(LoadScopeScheduling):  # type: ignore[misc]  # its base is untyped (xdist's)
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER else nodeid

    return Scheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long runs first, so that under xdist none of them starts last: the modules of ``ONE_WORKER`` (the scheduler
    also puts the largest of those first), then tests marked ``slow``, then the rest, each in the order
    collected."""

    def rank(item: pytest.Item) -> int:
        if item.nodeid.split("::", 1)[0] in ONE_WORKER:
            return 0
        return 1 if item.get_closest_marker("slow") is not None else 2

    items.sort(key=rank)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database (dropped afterwards)."""
    _require_postgres()
    name = create_database()
    try:
        yield pg_dsn(name)
    finally:
        drop_database(name)


def _require_postgres() -> None:
    reason = pg_unavailable_reason()
    if reason and os.environ.get("ROLLWAY_REQUIRE_POSTGRES") == "1":
        pytest.fail(reason)  # CI: PostgreSQL is there, so its cases must run
    if reason:
        pytest.skip(reason)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_engine(request: pytest.FixtureRequest) -> str:
    """Each engine the store runs on: the parameter of ``store_url``, ``migrated_url`` and ``store``."""
    engine: str = request.param
    return engine


@pytest.fixture
def store_url(db_engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database of each engine."""
    if db_engine == "sqlite":
        return f"sqlite:///{tmp_path / 'rollway.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


async def _migrate(url: str) -> None:
    await (await Store.open(url, run_watchdog=False, keepalive_interval=0)).close()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file with the schema at head and no rows, made by ``Store.open`` once per session (per worker)."""
    path = tmp_path_factory.mktemp("template") / "rollway.db"
    asyncio.run(_migrate(f"sqlite:///{path}"))
    return path


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A PostgreSQL database with the schema at head and no rows, made by ``Store.open`` once per session (per
    worker) and dropped at its end; nothing connects to it but ``CREATE DATABASE ... TEMPLATE``."""
    _require_postgres()
    name = create_database(prefix="rollway_template")
    try:
        asyncio.run(_migrate(pg_dsn(name)))
        yield name
    finally:
        drop_database(name)


@pytest.fixture
def migrated_url(db_engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a database of each engine with the schema at head and no rows: a copy of the session's template
    (what ``store`` opens)."""
    if db_engine == "sqlite":
        path = tmp_path / "rollway.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        yield f"sqlite:///{path}"
        return
    name = create_database(request.getfixturevalue("pg_template"))
    try:
        yield pg_dsn(name)
    finally:
        drop_database(name)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(migrated_url: str, clock: FakeClock) -> AsyncIterator[Store]:
    """An open store on a fresh database, watchdog loop off (tests call ``sweep(force=True)``)."""
    opened = await Store.open(migrated_url, clock=clock, run_watchdog=False)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture(scope="session")
def mock_process() -> Iterator[MockBackendProcess]:
    """One vLLM-like mock backend process for the session (``mock`` resets it per test)."""
    with MockBackendProcess() as process:
        yield process


@pytest.fixture
def mock(mock_process: MockBackendProcess) -> MockBackendProcess:
    mock_process.reset()
    return mock_process


@pytest.fixture(scope="session")
def sglang_mock_process() -> Iterator[MockBackendProcess]:
    """One SGLang-like mock backend process for the session (``sglang_mock`` resets it per test)."""
    with MockBackendProcess(flavor="sglang") as process:
        yield process


@pytest.fixture
def sglang_mock(sglang_mock_process: MockBackendProcess) -> MockBackendProcess:
    sglang_mock_process.reset()
    return sglang_mock_process


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    """The ``gw`` fixture's settings beyond its defaults (a SQLite file in the test's directory, ``public_url`` its
    own address). A module overrides this fixture to set them, a test with
    ``@pytest.mark.parametrize("gateway_settings", [{...}])``."""
    return {}


@pytest.fixture
def gateway_aliases() -> list[Alias]:
    """The model aliases the ``gw`` fixture's gateway serves from the start; a module overrides this fixture."""
    return []


@pytest.fixture
async def gw(
    request: pytest.FixtureRequest, tmp_path: Path, gateway_settings: dict[str, Any], gateway_aliases: list[Alias]
) -> AsyncIterator[RunningGateway]:
    """A gateway of ``gateway_settings`` serving ``gateway_aliases``: uvicorn on a loopback port, or in this process
    when the test is marked ``in_process`` (and not ``in_process(False)``)."""
    marker = request.node.get_closest_marker("in_process")
    in_process = marker is not None and marker.args != (False,)
    async with running_gateway(tmp_path, in_process=in_process, **gateway_settings) as gateway:
        for alias in gateway_aliases:
            await gateway.store.put_model(alias.name, alias.backends, version=alias.version)
        yield gateway
