"""The region controller's batch intake feeds the topology view (real NATS, KV)."""

from __future__ import annotations

from nats.aio.client import Client

from metalguard.controller.core.topology import (
    ClusterTopology,
    TopologyOverride,
    TopologySection,
    TopologyView,
)
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from metalguard.proto.topology import NodeTopology
from tests.support.clock import T0, ManualClock


async def test_batches_feed_the_view_and_the_config_overrides(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    clock = ManualClock()
    view = TopologyView(TopologySection(clusters={"c1": ClusterTopology(zone="z7")}))
    region = RegionController(
        js, await NodeStore.open(js, subjects), subjects, "r1", clock=clock, topology=view
    )
    await region.start()
    try:
        reported = NodeTopology(
            zone="z1", rack="k2", leaf="k2-l1", gpus=8, gpu_type="h100", cpu_cores=64
        )
        for seq, name in enumerate(("n1", "n2"), start=1):
            identity = NodeIdentity(region="r1", cluster="c1", node=name)
            topo = reported if name == "n1" else None
            batch = TelemetryBatch(
                node=identity, seq=seq, ts=T0 + seq, interval_s=5.0, topology=topo
            )
            await region.on_batch(batch, T0 + seq)
        fleet = {n.handle: n for n in region.topology.fleet(region.store.records)}
        assert set(fleet) == {"r1.c1.n1", "r1.c1.n2"}
        n1, n2 = fleet["r1.c1.n1"], fleet["r1.c1.n2"]
        assert (n1.zone, n1.rack, n1.leaf, n1.gpus, n1.gpu_type) == ("z7", "k2", "k2-l1", 8, "h100")
        assert n1.schedulable
        assert (n2.zone, n2.rack, n2.gpus) == ("z7", "", 0), "no report: only the config"
    finally:
        await region.stop()


async def test_records_carry_the_resolved_rack(nc: Client, subjects: Subjects) -> None:
    """The record's rack (what /v1/nodes and the dashboard group by) is the node's
    topology: its report, a node table of the config moving it, a new report moving it."""
    js = nc.jetstream(timeout=5)
    moved = ClusterTopology(nodes={"n2": TopologyOverride(rack="k9")})
    view = TopologyView(TopologySection(clusters={"c1": moved}))
    region = RegionController(
        js, await NodeStore.open(js, subjects), subjects, "r1", clock=ManualClock(), topology=view
    )
    await region.start()

    async def take(name: str, seq: int, rack: str | None) -> str:
        identity = NodeIdentity(region="r1", cluster="c1", node=name)
        topo = NodeTopology(rack=rack) if rack is not None else None
        batch = TelemetryBatch(node=identity, seq=seq, ts=T0 + seq, interval_s=5.0, topology=topo)
        await region.on_batch(batch, T0 + seq)
        return region.store.records[identity.handle].rack

    try:
        assert await take("n1", 1, "k3") == "k3", "the node's report"
        assert await take("n2", 1, "k3") == "k9", "the config's node table wins"
        assert await take("n3", 1, None) == "", "nothing said: no rack"
        assert await take("n1", 2, "k3") == "k3"
        assert await take("n1", 3, "k4") == "k4", "a steady node's new report moves it"
        assert await take("n1", 4, None) == "k4", "a batch without topology keeps the last"
        await region.flush_liveness()
        reloaded = await NodeStore.open(js, subjects)
        assert {h: r.rack for h, r in reloaded.records.items()} == {
            "r1.c1.n1": "k4",
            "r1.c1.n2": "k9",
            "r1.c1.n3": "",
        }, "written to KV"
    finally:
        await region.stop()
