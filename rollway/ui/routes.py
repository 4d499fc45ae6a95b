"""The dashboard's routes: the page shell at every page's URL, and its static files.

Every page (``/ui``, ``/ui/rollouts``, ``/ui/rollouts/{id}``, ``/ui/groups/{id}``, ``/ui/models``,
``/ui/models/{alias}``, ``/ui/resources``) answers with the same ``index.html``; the page's script reads the
path and draws it from the admin API. The pages are served without authentication: they hold no data, and
every ``/admin/v1`` request they make carries the admin token the user typed (kept in the tab's session
storage).

The files are read once, when the router is built, from this package's ``static`` folder (they ship in the
wheel); a path outside that set is a 404. Each answer carries a content security policy that lets the pages
load only their own scripts and styles and talk only to their own origin, so nothing recorded in a span (model
output is shown as text, never as markup) can run in the page.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse

STATIC = "static"
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
#: The pages' paths under ``/ui`` (``{id}`` one path segment, ``{alias}`` the rest: aliases may hold '/').
PAGES = (
    "",
    "/rollouts",
    "/rollouts/{rollout_id}",
    "/groups/{group_id}",
    "/models",
    "/models/{alias:path}",
    "/resources",
)


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def _assets() -> dict[str, Asset]:
    """Every file under ``static/`` by its path there (``app.js``, ``pages/rollout.js``)."""
    found: dict[str, Asset] = {}
    root = resources.files(__package__ or "rollway.ui").joinpath(STATIC)

    def walk(folder: resources.abc.Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
                continue
            suffix = "." + entry.name.rpartition(".")[2]
            body = entry.read_bytes()
            media_type = TYPES.get(suffix, "text/html; charset=utf-8" if suffix == ".html" else "text/plain")
            found[prefix + entry.name] = Asset(body, media_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')

    walk(root, "")
    return found


def build_router() -> APIRouter:
    assets = _assets()
    shell = assets["index.html"]
    router = APIRouter(prefix="/ui", include_in_schema=False)

    async def page(request: Request) -> Response:
        return HTMLResponse(shell.body, headers={**SECURITY_HEADERS, "cache-control": "no-cache"})

    for path in PAGES:
        router.add_api_route(path, page, methods=["GET"])

    @router.get("/static/{name:path}")
    async def static(name: str, request: Request) -> Response:
        asset = assets.get(name)
        if asset is None or name == "index.html":
            return Response(status_code=404)
        headers = {**SECURITY_HEADERS, "etag": asset.etag, "cache-control": "no-cache"}
        if request.headers.get("if-none-match") == asset.etag:
            return Response(status_code=304, headers=headers)
        return Response(asset.body, media_type=asset.media_type, headers=headers)

    return router
