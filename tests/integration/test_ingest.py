"""Ingest over the real session nats-server: ordering, dead letters, redelivery, restart,
sharding, backpressure.  Each test works under a prefix of its own (its own streams)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from metalguard.controller.ingest.consumer import (
    HDR_REASON,
    HDR_SENDER,
    HDR_SEQ,
    HDR_SUBJECT,
    Ingest,
    IngestSettings,
    StreamKind,
    durable_name,
    shard_of,
)
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import encode
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.waiting import wait_for_value, wait_until

REGION = "eu-west"
DEADLINE_S = 10.0


def ident(node: str, cluster: str = "c1") -> NodeIdentity:
    return NodeIdentity(region=REGION, cluster=cluster, node=node)


def batch(n: NodeIdentity, seq: int, v: int = 1) -> TelemetryBatch:
    return TelemetryBatch(node=n, seq=seq, ts=1_767_225_600.0 + seq, interval_s=15.0, v=v)


def event(n: NodeIdentity, i: int, kind: str = "aer_fatal") -> NodeEvent:
    return NodeEvent(node=n, event_id=f"{n.node}-{i}", ts=1_767_225_600.0 + i, kind=kind)


@dataclass
class Recorder:
    """An IngestHandler that records calls; optional hooks run before recording."""

    batches: list[TelemetryBatch] = field(default_factory=list)
    events: list[NodeEvent] = field(default_factory=list)
    hook: Callable[[TelemetryBatch], object] | None = None

    async def on_batch(self, batch: TelemetryBatch, received_ts: float) -> None:
        if self.hook is not None:
            result = self.hook(batch)
            if asyncio.iscoroutine(result):
                await result
        self.batches.append(batch)

    async def on_node_event(self, event: NodeEvent, received_ts: float) -> None:
        self.events.append(event)

    def seqs(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = defaultdict(list)
        for b in self.batches:
            out[b.node.node].append(b.seq)
        return out


@dataclass
class Env:
    nc: Client
    js: JetStreamContext
    subjects: Subjects
    ingests: list[Ingest] = field(default_factory=list)

    def ingest(self, handler: Recorder, **overrides: object) -> Ingest:
        params: dict[str, object] = {
            "region": REGION,
            "fetch_timeout_s": 0.2,
            "retry_delay_s": 0.2,
            "stop_timeout_s": 5.0,
        }
        params.update(overrides)
        ing = Ingest(self.js, self.subjects, IngestSettings(**params), handler)  # type: ignore[arg-type]
        self.ingests.append(ing)
        return ing

    async def publish_batches(self, batches: list[TelemetryBatch]) -> None:
        for b in batches:
            n = b.node
            await self.nc.publish(self.subjects.telemetry(n.region, n.cluster, n.node), encode(b))
        await self.nc.flush()

    async def stream_count(self, stream: str) -> int:
        return (await self.js.stream_info(stream)).state.messages

    async def wait_stream(self, stream: str, n: int) -> None:
        await wait_for_value(
            lambda: self.stream_count(stream), lambda c: c >= n, DEADLINE_S, f"{n} in {stream}"
        )

    async def wait_fully_acked(self, ing: Ingest, stream: str) -> None:
        durable = ing.durables[stream]

        async def probe() -> tuple[int, int]:
            info = await self.js.consumer_info(stream, durable)
            return info.num_ack_pending, info.num_pending

        await wait_for_value(probe, lambda v: v == (0, 0), DEADLINE_S, f"{durable} fully acked")


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[Env]:
    e = Env(nc, nc.jetstream(timeout=5), subjects)
    try:
        yield e
    finally:
        for ing in e.ingests:
            await ing.stop()
        leftover = [t for t in asyncio.all_tasks() if t.get_name().startswith("ingest")]
        assert not leftover, f"ingest tasks left running: {leftover}"


# --- ordering and parallelism ------------------------------------------------------------


async def test_per_node_order_with_nodes_handled_in_parallel(env: Env) -> None:
    nodes = [ident(f"n{i}") for i in range(4)]
    entered: set[str] = set()
    all_in = asyncio.Event()

    async def first_calls_meet(b: TelemetryBatch) -> None:
        # Each node's first call waits until every node has entered one: only possible
        # if nodes are handled concurrently.
        if b.seq == 1:
            entered.add(b.node.node)
            if len(entered) == len(nodes):
                all_in.set()
            await all_in.wait()

    rec = Recorder(hook=first_calls_meet)
    ing = env.ingest(rec)
    await ing.start()
    await env.publish_batches([batch(n, seq) for seq in range(1, 51) for n in nodes])

    await wait_until(lambda: len(rec.batches) == 200, DEADLINE_S, "200 batches")
    assert rec.seqs() == {n.node: list(range(1, 51)) for n in nodes}
    assert ing.stats().streams[env.subjects.stream_telemetry].ingested == 200
    await env.wait_fully_acked(ing, env.subjects.stream_telemetry)


# --- malformed messages ------------------------------------------------------------------


def malformed(s: Subjects, i: int, rng: random.Random) -> tuple[str, bytes]:
    """One of several kinds of undecodable telemetry, on a telemetry subject."""
    n = ident(f"bad{i % 7}")
    subject = s.telemetry(REGION, n.cluster, n.node)
    match i % 7:
        case 0:
            return subject, rng.randbytes(rng.randint(0, 64))
        case 1:
            data = encode(batch(n, i))
            return subject, data[: rng.randint(1, len(data) - 1)]
        case 2:
            return subject, encode(event(n, i))  # right codec, wrong type for the stream
        case 3:
            return subject, msgspec.msgpack.encode({"type": "bogus", "v": 1})
        case 4:
            return subject, encode(batch(n, i, v=2))  # newer major schema version
        case 5:
            return subject, encode(batch(ident("someone-else"), i))  # payload != subject
        case _:
            return f"{s.prefix}.tel.{REGION}.c1", encode(batch(n, i))  # subject too short


async def test_ten_thousand_malformed_are_dead_lettered_and_no_valid_batch_is_lost(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="metalguard.controller.ingest.consumer")
    s = env.subjects
    rng = random.Random(7)
    nodes = [ident(f"n{i}") for i in range(5)]
    valid = [batch(n, seq) for seq in range(1, 101) for n in nodes]
    rec = Recorder()
    ing = env.ingest(rec)
    await ing.start()

    started = time.monotonic()
    valid_iter = iter(valid)
    for i in range(10_000):
        subject, data = malformed(s, i, rng)
        await env.nc.publish(subject, data)
        if i % 20 == 19:
            b = next(valid_iter)
            await env.nc.publish(s.telemetry(REGION, b.node.cluster, b.node.node), encode(b))
    await env.nc.flush()

    await wait_until(lambda: len(rec.batches) == 500, 30, "500 valid batches")
    stream = s.stream_telemetry
    await wait_until(
        lambda: ing.stats().streams[stream].decode_errors == 10_000, 30, "10,000 decode errors"
    )
    await env.wait_fully_acked(ing, stream)
    elapsed = time.monotonic() - started
    print(f"\n10,000 malformed + 500 valid ingested in {elapsed:.2f}s")

    assert Counter((b.node.node, b.seq) for b in rec.batches) == Counter(
        (b.node.node, b.seq) for b in valid
    )
    assert rec.seqs() == {n.node: list(range(1, 101)) for n in nodes}
    stats = ing.stats().streams[stream]
    assert (stats.ingested, stats.decode_errors, stats.handler_errors) == (500, 10_000, 0)
    assert stats.lag == 0
    assert await env.stream_count(s.stream_dead_letter) == 10_000
    sample = ing.metrics.registry.get_sample_value(
        "metalguard_ingest_decode_errors_total", {"stream": stream}
    )
    assert sample == 10_000

    first = await env.js.get_msg(s.stream_dead_letter, 1)
    headers = first.headers or {}
    assert first.subject == s.dead_letter(stream)
    assert headers[HDR_SUBJECT] == s.telemetry(REGION, "c1", "bad0")
    assert headers[HDR_SENDER] == f"{REGION}.c1.bad0"
    assert headers[HDR_SEQ] == "1"
    # One warning per sender per minute, naming it: bad0..bad5 and "unknown".
    warned = [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(warned) == 7, warned
    assert any(w.startswith(f"undecodable message from {REGION}.c1.bad3 ") for w in warned)
    assert any(w.startswith("undecodable message from unknown ") for w in warned)
    assert headers[HDR_REASON].startswith(("malformed msgpack", "invalid message")), headers


async def test_wrong_types_and_bad_subjects_are_dead_lettered_with_reasons(env: Env) -> None:
    s = env.subjects
    n = ident("n1")
    rec = Recorder()
    ing = env.ingest(rec)
    await ing.start()
    await env.nc.publish(s.node_event(REGION, "c1", "n1", "aer_fatal"), encode(batch(n, 1)))
    await env.nc.publish(s.node_event(REGION, "c1", "n1", "aer_fatal"), encode(event(n, 1)))
    await env.nc.publish(f"{s.prefix}.evt.{REGION}.c1.n1", encode(event(n, 2)))
    await env.nc.flush()

    await wait_until(lambda: len(rec.events) == 1, DEADLINE_S, "the valid event")
    await env.wait_stream(s.stream_dead_letter, 2)
    reasons = []
    for seq in (1, 2):
        m = await env.js.get_msg(s.stream_dead_letter, seq)
        reasons.append((m.headers or {})[HDR_REASON])
        assert m.subject == s.dead_letter(s.stream_events)
    assert any("expected a 'node_event' message" in r for r in reasons), reasons
    assert any("bad subject" in r for r in reasons), reasons
    await env.wait_fully_acked(ing, s.stream_events)


# --- errors, restart ------------------------------------------------------------------------


async def test_handler_error_is_redelivered_and_the_loop_survives(env: Env) -> None:
    nodes = [ident("n1"), ident("n2")]
    failed: list[int] = []

    def fail_once(b: TelemetryBatch) -> None:
        if b.node.node == "n1" and b.seq == 3 and not failed:
            failed.append(b.seq)
            raise RuntimeError("handler bug")

    rec = Recorder(hook=fail_once)
    ing = env.ingest(rec)
    await ing.start()
    await env.publish_batches([batch(n, seq) for seq in range(1, 6) for n in nodes])

    await wait_until(lambda: len(rec.batches) == 10, DEADLINE_S, "10 batches incl. redelivery")
    assert sorted(rec.seqs()["n1"]) == [1, 2, 3, 4, 5]
    assert rec.seqs()["n2"] == [1, 2, 3, 4, 5]
    assert rec.seqs()["n1"][-1] == 3  # redelivered after its delay, so last
    assert ing.stats().streams[env.subjects.stream_telemetry].handler_errors == 1
    await env.wait_fully_acked(ing, env.subjects.stream_telemetry)


async def test_restart_with_the_same_durable_resumes_without_reprocessing(env: Env) -> None:
    n = ident("n1")
    first = Recorder()
    ing = env.ingest(first)
    await ing.start()
    await env.publish_batches([batch(n, seq) for seq in range(1, 11)])
    await wait_until(lambda: len(first.batches) == 10, DEADLINE_S, "first 10")
    await env.wait_fully_acked(ing, env.subjects.stream_telemetry)
    await ing.stop()

    await env.publish_batches([batch(n, seq) for seq in range(11, 21)])
    second = Recorder()
    again = env.ingest(second)
    await again.start()
    assert again.durables == ing.durables
    await wait_until(lambda: len(second.batches) == 10, DEADLINE_S, "next 10")
    await env.wait_fully_acked(again, env.subjects.stream_telemetry)
    assert second.seqs() == {"n1": list(range(11, 21))}


async def test_a_deleted_consumer_is_recreated_and_ingest_goes_on(env: Env) -> None:
    n = ident("n1")
    rec = Recorder()
    ing = env.ingest(rec)
    await ing.start()
    await env.publish_batches([batch(n, 1)])
    await wait_until(lambda: len(rec.batches) == 1, DEADLINE_S, "first batch")
    stream = env.subjects.stream_telemetry
    await env.wait_fully_acked(ing, stream)

    await env.js.delete_consumer(stream, ing.durables[stream])
    await env.publish_batches([batch(n, 2)])
    await wait_until(lambda: len(rec.batches) == 3, DEADLINE_S, "batches after re-creation")
    # The new consumer starts from the stream's beginning: batch 1 comes again.
    assert rec.seqs()["n1"] == [1, 1, 2]
    await env.wait_fully_acked(ing, stream)


# --- sharding -------------------------------------------------------------------------------


async def test_hash_shards_together_see_every_node_exactly_once(env: Env) -> None:
    nodes = [ident(f"n{i}", cluster=f"c{i % 3}") for i in range(12)]
    recs = [Recorder(), Recorder()]
    ings = [env.ingest(recs[i], shard=(i, 2)) for i in range(2)]
    for ing in ings:
        await ing.start()
    assert len({durable_name(i.settings, StreamKind.TELEMETRY) for i in ings}) == 2
    await env.publish_batches([batch(n, seq) for seq in range(1, 4) for n in nodes])

    await wait_until(
        lambda: sum(len(r.batches) for r in recs) == 36, DEADLINE_S, "36 batches over shards"
    )
    seen = [{b.node.node for b in r.batches} for r in recs]
    assert seen[0].isdisjoint(seen[1])
    assert seen[0] | seen[1] == {n.node for n in nodes}
    assert seen[0]
    assert seen[1]
    for i, r in enumerate(recs):
        assert all(shard_of(f"{REGION}.{b.node.cluster}.{b.node.node}", 2) == i for b in r.batches)
        assert all(seqs == [1, 2, 3] for seqs in r.seqs().values())
    stream = env.subjects.stream_telemetry
    assert sum(i.stats().streams[stream].skipped for i in ings) == 36


async def test_cluster_filters_split_the_region_between_processes(env: Env) -> None:
    nodes = [ident(f"n{i}", cluster=f"c{i % 3}") for i in range(6)]
    a, b = Recorder(), Recorder()
    ing_a = env.ingest(a, clusters=("c0", "c1"))
    ing_b = env.ingest(b, clusters=("c2",))
    await ing_a.start()
    await ing_b.start()
    await env.publish_batches([batch(n, 1) for n in nodes])

    await wait_until(lambda: len(a.batches) + len(b.batches) == 6, DEADLINE_S, "6 batches")
    assert {x.node.cluster for x in a.batches} == {"c0", "c1"}
    assert {x.node.cluster for x in b.batches} == {"c2"}
    info = await env.js.consumer_info(
        env.subjects.stream_telemetry, ing_a.durables[env.subjects.stream_telemetry]
    )
    p = env.subjects.prefix
    assert info.config.filter_subjects == [f"{p}.tel.{REGION}.c0.>", f"{p}.tel.{REGION}.c1.>"]
    assert ing_a.stats().streams[env.subjects.stream_telemetry].skipped == 0


# --- backpressure ---------------------------------------------------------------------------


async def test_a_slow_node_does_not_stop_the_others_and_nothing_is_dropped(env: Env) -> None:
    release = asyncio.Event()

    async def slow_n0(b: TelemetryBatch) -> None:
        if b.node.node == "slow":
            await release.wait()

    rec = Recorder(hook=slow_n0)
    ing = env.ingest(rec, node_queue_size=4)
    await ing.start()
    slow, others = ident("slow"), [ident(f"n{i}") for i in range(3)]
    # A few for the slow node first (fit its queue), then lots for the others.
    await env.publish_batches([batch(slow, seq) for seq in range(1, 4)])
    await env.publish_batches([batch(n, seq) for seq in range(1, 41) for n in others])
    await wait_until(lambda: len(rec.batches) == 120, DEADLINE_S, "other nodes' 120 batches")
    assert "slow" not in rec.seqs()

    # Now more for the slow node than its queue holds: the fetch loop waits (backpressure).
    await env.publish_batches([batch(slow, seq) for seq in range(4, 21)])
    stream = env.subjects.stream_telemetry
    await wait_until(
        lambda: ing.stats().streams[stream].backpressure_waits > 0, DEADLINE_S, "backpressure"
    )
    release.set()
    await wait_until(lambda: len(rec.batches) == 140, DEADLINE_S, "all 140 batches")
    assert rec.seqs()["slow"] == list(range(1, 21))
    await env.wait_fully_acked(ing, stream)
    assert ing.stats().active_nodes == 0  # idle workers retired


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="shard"):
        IngestSettings(region=REGION, shard=(2, 2))
    with pytest.raises(ValueError, match="region"):
        IngestSettings(region="eu.west")


async def test_start_without_streams_fails_cleanly(nc: Client) -> None:
    js = nc.jetstream(timeout=5)
    ing = Ingest(
        js, Subjects(f"t{uuid.uuid4().hex[:8]}"), IngestSettings(region=REGION), Recorder()
    )
    with pytest.raises(NotFoundError):
        await ing.start()
    await ing.stop()
    assert ing.stats().active_nodes == 0


# --- the handler's synchronous start (on_batch_now), called from the fetch loop ----------


@dataclass
class InlineRecorder(Recorder):
    """A Recorder with ``on_batch_now``: ``held`` batches (node, seq) need "I/O" that waits
    for ``gate``; ``fail`` batches raise once, inline."""

    held: set[tuple[str, int]] = field(default_factory=set)
    fail: set[tuple[str, int]] = field(default_factory=set)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    inline: list[tuple[str, int]] = field(default_factory=list)

    def on_batch_now(
        self, batch: TelemetryBatch, received_ts: float
    ) -> Callable[[], Awaitable[None]] | None:
        which = (batch.node.node, batch.seq)
        if which in self.fail:
            self.fail.discard(which)
            raise RuntimeError("handler bug, inline")
        self.inline.append(which)
        if which not in self.held:
            self.batches.append(batch)
            return None

        async def rest() -> None:
            await self.gate.wait()
            self.batches.append(batch)

        return rest


async def test_inline_batches_keep_each_nodes_order_behind_one_waiting_for_io(env: Env) -> None:
    rec = InlineRecorder(held={("n1", 1)})
    ing = env.ingest(rec)
    await ing.start()
    await env.publish_batches([batch(ident(n), seq) for seq in range(1, 6) for n in ("n1", "n2")])

    await wait_until(lambda: len(rec.seqs()["n2"]) == 5, DEADLINE_S, "n2 taken in inline")
    assert rec.seqs()["n2"] == [1, 2, 3, 4, 5]
    assert rec.seqs()["n1"] == []  # its first batch waits on I/O; the next four behind it
    assert ("n1", 2) not in rec.inline  # queued behind, handled by on_batch, not inline
    rec.gate.set()
    await wait_until(lambda: len(rec.batches) == 10, DEADLINE_S, "all 10")
    assert rec.seqs()["n1"] == [1, 2, 3, 4, 5]
    stats = ing.stats().streams[env.subjects.stream_telemetry]
    assert (stats.ingested, stats.handler_errors) == (10, 0)
    await env.wait_fully_acked(ing, env.subjects.stream_telemetry)


async def test_an_inline_handler_error_is_redelivered(env: Env) -> None:
    rec = InlineRecorder(fail={("n1", 3)})
    ing = env.ingest(rec)
    await ing.start()
    await env.publish_batches([batch(ident(n), seq) for seq in range(1, 6) for n in ("n1", "n2")])

    await wait_until(lambda: len(rec.batches) == 10, DEADLINE_S, "10 batches incl. redelivery")
    assert sorted(rec.seqs()["n1"]) == [1, 2, 3, 4, 5]
    assert rec.seqs()["n1"][-1] == 3  # naked with a delay, redelivered last
    assert rec.seqs()["n2"] == [1, 2, 3, 4, 5]
    assert ing.stats().streams[env.subjects.stream_telemetry].handler_errors == 1
    await env.wait_fully_acked(ing, env.subjects.stream_telemetry)
