"""The bmc-proxy: many simulated SNMP BMCs, each node's reading published on that node's
telemetry subject, out of band; ``agent collect`` and ``agent run`` with ``[[bmc]]``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.agent.bmc.proxy import BmcProxy, OutOfBandPublisher, TargetReader
from metalguard.agent.bmc.snmp_responder import SnmpResponder, load_snmprec
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.agent.publisher import PublisherSettings
from metalguard.agent.spool import Spool
from metalguard.proto.codec import decode
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import BmcReading, TelemetryBatch
from tests.support.harness.agent_proc import FIXTURE_SYSFS, METALGUARD, AgentProcess
from tests.support.waiting import wait_until

FIXTURES = Path(__file__).parents[1] / "fixtures" / "snmp"
ENTITY = FIXTURES / "entity-sensor-bmc.snmprec"
NODES = ("gpu001", "gpu002", "gpu003")


@contextlib.contextmanager
def _silent_port() -> Iterator[int]:
    """A bound UDP port that never answers: a dead BMC's address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


@pytest.fixture
async def responder() -> AsyncIterator[SnmpResponder]:
    sim = SnmpResponder()
    records = load_snmprec(ENTITY)
    for node in NODES:
        sim.add_community(f"c-{node}", records)
    try:
        yield sim
    finally:
        sim.close()


def _targets(sim: SnmpResponder, dead_port: int) -> list[BmcTarget]:
    targets = [
        BmcTarget(node=f"r1.c1.{n}", address=sim.address, protocol="snmp", community=f"c-{n}")
        for n in NODES
    ]
    targets.append(
        BmcTarget(
            node="r1.c1.gpu404",
            address=f"127.0.0.1:{dead_port}",
            protocol="snmp",
            community="public",
            timeout_s=0.3,
            retries=0,
        )
    )
    return targets


async def _collect(nc: Client, subject: str, into: list[Msg]) -> None:
    async def keep(msg: Msg) -> None:
        into.append(msg)

    await nc.subscribe(subject, cb=keep)
    await nc.flush()


async def test_each_nodes_reading_goes_to_its_own_subject_out_of_band(
    responder: SnmpResponder, nc: Client, nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    received: list[Msg] = []
    await _collect(nc, subjects.telemetry("r1", "c1", "*"), received)
    publisher = OutOfBandPublisher(
        PublisherSettings(servers=[nats_url], name="bmc-proxy-test"),
        spool=Spool(tmp_path / "bmc-queue", max_bytes=1 << 20),
        subjects=subjects,
    )
    await publisher.start()
    with _silent_port() as dead_port:
        proxy = BmcProxy(
            _targets(responder, dead_port),
            publisher.publish_batch,
            concurrency=2,
            wall_clock=lambda: 1_800_000_000.0,
        )
        try:
            readings = await proxy.poll_once()
            await wait_until(lambda: len(received) >= 4, 10, "4 out-of-band batches")
        finally:
            await proxy.close()
            await publisher.close()
    assert [r.reachable for r in readings] == [True, True, True, False]
    by_subject = {m.subject: m for m in received}
    assert set(by_subject) == {subjects.telemetry("r1", "c1", n) for n in (*NODES, "gpu404")}
    for node in (*NODES, "gpu404"):
        msg = by_subject[subjects.telemetry("r1", "c1", node)]
        batch = decode(msg.data, TelemetryBatch)
        assert batch.out_of_band is True
        assert (batch.node.region, batch.node.cluster, batch.node.node) == ("r1", "c1", node)
        assert batch.seq == 1_800_000_000_001
        assert msg.headers is not None
        assert msg.headers["Nats-Msg-Id"] == f"r1.c1.{node}:oob:{batch.seq}"
        (reading,) = batch.bmc
        assert reading.node == f"r1.c1.{node}"
        assert [batch.edac, batch.pcie, batch.hwmon, batch.smart] == [(), (), (), ()]
    down = decode(by_subject[subjects.telemetry("r1", "c1", "gpu404")].data, TelemetryBatch)
    assert down.bmc[0].reachable is False
    assert "no answer" in down.bmc[0].message
    up = decode(by_subject[subjects.telemetry("r1", "c1", "gpu001")].data, TelemetryBatch)
    assert {s.name for s in up.bmc[0].sensors} >= {"Fan 1", "Fan 3", "CPU1 Temp"}


async def test_concurrency_is_bounded(responder: SnmpResponder) -> None:
    published: list[TelemetryBatch] = []

    async def publish(batch: TelemetryBatch) -> None:
        published.append(batch)

    targets = [
        BmcTarget(
            node=f"r1.c1.n{i}",
            address=responder.address,
            protocol="snmp",
            community=f"c-{NODES[i % 3]}",
        )
        for i in range(12)
    ]
    proxy = BmcProxy(targets, publish, concurrency=3)
    try:
        readings = await proxy.poll_once()
    finally:
        await proxy.close()
    assert all(r.reachable for r in readings)
    assert len(published) == 12
    assert proxy.stats.max_in_flight == 3
    assert (proxy.stats.reads, proxy.stats.unreachable, proxy.stats.cycles) == (12, 0, 1)


async def test_a_reader_that_raises_is_still_a_reading() -> None:
    async def broken(target: BmcTarget) -> BmcReading:
        raise RuntimeError("boom")

    published: list[TelemetryBatch] = []

    async def publish(batch: TelemetryBatch) -> None:
        published.append(batch)

    target = BmcTarget(node="r1.c1.n1", address="x", protocol="ipmi")
    proxy = BmcProxy([target], publish, reader=broken)
    (reading,) = await proxy.poll_once()
    assert (reading.reachable, reading.message) == (False, "RuntimeError: boom")
    assert published[0].bmc == (reading,)


async def test_target_reader_reads_other_protocols_through_their_module() -> None:
    reader = TargetReader()
    try:
        reading = await reader(
            BmcTarget(
                node="r1.c1.n1", address="127.0.0.1:1", protocol="redfish", timeout_s=0.5, retries=0
            )
        )
    finally:
        reader.close()
    assert (reading.node, reading.source, reading.reachable) == ("r1.c1.n1", "redfish", False)
    assert reading.message


def _bmc_config(sim: SnmpResponder, dead_port: int) -> str:
    return "".join(
        f'\n[[bmc]]\nnode = "{t.node}"\naddress = "{t.address}"\nprotocol = "snmp"\n'
        f'community = "{t.community}"\ntimeout_s = {t.timeout_s}\nretries = {t.retries}\n'
        for t in _targets(sim, dead_port)
    )


async def test_agent_collect_prints_the_bmc_list(responder: SnmpResponder, tmp_path: Path) -> None:
    with _silent_port() as dead_port:
        config = tmp_path / "agent.toml"
        config.write_text(
            f'[node]\nname = "mgmt1"\n[collect]\nsysfs = "{FIXTURE_SYSFS}"\n'
            + _bmc_config(responder, dead_port)
        )
        proc = await asyncio.create_subprocess_exec(
            METALGUARD,
            "agent",
            "collect",
            "--once",
            "--config",
            str(config),
            "--collectors",
            "edac",
            "--format",
            "json",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    doc = json.loads(out)
    bmc = doc["bmc"]
    assert [b["node"] for b in bmc] == [f"r1.c1.{n}" for n in (*NODES, "gpu404")]
    assert [b["reachable"] for b in bmc] == [True, True, True, False]
    first = bmc[0]
    assert {"node", "source", "reachable", "power_state", "health", "sensors"} <= set(first)
    fan3 = next(s for s in first["sensors"] if s["name"] == "Fan 3")
    assert fan3 == {
        "name": "Fan 3",
        "kind": "fan",
        "value": 0.0,
        "unit": "rpm",
        "status": "critical",
        "lower_critical": None,
        "upper_critical": None,
    }
    assert bmc[3]["sensors"] == []
    assert "no answer" in bmc[3]["message"]


async def test_agent_collect_text_shows_bmc_lines(responder: SnmpResponder, tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[collect]\nsysfs = "{FIXTURE_SYSFS}"\n[[bmc]]\nnode = "r1.c1.gpu001"\n'
        f'address = "{responder.address}"\nprotocol = "snmp"\ncommunity = "c-gpu001"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        METALGUARD,
        "agent",
        "collect",
        "--config",
        str(config),
        "--collectors",
        "edac",
        "--format",
        "text",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "bmc   r1.c1.gpu001 snmp: reachable power=- health=critical" in text
    assert "        fan Fan 3: 0 rpm critical" in text


async def test_agent_run_publishes_out_of_band_batches_for_its_targets(
    responder: SnmpResponder, nc: Client, nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    received: list[Msg] = []
    await _collect(nc, subjects.telemetry("r1", "c1", "*"), received)
    with _silent_port() as dead_port:
        config = tmp_path / "agent.toml"
        config.write_text(
            f'[node]\nregion = "r1"\ncluster = "c1"\nname = "mgmt1"\nuuid = "u-mgmt1"\n'
            f'[nats]\nservers = ["{nats_url}"]\nprefix = "{subjects.prefix}"\n'
            f'[collect]\ninterval_s = 0.5\nenabled = ["edac"]\nsysfs = "{FIXTURE_SYSFS}"\n'
            f'[spool]\ndir = "{tmp_path / "spool"}"\n'
            f"[bmc_proxy]\ninterval_s = 1\nconcurrency = 2\n" + _bmc_config(responder, dead_port)
        )
        agent = AgentProcess(config)
        try:

            def oob_nodes() -> set[str]:
                return {
                    b.node.node
                    for b in (decode(m.data, TelemetryBatch) for m in list(received))
                    if b.out_of_band
                }

            await wait_until(
                lambda: oob_nodes() >= {*NODES, "gpu404"}, 20, "out-of-band batches for 4 nodes"
            )
            assert agent.terminate() == 0
        finally:
            agent.close()
    batches = [decode(m.data, TelemetryBatch) for m in received]
    own = [b for b in batches if b.node.node == "mgmt1"]
    assert own
    assert not any(b.out_of_band for b in own)  # the host's own batches stay in-band
    assert all(b.out_of_band for b in batches if b.node.node != "mgmt1")
