"""The agent's profile watcher over a real ``<P>_QOS`` bucket: node override, else the
cluster profile; undecodable or invalid values are reported and change nothing."""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.client import Client

from metalguard.agent.qos.reconciler import QosReconciler
from metalguard.agent.qos.watch import ProfileWatcher
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import encode
from metalguard.proto.events import NodeEvent
from metalguard.proto.qos import QosProfile, decode_profile
from metalguard.proto.subjects import Subjects
from tests.support.waiting import wait_until

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")


def profile(version: int) -> QosProfile:
    return decode_profile(f"version = {version}\npfc_priorities = [3]", "toml")


async def test_watch_follows_override_then_cluster(nc: Client, subjects: Subjects) -> None:
    events: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        events.append(event)

    reconciler = QosReconciler(NODE, emit, lister=lambda: [])
    watcher = ProfileWatcher(subjects, "c1", "n1", reconciler, retry_s=0.1)
    js = nc.jetstream(timeout=5)
    kv = await js.key_value(subjects.bucket("qos"))
    await kv.put("c1", encode(profile(1)))
    await kv.put("c2", encode(profile(9)))  # another cluster: ignored
    await kv.put("c1.n2", encode(profile(8)))  # another node: ignored

    async def get_js() -> object:
        return js

    task = asyncio.create_task(watcher.run(get_js))  # type: ignore[arg-type]
    try:
        await wait_until(lambda: reconciler.profile == profile(1), 10, "the cluster profile")
        await kv.put("c1.n1", encode(profile(5)))
        await wait_until(lambda: reconciler.profile == profile(5), 10, "the node override")
        await kv.put("c1", encode(profile(2)))  # the override still wins
        await kv.put("c1.n1", b"\x93garbage")  # undecodable: reported, nothing changes
        await wait_until(lambda: len(events) == 1, 10, "the invalid-value event")
        assert reconciler.profile == profile(5)
        assert events[0].kind == "qos_failed"
        assert events[0].message.startswith("profile at c1.n1 is invalid")
        bad = msgspec.structs.replace(profile(6), pfc_priorities=(3, 3))
        await kv.put("c1.n1", encode(bad))  # decodes, but fails profile_problems
        await wait_until(lambda: len(events) == 2, 10, "the second invalid-value event")
        assert "pfc_priorities[1]: priority 3 is listed twice" in str(
            events[1].attributes["reasons"]
        )
        await kv.delete("c1.n1")  # back to the cluster profile
        await wait_until(lambda: reconciler.profile == profile(2), 10, "the cluster fallback")
        await kv.delete("c1")
        await wait_until(lambda: reconciler.profile is None, 10, "no profile")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
