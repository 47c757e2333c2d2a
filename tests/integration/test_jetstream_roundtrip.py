"""The wire contract over a real nats-server: streams, durable consumers, the server child.

Each JetStream test works under its own subject prefix, so its streams and buckets are
its own on the shared session server, and removes them at the end.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from metalguard.controller.broker.server import NatsServer, NatsServerError
from metalguard.controller.state.streams import StreamSettings, bucket_configs, ensure_streams
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import (
    AerCounters,
    CollectorRun,
    EdacController,
    EdacDimm,
    Fan,
    GpuDevice,
    HwmonChip,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
    Temperature,
)
from tests.support.harness.private_streams import drop_streams
from tests.support.waiting import wait_for_value

FETCH_TIMEOUT_S = 5.0
"""Deadline for a message that is already in the stream to be delivered."""
NODE = NodeIdentity(region="eu-west", cluster="c1", node="n17", uuid="4c4c4544-0042-3510")


# --- helpers -------------------------------------------------------------------------------


def realistic_batch(seq: int = 1, node: NodeIdentity = NODE) -> TelemetryBatch:
    """A TelemetryBatch shaped like what the agent sends (a small GPU node)."""
    aer = AerCounters(
        correctable={"RxErr": 0, "BadTLP": 3, "BadDLLP": 1, "TOTAL_ERR_COR": 4},
        fatal={"DLP": 0, "MalfTLP": 0, "TOTAL_ERR_FATAL": 0},
        nonfatal={"CmpltTO": 2, "UnsupReq": 0, "TOTAL_ERR_NONFATAL": 2},
    )
    return TelemetryBatch(
        node=node,
        seq=seq,
        ts=1_767_225_600.25 + seq,
        interval_s=15.0,
        started_ts=1_767_225_599.75 + seq,
        edac=(
            EdacController(
                mc=0,
                ce_count=12,
                ue_count=0,
                dimms=(
                    EdacDimm(name="dimm0", label="CPU_SrcID#0_MC#0_Chan#0_DIMM#0", ce_count=12),
                    EdacDimm(name="dimm1", label="CPU_SrcID#0_MC#0_Chan#1_DIMM#0", ce_count=0),
                ),
            ),
        ),
        pcie=(
            PcieDevice(
                address="0000:17:00.0",
                pci_class="0x030200",
                vendor="0x10de",
                device="0x2330",
                current_link_speed_gts=32.0,
                max_link_speed_gts=32.0,
                current_link_width=16,
                max_link_width=16,
                aer=aer,
            ),
        ),
        hwmon=(
            HwmonChip(
                chip="platform_nct6775_656",
                name="nct6798",
                fans=(Fan(sensor="fan1", rpm=5400.0, min_rpm=1000.0, alarm=False),),
                temps=(Temperature(sensor="temp1", label="SYSTIN", celsius=41.5),),
            ),
        ),
        smart=(
            SmartDevice(
                device="/dev/nvme0",
                protocol="NVMe",
                model="SAMSUNG MZ1L21T9HCLS",
                passed=True,
                exit_status=0,
                temperature_c=38.0,
                power_on_hours=8123,
                media_errors=0,
                percentage_used=3,
            ),
        ),
        gpu=(GpuDevice(index=0, uuid="GPU-5d1c", name="NVIDIA H100", ecc_corrected=2),),
        collectors=(CollectorRun(collector="edac", duration_s=0.0042, success=True),),
    )


@dataclass
class JetStreamEnv:
    js: JetStreamContext
    subjects: Subjects


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> JetStreamEnv:
    """ensure_streams under a prefix of this test's own (the ``subjects`` fixture)."""
    return JetStreamEnv(nc.jetstream(timeout=5), subjects)


def stream_names(s: Subjects) -> list[str]:
    return [s.stream_telemetry, s.stream_events, s.stream_control, s.stream_dead_letter]


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def roundtrip_core(url: str) -> None:
    """Connect to ``url``, publish on a subject and read the message back."""
    client = await asyncio.wait_for(nats.connect(url, max_reconnect_attempts=1), 10)
    try:
        sub = await client.subscribe("it.ping")
        await client.publish("it.ping", b"pong")
        msg = await sub.next_msg(timeout=FETCH_TIMEOUT_S)
        assert msg.data == b"pong"
    finally:
        await client.close()


# --- streams ---------------------------------------------------------------------------------


async def test_ensure_streams_creates_everything_and_is_idempotent(env: JetStreamEnv) -> None:
    js, s = env.js, env.subjects
    ack = await js.publish(s.telemetry("r", "c", "n"), encode(realistic_batch()))
    await ensure_streams(js, s)  # the second call: same configs, data kept
    await ensure_streams(js, s)
    families = {
        s.stream_telemetry: "tel",
        s.stream_events: "evt",
        s.stream_control: "ctl",
        s.stream_dead_letter: "dlq",
    }
    for name, family in families.items():
        info = await js.stream_info(name)
        assert info.config.subjects == [s.all_of(family)]
        assert info.config.duplicate_window == StreamSettings().duplicate_window_s
    telemetry = await js.stream_info(s.stream_telemetry)
    assert telemetry.state.messages == 1
    assert telemetry.state.last_seq == ack.seq
    for kv in bucket_configs(s, StreamSettings()):
        status = await (await js.key_value(kv.bucket)).status()
        assert status.bucket == kv.bucket
        assert status.history == kv.history
    leases = await (await js.key_value(s.bucket("leases"))).status()
    assert leases.ttl == StreamSettings().lease_ttl_s


async def test_a_starting_controller_keeps_what_setup_configured(env: JetStreamEnv) -> None:
    """``controller setup`` settings (e.g. retention, replicas) survive ``controller run``'s
    own ensure_streams, which passes none."""
    js, s = env.js, env.subjects
    longer = StreamSettings(control_max_age_s=90 * 86400.0)
    await ensure_streams(js, s, longer)  # setup
    await ensure_streams(js, s)  # a controller starting
    info = await js.stream_info(s.stream_control)
    assert info.config.max_age == longer.control_max_age_s
    await ensure_streams(js, s, StreamSettings())  # setup again, with the defaults
    info = await js.stream_info(s.stream_control)
    assert info.config.max_age == StreamSettings().control_max_age_s


async def test_streams_are_removed_by_the_fixture(nc: Client) -> None:
    """The cleanup above really deletes (so it cannot hide leftovers between tests)."""
    js = nc.jetstream(timeout=5)
    s = Subjects(f"it{uuid.uuid4().hex[:10]}")
    await ensure_streams(js, s)
    await drop_streams(js, s)
    for name in stream_names(s):
        with pytest.raises(NotFoundError):
            await js.stream_info(name)
    for kv in bucket_configs(s, StreamSettings()):
        with pytest.raises(BucketNotFoundError):
            await js.key_value(kv.bucket)


# --- messages through JetStream ------------------------------------------------------------


async def test_telemetry_batch_round_trip_through_a_durable_consumer(env: JetStreamEnv) -> None:
    js, s = env.js, env.subjects
    first, second = realistic_batch(seq=41), realistic_batch(seq=42)
    subject = s.telemetry(NODE.region, NODE.cluster, NODE.node)
    msg_id = f"{NODE.uuid}-{first.seq}"

    ack = await js.publish(subject, encode(first), headers={"Nats-Msg-Id": msg_id})
    assert ack.stream == s.stream_telemetry
    assert ack.duplicate is not True
    again = await js.publish(subject, encode(first), headers={"Nats-Msg-Id": msg_id})
    assert again.duplicate is True, "the same Nats-Msg-Id inside the window is a duplicate"
    assert again.seq == ack.seq

    durable = "it-telemetry"
    config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    psub = await js.pull_subscribe(
        s.telemetry("*", "*", "*"), durable=durable, stream=s.stream_telemetry, config=config
    )
    try:
        (msg,) = await psub.fetch(batch=1, timeout=FETCH_TIMEOUT_S)
        assert msg.subject == subject
        assert msg.headers is not None
        assert msg.headers["Nats-Msg-Id"] == msg_id
        assert msg.metadata.sequence.stream == ack.seq
        assert decode(msg.data) == first
        assert decode(msg.data, TelemetryBatch) == first
        await msg.ack_sync()
        info = await psub.consumer_info()
        assert info.config.durable_name == durable
        assert info.num_ack_pending == 0
        assert info.num_pending == 0, "the duplicate publish must not have been stored"
        assert info.ack_floor is not None
        assert info.ack_floor.stream_seq == ack.seq
    finally:
        await psub.unsubscribe()

    # The durable outlives its subscription: bound again, it resumes after the ack.
    ack2 = await js.publish(
        subject, encode(second), headers={"Nats-Msg-Id": f"{NODE.uuid}-{second.seq}"}
    )
    # the server counts a new message for a durable without a subscriber asynchronously:
    # under load consumer_info answered 0 right after the publish (a CI run)
    await wait_for_value(
        lambda: js.consumer_info(s.stream_telemetry, durable),
        lambda info: info.num_pending == 1,
        10,
        "the durable to count the new message",
    )
    psub = await js.pull_subscribe(
        s.telemetry("*", "*", "*"), durable=durable, stream=s.stream_telemetry, config=config
    )
    try:
        (msg,) = await psub.fetch(batch=1, timeout=FETCH_TIMEOUT_S)
        assert msg.metadata.sequence.stream == ack2.seq
        assert decode(msg.data) == second
        await msg.ack_sync()
    finally:
        await psub.unsubscribe()


async def test_node_event_round_trip(env: JetStreamEnv) -> None:
    js, s = env.js, env.subjects
    event = NodeEvent(
        node=NODE,
        event_id=f"{NODE.uuid}-evt-7",
        ts=time.time(),
        kind="ecc_uncorrectable",
        source="edac",
        device="CPU_SrcID#0_MC#0_Chan#1_DIMM#0",
        message="1 uncorrectable error on mc0",
        attributes={"mc": 0, "ue_count": 1, "rank": "dimm1", "fatal": True, "ratio": 0.5},
    )
    subject = s.node_event(NODE.region, NODE.cluster, NODE.node, event.kind)
    ack = await js.publish(subject, encode(event), headers={"Nats-Msg-Id": event.event_id})
    assert ack.stream == s.stream_events
    psub = await js.pull_subscribe(
        s.node_event(NODE.region, "*", "*", "*"),
        durable="it-events",
        stream=s.stream_events,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
    )
    try:
        (msg,) = await psub.fetch(batch=1, timeout=FETCH_TIMEOUT_S)
        assert msg.subject == subject
        assert s.parse(msg.subject) == s.parse(subject)
        got = decode(msg.data)
        assert isinstance(got, NodeEvent)
        assert got == event
        await msg.ack_sync()
        assert (await psub.consumer_info()).num_ack_pending == 0
    finally:
        await psub.unsubscribe()


# --- controller.broker.server.NatsServer --------------------------------------------------------


async def test_server_start_gives_a_url_that_accepts_connections(
    fresh_server: NatsServer,
) -> None:
    assert fresh_server.running
    assert fresh_server.url == f"nats://127.0.0.1:{fresh_server.port}"
    assert fresh_server.port > 0
    await roundtrip_core(fresh_server.url)
    assert fresh_server.start() == fresh_server.url, "start() on a running server is a no-op"


async def test_server_restart_keeps_port_and_store(fresh_server: NatsServer) -> None:
    url, port, pid = fresh_server.url, fresh_server.port, fresh_server.pid
    assert pid is not None
    client = await nats.connect(url, max_reconnect_attempts=1)
    try:
        js = client.jetstream(timeout=5)
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.1", b"kept across restarts")
    finally:
        await client.close()

    assert await asyncio.to_thread(fresh_server.restart) == url
    assert fresh_server.port == port
    assert fresh_server.pid not in (None, pid)
    assert not process_exists(pid), "the old server process is gone"

    client = await nats.connect(fresh_server.url, max_reconnect_attempts=1)
    try:
        js = client.jetstream(timeout=5)
        msg = await js.get_msg("KEEP", 1)
        assert msg.data == b"kept across restarts"
    finally:
        await client.close()


def test_server_close_leaves_no_process_and_no_temp_dir() -> None:
    server = NatsServer()
    server.start()
    pid, store = server.pid, server.store_dir
    assert pid is not None
    assert store is not None
    assert process_exists(pid)
    assert store.exists(), "JetStream wrote to its temporary store"
    server.close()
    assert not process_exists(pid)
    assert not Path(f"/proc/{pid}").exists()
    assert not store.parent.exists(), "the temporary directory is removed"
    assert not server.running
    assert server.pid is None
    server.close()  # twice is harmless


def write_config(path: Path, store: Path) -> Path:
    path.write_text(f'listen: 127.0.0.1:-1\njetstream {{\n  store_dir: "{store}"\n}}\n')
    return path


async def test_server_from_config_file(tmp_path: Path) -> None:
    store = tmp_path / "store"
    server = NatsServer(config_file=write_config(tmp_path / "nats.conf", store))
    url = await asyncio.to_thread(server.start)
    try:
        assert url.startswith("nats://127.0.0.1:")
        await roundtrip_core(url)
        client = await nats.connect(url, max_reconnect_attempts=1)
        try:
            js = client.jetstream(timeout=5)
            await js.add_stream(name="CONF", subjects=["conf.>"])
            assert (await js.publish("conf.x", b"1")).seq == 1
        finally:
            await client.close()
        assert any(store.rglob("*")), "JetStream uses the configured store_dir"
    finally:
        pid = server.pid
        await asyncio.to_thread(server.close)
    assert pid is not None
    assert not process_exists(pid)


def test_server_from_config_file_restart_keeps_port(tmp_path: Path) -> None:
    """A config that asks for any port ('-1') keeps the port it got across restarts."""
    server = NatsServer(config_file=write_config(tmp_path / "nats.conf", tmp_path / "store"))
    try:
        url = server.start()
        first_pid = server.pid
        assert server.restart() == url
        assert server.pid != first_pid
    finally:
        server.close()


@pytest.mark.parametrize(
    ("config", "server_says"),
    [
        ("listen: 127.0.0.1:-1\nno_such_option: 5\n", 'unknown field "no_such_option"'),
        ("listen: 127.0.0.1:-1\njetstream {\n  store_dir: \n", "Parse error"),
    ],
    ids=["unknown-field", "syntax"],
)
def test_broken_config_raises_with_the_server_log(
    tmp_path: Path, config: str, server_says: str
) -> None:
    path = tmp_path / "broken.conf"
    path.write_text(config)
    server = NatsServer(config_file=path)
    started = time.monotonic()
    with pytest.raises(NatsServerError) as info:
        server.start(timeout=30)
    assert server_says in str(info.value), "the server's own log explains the failure"
    assert time.monotonic() - started < 15, "a server that exits is not waited for"
    assert not server.running
    assert server.pid is None
