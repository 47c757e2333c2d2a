"""``/v1/qos`` (controller/api_qos.py) over a real MG_QOS bucket, and ``metalguard qos``
as a subprocess against it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.qos import QosStore
from metalguard.proto.qos import decode_profile
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import NetInterface, TcClassStats, TelemetryBatch
from tests.support.harness.api_env import ADMIN_TOKEN, READ_TOKEN, api_env, batch

METALGUARD = Path(sys.executable).parent / "metalguard"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TOML = {**ADMIN, "Content-Type": "application/toml"}

PROFILE = """\
version = {version}
pfc_priorities = [3]
link_rate_mbit = 100000
[interfaces]
names = ["eth0"]
[dscp_map]
26 = 3
48 = 6
[[traffic_class]]
name = "default"
priorities = [0, 1, 2, 4, 5, 7]
bandwidth_percent = 40
[[traffic_class]]
name = "training"
priorities = [3]
bandwidth_percent = 50
ecn = {{ min_kb = 150, max_kb = 1500, probability = 0.1 }}
[[traffic_class]]
name = "control"
priorities = [6]
bandwidth_percent = 10
strict = true
"""

INVALID = """\
version = 9
colour = "blue"
[[traffic_class]]
name = "default"
priorities = [0, 3]
bandwidth_percent = 40
[[traffic_class]]
name = "training"
priorities = [3]
bandwidth_percent = 50
ecn = { min_kb = 1500, max_kb = 150 }
"""
"""Four problems: an unknown key, priority 3 twice, shares summing to 90, min >= max."""

INVALID_VALUES = INVALID.replace('colour = "blue"\n', "")
"""The same without the unknown key: the semantic problems, all listed at once."""


@pytest.fixture
async def qos(nc: Client, subjects: Subjects) -> QosStore:
    return await QosStore.open(nc.jetstream(timeout=5), subjects)


@pytest.fixture
async def client(
    nc: Client, subjects: Subjects, qos: QosStore
) -> AsyncIterator[TestClient[Any, Any]]:
    async with api_env(nc, subjects) as env:
        app = make_app(
            env.controller,
            env.source,
            read_tokens={READ_TOKEN},
            admin_tokens={ADMIN_TOKEN},
            qos=qos,
        )
        async with TestClient(TestServer(app)) as c:
            yield c


async def put(client: TestClient[Any, Any], path: str, body: str, status: int = 200) -> Any:
    response = await client.put(path, data=body.encode(), headers=TOML)
    assert response.status == status, await response.text()
    return await response.json()


async def get(client: TestClient[Any, Any], path: str, status: int = 200) -> Any:
    response = await client.get(path, headers=READ)
    assert response.status == status, await response.text()
    return await response.json()


async def test_put_then_get_versioned_with_history(
    client: TestClient[Any, Any], qos: QosStore
) -> None:
    assert (await get(client, "/v1/qos/c1", 404))["error"]["code"] == "not_found"
    first = await put(client, "/v1/qos/c1", PROFILE.format(version=1))
    assert (first["key"], first["version"], first["previous_version"]) == ("c1", 1, None)

    body = await get(client, "/v1/qos/c1")
    assert body["revision"] == first["revision"]
    assert body["source"] == "cluster"
    assert body["profile"]["dscp_map"] == {"26": 3, "48": 6}
    assert [tc["name"] for tc in body["profile"]["traffic_class"]] == [
        "default",
        "training",
        "control",
    ]

    second = await put(client, "/v1/qos/c1", PROFILE.format(version=2))
    assert second["previous_version"] == 1
    assert second["revision"] > first["revision"]
    history = (await get(client, "/v1/qos/c1?history=1"))["history"]
    assert [(h["version"], h["revision"]) for h in history] == [
        (1, first["revision"]),
        (2, second["revision"]),
    ]
    stored = await qos.get("c1")
    assert stored is not None
    assert stored.profile.version == 2  # what the agents will decode


async def test_stale_or_equal_version_is_409_and_changes_nothing(
    client: TestClient[Any, Any],
) -> None:
    stored = await put(client, "/v1/qos/c1", PROFILE.format(version=5))
    for version in (5, 4):
        error = (await put(client, "/v1/qos/c1", PROFILE.format(version=version), 409))["error"]
        assert error["code"] == "version_conflict"
        assert f"version {version} is not newer than the stored version 5" in error["message"]
    assert (await get(client, "/v1/qos/c1"))["revision"] == stored["revision"]


async def test_invalid_profile_is_422_with_every_reason_and_changes_nothing(
    client: TestClient[Any, Any],
) -> None:
    stored = await put(client, "/v1/qos/c1", PROFILE.format(version=1))

    error = (await put(client, "/v1/qos/c1", INVALID, 422))["error"]
    assert error["code"] == "invalid_profile"
    assert any("colour" in r for r in error["reasons"]), error

    reasons = (await put(client, "/v1/qos/c1", INVALID_VALUES, 422))["error"]["reasons"]
    assert any("priority 3 is already in class 'default'" in r for r in reasons), reasons
    assert any("sum to 90" in r for r in reasons), reasons
    assert any("min_kb (1500) must be < max_kb (150)" in r for r in reasons), reasons

    syntax = (await put(client, "/v1/qos/c1", "version = = 3", 422))["error"]["reasons"]
    assert any("TOML" in r for r in syntax), syntax
    assert (await get(client, "/v1/qos/c1"))["revision"] == stored["revision"]


async def test_json_body_media_types_and_auth(client: TestClient[Any, Any]) -> None:
    path = "/v1/qos/c1"
    toml = PROFILE.format(version=3)
    assert (await client.put(path, data=toml)).status == 401
    response = await client.put(path, data=toml, headers={**READ, "Content-Type": "text/toml"})
    assert response.status == 403
    response = await client.put(path, data=toml, headers={**ADMIN, "Content-Type": "text/plain"})
    assert response.status == 415
    assert (await client.put(path, data=b"  ", headers=TOML)).status == 400
    await get(client, path, 404)  # none of these stored anything

    first = await put(client, "/v1/qos/c2", PROFILE.format(version=1))
    body = json.dumps({**first["profile"], "version": 2})
    response = await client.put(
        "/v1/qos/c2", data=body, headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert response.status == 200, await response.text()
    assert (await response.json())["version"] == 2
    assert (await client.get("/v1/qos/c.x", headers=READ)).status == 400


async def test_node_override_and_fallback(client: TestClient[Any, Any], qos: QosStore) -> None:
    await get(client, "/v1/qos/c1/nodes/n1", 404)
    cluster = await put(client, "/v1/qos/c1", PROFILE.format(version=4))
    fallback = await get(client, "/v1/qos/c1/nodes/n1?history=1")
    assert (fallback["source"], fallback["key"], fallback["version"]) == ("cluster", "c1", 4)
    assert [h["key"] for h in fallback["history"]] == ["c1"]  # the history of what is served

    override = await put(client, "/v1/qos/c1/nodes/n1", PROFILE.format(version=1))
    assert (override["key"], override["source"]) == ("c1.n1", "node")
    body = await get(client, "/v1/qos/c1/nodes/n1")
    assert (body["source"], body["version"]) == ("node", 1)
    assert (await get(client, "/v1/qos/c1/nodes/n2"))["revision"] == cluster["revision"]
    effective = await qos.effective("c1", "n1")
    assert effective is not None
    assert effective.key == "c1.n1"


# --- the CLI ----------------------------------------------------------------------------


async def metalguard(url: str, *args: str, token: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METALGUARD_")}
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        *args,
        "--api",
        url,
        "--token",
        token,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**env, "COLUMNS": "200"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_apply_and_show(
    nc: Client, subjects: Subjects, qos: QosStore, tmp_path: Path
) -> None:
    async with api_env(nc, subjects) as env:
        app = make_app(
            env.controller,
            env.source,
            read_tokens={READ_TOKEN},
            admin_tokens={ADMIN_TOKEN},
            qos=qos,
        )
        server = TestServer(app)
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            good = tmp_path / "training.toml"
            good.write_text(PROFILE.format(version=1))
            bad = tmp_path / "bad.toml"
            bad.write_text(INVALID_VALUES)

            code, out, err = await metalguard(url, "qos", "apply", "c1", str(good))
            assert code == 0, err
            assert "c1: version 1 stored (new)" in out

            code, out, err = await metalguard(url, "qos", "apply", "c1", str(bad))
            assert code == 2
            assert "invalid QoS profile (HTTP 422 invalid_profile):" in err
            assert "  - traffic_class: bandwidth_percent shares sum to 90, must be 100" in err

            code, out, err = await metalguard(url, "qos", "apply", "c1", str(good))
            assert code == 2
            assert "not newer than the stored version 1" in err

            code, out, err = await metalguard(url, "qos", "show", "c1", token=READ_TOKEN)
            assert code == 0, err
            assert "c1 (cluster profile)" in out
            assert "26->3 48->6" in out
            assert "training  3" in out

            code, out, err = await metalguard(
                url, "qos", "show", "c1", "--node", "n1", "--format", "json", token=READ_TOKEN
            )
            assert code == 0, err
            shown = json.loads(out)
            assert shown["source"] == "cluster"
            stored = await qos.get("c1")
            assert stored is not None
            assert decode_profile(json.dumps(shown["profile"]), "json") == stored.profile
        finally:
            await server.close()


# --- the node page shows the network component -----------------------------------------


async def test_node_page_shows_network_reasons_and_counters(nc: Client, subjects: Subjects) -> None:
    def net_batch(seq: int, drops: int) -> TelemetryBatch:
        tc = TcClassStats(classid="1:10", name="training", lossless=True, drops=drops)
        nic = NetInterface(name="ens1f0", rx_dropped=0, tx_dropped=0, rx_errors=0, tc_classes=(tc,))
        return msgspec.structs.replace(batch("c1", "n1", seq), net=(nic,))

    async with api_env(nc, subjects) as env:
        await env.feed(net_batch(1, 0), net_batch(2, 12))
        app = make_app(env.controller, env.source, read_tokens={READ_TOKEN})
        async with TestClient(TestServer(app)) as client:
            body = await get(client, "/v1/nodes/r1.c1.n1")
    reasons = body["record"]["reasons"]
    network = [r for r in reasons if r["signal"].startswith("network.")]
    assert [(r["rule"], r["signal"]) for r in network] == [
        ("tc_lossless_drops", "network.lossless_drops")
    ]
    assert "lossless class training (1:10) on ens1f0: 12 drops" in network[0]["message"]
    assert body["record"]["score"] < 100
    signals = body["signals"]
    assert [v for _, v in signals["net.ens1f0.tc.1:10.drops"]["samples"]] == [0, 12]
    assert "net.ens1f0.drops" in signals
