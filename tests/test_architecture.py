"""The rooms of the ``rollway`` package and the arrows allowed between them, read from every import in the source.

``rollway.store`` knows no HTTP; the data plane (``rollway.gateway``) and the control plane (``rollway.admin``) do
not know each other, and neither knows the protocol rooms built on them (``rollway.agl``, ``rollway.osmosis``), the
mock backend or the command line; the composition root (``rollway.app``) puts them together, and the command line
(``rollway.cli``) reaches the server only through the app and the admin client. No module imports itself
through a chain of imports, at start-up or later.

Inside ``rollway.store`` the layers import downward only: ``Store`` (``store.py``) is assembled from its parts
(``parts/``), which run the statements of ``sql/``, which reach the database through ``db/``; the public objects
at the top (``errors``, ``schemas``, ``states``, ...) import none of those layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import TypeGuard

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> the rooms it may import. A room not listed as a key may import nothing first-party.
ALLOWED: dict[str, set[str]] = {
    "store": set(),
    "logs": set(),
    "process": set(),
    "settings": {"store"},
    "envelope": {"store"},
    "gateway": {"store", "settings", "logs", "envelope"},
    "admin": {"store", "envelope"},
    "agl": {"admin", "store", "envelope"},
    "osmosis": {"admin", "gateway", "store", "settings"},
    "mock": {"process", "envelope"},
    "ui": set(),  # the dashboard's pages and files: it reads and acts through the admin API, from the browser
    "app": {"gateway", "admin", "agl", "osmosis", "store", "settings", "logs", "envelope", "ui"},
    "cli": {"app", "admin", "mock", "process", "store", "settings", "logs"},
    # the package itself re-exports the public API, each name imported on first use
    "rollway": {"store", "admin", "app", "settings"},
}

# third-party names a room must not import, whatever the arrows
FORBIDDEN: dict[str, set[str]] = {
    "store": {"fastapi", "starlette", "uvicorn", "httpx", "aiohttp", "litellm"},
    "admin.client": {"fastapi", "starlette", "uvicorn", "aiohttp"},
}

# the layers of rollway.store -> the layers each may import (besides its own). "assembly" is rollway.store and
# rollway.store.store (Store); "public" the other top-level modules, the objects callers use.
STORE_LAYERS: dict[str, set[str]] = {
    "assembly": {"parts", "sql", "db", "public"},
    "parts": {"sql", "db", "public"},
    "sql": {"db", "public"},
    "db": {"public"},
    "migrations": {"db"},
    "public": set(),
}
# ids.redraw_taken draws ids again where the table holds them already: a query, with SQLAlchemy and the dialect
# imported inside it, so the schemas' ids come without them
STORE_LAYER_EXCEPTIONS = {"rollway.store.ids -> rollway.store.db.dialect"}

SOURCES = {"rollway": ROOT / "rollway", "rollway.gateway": ROOT / "gateway", "rollway.store": ROOT / "store"}
SOURCES["rollway.admin"] = ROOT / "admin"


def _modules() -> dict[str, Path]:
    """Every module of the package, by its installed name."""
    found: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> Iterator[tuple[str, str | None]]:
    """(module, name) for each import anywhere in the file, lazy ones in functions and ``TYPE_CHECKING`` included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name


def _targets(path: Path) -> set[str]:
    """The first-party modules a file imports (``from rollway.x import y`` counts ``rollway.x.y`` if a module)."""
    out: set[str] = set()
    for module, name in _imports(path):
        if module.split(".")[0] != "rollway":
            continue
        sub = f"{module}.{name}"
        out.add(sub if sub in MODULES else module)
    return out


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rollway"


def store_layer(module: str) -> str:
    if module in {"rollway.store", "rollway.store.store"}:
        return "assembly"
    layer = module.split(".")[2]
    return layer if layer in STORE_LAYERS else "public"


def test_the_rooms_are_the_ones_named_here() -> None:
    assert {room(m) for m in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("source", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_it_may(source: str) -> None:
    offenders = {
        f"{module} -> {target}"
        for module, path in MODULES.items()
        if room(module) == source
        for target in _targets(path)
        if room(target) != source and room(target) not in ALLOWED[source]
    }
    assert offenders == set()


@pytest.mark.parametrize(("prefix", "forbidden"), sorted(FORBIDDEN.items()))
def test_a_room_does_not_use_the_libraries_it_must_not(prefix: str, forbidden: set[str]) -> None:
    offenders = {
        f"{module} -> {imported}"
        for module, path in MODULES.items()
        if module.removeprefix("rollway.").startswith(prefix)
        for imported, _ in _imports(path)
        if imported.split(".")[0] in forbidden
    }
    assert offenders == set()


def test_the_store_layers_are_the_ones_named_here() -> None:
    store = {m for m in MODULES if room(m) == "store"}
    assert {store_layer(m) for m in store} == set(STORE_LAYERS)
    # a sub-package of the store is a layer named here, or a module of the public top level
    assert {m.split(".")[2] for m in store if m.count(".") > 2} <= set(STORE_LAYERS)


def test_a_store_layer_imports_only_the_layers_below_it() -> None:
    offenders = {
        f"{module} -> {target}"
        for module, path in MODULES.items()
        if room(module) == "store"
        for target in _targets(path)
        if room(target) == "store"
        and store_layer(target) != store_layer(module)
        and store_layer(target) not in STORE_LAYERS[store_layer(module)]
    }
    assert offenders == STORE_LAYER_EXCEPTIONS


def test_the_store_layers_have_no_cycle() -> None:
    layers = {layer: below - {layer} for layer, below in STORE_LAYERS.items()}
    assert _cycles(layers) == []


def test_the_arrows_between_rooms_have_no_cycle() -> None:
    rooms = {r: ALLOWED[r] - {r, "rollway"} for r in ALLOWED if r != "rollway"}
    assert _cycles(rooms) == []


def test_no_module_imports_itself_through_a_cycle() -> None:
    graph = {module: _targets(path) - {module} for module, path in MODULES.items()}
    # a package's __init__ re-exporting its own modules is how Python packages work, not a cycle
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    assert _cycles(graph) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _reads_the_app_state(node: ast.AST) -> TypeGuard[ast.expr]:
    """``app.state``, ``request.app.state``, ``scope["app"]``: the application found at run time, untyped."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "app":
        return True
    if isinstance(node, ast.Attribute) and node.attr == "state":
        owner = node.value
        return (isinstance(owner, ast.Name) and owner.id == "app") or (
            isinstance(owner, ast.Attribute) and owner.attr == "app"
        )
    return False


def test_the_data_plane_gets_its_parts_handed_in_not_from_the_app_state() -> None:
    offenders = {
        f"{module}:{node.lineno}"
        for module, path in MODULES.items()
        if room(module) == "gateway"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if _reads_the_app_state(node)
    }
    assert offenders == set()


def _calls_of(method: str) -> list[str]:
    """Where ``<anything>.<method>(...)`` is called in the data plane: ``module:Class.function`` for each call."""
    found: list[str] = []

    def visit(node: ast.AST, scope: tuple[str, ...], module: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = (*scope, child.name)
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == method:
                found.append(f"{module}:{'.'.join(scope)}")
            visit(child, inner, module)

    for module, path in MODULES.items():
        if room(module) == "gateway":
            visit(ast.parse(path.read_text(), str(path)), (), module)
    return sorted(found)


def test_a_calls_span_is_written_in_one_place_called_from_one_place() -> None:
    """``Call._write_span`` is the one place a call's span is written (``Store.record_call``), and ``Call.run`` the one
    place it is called from, whatever ended the call: one span per call by construction, not by guards."""
    assert _calls_of("record_call") == ["rollway.gateway.call:Call._write_span"]
    assert _calls_of("_write_span") == ["rollway.gateway.call:Call.run"]
