"""``GET /v1/qos`` on a real region controller fed by its real ingest over the session
nats-server: TelemetryBatches with moving pause and ``port_xmit_wait`` counters, published
on the telemetry subjects, become per-cluster rates, the most congested nodes and the
degraded nodes; a node that stops reporting leaves the sums, a counter reset counts
nothing; the congestion never touches a node's grade."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.api.sse import NatsEventSource
from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.controller.qos import QosStore
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import encode
from metalguard.proto.qos import decode_profile
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import NetInterface, QosInterfaceStatus, RdmaPort, TelemetryBatch
from tests.support.clock import T0, ManualClock
from tests.support.harness.api_env import READ_TOKEN
from tests.support.waiting import wait_for_value

INTERVAL = 10.0
DEADLINE_S = 15.0
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
DEGRADED = QosInterfaceStatus(
    interface="eth2",
    version=3,
    status="degraded",
    reasons=("mlx5_0/1: np_ecn_marked_roce_packets +500 but np_cnp_sent +0",),
)


def batch(
    cluster: str,
    node: str,
    seq: int,
    *,
    rx: int | None = None,
    tx: int | None = None,
    wait: int | None = None,
    degraded: bool = False,
) -> TelemetryBatch:
    rdma: tuple[RdmaPort, ...] = ()
    if wait is not None:
        rdma = (
            RdmaPort(device="mlx5_0", port=1, netdev="eth2", counters={"port_xmit_wait": wait}),
        )
    return TelemetryBatch(
        node=NodeIdentity(region="r1", cluster=cluster, node=node),
        seq=seq,
        ts=T0 + seq * INTERVAL,
        interval_s=INTERVAL,
        net=(NetInterface(name="eth2", rx_pause=rx, tx_pause=tx),),
        rdma=rdma,
        qos=(DEGRADED,) if degraded else (),
    )


class Controller:
    """A region controller, its ingest and its API (with the QoS store), one clock."""

    def __init__(self, nc: Client, subjects: Subjects, client: TestClient[Any, Any]) -> None:
        self.nc, self.subjects, self.client = nc, subjects, client

    async def publish(self, *batches: TelemetryBatch) -> None:
        for b in batches:
            n = b.node
            await self.nc.publish(self.subjects.telemetry(n.region, n.cluster, n.node), encode(b))
        await self.nc.flush()

    async def view(self) -> dict[str, Any]:
        response = await self.client.get("/v1/qos", headers=READ)
        assert response.status == 200, await response.text()
        return dict(await response.json())

    async def until(self, what: str, done: Any) -> dict[str, dict[str, Any]]:
        """The clusters of ``GET /v1/qos`` (by name) once ``done(clusters)`` holds."""

        async def probe() -> dict[str, dict[str, Any]]:
            return {c["cluster"]: c for c in (await self.view())["clusters"]}

        return await wait_for_value(probe, done, DEADLINE_S, what)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def controller(
    nc: Client, subjects: Subjects, clock: ManualClock
) -> AsyncIterator[tuple[Controller, RegionController]]:
    js = nc.jetstream(timeout=5)
    region = RegionController(js, await NodeStore.open(js, subjects), subjects, "r1", clock=clock)
    settings = IngestSettings(
        region="r1", fetch_timeout_s=0.2, retry_delay_s=0.2, stop_timeout_s=5.0
    )
    ingest = Ingest(js, subjects, settings, region, clock=clock)
    qos = await QosStore.open(js, subjects)
    await qos.put(
        "c1", None, decode_profile("version = 3\n[dcqcn]\nnp = { cnp_dscp = 48 }", "toml")
    )
    app = make_app(
        region, NatsEventSource(nc, subjects, "r1"), read_tokens={READ_TOKEN}, qos=qos, clock=clock
    )
    await region.start()
    await ingest.start()
    try:
        async with TestClient(TestServer(app)) as client:
            yield Controller(nc, subjects, client), region
    finally:
        await ingest.stop()
        await region.stop()


async def test_congestion_per_cluster_over_ingest(
    controller: tuple[Controller, RegionController], clock: ManualClock
) -> None:
    api, region = controller
    assert (await api.client.get("/v1/qos")).status == 401, "a read token is needed"
    assert (await api.client.get("/v1/qos?x=1", headers=READ)).status == 400

    # n1: 10 pause frames/s received and 100 xmit_wait ticks/s; n2: 50 pause frames/s,
    # a QoS interface degraded; m1 (cluster c2) counts no pause frames.
    await api.publish(
        *(batch("c1", "n1", s, rx=100 * (s - 1), tx=0, wait=1000 * (s - 1)) for s in (1, 2, 3)),
        *(batch("c1", "n2", s, rx=500 * (s - 1), tx=0, wait=0, degraded=True) for s in (1, 2, 3)),
        *(batch("c2", "m1", s) for s in (1, 2, 3)),
    )
    clusters = await api.until(
        "both nodes of c1 reporting their third batch",
        lambda cs: (
            set(cs) == {"c1", "c2"}
            and cs["c1"]["nodes_reporting"] == 2
            and cs["c1"]["rx_pause_per_s"] == 60.0
        ),
    )
    c1, c2 = clusters["c1"], clusters["c2"]
    assert (c1["region"], c1["profile_version"], c1["nodes"]) == ("r1", 3, 2)
    assert (c1["pause_frames_per_s"], c1["tx_pause_per_s"], c1["xmit_wait_per_s"]) == (
        60.0,
        0.0,
        100.0,
    )
    assert [(n["node"], round(n["share"], 3)) for n in c1["top"]] == [("n1", 1.0), ("n2", 0.833)]
    assert c1["top"][1] == {
        "handle": "r1.c1.n2",
        "node": "n2",
        "share": pytest.approx(50 / 60),
        "pause_frames_per_s": 50.0,
        "rx_pause_per_s": 50.0,
        "tx_pause_per_s": 0.0,
        "xmit_wait_per_s": 0.0,
    }
    assert c1["degraded"] == [
        {
            "handle": "r1.c1.n2",
            "node": "n2",
            "interfaces": [
                {
                    "interface": "eth2",
                    "version": 3,
                    "status": "degraded",
                    "reasons": list(DEGRADED.reasons),
                }
            ],
        }
    ]
    assert (c2["profile_version"], c2["nodes"], c2["nodes_reporting"], c2["top"]) == (
        None,
        1,
        0,
        [],
    )
    grades = {h: r.grade for h, r in region.store.records.items()}
    assert set(grades.values()) == {"HEALTHY"}, "congestion is no node fault by itself"

    # n1 falls silent; a minute later only n2 reports, and its counter resets once.
    clock.now = T0 + 100
    await api.publish(batch("c1", "n2", 4, rx=1200, tx=0), batch("c1", "n2", 5, rx=40, tx=0))
    clusters = await api.until(
        "n1 stale, n2's reset interval counted as nothing",
        lambda cs: cs["c1"]["nodes_reporting"] == 1 and cs["c1"]["rx_pause_per_s"] == 0.0,
    )
    assert [n["node"] for n in clusters["c1"]["top"]] == []
    assert clusters["c1"]["degraded"] == [], "n2's newest batch has no degraded interface"
    await api.publish(batch("c1", "n2", 6, rx=240, tx=0))
    clusters = await api.until(
        "n2's rate from its new base",
        lambda cs: cs["c1"]["rx_pause_per_s"] == 20.0,
    )
    assert [n["node"] for n in clusters["c1"]["top"]] == ["n2"]
    assert clusters["c1"]["nodes"] == 2, "n1 still has its record"
