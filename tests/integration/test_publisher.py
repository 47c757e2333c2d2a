"""The publisher against a real nats-server: outages, restarts, a full spool, replays.

Every test ends by reading the stream back and checking that each message is there
exactly once and in order.  Waits are on conditions with deadlines; the only fixed sleep
is the outage itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from metalguard.agent.publisher import Publisher, PublisherSettings, batch_msg_id, event_msg_id
from metalguard.agent.spool import Spool, SpoolEntry
from metalguard.controller.broker.server import NatsServer
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import DEFAULT_SUBJECTS
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.waiting import wait_until

OUTAGE_S = 30.0
"""How long the server is down in the acceptance test (the issue's criterion)."""
INTERVAL_S = 0.2
TELEMETRY = DEFAULT_SUBJECTS.stream_telemetry
EVENTS = DEFAULT_SUBJECTS.stream_events


# --- helpers --------------------------------------------------------------------------
def identity() -> NodeIdentity:
    return NodeIdentity(region="r1", cluster="c1", node=f"n{uuid.uuid4().hex[:10]}")


def batch(node: NodeIdentity, seq: int, spool_dropped: int = 0) -> TelemetryBatch:
    return TelemetryBatch(
        node=node, seq=seq, ts=time.time(), interval_s=INTERVAL_S, spool_dropped=spool_dropped
    )


def settings(url: str, **overrides: object) -> PublisherSettings:
    base: dict[str, object] = {
        "servers": (url,),
        "name": "test-agent",
        "connect_timeout_s": 1.0,
        "first_connect_timeout_s": 1.0,
        "reconnect_base_s": 0.05,
        "reconnect_max_s": 0.5,
        "publish_timeout_s": 1.0,
        "ping_interval_s": 5.0,
    }
    base.update(overrides)
    return PublisherSettings(**base)  # type: ignore[arg-type]


def publisher(
    url: str, spool_dir: Path, *, max_entries: int | None = None, **kw: object
) -> Publisher:
    spool = Spool(spool_dir, max_bytes=1 << 20, max_entries=max_entries)
    return Publisher(settings(url, **kw), spool=spool, rng=random.Random(1))


async def connect(url: str) -> Client:
    return await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)


async def read_subject(url: str, stream: str, subject: str) -> list[Msg]:
    """Every message of ``stream`` on ``subject``, in stream order."""
    nc = await connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        if info.state.messages == 0:
            return []
        psub = await js.pull_subscribe(
            subject,
            stream=stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=10
            ),
        )
        out: list[Msg] = []
        try:
            while True:
                try:
                    msgs = await psub.fetch(batch=500, timeout=1)
                except nats.errors.TimeoutError:
                    break
                out += msgs
                if msgs[-1].metadata.num_pending == 0:
                    break
        finally:
            await psub.unsubscribe()
        return out
    finally:
        await nc.close()


async def stored_seqs(url: str, node: NodeIdentity) -> list[int]:
    subject = DEFAULT_SUBJECTS.telemetry(node.region, node.cluster, node.node)
    msgs = await read_subject(url, TELEMETRY, subject)
    seqs = []
    for m in msgs:
        b = decode(m.data, TelemetryBatch)
        assert m.headers is not None
        assert m.headers["Nats-Msg-Id"] == batch_msg_id(b)
        seqs.append(b.seq)
    return seqs


async def setup_streams(url: str) -> None:
    nc = await connect(url)
    try:
        await ensure_streams(nc.jetstream())
    finally:
        await nc.close()


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks behind."""
    yield
    me = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    if others:
        _, left = await asyncio.wait(others, timeout=2)
        assert not left, f"leaked tasks: {[t.get_name() for t in left]}"


# --- happy path -----------------------------------------------------------------------
async def test_batches_and_events_arrive_in_order_with_message_ids(
    nats_url: str, nc: Client, tmp_path: Path
) -> None:
    await ensure_streams(nc.jetstream())
    node = identity()
    pub = publisher(nats_url, tmp_path / "spool")
    assert await pub.start() is True
    events = []
    for seq in range(20):
        await pub.publish_batch(batch(node, seq))
        if seq % 7 == 0:
            event = NodeEvent(node=node, event_id=f"e{seq}", ts=time.time(), kind="aer_fatal")
            events.append(event)
            await pub.publish_event(event)
    await asyncio.wait_for(pub.wait_idle(), 10)
    stats = pub.stats()
    await pub.close()

    assert await stored_seqs(nats_url, node) == list(range(20))
    evt_subject = DEFAULT_SUBJECTS.node_event(node.region, node.cluster, node.node, "aer_fatal")
    got = await read_subject(nats_url, EVENTS, evt_subject)
    assert [decode(m.data, NodeEvent) for m in got] == events
    assert [m.headers and m.headers["Nats-Msg-Id"] for m in got] == [
        event_msg_id(e) for e in events
    ]
    assert event_msg_id(events[0]) == f"r1.c1.{node.node}:e0"
    assert (stats.published, stats.spooled, stats.dropped, stats.connected) == (23, 0, 0, True)
    assert pub.take_dropped() == 0


# --- the acceptance criterion: a 30 s outage loses and duplicates nothing --------------
@pytest.mark.slow
@pytest.mark.timeout(OUTAGE_S + 60)
async def test_server_outage_loses_nothing_and_duplicates_nothing(
    fresh_server: NatsServer, tmp_path: Path
) -> None:
    url = fresh_server.url
    await setup_streams(url)
    node = identity()
    pub = publisher(url, tmp_path / "spool")
    assert await pub.start() is True
    produced = 0
    stop = asyncio.Event()

    async def produce() -> None:
        nonlocal produced
        while not stop.is_set():
            await pub.publish_batch(batch(node, produced))
            produced += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), INTERVAL_S)

    producer = asyncio.create_task(produce(), name="producer")
    try:
        await wait_until(lambda: pub.stats().published >= 5, 10, "5 batches published")
        await asyncio.to_thread(fresh_server.stop)
        await wait_until(lambda: not pub.stats().connected, 10, "the publisher to notice")
        at_outage = produced
        await asyncio.sleep(OUTAGE_S)  # the scenario: the server stays down
        during = pub.stats()
        assert not during.connected
        assert during.spool_entries >= produced - at_outage - 2
        await asyncio.to_thread(fresh_server.start)
        await asyncio.wait_for(pub.connection.wait_connected(), 15)
        await wait_until(lambda: pub.stats().spool_entries == 0, 30, "spool replayed")
        after = produced
        await wait_until(lambda: produced >= after + 5, 10, "5 more batches produced")
    finally:
        stop.set()
        await producer
    await asyncio.wait_for(pub.wait_idle(), 15)
    stats = pub.stats()
    await pub.close()

    assert await stored_seqs(url, node) == list(range(produced))
    assert stats.replayed >= OUTAGE_S / INTERVAL_S * 0.8
    assert stats.published + stats.replayed == produced
    assert stats.dropped == 0


# --- shutdown during an outage ----------------------------------------------------------
async def test_close_during_outage_spools_queue_and_next_publisher_replays(
    fresh_server: NatsServer, tmp_path: Path
) -> None:
    url = fresh_server.url
    await setup_streams(url)
    node = identity()
    spool_dir = tmp_path / "spool"
    first = publisher(url, spool_dir)
    assert await first.start() is True
    for seq in range(5):
        await first.publish_batch(batch(node, seq))
    await asyncio.wait_for(first.wait_idle(), 10)
    await asyncio.to_thread(fresh_server.stop)
    for seq in range(5, 15):  # no await in between: all still in memory at close()
        await first.publish_batch(batch(node, seq))
    await first.close(flush_timeout=2)
    assert first.stats().spool_entries == 10

    with Spool(spool_dir, max_bytes=1 << 20) as spool:  # what the next agent will find
        assert [s.entry.msg_id for s in spool.peek(100)] == [
            f"r1.c1.{node.node}:{seq}" for seq in range(5, 15)
        ]
    await asyncio.to_thread(fresh_server.start)
    second = publisher(url, spool_dir)
    assert await second.start() is True
    for seq in range(15, 20):
        await second.publish_batch(batch(node, seq))
    await asyncio.wait_for(second.wait_idle(), 15)
    stats = second.stats()
    await second.close()

    assert await stored_seqs(url, node) == list(range(20))
    assert stats.replayed >= 10  # batches sent while the spool was not empty go behind it
    assert stats.published + stats.replayed == 15


async def test_close_with_zero_flush_time_spools_everything_unacked(
    nats_url: str, nc: Client, tmp_path: Path
) -> None:
    await ensure_streams(nc.jetstream())
    node = identity()
    spool_dir = tmp_path / "spool"
    first = publisher(nats_url, spool_dir)
    assert await first.start() is True
    for seq in range(200):
        await first.publish_batch(batch(node, seq))
    # Closed at once with no time to flush: whatever the sender had not had acknowledged
    # (on a fast machine possibly all of it) must be in the spool.  The case of a publish
    # interrupted in flight is tests/unit/test_publisher_paths.py's.
    await first.close(flush_timeout=0)
    unacked = first.stats().spool_entries
    acked = len(await stored_seqs(nats_url, node))
    assert acked + unacked >= 200  # an interrupted publish may be in both places
    assert unacked > 0

    second = publisher(nats_url, spool_dir)
    assert await second.start() is True
    await asyncio.wait_for(second.wait_idle(), 15)
    await second.close()
    assert await stored_seqs(nats_url, node) == list(range(200))


# --- a full spool ---------------------------------------------------------------------
@pytest.mark.parametrize("report_before_restart", [True, False])
async def test_full_spool_drops_oldest_and_reports_the_count(
    fresh_server: NatsServer, tmp_path: Path, report_before_restart: bool
) -> None:
    url = fresh_server.url
    await setup_streams(url)
    await asyncio.to_thread(fresh_server.stop)  # down before the agent starts
    node = identity()
    spool_dir = tmp_path / "spool"
    first = publisher(url, spool_dir, max_entries=5)
    assert await first.start() is False
    for seq in range(12):
        await first.publish_batch(batch(node, seq))
    await wait_until(lambda: first.stats().spooled == 12, 10, "12 batches spooled")
    assert first.stats().dropped == 7
    assert first.stats().spool_entries == 5
    if report_before_restart:
        assert first.take_dropped() == 7
        assert first.take_dropped() == 0
    await first.close()

    await asyncio.to_thread(fresh_server.start)
    second = publisher(url, spool_dir)
    await second.start()
    carried = second.take_dropped()
    assert carried == (0 if report_before_restart else 7)
    await second.publish_batch(batch(node, 12, spool_dropped=carried))
    await asyncio.wait_for(second.wait_idle(), 15)
    await second.close()
    assert await stored_seqs(url, node) == list(range(7, 13))


async def test_first_connect_fails_then_background_retry_connects(
    fresh_server: NatsServer, tmp_path: Path
) -> None:
    url = fresh_server.url
    await setup_streams(url)
    await asyncio.to_thread(fresh_server.stop)
    node = identity()
    pub = publisher(url, tmp_path / "spool")
    assert await pub.start() is False
    await pub.publish_batch(batch(node, 0))
    await wait_until(lambda: pub.stats().spool_entries == 1, 5, "batch spooled")
    await asyncio.to_thread(fresh_server.start)
    await asyncio.wait_for(pub.connection.wait_connected(), 15)
    await pub.publish_batch(batch(node, 1))
    await asyncio.wait_for(pub.wait_idle(), 15)
    await pub.close()
    assert await stored_seqs(url, node) == [0, 1]


# --- the stream is missing, then created ----------------------------------------------
async def test_missing_stream_spools_until_it_exists(
    fresh_server: NatsServer, tmp_path: Path
) -> None:
    url = fresh_server.url
    node = identity()
    pub = publisher(url, tmp_path / "spool")
    assert await pub.start() is True
    for seq in range(3):
        await pub.publish_batch(batch(node, seq))
    await wait_until(lambda: pub.stats().spool_entries == 3, 10, "3 batches spooled (no stream)")
    await setup_streams(url)
    await asyncio.wait_for(pub.wait_idle(), 15)
    await pub.close()
    assert await stored_seqs(url, node) == [0, 1, 2]


# --- duplicate suppression ------------------------------------------------------------
async def test_replaying_an_entry_the_stream_already_has_does_not_duplicate(
    nats_url: str, nc: Client, tmp_path: Path
) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    node = identity()
    first = batch(node, 0)
    entry = SpoolEntry(
        DEFAULT_SUBJECTS.telemetry(node.region, node.cluster, node.node),
        batch_msg_id(first),
        encode(first),
    )
    # The message was stored but its ack was lost, so the agent also kept it in the spool.
    ack = await js.publish(entry.subject, entry.payload, headers={"Nats-Msg-Id": entry.msg_id})
    assert ack.duplicate is not True
    spool_dir = tmp_path / "spool"
    with Spool(spool_dir, max_bytes=1 << 20) as spool:
        spool.append(entry)

    pub = publisher(nats_url, spool_dir)
    assert await pub.start() is True
    await pub.publish_batch(batch(node, 1))
    await asyncio.wait_for(pub.wait_idle(), 10)
    stats = pub.stats()
    await pub.close()
    assert await stored_seqs(nats_url, node) == [0, 1]
    assert stats.duplicates == 1
    assert stats.published + stats.replayed == 2
