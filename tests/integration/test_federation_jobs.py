"""Jobs across regions (controller/jobs_federated.py) on one real nats-server: two
regions' job managers (each over its own MG_JOBS bucket) and federations; forwarding,
lookups by id, and what happens when the chosen region refuses or cannot answer."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import msgspec
import pytest
from nats.aio.client import Client

from metalguard.controller.core.topology import TopologyView
from metalguard.controller.federation.jobs import FederatedJobs
from metalguard.controller.federation.service import Federation
from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.controller.jobs.spec import JobRejectedError, NotLeaderError
from metalguard.controller.jobs.store import JobExistsError, JobStore
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from tests.support.waiting import wait_until

INTERVAL_S = 0.2
DEADLINE_S = 10.0


@dataclass
class NoRecords:
    records: Mapping[str, NodeRecord] = field(default_factory=dict)


@dataclass
class Region:
    name: str
    manager: JobManager
    federation: Federation
    jobs: FederatedJobs
    leading: list[bool]


def fleet(region: str, nodes: int) -> list[FleetNode]:
    return [
        FleetNode(handle=f"{region}.c1.n{i}", region=region, cluster="c1", gpus=8, gpu_type="h100")
        for i in range(nodes)
    ]


async def make_region(nc: Client, subjects: Subjects, name: str, nodes: int) -> Region:
    js = nc.jetstream(timeout=5)
    kv = await js.create_key_value(bucket=f"{subjects.prefix.upper()}_JOBS_{name.upper()}")
    store = JobStore(kv, js)
    await store.load()
    leading = [True]
    manager = JobManager(
        nc, js, store, NoRecords(), subjects, name,
        fleet=TopologyView().fleet, leading=lambda: leading[0],
    )  # fmt: skip
    nodes_of = fleet(name, nodes)
    federation = Federation(
        nc, subjects, name, dict, lambda: nodes_of, interval_s=INTERVAL_S,
        leading=lambda: leading[0], latency_ms={"r1": 5.0, "r2": 5.0, "r3": 50.0},
    )  # fmt: skip
    jobs = FederatedJobs(manager, federation, leading=lambda: leading[0])
    return Region(name, manager, federation, jobs, leading)


@pytest.fixture
async def regions(nc: Client, subjects: Subjects) -> AsyncIterator[dict[str, Region]]:
    out = {
        "r1": await make_region(nc, subjects, "r1", 1),
        "r2": await make_region(nc, subjects, "r2", 4),
        "r3": await make_region(nc, subjects, "r3", 8),
    }
    for region in out.values():
        await region.federation.start()
    try:
        for region in out.values():
            await wait_until(
                functools.partial(hears_all, region), DEADLINE_S, f"{region.name} to hear all"
            )
        yield out
    finally:
        for region in out.values():
            await region.federation.stop()


def hears_all(region: Region) -> bool:
    return set(region.federation.view.regions) == {"r1", "r2", "r3"}


def gang(job_id: str, nodes: int, **extra: object) -> dict[str, object]:
    return {"job_id": job_id, "name": job_id, "nodes": nodes, "command": "python"} | extra


async def test_a_job_too_big_for_home_runs_where_it_fits_and_resolves_from_anywhere(
    regions: dict[str, Region],
) -> None:
    r1, r2, r3 = regions["r1"], regions["r2"], regions["r3"]
    status = await r1.jobs.submit(gang("big", 3))
    assert r1.jobs.forwarded == {"big": "r2"}  # r3 fits too, but is 50 ms away
    assert status.job_id == "big"
    assert status.state == "queued"
    assert status.history[0].reason == "forwarded from r1"
    assert "big" in r2.manager.jobs
    assert "big" not in r1.manager.jobs
    for region in (r1, r2, r3):
        found = await region.jobs.find("big")
        assert found is not None
        assert found[0] == "r2"
    assert await r3.jobs.find("no-such-job") is None

    small = await r1.jobs.submit(gang("small", 1))
    assert small.job_id in r1.manager.jobs  # fits home: stays home
    assert "small" not in r1.jobs.forwarded

    with pytest.raises(JobExistsError):  # the chosen region already has that id
        await r1.jobs.submit(gang("big", 3))

    cancelled = await r3.jobs.cancel("big")  # cancelled from a third region
    assert cancelled is not None
    assert cancelled.cancel_requested
    assert r2.manager.jobs["big"].cancel_requested
    assert await r3.jobs.cancel("no-such-job") is None


async def test_latency_and_allowed_regions_bound_the_choice(regions: dict[str, Region]) -> None:
    r1, r3 = regions["r1"], regions["r3"]
    await r1.jobs.submit(gang("huge", 6))  # only r3 (8 nodes) fits: 50 ms is fine
    assert r1.jobs.forwarded["huge"] == "r3"
    near = await r1.jobs.submit(gang("huge-near", 6, max_latency_ms=20.0))
    assert near.job_id in r1.manager.jobs
    assert near.state == "queued"
    assert "r3: latency 50 ms > max_latency_ms 20" in near.reason
    assert "huge-near" not in r3.manager.jobs
    pinned = await r1.jobs.submit(gang("pinned", 1, allowed_regions=["r3"]))
    assert r1.jobs.forwarded["pinned"] == "r3"
    assert pinned.job_id in r3.manager.jobs


async def test_a_region_that_cannot_take_the_job_leaves_it_queued_at_home(
    regions: dict[str, Region],
) -> None:
    r1, r2, r3 = regions["r1"], regions["r2"], regions["r3"]
    for region in (r2, r3):  # no leader: nobody holds their forwarded-job subscription
        region.leading[0] = False
        await region.federation.publish_once()
        await region.federation._sync_submit()
    status = await r1.jobs.submit(gang("orphan", 3))
    assert status.job_id in r1.manager.jobs
    assert "did not take it (unavailable): queued here" in status.reason
    assert r1.jobs.forwarded == {}
    near = await r1.jobs.submit(gang("orphan-near", 3, max_latency_ms=1.0))
    assert near.job_id in r1.manager.jobs

    await r1.jobs.retry_pass()  # still nobody to take it: it stays
    assert set(r1.manager.jobs) == {"orphan", "orphan-near"}

    r2.leading[0] = True  # r2 has a leader again: the next pass forwards the waiting job
    await r2.federation._sync_submit()
    await r2.federation.publish_once()
    await r1.jobs.retry_pass()
    assert r1.jobs.forwarded == {"orphan": "r2"}
    assert set(r1.manager.jobs) == {"orphan-near"}  # 5 ms > 1 ms: never sent
    assert r2.manager.jobs["orphan"].history[0].reason == "forwarded from r1"
    assert await r1.manager.store.refresh("orphan") is None  # gone from r1's MG_JOBS
    found = await r1.jobs.find("orphan")
    assert found is not None
    assert found[0] == "r2"


async def test_a_started_job_is_never_handed_over(regions: dict[str, Region]) -> None:
    r1 = regions["r1"]
    status = await r1.jobs.submit(gang("local", 1))
    started = msgspec.structs.replace(status, generation=1)  # it ran here once
    await r1.manager.store.put(started)
    r1.manager._live["local"] = started

    async def send(_: object) -> bool:
        raise AssertionError("a started job must not be sent")

    assert await r1.manager.hand_over("local", send) is False


async def test_a_follower_refuses_and_bad_jobs_are_rejected_before_forwarding(
    regions: dict[str, Region],
) -> None:
    r1, r2 = regions["r1"], regions["r2"]
    with pytest.raises(JobRejectedError):
        await r1.jobs.submit(gang("bad", 0))
    r1.leading[0] = False
    with pytest.raises(NotLeaderError):
        await r1.jobs.submit(gang("late", 3))
    assert "late" not in r2.manager.jobs
