"""`metalguard demo` makes an admin token per run and prints it (docs/demo.md): reads stay
open (the dashboard, `metalguard nodes`), actions need that token: without it 401, with
it `metalguard cordon`, `metalguard jobs submit` and `metalguard tenants set` work against
the demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.harness.demo_child import METALGUARD, Demo

SCENARIO = 'description = "nothing happens"\n'
EXPORT = re.compile(r"export METALGUARD_TOKEN=(\S+)")
API = re.compile(r"API at (http://\S+) ")


def _status(url: str, method: str = "GET", token: str | None = None) -> int:
    request = urllib.request.Request(url, method=method, data=b"{}" if method != "GET" else None)
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _cli(api: str, token: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "METALGUARD_TOKEN"}
    if token is not None:
        env["METALGUARD_TOKEN"] = token
    return subprocess.run(
        [str(METALGUARD), *args, "--api", api], capture_output=True, text=True, timeout=30,
        env=env, check=False,
    )  # fmt: skip


def test_the_demo_prints_an_admin_token_that_actions_need(tmp_path: Path) -> None:
    demo = Demo(tmp_path, SCENARIO, 60.0)
    try:
        api_line = demo.wait_for("API at ", 90)
        match = API.search(api_line)
        assert match is not None, api_line
        api = match.group(1)
        line = demo.wait_for("export METALGUARD_TOKEN=", 90)
        found = EXPORT.search(line)
        assert found is not None, line
        token = found.group(1)
        assert len(token) >= 24
        # reads are open: the dashboard and the CLI's reads need no token
        assert _status(f"{api}/v1/nodes") == 200
        assert _status(f"{api}/ui/") == 200
        # actions are not: no token, a wrong one
        cordon = f"{api}/v1/nodes/r1c1k1n1/cordon"
        assert _status(cordon, "POST") == 401
        assert _status(cordon, "POST", token="not-the-token") == 401
        refused = _cli(api, None, "cordon", "r1c1k1n1", "--reason", "try")
        assert refused.returncode != 0
        assert "bearer token" in (refused.stderr + refused.stdout)
        # with the printed token: the operator's and the user's actions work
        done = _cli(api, token, "cordon", "r1c1k1n1", "--reason", "try", "--format", "json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["record"]["cordoned"] is True
        submitted = _cli(
            api, token, "jobs", "submit", "--name", "by-hand", "--command", "true", "--nodes", "1"
        )
        assert submitted.returncode == 0, submitted.stderr
        assert "by-hand" in submitted.stdout
        quota = _cli(api, token, "tenants", "set", "team-a", "--gpus", "16")
        assert quota.returncode == 0, quota.stderr
        listed = _cli(api, None, "tenants", "list", "--format", "json")
        assert listed.returncode == 0, listed.stderr
        tenants = {t["name"]: t for t in json.loads(listed.stdout)["tenants"]}
        assert tenants["team-a"]["guarantee"] == 16
        assert _cli(api, None, "tenants", "set", "team-b", "--gpus", "8").returncode != 0
    finally:
        demo.kill()
