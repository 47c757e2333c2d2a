"""The fleet dashboard's routes (docs/dashboard.md): static files, no build step.

``/`` and ``/ui`` redirect to ``/ui/``, which serves ``controller/api/static/index.html``;
``/ui/static/<file>`` serves the other files of that folder (shipped in the wheel; any
other name is a JSON 404 like every error of the API).  The
pages carry no data: the browser reads the API (``/v1/...``) with the operator's token,
so these routes are open even when tokens are configured.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from aiohttp import web

from metalguard.controller.api.errors import ApiError

DASHBOARD_DIR: Final = Path(__file__).parent / "static"
UI_PATH: Final = "/ui/"
STATIC_PATH: Final = "/ui/static"
HEADERS: Final = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # everything comes from this origin; no inline script, no framing
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
}


def add_dashboard_routes(app: web.Application, root: Path = DASHBOARD_DIR) -> None:
    """Register ``/``, ``/ui``, ``/ui/`` and ``/ui/static/`` over the files in ``root``."""
    app.router.add_get("/", _to_ui)
    app.router.add_get("/ui", _to_ui)
    app.router.add_get(UI_PATH, _index_handler(root / "index.html"))
    app.router.add_get(f"{STATIC_PATH}/{{filename}}", _static_handler(root))
    app.on_response_prepare.append(_dashboard_headers)


async def _to_ui(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(UI_PATH)


def _index_handler(index: Path) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def index_page(request: web.Request) -> web.StreamResponse:
        """The dashboard's single page."""
        return web.FileResponse(index)

    return index_page


def _static_handler(root: Path) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    files = {p.name: p for p in root.iterdir() if p.is_file() and not p.is_symlink()}

    async def static_file(request: web.Request) -> web.StreamResponse:
        """One file of the folder (listed at start: nothing outside it, no links); a
        JSON 404 for any other name."""
        name = request.match_info["filename"]
        path = files.get(name)
        if path is None or not path.is_file():
            raise ApiError(404, "not_found", f"no dashboard file {name!r}")
        return web.FileResponse(path)

    return static_file


async def _dashboard_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Security and caching headers on the dashboard's own files (not on the API)."""
    if request.path == "/ui" or request.path.startswith(UI_PATH):
        for name, value in HEADERS.items():
            response.headers.setdefault(name, value)
