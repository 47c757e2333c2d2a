"""Federation's pure parts: a region's summary, the fleet view's staleness, UUID lookups."""

from __future__ import annotations

from metalguard.controller.federation.view import FleetView, find_uuid, summarize
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.proto.base import NodeIdentity
from metalguard.proto.federation import GpuCapacity
from metalguard.proto.nodes import NodeRecord

T0 = 1_800_000_000.0


def record(name: str, grade: str = "HEALTHY", uuid: str = "") -> NodeRecord:
    node = NodeIdentity(region="r1", cluster="c1", node=name, uuid=uuid)
    return NodeRecord(node=node, grade=grade)  # type: ignore[arg-type]


def fleet_node(
    name: str, gpus: int, gpu_type: str, grade: str = "HEALTHY", cordoned: bool = False
) -> FleetNode:
    handle = f"r1.c1.{name}"
    return FleetNode(
        handle=handle,
        region="r1",
        cluster="c1",
        gpus=gpus,
        gpu_type=gpu_type,
        grade=grade,
        cordoned=cordoned,
    )


def test_summary_counts_grades_and_gpu_capacity_by_type() -> None:
    records = {
        "r1.c1.a": record("a"),
        "r1.c1.b": record("b", "FAILING"),
        "r1.c1.c": record("c"),
        "r1.c1.d": record("d"),
    }
    fleet = [
        fleet_node("a", 8, "h100"),
        fleet_node("b", 8, "h100", "FAILING"),
        fleet_node("c", 8, "h100", cordoned=True),
        fleet_node("d", 0, ""),
    ]
    s = summarize("r1", records, fleet, T0, 5.0, controller="ctl-a", queued_jobs=2)
    assert (s.region, s.ts, s.interval_s, s.controller, s.nodes) == ("r1", T0, 5.0, "ctl-a", 4)
    assert s.grades["HEALTHY"] == 3
    assert s.grades["FAILING"] == 1
    assert s.grades["UNREACHABLE"] == 0
    assert s.capacity == (
        GpuCapacity(
            gpu_type="", nodes=1, healthy_nodes=1, gpus=0, healthy_gpus=0, free_nodes=1,
            free_in={"rack": 1, "cluster": 1, "zone": 1},
        ),
        GpuCapacity(
            gpu_type="h100", nodes=3, healthy_nodes=1, gpus=24, healthy_gpus=8, free_nodes=1,
            free_in={"rack": 1, "cluster": 1, "zone": 1},
        ),
    )  # fmt: skip
    assert (s.queued_jobs, s.running_jobs) == (2, 0)


def test_fleet_view_marks_old_summaries_stale_and_keeps_the_newest() -> None:
    view = FleetView()
    r2 = summarize("r2", {}, [], T0, 5.0)
    assert view.take(r2, T0 + 0.1)
    assert not view.take(summarize("r2", {}, [], T0 - 5, 5.0), T0 + 0.2)  # an older one
    (fresh,) = view.snapshot(T0 + 10)
    assert (fresh["region"], fresh["stale"]) == ("r2", False)
    (old,) = view.snapshot(T0 + 15.2)  # more than 3 intervals after it was heard
    assert old["stale"]
    assert old["age_s"] > 15
    assert view.take(summarize("r2", {}, [], T0 + 20, 5.0), T0 + 20.1)  # the gateway is back
    assert view.snapshot(T0 + 21)[0]["stale"] is False


def test_find_uuid() -> None:
    records = {"r1.c1.a": record("a", uuid="4c4c4544-0042"), "r1.c1.b": record("b")}
    hit = find_uuid("r1", records, "4c4c4544-0042")
    assert (hit.found, hit.region, hit.handle) == (True, "r1", "r1.c1.a")
    assert hit.record == records["r1.c1.a"]
    assert not find_uuid("r1", records, "nope").found
    assert not find_uuid("r1", records, "").found  # nodes without a uuid never match ""
