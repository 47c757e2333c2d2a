"""Where a submitted job goes across regions (controller/forwarding.py), table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from metalguard.controller.federation.forwarding import (
    RegionOffer,
    choose_region,
    effective_latency,
    healthy_fit,
    median,
    why_no_room,
    why_not,
)
from metalguard.controller.federation.view import busy_nodes, summarize
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.proto.federation import GpuCapacity, RegionSummary
from metalguard.proto.jobs import Job, JobStatus


def summary(
    region: str,
    healthy: int,
    *,
    nodes: int | None = None,
    gpus: int = 8,
    gpu_type: str = "h100",
    queued: int = 0,
    free: int | None = None,
    free_in: dict[str, int] | None = None,
) -> RegionSummary:
    total = healthy if nodes is None else nodes
    row = GpuCapacity(
        gpu_type=gpu_type,
        nodes=total,
        healthy_nodes=healthy,
        gpus=total * gpus,
        healthy_gpus=healthy * gpus,
        free_nodes=free,
        free_in=free_in or {},
    )
    return RegionSummary(
        region=region, ts=0.0, interval_s=5.0, nodes=total, capacity=(row,), queued_jobs=queued
    )


def job(**fields: Any) -> Job:
    return Job(job_id="j1", name="train", **fields)


def offer(region: str, healthy: int, latency: float | None = 0.0, **kw: Any) -> RegionOffer:
    stale = kw.pop("stale", False)
    return RegionOffer(summary(region, healthy, **kw), stale, latency)


@pytest.mark.parametrize(
    ("fields", "row", "fits"),
    [
        ({"nodes": 2}, summary("r1", 2), True),
        ({"nodes": 3}, summary("r1", 2), False),
        ({"nodes": 2}, summary("r1", 1, nodes=4), False),  # only healthy nodes count
        ({"nodes": 1, "gpus_per_node": 8}, summary("r1", 1, gpus=8), True),
        ({"nodes": 1, "gpus_per_node": 16}, summary("r1", 4, gpus=8), False),
        ({"nodes": 1, "gpu_type": "a100"}, summary("r1", 4), False),
        ({"nodes": 1, "gpu_type": "h100"}, summary("r1", 4), True),
        ({"nodes": 1}, summary("r1", 0, nodes=0), False),
    ],
)
def test_healthy_fit(fields: dict[str, Any], row: RegionSummary, fits: bool) -> None:
    assert healthy_fit(job(**fields), row) is fits


@pytest.mark.parametrize(
    ("fields", "o", "reason"),
    [
        ({"nodes": 2}, offer("r2", 4, 40.0), None),
        ({"nodes": 2, "allowed_regions": ("r3",)}, offer("r2", 4), "not in allowed_regions"),
        ({"nodes": 2}, offer("r2", 4, stale=True), "stale (cut off)"),
        (
            {"nodes": 2, "max_latency_ms": 10.0},
            offer("r2", 4, 40.0),
            "latency 40 ms > max_latency_ms 10",
        ),
        ({"nodes": 2, "max_latency_ms": 50.0}, offer("r2", 4, 40.0), None),
        (
            {"nodes": 2, "max_latency_ms": 10.0},
            offer("r2", 4, None),
            "latency unknown (max_latency_ms 10)",
        ),
        ({"nodes": 2, "max_latency_ms": 1.0}, offer("r1", 4, 0.0), None),  # home: no bound
        (
            {"nodes": 5, "gpus_per_node": 8, "gpu_type": "h100"},
            offer("r2", 4),
            "fewer than 5 healthy nodes with >= 8 GPUs of type h100",
        ),
    ],
)
def test_why_not(fields: dict[str, Any], o: RegionOffer, reason: str | None) -> None:
    assert why_not(job(**fields), "r1", o) == reason


def test_a_job_that_fits_home_stays_home_even_when_another_region_is_emptier() -> None:
    choice = choose_region(job(nodes=2), "r1", [offer("r1", 2, queued=5), offer("r2", 8, 1.0)])
    assert (choice.region, choice.forward) == ("r1", False)


def test_a_job_too_big_for_home_goes_to_the_best_fitting_region() -> None:
    offers = [
        offer("r1", 2),
        offer("r2", 4, 40.0, queued=1),
        offer("r3", 4, 80.0, queued=0),  # fewer queued jobs wins over latency
        offer("r4", 1, 5.0),  # too small
    ]
    choice = choose_region(job(nodes=3), "r1", offers)
    assert (choice.region, choice.forward) == ("r3", True)
    assert choice.reason.startswith("r1: fewer than 3 healthy nodes")


def test_ties_go_to_the_lowest_latency_then_the_name() -> None:
    offers = [offer("r1", 1), offer("r3", 4, 20.0), offer("r2", 4, 20.0), offer("r4", 4, 30.0)]
    assert choose_region(job(nodes=3), "r1", offers).region == "r2"


def test_a_region_beyond_max_latency_is_never_chosen_and_the_job_stays_queued_home() -> None:
    offers = [offer("r1", 2), offer("r2", 4, 40.0)]
    choice = choose_region(job(nodes=3, max_latency_ms=10.0), "r1", offers)
    assert (choice.region, choice.forward) == ("r1", False)
    assert "r2: latency 40 ms > max_latency_ms 10" in choice.reason
    assert "r1: fewer than 3 healthy nodes" in choice.reason


def test_home_not_allowed_forwards_even_when_home_has_room() -> None:
    offers = [offer("r1", 8), offer("r2", 4, 40.0)]
    choice = choose_region(job(nodes=1, allowed_regions=("r2",)), "r1", offers)
    assert (choice.region, choice.forward) == ("r2", True)


def test_stale_regions_are_skipped() -> None:
    offers = [offer("r1", 1), offer("r2", 4, 1.0, stale=True)]
    assert choose_region(job(nodes=3), "r1", offers).forward is False


@pytest.mark.parametrize(
    ("region", "configured", "measured", "expected"),
    [
        ("r1", {"r1": 9.0}, {}, 0.0),  # home
        ("r2", {"r2": 40.0}, {"r2": 0.4}, 40.0),  # declared beats measured
        ("r2", {}, {"r2": 0.4}, 0.4),
        ("r2", {}, {}, None),
    ],
)
def test_effective_latency(
    region: str, configured: dict[str, float], measured: dict[str, float], expected: float | None
) -> None:
    assert effective_latency(region, "r1", configured, measured) == expected


def test_median() -> None:
    assert median([]) is None
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5


# --- free capacity and max_spread --------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "row", "reason"),
    [
        ({"nodes": 4}, summary("r1", 8, free=4), None),
        ({"nodes": 4}, summary("r1", 8, free=3), "3 of 8 healthy nodes free, 4 needed"),
        ({"nodes": 4}, summary("r1", 8, free=0), "0 of 8 healthy nodes free, 4 needed"),
        ({"nodes": 4}, summary("r1", 8), None),  # an older region: healthy stands in
        ({"nodes": 9}, summary("r1", 8, free=8), "fewer than 9 healthy nodes"),
        (
            {"nodes": 4, "gpus_per_node": 8},
            summary("r1", 8, free=2),
            "2 of 8 healthy nodes with >= 8 GPUs free, 4 needed",
        ),
        # max_spread: the gang must fit in one group of that level
        ({"nodes": 4, "max_spread": "rack"}, summary("r1", 8, free=8, free_in={"rack": 4}), None),
        (
            {"nodes": 4, "max_spread": "rack"},
            summary("r1", 8, free=8, free_in={"rack": 3, "cluster": 8, "zone": 8}),
            "at most 3 free nodes in one rack, 4 needed (max_spread rack)",
        ),
        (
            {"nodes": 6, "max_spread": "cluster", "gpu_type": "h100"},
            summary("r1", 8, free=8, free_in={"rack": 4, "cluster": 5, "zone": 8}),
            "at most 5 free nodes of type h100 in one cluster, 6 needed (max_spread cluster)",
        ),
        (
            {"nodes": 6, "max_spread": "zone"},
            summary("r1", 8, free=8, free_in={"rack": 4, "cluster": 5, "zone": 8}),
            None,
        ),
        ({"nodes": 6, "max_spread": "region"}, summary("r1", 8, free=8, free_in={"rack": 1}), None),
        # an older region tells no groups: the spread is not judged
        ({"nodes": 4, "max_spread": "rack"}, summary("r1", 8, free=8), None),
    ],
)
def test_why_no_room(fields: dict[str, Any], row: RegionSummary, reason: str | None) -> None:
    assert why_no_room(job(**fields), row) == reason


def test_a_job_fitting_home_healthy_but_not_free_goes_where_nodes_are_free() -> None:
    offers = [
        RegionOffer(summary("r1", 8, free=1), latency_ms=0.0),
        RegionOffer(summary("r2", 8, free=8), latency_ms=5.0),
    ]
    choice = choose_region(job(nodes=4), "r1", offers)
    assert (choice.region, choice.forward) == ("r2", True)
    assert choice.reason.startswith("r1: 1 of 8 healthy nodes free, 4 needed")


def test_a_region_too_spread_for_the_gang_is_not_chosen() -> None:
    offers = [
        RegionOffer(summary("r1", 1, free=1), latency_ms=0.0),
        RegionOffer(summary("r2", 8, free=8, free_in={"rack": 2}), latency_ms=1.0),
        RegionOffer(summary("r3", 8, free=8, free_in={"rack": 8}), latency_ms=50.0, stale=False),
    ]
    choice = choose_region(job(nodes=4, max_spread="rack"), "r1", offers)
    assert choice.region == "r3"


def _node(i: int, rack: str, *, grade: str = "HEALTHY", gpu_type: str = "h100") -> FleetNode:
    return FleetNode(
        handle=f"r1.c1.n{i}", region="r1", cluster="c1", rack=rack, zone="z1",
        gpus=8, gpu_type=gpu_type, grade=grade,
    )  # fmt: skip


def test_summarize_counts_free_nodes_per_group() -> None:
    fleet = [
        *(_node(i, "ra") for i in range(4)),
        *(_node(i, "rb") for i in range(4, 7)),
        _node(7, "rb", grade="FAILING"),
        _node(8, "rc", gpu_type="a100"),
    ]
    jobs = {
        "run": JobStatus(job_id="run", state="running", placement=("r1.c1.n0", "r1.c1.n1")),
        "done": JobStatus(job_id="done", state="succeeded", placement=("r1.c1.n4",)),
    }
    busy = busy_nodes(jobs)
    assert busy == {"r1.c1.n0", "r1.c1.n1"}
    got = summarize("r1", {}, fleet, 0.0, 5.0, busy=busy)
    h100 = next(row for row in got.capacity if row.gpu_type == "h100")
    assert (h100.nodes, h100.healthy_nodes, h100.free_nodes) == (8, 7, 5)
    assert h100.free_in == {"rack": 3, "cluster": 5, "zone": 5}
    a100 = next(row for row in got.capacity if row.gpu_type == "a100")
    assert (a100.free_nodes, a100.free_in) == (1, {"rack": 1, "cluster": 1, "zone": 1})
    assert why_no_room(job(nodes=4, max_spread="rack", gpu_type="h100"), got) == (
        "at most 3 free nodes of type h100 in one rack, 4 needed (max_spread rack)"
    )
