"""controller/qos.py: keys and the version rule (pure), and the store over a real KV."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client

from metalguard.controller.qos import QosStore, VersionConflictError, profile_key, version_problem
from metalguard.proto.codec import decode, encode
from metalguard.proto.qos import QosProfile, TrafficClass
from metalguard.proto.subjects import Subjects


def profile(version: int, share: float = 100.0) -> QosProfile:
    return QosProfile(
        version=version,
        traffic_class=(TrafficClass(name="default", priorities=(0,), bandwidth_percent=share),),
    )


def test_keys_are_cluster_and_cluster_dot_node() -> None:
    assert profile_key("c1") == "c1"
    assert profile_key("c1", "n7") == "c1.n7"
    for bad in ("", "a.b", "a b", "a*", "a>"):
        with pytest.raises(ValueError, match="cluster"):
            profile_key(bad)
        with pytest.raises(ValueError, match="node"):
            profile_key("c1", bad)


def test_version_must_grow() -> None:
    assert version_problem(None, profile(0)) is None
    assert version_problem(profile(3), profile(4)) is None
    same = version_problem(profile(3), profile(3))
    assert same is not None
    assert "version 3 is not newer than the stored version 3" in same
    older = version_problem(profile(3), profile(2))
    assert older is not None
    assert "above 3" in older


async def test_put_get_history_and_conflicts(nc: Client, subjects: Subjects) -> None:
    js = nc.jetstream(timeout=5)
    store = await QosStore.open(js, subjects)
    assert await store.get("c1") is None
    assert await store.effective("c1", "n1") is None
    assert await store.history("c1", "n1") == []  # no such key: no history, no error

    first, replaced = await store.put("c1", None, profile(1))
    assert replaced is None
    assert (first.key, first.profile.version) == ("c1", 1)
    got = await store.get("c1")
    assert got == first

    # the stored bytes are the wire encoding the agents decode
    kv = await js.key_value(subjects.bucket("qos"))
    raw = (await kv.get("c1")).value
    assert raw is not None
    assert decode(raw, QosProfile) == profile(1)

    with pytest.raises(VersionConflictError, match="not newer"):
        await store.put("c1", None, profile(1, share=100.0))
    with pytest.raises(VersionConflictError):
        await store.put("c1", None, profile(0))
    assert await store.get("c1") == first  # nothing changed

    second, replaced = await store.put("c1", None, profile(5))
    assert replaced == first
    assert second.revision > first.revision
    assert [s.profile.version for s in await store.history("c1")] == [1, 5]

    # a node override is its own key with its own versions
    assert await store.effective("c1", "n1") == second
    override, _ = await store.put("c1", "n1", profile(1))
    assert override.key == "c1.n1"
    assert await store.effective("c1", "n1") == override
    assert await store.effective("c1", "n2") == second


async def test_unreadable_value_can_be_replaced(nc: Client, subjects: Subjects) -> None:
    js = nc.jetstream(timeout=5)
    kv = await js.key_value(subjects.bucket("qos"))
    await kv.put("c9", b"\x00garbage")
    store = await QosStore.open(js, subjects)
    assert await store.history("c9") == []
    stored, replaced = await store.put("c9", None, profile(1))
    assert replaced is None
    assert msgspec.structs.asdict(stored.profile) == msgspec.structs.asdict(profile(1))
    assert await store.get("c9") == stored


async def test_concurrent_writer_loses_with_a_conflict(nc: Client, subjects: Subjects) -> None:
    js = nc.jetstream(timeout=5)
    kv = await js.key_value(subjects.bucket("qos"))
    store = await QosStore.open(js, subjects)
    await store.put("c1", None, profile(1))

    class Racing(QosStore):
        """Another writer stores version 7 between this store's read and its write."""

        async def _entry(self, key: str) -> tuple[bytes, int] | None:
            entry = await super()._entry(key)
            await kv.put(key, encode(profile(7)))
            return entry

    with pytest.raises(VersionConflictError, match="changed while it was written"):
        await Racing(kv).put("c1", None, profile(2))
    stored = await store.get("c1")
    assert stored is not None
    assert stored.profile.version == 7
