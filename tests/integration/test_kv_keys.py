"""``bucket_keys`` (controller/kv_keys.py) on a real bucket: right after each write it
lists every key (nats-py's watcher-based ``keys()`` sometimes lists too few there), and
a store loading from it keeps every record."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.state.kv_keys import bucket_keys, latest_values
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import JobStatus
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects

WRITES = 200


async def test_every_key_right_after_each_write(nc: Client, subjects: Subjects) -> None:
    js = nc.jetstream(timeout=5)
    kv = await js.create_key_value(bucket=f"{subjects.prefix.upper()}_KEYS_TEST")
    assert await bucket_keys(js, kv) == []
    for i in range(WRITES):
        await kv.put(f"k{i:03d}", b"x")
        assert len(await bucket_keys(js, kv)) == i + 1
    await kv.delete("k001")
    assert "k001" in await bucket_keys(js, kv)  # a delete marker: readers treat it as absent
    await js.delete_key_value(f"{subjects.prefix.upper()}_KEYS_TEST")


async def test_a_store_loads_every_job_right_after_it_was_written(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    writer = await JobStore.open(js, subjects)
    for i in range(50):
        await writer.create(JobStatus(job_id=f"job-{i}", state="queued"))
        reader = await JobStore.open(js, subjects)  # a restarted controller's load
        assert set(reader.jobs) == set(writer.jobs), i
    await writer.delete("job-3")
    reader = await JobStore.open(js, subjects)
    assert "job-3" not in reader.jobs
    assert len(reader.jobs) == 49


async def test_a_store_reloads_in_place(nc: Client, subjects: Subjects) -> None:
    """What a controller taking the lease does: the same store object (held by the job
    manager and the federation too) then shows what another controller wrote."""
    js = nc.jetstream(timeout=5)
    mine = await NodeStore.open(js, subjects)
    held = mine.records  # e.g. by a reader that kept the mapping
    other = await NodeStore.open(js, subjects)
    node = NodeIdentity(region="r1", cluster="c1", node="n1")
    await other.put_record(NodeRecord(node=node, grade="FAILING"))
    assert mine.records == {}
    await mine.reload()
    assert mine.records[node.handle].grade == "FAILING"
    assert held == {}  # a new mapping was taken over, not filled in while readers looked


async def test_latest_values_reads_every_key_once_with_its_last_value_and_revision(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    bucket = f"{subjects.prefix.upper()}_LATEST_TEST"
    kv = await js.create_key_value(bucket=bucket)
    assert await latest_values(js, kv) == {}
    revisions: dict[str, int] = {}
    for i in range(300):
        revisions[f"k{i:03d}"] = await kv.put(f"k{i:03d}", b"v1")
    for i in range(0, 300, 7):  # rewrites interleave the keys' last messages
        revisions[f"k{i:03d}"] = await kv.put(f"k{i:03d}", f"v2-{i}".encode())
    await kv.delete("k005")
    await kv.purge("k006")
    latest = await latest_values(js, kv)
    assert set(latest) == set(revisions)
    assert latest["k005"].value is None
    assert latest["k006"].value is None
    assert latest["k007"].value == b"v2-7"
    assert latest["k008"].value == b"v1"
    for key, revision in revisions.items():
        if key not in ("k005", "k006"):
            assert latest[key].revision == revision, key
            assert (await kv.get(key)).revision == revision
    await js.delete_key_value(bucket)


async def test_latest_values_ends_while_another_writer_never_pauses(
    nc: Client, subjects: Subjects
) -> None:
    """Other shards write to the same bucket all the time: the read still ends (at the
    stream's last sequence as of its start) with every key written before it."""
    js = nc.jetstream(timeout=5)
    bucket = f"{subjects.prefix.upper()}_BUSY_TEST"
    kv = await js.create_key_value(bucket=bucket)
    before = {f"k{i:04d}" for i in range(500)}
    for key in sorted(before):
        await kv.put(key, b"x")
    stop = asyncio.Event()

    async def write_forever() -> int:
        n = 0
        while not stop.is_set():
            await kv.put(f"busy{n % 50}", str(n).encode())
            n += 1
        return n

    writer = asyncio.create_task(write_forever())
    try:
        for _ in range(5):
            latest = await asyncio.wait_for(latest_values(js, kv), 30)
            assert before <= set(latest)
    finally:
        stop.set()
        assert await asyncio.wait_for(writer, 30) > 0
    await js.delete_key_value(bucket)


async def test_a_store_loads_records_signals_and_skips_deleted_outbox_entries(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    writer = await NodeStore.open(js, subjects)
    nodes = [NodeIdentity(region="r1", cluster=f"c{i % 3}", node=f"n{i}") for i in range(40)]
    for node in nodes:
        await writer.put_record(NodeRecord(node=node, grade="HEALTHY"))
    await writer.put_record(NodeRecord(node=nodes[0], grade="FAILING"))
    await writer.put_signals(nodes[1].handle, NodeSignals())
    events = [
        ControllerEvent(event_id=f"e{i}", kind="node.isolated", region="r1", ts=1.0)
        for i in range(4)
    ]
    await writer.add_pending(events)
    await writer.remove_pending("e0")
    reader = await NodeStore.open(js, subjects)
    assert reader.records == writer.records
    assert reader.records[nodes[0].handle].grade == "FAILING"
    assert set(reader.outbox) == {"e1", "e2", "e3"}
    assert nodes[1].handle in reader.signals
    assert reader.cluster_size("r1", "c0") == 14
    await reader.put_record(NodeRecord(node=nodes[2], grade="SUB_HEALTHY"))  # revisions kept
    shard = await NodeStore.open(js, subjects, [("r1", "c1")])  # a shard's share
    assert set(shard.records) == {n.handle for n in nodes if n.cluster == "c1"}
    assert set(shard.signals) == {nodes[1].handle}  # n1 is in c1
    assert set(shard.outbox) == {"e1", "e2", "e3"}  # all pending: the shard keeps its own
    assert shard.cluster_size("r1", "c0") == 0
    await shard.reload()
    assert set(shard.records) == {n.handle for n in nodes if n.cluster == "c1"}
