"""The dashboard's routes (controller/api/dashboard.py): the static files, served by the
API's own app, open while the API itself needs a token (that they ship in the wheel:
test_packaging.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.api.dashboard import DASHBOARD_DIR
from metalguard.proto.subjects import Subjects
from tests.support.harness.api_env import READ_TOKEN, ApiEnv, api_env

FILES = ("index.html", "app.js", "style.css")


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[ApiEnv]:
    async with api_env(nc, subjects) as e:
        yield e


@pytest.fixture
async def client(env: ApiEnv) -> AsyncIterator[TestClient[Any, Any]]:
    app = make_app(env.controller, env.source, read_tokens={READ_TOKEN})
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_root_and_ui_redirect_to_the_dashboard(client: TestClient[Any, Any]) -> None:
    for path in ("/", "/ui"):
        response = await client.get(path, allow_redirects=False)
        assert response.status == 302, path
        assert response.headers["Location"] == "/ui/"


async def test_pages_are_open_while_the_api_needs_a_token(client: TestClient[Any, Any]) -> None:
    page = await client.get("/ui/")
    assert page.status == 200
    assert page.content_type == "text/html"
    html = await page.text()
    assert 'src="static/app.js"' in html
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp
    assert "script-src 'self'" in csp
    assert page.headers["Cache-Control"] == "no-cache"
    # every file the page names is served, with its type
    named = re.findall(r'(?:src|href)="(static/[^"]+)"', html)
    assert sorted(named) == ["static/app.js", "static/style.css"]
    types = {"static/app.js": "javascript", "static/style.css": "text/css"}
    for path in named:
        response = await client.get(f"/ui/{path}")
        assert response.status == 200, path
        assert types[path] in response.content_type
        assert response.headers["X-Content-Type-Options"] == "nosniff"
    # the data itself stays behind the token (which the page sends as a bearer header)
    assert (await client.get("/v1/nodes")).status == 401
    headers = {"Authorization": f"Bearer {READ_TOKEN}"}
    assert (await client.get("/v1/nodes", headers=headers)).status == 200
    # the API's answers do not carry the dashboard's headers
    assert "Content-Security-Policy" not in (await client.get("/healthz")).headers


async def test_static_serves_nothing_outside_its_folder(client: TestClient[Any, Any]) -> None:
    for path in (
        "/ui/static/../api_dashboard.py",
        "/ui/static/%2e%2e/api_dashboard.py",
        "/ui/static/..%2fapi_dashboard.py",
        "/ui/static/nope.js",
    ):
        response = await client.get(path, allow_redirects=False)
        body = await response.text()
        assert response.status in (403, 404), (path, response.status)
        assert "add_dashboard_routes" not in body, path


def test_the_pages_load_nothing_from_elsewhere() -> None:
    """No CDN, no external font or script: only this origin (the SVG namespace aside)."""
    for name in FILES:
        text = (DASHBOARD_DIR / name).read_text(encoding="utf-8")
        urls = set(re.findall(r"""https?://[^\s"'`)]+""", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)


def test_app_js_parses() -> None:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed: app.js is checked by the browser test only")
    done = subprocess.run(
        [node, "--check", str(DASHBOARD_DIR / "app.js")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
