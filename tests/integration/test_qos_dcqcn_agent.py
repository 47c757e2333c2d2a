"""A real AgentService with ``[qos]`` and the rdma collector over a fake mlx5 sysfs tree and
the session nats-server: the profile (DCQCN knobs) comes from KV and is applied; while
the RoCE port's ``np_ecn_marked_roce_packets`` grows and ``np_cnp_sent`` does not, the
interface's verdict in the published batches is ``degraded`` naming the counters (and a
``qos_degraded`` NodeEvent says so); once CNPs answer the marks it is ``applied`` again."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.agent.config import parse_config
from metalguard.agent.service import AgentService
from metalguard.controller.qos import QosStore
from metalguard.proto.codec import decode
from metalguard.proto.events import NodeEvent
from metalguard.proto.qos import decode_profile
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import QosInterfaceStatus, TelemetryBatch
from tests.support.waiting import wait_until

IFNAME = "ens1f0np0"
WAIT_S = 20.0
PROFILE = f"""
version = 3
[interfaces]
names = ["{IFNAME}"]
[dcqcn]
np = {{ cnp_dscp = 48 }}
"""


class FakeHca:
    """``class/infiniband/mlx5_0`` with one RoCE port bound to IFNAME, and the interface's
    DCQCN knob; the congestion counters are moved by the test."""

    def __init__(self, sysfs: Path) -> None:
        self.sysfs = sysfs
        port = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
        for name, text in {
            "state": "4: ACTIVE",
            "phys_state": "5: LinkUp",
            "rate": "100 Gb/sec (2X HDR)",
            "link_layer": "Ethernet",
            "gid_attrs/ndevs/0": IFNAME,
            "counters/port_xmit_wait": "0",
        }.items():
            (port / name).parent.mkdir(parents=True, exist_ok=True)
            (port / name).write_text(f"{text}\n")
        self.hw = port / "hw_counters"
        self.hw.mkdir()
        self.counters = {
            "np_ecn_marked_roce_packets": 0,
            "np_cnp_sent": 0,
            "rp_cnp_handled": 0,
            "rp_cnp_ignored": 0,
        }
        self.write()
        knob = sysfs / "class" / "net" / IFNAME / "ecn" / "roce_np" / "cnp_dscp"
        knob.parent.mkdir(parents=True)
        knob.write_text("0\n")
        self.knob = knob

    def write(self) -> None:
        for name, value in self.counters.items():
            (self.hw / name).write_text(f"{value}\n")

    def grow(self, **by: int) -> None:
        for name, step in by.items():
            self.counters[name] += step
        self.write()


def agent_config(nats_url: str, prefix: str, sysfs: Path, spool: Path) -> str:
    return f"""
[node]
region = "r1"
cluster = "c1"
name = "n1"
uuid = "test-uuid-dcqcn"

[nats]
servers = ["{nats_url}"]
prefix = "{prefix}"
connect_timeout_s = 1.0
reconnect_base_s = 0.1
reconnect_max_s = 0.5

[collect]
interval_s = 0.5
enabled = ["rdma"]
sysfs = "{sysfs}"
intervals = {{ rdma = 0.5 }}

[spool]
dir = "{spool}"

[qos]
enabled = true
reconcile_interval_s = 0.5
sysfs = "{sysfs}"
"""


async def test_a_degraded_dcqcn_verdict_reaches_the_batch(
    nc: Client, nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    hca = FakeHca(tmp_path / "sys")
    store = await QosStore.open(nc.jetstream(timeout=5), subjects)
    await store.put("c1", None, decode_profile(PROFILE, "toml"))
    growth = {"np_ecn_marked_roce_packets": 1000}
    verdicts: list[QosInterfaceStatus] = []
    events: list[NodeEvent] = []

    async def on_batch(msg: Msg) -> None:
        batch = decode(msg.data, TelemetryBatch)
        verdicts.extend(q for q in batch.qos if q.interface == IFNAME)
        hca.grow(**growth)  # the traffic of the next interval

    async def on_event(msg: Msg) -> None:
        event = decode(msg.data, NodeEvent)
        if event.kind.startswith("qos_"):
            events.append(event)

    tel = await nc.subscribe(subjects.telemetry("r1", "c1", "n1"), cb=on_batch)
    evt_prefix = subjects.node_event("r1", "c1", "n1", "x").rsplit(".", 1)[0] + ".>"
    evt = await nc.subscribe(evt_prefix, cb=on_event)
    config_path = tmp_path / "agent.toml"
    config_path.write_text(agent_config(nats_url, subjects.prefix, hca.sysfs, tmp_path / "q"))
    service = AgentService(config_path, parse_config(config_path.read_text()), env={})
    agent = asyncio.create_task(service.run())
    try:
        await wait_until(
            lambda: any(v.status == "degraded" for v in verdicts),
            WAIT_S,
            f"a degraded verdict on {IFNAME}",
        )
        assert hca.knob.read_text() == "48\n", "the profile was applied first"
        degraded = next(v for v in verdicts if v.status == "degraded")
        assert degraded.version == 3
        assert "np_ecn_marked_roce_packets +" in degraded.reasons[0]
        assert "but np_cnp_sent +0" in degraded.reasons[0]
        assert degraded.reasons[0].startswith("mlx5_0/1: ")
        await wait_until(
            lambda: any(e.kind == "qos_degraded" for e in events), WAIT_S, "qos_degraded"
        )
        event = next(e for e in events if e.kind == "qos_degraded")
        assert (event.device, event.source, event.severity) == (IFNAME, "qos", "warning")
        assert event.attributes["counters"] == "np_ecn_marked_roce_packets np_cnp_sent"

        growth["np_cnp_sent"] = 10  # CNPs now answer the marks
        seen = len(verdicts)
        await wait_until(
            lambda: any(v.status == "applied" for v in verdicts[seen:]),
            WAIT_S,
            "the verdict applied again once CNPs are sent",
        )
        await wait_until(
            lambda: any("working again" in e.message for e in events), WAIT_S, "the recovery"
        )
    finally:
        service.request_stop()
        await asyncio.wait_for(agent, 20)
        await tel.unsubscribe()
        await evt.unsubscribe()
