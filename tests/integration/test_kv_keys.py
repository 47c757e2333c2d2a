"""``bucket_keys`` (controller/kv_keys.py) on a real bucket: right after each write it
lists every key (nats-py's watcher-based ``keys()`` sometimes lists too few there), and
a store loading from it keeps every record."""

from __future__ import annotations

from nats.aio.client import Client

from metalguard.controller.jobs.store import JobStore
from metalguard.controller.state.kv_keys import bucket_keys
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
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
