"""``/v1/images``, ``/v1/instances``, ``/v1/volumes`` and ``/v1/provision/nodes``
(controller/api/provision.py) over the real ProvisionService, its KV bucket and its boot
server, on a real nats-server, with the demo's simulated BMC and storage
(metalguard/demo/sim/provision.py: the node fetches its iPXE script by MAC over HTTP,
attaches its export and posts its ready report); and ``metalguard provision`` as a
subprocess against it (exit 0; 2 on a 4xx, or a 502/504 of the BMC, with the server's
message)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.demo.sim.provision import SimProvisioning, sim_mac
from metalguard.proto.base import NodeIdentity
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness.api_env import ADMIN_TOKEN, READ_TOKEN, ApiEnv, api_env
from tests.support.waiting import wait_for_value

METALGUARD = Path(sys.executable).parent / "metalguard"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NODES = [f"r1.c1.n0{i}" for i in range(1, 5)]
MACS = {node: sim_mac(i) for i, node in enumerate(NODES, 1)}
SETTLE_S = 20.0


@dataclass
class Env:
    client: TestClient[Any, Any]
    api: ApiEnv
    sim: SimProvisioning

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    async def post(self, path: str, body: Any, status: int, token: str = ADMIN_TOKEN) -> Any:
        headers = {"Authorization": f"Bearer {token}"}
        response = await self.client.post(path, json=body, headers=headers)
        text = await response.text()
        assert response.status == status, text
        return json.loads(text)

    async def get(self, path: str, status: int = 200) -> Any:
        response = await self.client.get(path, headers=READ)
        text = await response.text()
        assert response.status == status, text
        return json.loads(text)

    async def settled(self, instance_id: str, state: str) -> dict[str, Any]:
        """The instance once it is in ``state`` (the simulated node reported)."""
        return await wait_for_value(
            lambda: self.get(f"/v1/instances/{instance_id}"),
            lambda body: body["state"] == state,
            SETTLE_S,
            f"{instance_id} {state}",
        )

    async def leftovers(self) -> dict[str, Any]:
        """What a failure must not leave: volumes, exports, node claims, instances."""
        service = self.sim.service
        return {
            "volumes": [v.name for v in await self.sim.storage.list_volumes()],
            "exports": await self.sim.storage.list_exports(),
            "claims": sorted(n for n, c in service.store.claims.items() if c.instance_id),
            "instances": sorted(service.store.instances),
        }


NOTHING: dict[str, list[str]] = {"volumes": [], "exports": [], "claims": [], "instances": []}


def healthy(handle: str) -> TelemetryBatch:
    """A batch of ``handle`` from a minute ago: it makes the node's record (HEALTHY), and
    being older than any boot here it never counts as the new boot's first telemetry (the
    instance becomes active on the simulated node's ready report)."""
    region, cluster, node = handle.split(".")
    return TelemetryBatch(
        node=NodeIdentity(region=region, cluster=cluster, node=node),
        seq=1,
        ts=time.time() - 60.0,
        interval_s=5.0,
    )


@pytest.fixture
async def env(nc: Client, subjects: Subjects, tmp_path: Path) -> AsyncIterator[Env]:
    async with api_env(nc, subjects) as api:
        await api.feed(*(healthy(n) for n in NODES))
        sim = await SimProvisioning.start(
            nc,
            nc.jetstream(timeout=5),
            subjects,
            "r1",
            api.controller.store,
            MACS,
            boot_delay_s=0.2,
            deploy_timeout_s=30.0,
            tick_s=0.2,
        )
        (tmp_path / "base").mkdir()
        (tmp_path / "base" / "init").write_text("#!/bin/sh\n")
        await sim.service.add_image_from_dir("base", str(tmp_path / "base"), 0)
        app = make_app(
            api.controller,
            api.source,
            read_tokens={READ_TOKEN},
            admin_tokens={ADMIN_TOKEN},
            provision=sim.service,
        )
        try:
            async with TestClient(TestServer(app)) as client:
                yield Env(client, api, sim)
        finally:
            await sim.stop()


async def cli(env: Env, *args: str, token: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        "provision",
        *args,
        "--api",
        env.url,
        "--token",
        token,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_deploy_is_202_then_active_on_the_nodes_report_and_never_shows_its_export(
    env: Env,
) -> None:
    body = {"tenant": "acme", "image": "base", "node": NODES[0], "instance_id": "acme-1"}
    created = await env.post("/v1/instances", body, 202)
    assert created["state"] == "deploying"
    assert created["node"] == NODES[0]
    active = await env.settled("acme-1", "active")
    assert active["ready_report"]["kernel"] == "metalguard-sim"
    assert [h["state"] for h in active["history"]] == ["deploying", "active"]
    secret = env.sim.service.store.instances["acme-1"].export
    assert secret
    assert secret in await env.sim.storage.list_exports()
    for path in ("/v1/instances", "/v1/instances/acme-1", "/v1/volumes", "/v1/nodes"):
        text = await (await env.client.get(path, headers=READ)).text()
        assert secret not in text, path
        assert '"export"' not in text, path
    # the node's line, the volume's user, the provisioned nodes
    nodes = {n["handle"]: n for n in (await env.get("/v1/nodes"))["nodes"]}
    assert nodes[NODES[0]]["provision"] == {
        "state": "active",
        "instance": "acme-1",
        "tenant": "acme",
        "image": "base",
        "flagged": False,
    }
    assert nodes[NODES[1]]["provision"]["state"] == "available"
    [volume] = (await env.get("/v1/volumes"))["volumes"]
    assert volume["instance"] == "acme-1"
    assert volume["tenant"] == "acme"
    assert volume["size_bytes"] < 1 << 20  # copy-on-write: kilobytes, not the image
    listed = (await env.get("/v1/provision/nodes"))["nodes"]
    assert {n["node"]: n["mac"] for n in listed} == MACS
    assert (await env.get("/v1/instances?state=active&tenant=acme"))["instances"][0][
        "instance_id"
    ] == "acme-1"
    assert (await env.get("/v1/instances?tenant=globex"))["instances"] == []
    # with ?wait=true the answer is the active instance, 201
    waited = await env.post("/v1/instances?wait=true", {"tenant": "acme", "image": "base"}, 201)
    assert waited["state"] == "active"
    assert waited["node"] != NODES[0]


async def test_switch_detaches_a_attaches_b_and_as_volume_stays_as(env: Env) -> None:
    body = {"tenant": "acme", "image": "base", "node": NODES[0], "instance_id": "one"}
    await env.post("/v1/instances?wait=true", body, 201)
    a_volume = env.sim.service.store.instances["one"].volume
    switching = await env.post(
        "/v1/instances/one/switch", {"tenant": "globex", "image": "base"}, 202
    )
    assert switching["state"] == "switching"
    active = await env.settled("one", "active")
    assert active["tenant"] == "globex"
    assert active["node"] == NODES[0]
    b_volume = active["volume"]
    assert b_volume != a_volume
    volumes = {v["name"]: v for v in (await env.get("/v1/volumes"))["volumes"]}
    assert volumes[a_volume]["tenant"] == "acme"
    assert volumes[a_volume]["instance"] is None  # kept for acme, attached nowhere
    assert volumes[b_volume]["instance"] == "one"
    assert env.sim.storage.lines(a_volume) == [f"booted one on {NODES[0]}"]
    assert env.sim.storage.lines(b_volume) == [f"booted one on {NODES[0]}"]
    assert len(await env.sim.storage.list_exports()) == 1  # only B's
    # a switch of an instance that is not active is 409
    await env.post("/v1/instances/one/switch", {"tenant": "acme", "image": "base"}, 202)
    again = await env.post("/v1/instances/one/switch", {"tenant": "x", "image": "base"}, 409)
    assert "switching" in again["error"]["message"]


async def test_release_keeps_or_deletes_the_volume_and_frees_the_node(env: Env) -> None:
    await env.post(
        "/v1/instances?wait=true", {"tenant": "a", "image": "base", "instance_id": "k"}, 201
    )
    await env.post(
        "/v1/instances?wait=true", {"tenant": "b", "image": "base", "instance_id": "d"}, 201
    )
    kept = env.sim.service.store.instances["k"].volume
    response = await env.client.delete("/v1/instances/k", headers=ADMIN)
    assert response.status == 200, await response.text()
    assert (await response.json())["state"] == "released"
    response = await env.client.delete("/v1/instances/d?keep_volume=false", headers=ADMIN)
    assert response.status == 200, await response.text()
    assert [v["name"] for v in (await env.get("/v1/volumes"))["volumes"]] == [kept]
    assert await env.sim.storage.list_exports() == []
    states = {n["node"]: n["state"] for n in (await env.get("/v1/provision/nodes"))["nodes"]}
    assert set(states.values()) == {"available"}
    # a kept volume boots again for its tenant; it cannot be deleted while it is in use
    body = {"tenant": "a", "image": "base", "volume": kept, "instance_id": "k2"}
    await env.post("/v1/instances?wait=true", body, 201)
    refused = await env.client.delete(f"/v1/volumes/{kept}", headers=ADMIN)
    assert refused.status == 409
    assert "k2" in (await refused.json())["error"]["message"]
    image = await env.client.delete("/v1/images/base", headers=ADMIN)
    assert image.status == 409


async def test_bad_requests_are_clear_errors_that_leave_nothing(env: Env) -> None:
    bad = await env.post("/v1/instances", {"tenant": "a b", "image": "base", "colour": 1}, 400)
    reasons = bad["error"]["reasons"]
    assert any(r.startswith("colour") for r in reasons)
    assert any(r.startswith("tenant") for r in reasons)
    assert (
        "no image 'nope'"
        in (await env.post("/v1/instances", {"tenant": "a", "image": "nope"}, 404))["error"][
            "message"
        ]
    )
    unknown = {"tenant": "a", "image": "base", "node": "r1.c1.n99"}
    assert (await env.post("/v1/instances", unknown, 404))["error"]["code"] == "not_found"
    assert await env.leftovers() == NOTHING
    # a BMC that refuses: 502 with its message, everything rolled back
    env.sim.power.refuse.add(NODES[1])
    on_1 = {"tenant": "a", "image": "base", "node": NODES[1]}
    refused = await env.post("/v1/instances", on_1, 502)
    assert "refused" in refused["error"]["message"]
    assert await env.leftovers() == NOTHING
    env.sim.power.refuse.clear()
    # an export that fails: 502, nothing left
    env.sim.storage.fail_exports = True
    failed = await env.post("/v1/instances", on_1, 502)
    assert "export" in failed["error"]["message"]
    assert await env.leftovers() == NOTHING
    env.sim.storage.fail_exports = False
    # a node that is taken: 409, the first instance untouched
    await env.post("/v1/instances", {"tenant": "a", "image": "base", "node": NODES[2]}, 202)
    on_2 = {"tenant": "b", "image": "base", "node": NODES[2]}
    taken = await env.post("/v1/instances", on_2, 409)
    assert NODES[2] in taken["error"]["message"]
    assert len(env.sim.service.store.instances) == 1
    # other mistakes
    response = await env.client.post("/v1/instances", data=b"tenant=a", headers=ADMIN)
    assert response.status == 415
    assert (await env.get("/v1/instances?state=flying", 400))["error"]["code"] == "bad_request"
    assert (await env.get("/v1/instances/nope", 404))["error"]["message"] == "no instance 'nope'"
    forbidden = await env.post("/v1/instances", {"tenant": "a", "image": "base"}, 403, READ_TOKEN)
    assert forbidden["error"]["code"] == "forbidden"
    dup = await env.client.post(
        "/v1/images", json={"name": "base", "directory": "/tmp"}, headers=ADMIN
    )
    assert dup.status == 409


async def test_a_controller_without_provisioning_says_so(env: Env) -> None:
    app = make_app(env.api.controller, env.api.source)
    async with TestClient(TestServer(app)) as client:
        for method, path in (("GET", "/v1/instances"), ("POST", "/v1/images/x")):
            response = await client.request(method, path)
            assert response.status == 404
            error = (await response.json())["error"]
            assert error["code"] == "not_enabled"
            assert "[provision]" in error["message"]
        nodes = (await (await client.get("/v1/nodes")).json())["nodes"]
        assert all("provision" not in n for n in nodes)


async def test_cli_images_instances_volumes(env: Env, tmp_path: Path) -> None:
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "hello").write_text("hi\n")
    code, out, err = await cli(env, "images", "add", "tree", "--dir", str(tmp_path / "tree"))
    assert code == 0, err
    assert "image tree" in out
    upload = tmp_path / "disk.raw"
    upload.write_bytes(b"\0" * 4096)
    code, out, err = await cli(env, "images", "add", "disk", "--file", str(upload))
    assert code == 0, err
    code, out, _ = await cli(env, "images", "list")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["base", "disk", "tree"]
    assert "upload:" in out
    code, out, err = await cli(
        env, "instances", "create", "--tenant", "acme", "--image", "tree", "--id", "c1", "--wait"
    )
    assert code == 0, err
    assert out.startswith("c1: active (tenant acme, image tree")
    code, out, _ = await cli(env, "instances", "show", "c1")
    assert "ready report:" in out
    assert "metalguard-sim" in out
    code, out, err = await cli(
        env, "instances", "switch", "c1", "--tenant", "globex", "--image", "base", "--wait"
    )
    assert code == 0, err
    assert "active (tenant globex" in out
    code, out, _ = await cli(env, "instances", "list", "--format", "json")
    assert [i["tenant"] for i in json.loads(out)["instances"]] == ["globex"]
    code, out, _ = await cli(env, "volumes", "list", "--tenant", "acme")
    [row] = out.splitlines()[1:]
    acme_volume = row.split()[0]
    assert row.split()[-1] == "-"  # attached nowhere
    code, out, err = await cli(env, "volumes", "delete", acme_volume)
    assert code == 0, err
    code, out, err = await cli(env, "instances", "release", "c1", "--delete-volume")
    assert code == 0, err
    assert out.startswith("c1: released")
    code, out, _ = await cli(env, "volumes", "list")
    assert out.splitlines()[1:] == []
    code, out, _ = await cli(env, "nodes", "list")
    assert code == 0
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [
        [node, MACS[node]] for node in NODES
    ]
    code, out, err = await cli(env, "nodes", "clear", NODES[0])
    assert code == 0, err
    assert out == f"{NODES[0]}: available, failures 0, not flagged\n"
    code, _, err = await cli(env, "nodes", "clear", "r1.c1.n99")
    assert code == 2
    assert "not a provisioned node" in err


async def test_cli_exit_codes_carry_the_servers_message(env: Env) -> None:
    code, _, err = await cli(env, "instances", "create", "--tenant", "a", "--image", "nope")
    assert code == 2
    assert "no image 'nope' (HTTP 404" in err
    code, _, err = await cli(env, "instances", "create", "--tenant", "a b", "--image", "base")
    assert code == 2
    assert "invalid request (HTTP 400" in err
    assert "tenant:" in err
    code, _, err = await cli(env, "instances", "show", "nope")
    assert code == 2
    code, _, err = await cli(env, "images", "delete", "nope")
    assert code == 2
    code, _, err = await cli(
        env, "instances", "create", "--tenant", "a", "--image", "base", token=READ_TOKEN
    )
    assert code == 2
    assert "admin token" in err
    env.sim.power.refuse.add(NODES[0])
    code, _, err = await cli(
        env, "instances", "create", "--tenant", "a", "--image", "base", "--node", NODES[0]
    )
    assert code == 2  # the BMC refused: the request could not be carried out (502)
    assert "refused" in err
    assert "HTTP 502 bad_gateway" in err
    assert await env.leftovers() == NOTHING
