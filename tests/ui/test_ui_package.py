"""The dashboard's files as shipped: each is in the wheel's package data, and every module a page imports is one
the router serves (no browser needed: a missing file would otherwise show only as a blank page)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import httpx
from fastapi import FastAPI

from rollway.ui.routes import PAGES, build_router

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "rollway" / "ui" / "static"
IMPORT = re.compile(r"""(?:from\s+|import\s*\(\s*)["'](\.{1,2}/[^"']+)["']""")


def test_every_static_file_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "rollway.ui" in config["tool"]["setuptools"]["packages"]
    globs = config["tool"]["setuptools"]["package-data"]["rollway.ui"]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.rglob("*") if p.is_file()]
    assert files
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []


async def test_every_page_serves_the_shell_and_every_import_resolves() -> None:
    app = FastAPI()
    app.include_router(build_router())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        for path in PAGES:
            concrete = re.sub(r"\{[^}]+\}", "x", path)
            answer = await client.get(f"/ui{concrete}")
            assert answer.status_code == 200, path
            assert answer.headers["content-type"].startswith("text/html")
        modules = sorted(STATIC.rglob("*.js"))
        assert len(modules) >= 10
        for module in modules:
            url = "/ui/static/" + module.relative_to(STATIC).as_posix()
            served = await client.get(url)
            assert served.status_code == 200, url
            assert served.content == module.read_bytes()
            for target in IMPORT.findall(module.read_text()):
                resolved = httpx.URL(url).join(target).path
                assert (await client.get(resolved)).status_code == 200, f"{url} imports {target}"
        assert (await client.get("/ui/static/nothing.js")).status_code == 404
