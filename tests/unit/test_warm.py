"""Which datasets are warm on a node (controller/core/warm.py) and how the topology view
hands them to the scheduler and the API (pure, time injected)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metalguard.controller.core.topology import TopologyView
from metalguard.controller.core.warm import (
    FRESH_S,
    WARM_FRACTION,
    batch_warm_datasets,
    is_warm,
    warm_datasets,
)
from metalguard.controller.jobs.scheduler import request_from_job
from metalguard.proto.base import NodeIdentity
from metalguard.proto.jobs import Job
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.telemetry import DatasetCache, TelemetryBatch
from tests.support.clock import T0

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")


def cache(**kw: object) -> DatasetCache:
    fields: dict[str, object] = {"dataset": "ds", "ts": T0, "max_bytes": 1000} | kw
    return msgspec.convert(fields, DatasetCache)


@pytest.mark.parametrize(
    ("fields", "warm"),
    [
        ({"used_bytes": 500}, True),  # size unknown: half of max_bytes
        ({"used_bytes": 499}, False),
        ({"used_bytes": 300, "dataset_bytes": 600}, True),  # half of a dataset smaller
        ({"used_bytes": 299, "dataset_bytes": 600}, False),
        ({"used_bytes": 500, "dataset_bytes": 10_000}, True),  # bigger: half of the cache
        ({"used_bytes": 499, "dataset_bytes": 10_000}, False),
        ({"used_bytes": 0, "max_bytes": 0}, False),  # nothing cached is never warm
        ({"used_bytes": 0, "dataset_bytes": 0}, False),
        ({"used_bytes": 900, "ts": 0.0}, False),  # the agent's entry: cache not running
        ({"used_bytes": 900, "ts": T0 - FRESH_S}, True),
        ({"used_bytes": 900, "ts": T0 - FRESH_S - 0.1}, False),  # stopped or hung
    ],
)
def test_is_warm(fields: dict[str, object], warm: bool) -> None:
    assert is_warm(cache(**fields), T0) is warm


@given(
    max_bytes=st.integers(0, 10**12),
    dataset_bytes=st.integers(0, 10**12),
    used=st.integers(0, 10**12),
    age=st.floats(0, 2 * FRESH_S),
)
def test_is_warm_is_the_documented_rule(
    max_bytes: int, dataset_bytes: int, used: int, age: float
) -> None:
    used = min(used, max_bytes)  # the cache never holds more than max_bytes
    c = cache(max_bytes=max_bytes, dataset_bytes=dataset_bytes, used_bytes=used, ts=T0 - age)
    room = min(max_bytes, dataset_bytes) if dataset_bytes else max_bytes
    fresh = T0 - c.ts <= FRESH_S  # the age as the clock sees it (float rounding)
    expected = fresh and used > 0 and used >= WARM_FRACTION * room
    assert is_warm(c, T0) is expected


def test_warm_datasets_of_a_batch_are_judged_at_its_own_ts() -> None:
    caches = (cache(dataset="a", used_bytes=800), cache(dataset="b", used_bytes=10))
    assert warm_datasets(caches, T0) == {"a"}
    batch = TelemetryBatch(node=NODE, seq=1, ts=T0 + 5, cache=caches)
    assert batch_warm_datasets(batch) == {"a"}
    late = msgspec.structs.replace(batch, ts=T0 + FRESH_S + 1)  # the node's own clock
    assert batch_warm_datasets(late) == frozenset()
    assert batch_warm_datasets(TelemetryBatch(node=NODE, seq=1, ts=T0)) == frozenset()


def test_the_view_keeps_each_nodes_newest_warm_set_for_the_scheduler() -> None:
    view = TopologyView()
    handle = NODE.handle
    warm = TelemetryBatch(node=NODE, seq=1, ts=T0, cache=(cache(used_bytes=900),))
    view.observe(handle, warm)
    assert view.warm_datasets(handle) == {"ds"}
    oob = TelemetryBatch(node=NODE, seq=7, ts=T0 + 1, out_of_band=True)
    view.observe(handle, oob)
    assert view.warm_datasets(handle) == {"ds"}, "a bmc-proxy's batch says nothing of it"
    records = {handle: NodeRecord(node=NODE, grade="HEALTHY")}
    (node,) = view.fleet(records)
    assert node.warm_datasets == {"ds"}
    cold = msgspec.structs.replace(warm, seq=2, ts=T0 + 60)  # the same figures, now stale
    view.observe(handle, cold)
    assert view.warm_datasets(handle) == frozenset()
    (node,) = view.fleet(records)
    assert node.warm_datasets == frozenset()
    assert view.warm_datasets("r1.c1.unknown") == frozenset()


def test_request_from_job_carries_the_dataset() -> None:
    job = Job(job_id="j", name="t", command="python", dataset="imagenet")
    assert request_from_job(job).dataset == "imagenet"
    assert request_from_job(Job(job_id="j", name="t", command="p")).dataset == ""
