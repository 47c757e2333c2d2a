"""Job events go through the jobs' outbox (MG_JOBS ``_outbox.*``): a job manager stopped
right after the KV write, before its publish (or after the publish, before the outbox
delete), is replaced by a fresh manager on the same bucket, which announces the event
once: never lost, never twice (counted in <P>_CONTROL, what every subscriber reads)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.core.topology import TopologyView
from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.store import JobStore
from metalguard.proto.codec import decode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects

REGION = "r1"


@dataclass
class NoRecords:
    records: Mapping[str, NodeRecord] = field(default_factory=dict)


class DiesOnPublish:
    """A JetStream context whose publish never happens: the task is cancelled there, as
    a controller killed between the KV write and the publish."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self.tried: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        self.tried.append(subject)
        raise asyncio.CancelledError


class DiesAfterPublishing(JobStore):
    """A store whose controller dies once the stream took the event, before the outbox
    entry is deleted."""

    async def remove_pending(self, event_id: str) -> None:
        raise asyncio.CancelledError


async def manager(nc: Client, js: Any, store: JobStore, subjects: Subjects) -> JobManager:
    return JobManager(nc, js, store, NoRecords(), subjects, REGION, fleet=TopologyView().fleet)


async def announced(js: JetStreamContext, subjects: Subjects, kind: str) -> list[ControllerEvent]:
    """Every ``kind`` event of the region in the control stream, read by an ordered
    consumer from the start (what any subscriber of the stream gets)."""
    subject = subjects.control(REGION, kind)
    info = await js.stream_info(subjects.stream_control, subjects_filter=subject)
    count = (info.state.subjects or {}).get(subject, 0)
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        return [decode((await sub.next_msg(timeout=5)).data, ControllerEvent) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def test_killed_between_the_write_and_the_publish_announces_once(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    dying = DiesOnPublish(js)
    first = await manager(nc, dying, await JobStore.open(js, subjects), subjects)
    with pytest.raises(asyncio.CancelledError):
        await first.submit({"job_id": "crash1", "name": "crash1", "command": "python"})
    assert dying.tried == [subjects.control(REGION, "job.queued")]
    assert await announced(js, subjects, "job.queued") == []  # lost, were it not for...

    store = await JobStore.open(js, subjects)  # ... the outbox a restarted one reads
    assert store.jobs["crash1"].state == "queued"
    assert [e.kind for e in store.outbox.values()] == ["job.queued"]
    second = await manager(nc, js, store, subjects)
    await second.run_pass()
    await second.run_pass()
    events = await announced(js, subjects, "job.queued")
    assert [(e.job_id, e.event_id) for e in events] == [("crash1", "crash1.job.queued.0")]
    assert (await JobStore.open(js, subjects)).outbox == {}  # published: deleted

    third = await manager(nc, js, await JobStore.open(js, subjects), subjects)
    await third.run_pass()
    assert len(await announced(js, subjects, "job.queued")) == 1


async def test_killed_after_the_publish_before_the_delete_announces_once(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    kv = await js.key_value(subjects.bucket("jobs"))
    first = await manager(nc, js, DiesAfterPublishing(kv, js), subjects)
    with pytest.raises(asyncio.CancelledError):
        await first.submit({"job_id": "crash2", "name": "crash2", "command": "python"})
    assert len(await announced(js, subjects, "job.queued")) == 1

    store = await JobStore.open(js, subjects)
    assert list(store.outbox) == ["crash2.job.queued.0"]  # still there: published again
    second = await manager(nc, js, store, subjects)
    await second.run_pass()
    assert store.outbox == {}
    events = await announced(js, subjects, "job.queued")  # the stream dropped the repeat
    assert [e.event_id for e in events] == ["crash2.job.queued.0"]


async def test_a_pass_killed_before_its_publish_announces_once_after_restart(
    nc: Client, subjects: Subjects
) -> None:
    """The same inside a pass: a cancel's ``job.cancelled`` written, not published."""
    js = nc.jetstream(timeout=5)
    first = await manager(nc, js, await JobStore.open(js, subjects), subjects)
    await first.submit({"job_id": "crash3", "name": "crash3", "command": "python"})
    await first.cancel("crash3")
    first._js = DiesOnPublish(js)  # type: ignore[assignment]
    with pytest.raises(asyncio.CancelledError):
        await first.run_pass()
    store = await JobStore.open(js, subjects)
    assert store.jobs["crash3"].state == "cancelled"
    kinds = sorted(e.kind for e in store.outbox.values())
    assert kinds, "the pass wrote its events to the outbox"
    second = await manager(nc, js, store, subjects)
    await second.run_pass()
    await second.run_pass()
    for kind in kinds:
        assert len(await announced(js, subjects, kind)) == 1, kind
    assert store.outbox == {}
