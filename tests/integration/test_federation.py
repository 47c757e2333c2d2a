"""Two regions' Federation objects over real NATS (one server stands in for a gateway
pair here): summaries, the fleet view, UUID lookups across regions, staleness, convergence."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.api.fleet import add_fleet_routes
from metalguard.controller.federation.service import Federation
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from tests.support.harness.api_env import ApiEnv, api_env
from tests.support.waiting import wait_until

INTERVAL_S = 0.2
DEADLINE_S = 10.0


def region_records(region: str, uuid: str) -> dict[str, NodeRecord]:
    node = NodeIdentity(region=region, cluster="c1", node="n1", uuid=uuid)
    return {f"{region}.c1.n1": NodeRecord(node=node)}


def federation(nc: Client, subjects: Subjects, region: str, uuid: str) -> Federation:
    records = region_records(region, uuid)
    fleet = [
        FleetNode(handle=f"{region}.c1.n1", region=region, cluster="c1", gpus=8, gpu_type="h100")
    ]
    return Federation(nc, subjects, region, lambda: records, lambda: fleet, interval_s=INTERVAL_S)


@pytest.fixture
async def regions(nc: Client, subjects: Subjects) -> AsyncIterator[tuple[Federation, Federation]]:
    r1 = federation(nc, subjects, "r1", "uuid-in-r1")
    r2 = federation(nc, subjects, "r2", "uuid-in-r2")
    await r1.start()
    await r2.start()
    try:
        yield r1, r2
    finally:
        await r1.stop()
        await r2.stop()


def view_of(fed: Federation) -> dict[str, dict[str, object]]:
    return {str(r["region"]): r for r in fed.fleet()}


async def test_regions_see_each_other_look_up_nodes_and_go_stale_when_cut_off(
    regions: tuple[Federation, Federation],
) -> None:
    r1, r2 = regions
    await wait_until(lambda: set(view_of(r1)) == {"r1", "r2"}, DEADLINE_S, "r1 to hear r2")
    await wait_until(lambda: set(view_of(r2)) == {"r1", "r2"}, DEADLINE_S, "r2 to hear r1")
    seen = view_of(r1)["r2"]
    assert seen["stale"] is False
    assert seen["nodes"] == 1
    assert list(seen["capacity"]) == [  # type: ignore[call-overload]
        {
            "gpu_type": "h100", "nodes": 1, "healthy_nodes": 1, "gpus": 8, "healthy_gpus": 8,
            "free_nodes": 1, "free_in": {"rack": 1, "cluster": 1, "zone": 1},
        }
    ]  # fmt: skip

    found = await r1.lookup("uuid-in-r2")  # a node's UUID is its global handle
    assert (found.found, found.region, found.handle) == (True, "r2", "r2.c1.n1")
    assert (await r1.lookup("uuid-in-r1")).region == "r1"
    assert not (await r1.lookup("no-such-uuid")).found

    await r2.stop()  # r2 cut off: r1 keeps its own view, r2's goes stale
    await wait_until(lambda: view_of(r1)["r2"]["stale"] is True, DEADLINE_S, "r2 to go stale")
    assert view_of(r1)["r1"]["stale"] is False
    await r2.start()  # back: the next summary makes the views converge
    await wait_until(lambda: view_of(r1)["r2"]["stale"] is False, DEADLINE_S, "r2 fresh again")


async def test_fleet_routes(
    nc: Client, subjects: Subjects, regions: tuple[Federation, Federation]
) -> None:
    r1, _ = regions
    await wait_until(lambda: "r2" in view_of(r1), DEADLINE_S, "r1 to hear r2")
    env: ApiEnv
    async with api_env(nc, subjects) as env:
        app = make_app(env.controller, env.source)
        add_fleet_routes(app, r1)
        async with TestClient(TestServer(app)) as client:
            body = await (await client.get("/v1/fleet")).json()
            assert body["region"] == "r1"
            assert [r["region"] for r in body["regions"]] == ["r1", "r2"]
            node = await (await client.get("/v1/nodes/by-uuid/uuid-in-r2")).json()
            assert (node["region"], node["handle"]) == ("r2", "r2.c1.n1")
            assert node["record"]["node"]["uuid"] == "uuid-in-r2"
            missing = await client.get("/v1/nodes/by-uuid/nope")
            assert missing.status == 404
            assert "nope" in (await missing.json())["error"]["message"]
