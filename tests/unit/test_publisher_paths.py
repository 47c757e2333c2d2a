"""Publisher paths a real server cannot easily produce: slow acks, overflow, rejection."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.api import PubAck

from metalguard.agent.publisher import Publisher, PublisherSettings
from metalguard.agent.spool import Spool
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.telemetry import TelemetryBatch

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")


class FakeJetStream:
    """``publish`` waits for ``gate`` (bounded by its timeout) or fails on chosen ids."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.acked: list[str] = []
        self.fail: dict[str, Exception] = {}

    async def publish(
        self,
        subject: str,
        payload: bytes,
        timeout: float,  # noqa: ASYNC109 - mirrors JetStreamContext.publish
        headers: dict[str, str],
    ) -> PubAck:
        msg_id = headers["Nats-Msg-Id"]
        if msg_id in self.fail:
            raise self.fail[msg_id]
        try:
            await asyncio.wait_for(self.gate.wait(), timeout)
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        self.acked.append(msg_id)
        return PubAck(stream="MG_TELEMETRY", seq=len(self.acked))


class FakeClient(Client):
    js = FakeJetStream()

    async def connect(self, **options: Any) -> None:  # type: ignore[override]
        self._fake_connected = True

    @property
    def is_connected(self) -> bool:
        return getattr(self, "_fake_connected", False)

    def jetstream(self, **options: Any) -> Any:
        return FakeClient.js

    async def close(self) -> None:
        self._fake_connected = False


@pytest.fixture
def fake_js() -> FakeJetStream:
    FakeClient.js = FakeJetStream()
    return FakeClient.js


def make(tmp_path: Path, **kw: Any) -> Publisher:
    settings = PublisherSettings(reconnect_base_s=0.01, reconnect_max_s=0.05, **kw)
    return Publisher(
        settings,
        spool=Spool(tmp_path / "spool", max_bytes=1 << 20),
        rng=random.Random(0),
        client_factory=FakeClient,
    )


def batch(seq: int) -> TelemetryBatch:
    return TelemetryBatch(node=NODE, seq=seq, ts=time.time())


async def test_overflow_while_an_ack_is_slow_spills_in_order(
    tmp_path: Path, fake_js: FakeJetStream
) -> None:
    pub = make(tmp_path, queue_max=3, publish_timeout_s=30)
    assert await pub.start() is True
    fake_js.gate.clear()  # acks hang
    await pub.publish_batch(batch(0))
    await asyncio.sleep(0)  # let the sender take message 0 in flight
    for seq in range(1, 4):
        await pub.publish_batch(batch(seq))  # the 4th exceeds queue_max
    spool_ids = await _wait_spool(pub, 4)
    assert spool_ids == [f"r1.c1.n1:{i}" for i in range(4)]
    assert pub.stats().queued == 0
    fake_js.gate.set()
    await asyncio.wait_for(pub.wait_idle(), 5)
    await pub.close()
    assert fake_js.acked == [f"r1.c1.n1:{i}" for i in range(4)]


async def _wait_spool(pub: Publisher, n: int) -> list[str]:
    """Wait until ``n`` entries are spooled and the memory queue is empty."""
    deadline = time.monotonic() + 5
    while len(pub.spool) < n or pub.stats().queued:
        assert time.monotonic() < deadline, f"{n} entries not spooled in time"
        await asyncio.sleep(0.005)
    return [s.entry.msg_id for s in pub.spool.peek(100)]


async def test_close_deadline_interrupts_a_hanging_publish_and_spools_it(
    tmp_path: Path, fake_js: FakeJetStream
) -> None:
    pub = make(tmp_path, publish_timeout_s=30)
    await pub.start()
    fake_js.gate.clear()
    for seq in range(3):
        await pub.publish_batch(batch(seq))
    started = time.monotonic()
    await pub.close(flush_timeout=0.1)
    assert time.monotonic() - started < 2
    with Spool(tmp_path / "spool", max_bytes=1 << 20) as spool:
        assert [s.entry.msg_id for s in spool.peek(10)] == [f"r1.c1.n1:{i}" for i in range(3)]


async def test_permanent_errors_are_discarded_and_counted(
    tmp_path: Path, fake_js: FakeJetStream
) -> None:
    fake_js.fail["r1.c1.n1:1"] = nats.errors.MaxPayloadError()
    pub = make(tmp_path)
    await pub.start()
    for seq in range(3):
        await pub.publish_batch(batch(seq))
    bad = NodeEvent(node=NODE, event_id="e1", ts=time.time(), kind="bad.kind")
    await pub.publish_event(bad)  # not a subject token: refused, not raised
    await asyncio.wait_for(pub.wait_idle(), 5)
    stats = pub.stats()
    await pub.close()
    assert fake_js.acked == ["r1.c1.n1:0", "r1.c1.n1:2"]
    assert (stats.published, stats.rejected, stats.spooled) == (2, 2, 0)


async def test_transient_failure_spools_then_retries_after_backoff(
    tmp_path: Path, fake_js: FakeJetStream
) -> None:
    fake_js.fail["r1.c1.n1:0"] = nats.errors.TimeoutError()
    pub = make(tmp_path)
    await pub.start()
    await pub.publish_batch(batch(0))
    await pub.publish_batch(batch(1))
    await _wait_spool(pub, 2)
    del fake_js.fail["r1.c1.n1:0"]
    await asyncio.wait_for(pub.wait_idle(), 5)
    stats = pub.stats()
    await pub.close()
    assert fake_js.acked == ["r1.c1.n1:0", "r1.c1.n1:1"]
    assert (stats.spooled, stats.replayed, stats.dropped) == (2, 2, 0)


async def test_publishing_after_close_is_an_error(tmp_path: Path, fake_js: FakeJetStream) -> None:
    pub = make(tmp_path)
    await pub.start()
    await pub.close()
    await pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await pub.publish_batch(batch(0))
