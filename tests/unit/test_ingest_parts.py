"""Ingest's pure parts: settings-derived names and filters, the log rate limiter and the
per-node dispatcher (ordering, parallelism, retirement, drain)."""

from __future__ import annotations

import asyncio

import pytest

from metalguard.controller.ingest.dispatch import NodeDispatcher
from metalguard.controller.ingest.metrics import IngestMetrics, RateLimiter
from metalguard.controller.ingest.settings import (
    IngestSettings,
    StreamKind,
    durable_name,
    filter_subjects,
    shard_of,
)
from metalguard.proto.subjects import Subjects
from tests.support.clock import ManualClock


def test_filters_cover_the_region_or_the_owned_clusters() -> None:
    s = Subjects("mg")
    region = IngestSettings(region="eu")
    assert filter_subjects(s, region, StreamKind.TELEMETRY) == ["mg.tel.eu.>"]
    assert filter_subjects(s, region, StreamKind.EVENTS) == ["mg.evt.eu.>"]
    owned = IngestSettings(region="eu", clusters=("c2", "c1"))
    assert filter_subjects(s, owned, StreamKind.EVENTS) == ["mg.evt.eu.c1.>", "mg.evt.eu.c2.>"]


def test_durable_names_differ_by_stream_cluster_set_and_shard() -> None:
    names = {
        durable_name(IngestSettings(region="eu"), StreamKind.TELEMETRY),
        durable_name(IngestSettings(region="eu"), StreamKind.EVENTS),
        durable_name(IngestSettings(region="eu", clusters=("c1",)), StreamKind.TELEMETRY),
        durable_name(IngestSettings(region="eu", shard=(0, 2)), StreamKind.TELEMETRY),
        durable_name(IngestSettings(region="eu", shard=(1, 2)), StreamKind.TELEMETRY),
    }
    assert len(names) == 5
    assert durable_name(IngestSettings(region="eu"), StreamKind.TELEMETRY) == "mg-controller-eu-tel"
    same = IngestSettings(region="eu", clusters=("b", "a"))
    assert durable_name(same, StreamKind.TELEMETRY) == durable_name(
        IngestSettings(region="eu", clusters=("a", "b")), StreamKind.TELEMETRY
    )


def test_shard_of_is_stable_and_spreads() -> None:
    keys = [f"eu.c1.n{i}" for i in range(1000)]
    counts = [sum(shard_of(k, 4) == i for k in keys) for i in range(4)]
    assert all(200 < c < 300 for c in counts), counts
    assert shard_of("eu.c1.n1", 4) == shard_of("eu.c1.n1", 4)


@pytest.mark.parametrize(
    "kwargs",
    [{"shard": (0, 0)}, {"shard": (-1, 2)}, {"clusters": ("a", "a")}, {"node_queue_size": 0}],
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the messages vary by field
        IngestSettings(region="eu", **kwargs)  # type: ignore[arg-type]


def test_rate_limiter_allows_once_per_interval_per_key_and_counts_the_rest() -> None:
    clock = ManualClock(1000.0)
    rl = RateLimiter(60.0, clock)
    assert rl.allow("a") == 0
    assert rl.allow("a") is None
    assert rl.allow("b") == 0
    clock.now += 30
    assert rl.allow("a") is None
    clock.now += 30
    assert rl.allow("a") == 2


def test_rate_limiter_forgets_stale_keys_when_full() -> None:
    clock = ManualClock(1000.0)
    rl = RateLimiter(60.0, clock, max_keys=3)
    for k in "abc":
        rl.allow(k)
    clock.now += 61
    assert rl.allow("d") == 0
    assert len(rl._last) == 1


def test_metrics_snapshot_is_a_copy() -> None:
    m = IngestMetrics()
    m.count("S", "decode_errors", 3)
    snap = m.snapshot(active_nodes=0)
    m.count("S", "decode_errors")
    assert snap.streams["S"].decode_errors == 3
    assert (
        m.registry.get_sample_value("metalguard_ingest_decode_errors_total", {"stream": "S"}) == 4
    )


async def test_dispatcher_orders_per_key_runs_keys_in_parallel_and_retires_workers() -> None:
    seen: list[tuple[str, int]] = []
    gate, b_done = asyncio.Event(), asyncio.Event()

    async def serve(item: tuple[str, int]) -> None:
        key, i = item
        if key == "a" and i == 0:
            await gate.wait()  # "a" is stuck; "b" must still progress
        seen.append(item)
        if item == ("b", 4):
            b_done.set()

    d: NodeDispatcher[tuple[str, int]] = NodeDispatcher(serve, queue_size=10, max_concurrent=4)
    for i in range(5):
        await d.put("a", ("a", i))
        await d.put("b", ("b", i))
    assert d.is_full("a") is False
    await asyncio.wait_for(b_done.wait(), 5)
    await asyncio.sleep(0)  # b's worker retires once its queue is empty
    assert [x for x in seen if x[0] == "b"] == [("b", i) for i in range(5)]
    assert d.active == 1
    gate.set()
    assert await d.drain(5.0) == 0
    assert [x for x in seen if x[0] == "a"] == [("a", i) for i in range(5)]
    assert d.active == 0


async def test_dispatcher_put_waits_on_a_full_queue_and_drain_cancels_stuck_work() -> None:
    never, entered = asyncio.Event(), asyncio.Event()

    async def serve(item: int) -> None:
        entered.set()
        await never.wait()

    d: NodeDispatcher[int] = NodeDispatcher(serve, queue_size=1, max_concurrent=1)
    await d.put("a", 1)
    await asyncio.wait_for(entered.wait(), 5)  # the worker holds item 1
    await d.put("a", 2)
    assert d.is_full("a")
    blocked = asyncio.create_task(d.put("a", 3))
    done, _ = await asyncio.wait({blocked}, timeout=0.05)
    assert not done  # put waits while the queue is full
    blocked.cancel()
    assert await d.drain(0.01) == 1
    assert d.active == 0
