"""The region controller scores a batch against the node's resolved topology: a cabled
RDMA port forced by the controller's [topology] (not in the node's report) is judged
(real NATS, KV)."""

from __future__ import annotations

from nats.aio.client import Client

from metalguard.controller.core.topology import ClusterTopology, TopologySection, TopologyView
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import RdmaPort, TelemetryBatch
from metalguard.proto.topology import NodeTopology
from tests.support.clock import T0, ManualClock


async def test_config_forced_rdma_ports_are_judged(nc: Client, subjects: Subjects) -> None:
    js = nc.jetstream(timeout=5)
    forced = ClusterTopology(rdma_ports=("mlx5_0/1",), rdma_rate_gbps=400.0)
    view = TopologyView(TopologySection(clusters={"c1": forced}))
    region = RegionController(
        js, await NodeStore.open(js, subjects), subjects, "r1", clock=ManualClock(), topology=view
    )
    await region.start()
    try:
        port = RdmaPort(device="mlx5_0", port=1, state="DOWN", phys_state="Polling")
        for name in ("n1", "n2"):
            identity = NodeIdentity(region="r1", cluster="c1" if name == "n1" else "c2", node=name)
            batch = TelemetryBatch(
                node=identity,
                seq=1,
                ts=T0 + 1,
                interval_s=5.0,
                topology=NodeTopology(rack="k1"),
                rdma=(port,),
            )
            await region.on_batch(batch, T0 + 1)
        n1 = region.store.records["r1.c1.n1"]
        assert n1.grade == "FAILING"
        assert [r.rule for r in n1.reasons] == ["rdma_cabled_port_down"]
        assert "mlx5_0/1" in n1.reasons[0].message
        assert n1.rack == "k1", "the report's rack is kept"
        n2 = region.store.records["r1.c2.n2"]
        assert (n2.grade, n2.reasons) == ("HEALTHY", ()), "c2 forces nothing: not cabled"
    finally:
        await region.stop()
