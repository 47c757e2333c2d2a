"""The operator CLI (``metalguard nodes|node|cordon|uncordon|maintenance|events``) as
subprocesses against the HTTP API served in the test's loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.api.events import HUB
from metalguard.proto.subjects import Subjects
from tests.support.harness.api_env import ADMIN_TOKEN, FATAL, FLEET, READ_TOKEN, ApiEnv, api_env
from tests.support.waiting import wait_for_line, wait_until

METALGUARD = Path(sys.executable).parent / "metalguard"
DEADLINE_S = 20.0


@dataclass
class Api:
    env: ApiEnv
    server: TestServer

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
async def api(nc: Client, subjects: Subjects) -> AsyncIterator[Api]:
    async with api_env(nc, subjects) as env:
        await env.feed(*FLEET, FATAL)
        app = make_app(
            env.controller,
            env.source,
            read_tokens={READ_TOKEN},
            admin_tokens={ADMIN_TOKEN},
            keepalive_s=0.2,
        )
        server = TestServer(app)
        await server.start_server()
        try:
            yield Api(env, server)
        finally:
            await server.close()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METALGUARD_")}
    return {**env, "COLUMNS": "200"}


async def cli(api: Api | str, *args: str, token: str = READ_TOKEN) -> Result:
    """Run ``metalguard ARGS --api URL [--token T]`` to completion."""
    url = api if isinstance(api, str) else api.url
    auth = ["--token", token] if token else []
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        *args,
        "--api",
        url,
        *auth,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def test_nodes_table_and_json(api: Api) -> None:
    r = await cli(api, "nodes")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].split() == ["NODE", "GRADE", "SCORE", "FLAGS", "RACK", "REASON"]
    assert [line.split()[0] for line in lines[1:]] == [
        "r1.c1.n1",
        "r1.c1.n2",
        "r1.c1.n3",
        "r1.c2.n1",
    ]
    n3 = lines[3]
    assert "FAILING" in n3
    assert n3.index("FAILING") == lines[0].index("GRADE")  # aligned columns

    r = await cli(api, "nodes", "--grade", "FAILING", "--format", "json")
    assert r.code == 0, r.err
    nodes = json.loads(r.out)
    assert [n["handle"] for n in nodes] == ["r1.c1.n3"]
    assert nodes[0]["reasons"][0]["rule"] == "ecc_uncorrectable"


async def test_node_detail_and_errors(api: Api) -> None:
    r = await cli(api, "node", "n3")
    assert r.code == 0, r.err
    assert "r1.c1.n3" in r.out
    assert "FAILING" in r.out
    assert "reasons:" in r.out
    assert "history:" in r.out
    assert "ecc_uncorrectable" in r.out

    r = await cli(api, "node", "r1.c1.n2", "--format", "json")
    assert json.loads(r.out)["record"]["grade"] == "HEALTHY"

    r = await cli(api, "node", "n1")
    assert r.code == 2
    assert "r1.c1.n1" in r.err
    assert "r1.c2.n1" in r.err
    assert "409" in r.err
    r = await cli(api, "nodes", "--grade", "SICK")
    assert r.code == 2
    assert "valid: HEALTHY" in r.err
    assert "Traceback" not in r.err


async def test_cordon_round_trip(api: Api) -> None:
    r = await cli(api, "cordon", "n2", "--reason", "DIMM swap", "--who", "bob", token=ADMIN_TOKEN)
    assert r.code == 0, r.err
    assert "r1.c1.n2: cordon: announced node.cordoned" in r.out
    assert api.env.controller.store.records["r1.c1.n2"].operator_by == "operator:bob"

    r = await cli(api, "nodes", "--cluster", "c1")
    row = next(line for line in r.out.splitlines() if line.startswith("r1.c1.n2"))
    assert "cordoned" in row

    r = await cli(api, "maintenance", "r1.c1.n2", "--reason", "firmware", token=ADMIN_TOKEN)
    assert r.code == 0, r.err
    assert "grade MAINTENANCE" in r.out
    r = await cli(api, "uncordon", "n2", "--reason", "done", "--format", "json", token=ADMIN_TOKEN)
    assert r.code == 0, r.err
    assert json.loads(r.out)["record"]["cordoned"] is False
    assert not api.env.controller.store.records["r1.c1.n2"].cordoned


async def test_cordon_refused_without_admin_token(api: Api) -> None:
    r = await cli(api, "cordon", "n2", "--reason", "x")
    assert r.code == 2
    assert "admin token" in r.err
    r = await cli(api, "cordon", "n2", "--reason", "x", token="")
    assert r.code == 2
    assert "401" in r.err
    r = await cli(api, "cordon", "n2", token=ADMIN_TOKEN)  # --reason is required
    assert r.code == 2
    assert "--reason" in r.err
    assert not api.env.controller.store.records["r1.c1.n2"].cordoned


async def test_unreachable_api_names_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    r = await cli(url, "nodes")
    assert r.code == 1
    assert url in r.err
    assert "Traceback" not in r.err


async def test_events_follow(api: Api) -> None:
    hub = api.server.app[HUB]
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        "events",
        "--follow",
        "--kind",
        "node.",
        "--node",
        "n2",
        "--count",
        "1",
        "--api",
        api.url,
        "--token",
        READ_TOKEN,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(),
    )
    try:
        await wait_until(lambda: hub.open_streams == 1, DEADLINE_S, "the CLI to subscribe")
        await api.env.controller.operator_action("r1.c1.n3", "cordon", "x", "t")  # other node
        await api.env.controller.operator_action("r1.c1.n2", "cordon", "rack work", "carol")
        out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    line = out.decode().strip()
    assert "node.cordoned" in line
    assert "r1.c1.n2" in line
    assert "rack work" in line
    assert "r1.c1.n3" not in line


async def test_events_past_without_follow(api: Api) -> None:
    await api.env.controller.operator_action("r1.c1.n3", "cordon", "first", "t")
    await api.env.controller.operator_action("r1.c1.n2", "cordon", "second", "t")
    r = await cli(api, "events", "--since", "all")
    assert r.code == 0, r.err
    lines = r.out.strip().splitlines()
    assert [("r1.c1.n3" in ln, "r1.c1.n2" in ln) for ln in lines[-2:]] == [
        (True, False),
        (False, True),
    ]
    r = await cli(api, "events", "--since", "10m", "--node", "n2", "--format", "json")
    assert r.code == 0, r.err
    (only,) = [json.loads(ln) for ln in r.out.strip().splitlines()]
    assert (only["kind"], only["node"]["node"]) == ("node.cordoned", "n2")
    r = await cli(api, "events", "--since", "last tuesday")
    assert r.code == 2
    assert "duration" in r.err
    assert "Traceback" not in r.err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_controller_run_serves_the_api(
    nc: Client, nats_url: str, tmp_path: Path, subjects: Subjects
) -> None:
    """``[http]`` in controller.toml: the API is served with the tokens files, and an open
    event stream does not hold up a SIGTERM stop."""
    (tmp_path / "read.tokens").write_text(f"# read-only\n\n{READ_TOKEN}\n")
    (tmp_path / "admin.tokens").write_text(f"{ADMIN_TOKEN}\n")
    port = free_port()
    async with api_env(nc, subjects) as env:
        config = tmp_path / "controller.toml"
        config.write_text(
            f'region = "r1"\n[nats]\nservers = ["{nats_url}"]\nprefix = "{env.subjects.prefix}"\n'
            f'[http]\nlisten = "127.0.0.1:{port}"\n'
            f'read_tokens_file = "{tmp_path / "read.tokens"}"\n'
            f'admin_tokens_file = "{tmp_path / "admin.tokens"}"\n'
            "[federation]\nenabled = true\ninterval_s = 0.2\n"
        )
        proc = await asyncio.create_subprocess_exec(
            str(METALGUARD),
            "controller",
            "run",
            "--config",
            str(config),
            stderr=asyncio.subprocess.PIPE,
            env=_env(),
        )
        assert proc.stderr is not None
        seen: list[str] = []
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_for_line(proc.stderr, "running", DEADLINE_S, seen)
            r = await cli(url, "nodes", "--format", "json")
            assert (r.code, json.loads(r.out)) == (0, []), r.err
            r = await cli(url, "nodes", token="")
            assert r.code == 2
            r = await cli(url, "cordon", "n9", "--reason", "x", token=ADMIN_TOKEN)
            assert r.code == 2
            assert "unknown node 'n9'" in r.err
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    f"{url}/v1/fleet", headers={"Authorization": f"Bearer {READ_TOKEN}"}
                ) as fleet,
            ):
                body = await fleet.json()
                assert fleet.status == 200, body
                assert [r["region"] for r in body["regions"]] == ["r1"]
            r = await cli(url, "fleet")
            assert r.code == 0, r.err
            assert "r1 (here)" in r.out
            assert "STALE" not in r.out
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    f"{url}/v1/events", headers={"Authorization": f"Bearer {READ_TOKEN}"}
                ) as stream,
            ):
                first = await asyncio.wait_for(stream.content.readline(), DEADLINE_S)
                assert first == b": subscribed\n"
                proc.send_signal(signal.SIGTERM)
                _, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
                rest = await asyncio.wait_for(stream.content.read(), DEADLINE_S)
                assert b"event:" not in rest  # ended by the shutdown, nothing more
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, "".join(seen) + err.decode()
