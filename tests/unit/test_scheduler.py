"""Scheduler examples: levels, best fit, queue order, backfill, preemption in a pass."""

from __future__ import annotations

import msgspec

from metalguard.controller.jobs.scheduler import (
    FleetIndex,
    FleetNode,
    JobRequest,
    RunningJob,
    place,
    plan_preemption,
    request_from_job,
    schedule_queue,
)
from metalguard.proto.jobs import Job


def _fleet(racks: dict[tuple[str, str], int], **caps: object) -> list[FleetNode]:
    """``{(cluster, rack): count}`` nodes of 8 GPUs each in region r1 / zone z1."""
    nodes = []
    for (cluster, rack), count in racks.items():
        for i in range(count):
            nodes.append(
                FleetNode(
                    handle=f"r1.{cluster}.{rack}-{i}",
                    region="r1",
                    cluster=cluster,
                    zone="z1",
                    rack=rack,
                    leaf=f"{rack}-l{i // 2}",
                    gpus=8,
                    gpu_type="h100",
                    cpu_cores=64,
                    memory_gb=512,
                    bandwidth_tier=1,
                    dma_posture="isolated",
                    **caps,  # type: ignore[arg-type]
                )
            )
    return nodes


def test_one_rack_when_one_has_room_and_the_fullest_that_fits() -> None:
    nodes = _fleet({("c1", "a"): 6, ("c1", "b"): 4, ("c1", "c"): 3})
    placed = place(JobRequest("j", nodes=4, gpus_per_node=8), nodes)
    assert placed is not None
    assert placed.level == "rack"
    assert placed.group == ("r1", "z1", "c1", "b"), "best fit: the rack with the fewest free nodes"
    assert sorted(placed.nodes) == [f"r1.c1.b-{i}" for i in range(4)]


def test_widens_to_the_cluster_but_never_past_max_spread() -> None:
    nodes = _fleet({("c1", "a"): 3, ("c1", "b"): 3, ("c2", "a"): 2})
    wide = place(JobRequest("j", nodes=5, gpus_per_node=8), nodes)
    assert wide is not None
    assert wide.level == "cluster"
    assert wide.group == ("r1", "z1", "c1")
    assert place(JobRequest("j", nodes=5, gpus_per_node=8, max_spread="rack"), nodes) is None
    assert place(JobRequest("j", nodes=9, gpus_per_node=8), nodes) is None, "never a partial gang"


def test_only_healthy_uncordoned_nodes_and_not_the_excluded_one() -> None:
    nodes = _fleet({("c1", "a"): 4})
    nodes[0] = msgspec.structs.replace(nodes[0], grade="SUB_HEALTHY")
    nodes[1] = msgspec.structs.replace(nodes[1], cordoned=True)
    assert place(JobRequest("j", nodes=2), nodes) is not None
    assert place(JobRequest("j", nodes=2, exclude=frozenset({"r1.c1.a-3"})), nodes) is None


def test_partial_capacity_is_shared_and_whole_node_requests_need_idle_nodes() -> None:
    nodes = _fleet({("c1", "a"): 2})
    half = JobRequest("half", nodes=2, gpus_per_node=4, cpu=8, memory_gb=64)
    index = FleetIndex(nodes)
    first = index.place(half)
    assert first is not None
    index.commit(half, first.nodes)
    assert index.free("r1.c1.a-0") == (4, 56, 448)
    second = index.place(JobRequest("half2", nodes=2, gpus_per_node=4))
    assert second is not None, "the other half of each node is still free"
    assert index.place(JobRequest("whole", nodes=1)) is None, "no idle node left"
    assert index.place(JobRequest("five", nodes=1, gpus_per_node=5)) is None


def test_queue_in_priority_order_with_backfill_outside_the_reservation() -> None:
    nodes = _fleet({("c1", "a"): 4, ("c1", "b"): 4})
    holder = RunningJob(JobRequest("old", nodes=2, priority=9), ("r1.c1.a-0", "r1.c1.b-0"))
    queue = [
        JobRequest("small", nodes=2, priority=1, submitted_ts=1),
        JobRequest("big", nodes=4, priority=5, submitted_ts=2, max_spread="rack"),
    ]
    result = schedule_queue(queue, nodes, [holder])
    assert [b.job_id for b in result.blocked] == ["big"]
    reserved = set(result.blocked[0].reserved)
    assert len(reserved) == 4
    [small] = result.placements
    assert small.job_id == "small"
    assert not reserved & set(small.nodes), "backfill never takes the blocked job's nodes"

    strict = schedule_queue(queue, nodes, [holder], backfill=False)
    assert not strict.placements
    assert [b.job_id for b in strict.blocked] == ["big", "small"]


def test_an_impossible_job_blocks_nobody() -> None:
    nodes = _fleet({("c1", "a"): 2})
    queue = [JobRequest("huge", nodes=3, priority=9), JobRequest("ok", nodes=2, priority=0)]
    result = schedule_queue(queue, nodes, backfill=False)
    assert [p.job_id for p in result.placements] == ["ok"]
    assert result.blocked[0].job_id == "huge"
    assert not result.blocked[0].reserved


def test_preemption_picks_the_fewest_then_the_lowest_priority() -> None:
    nodes = _fleet({("c1", "a"): 4})
    running = [
        RunningJob(JobRequest("p1", nodes=1, priority=1, preemptible=True), ("r1.c1.a-0",)),
        RunningJob(JobRequest("p2", nodes=1, priority=2, preemptible=True), ("r1.c1.a-1",)),
        RunningJob(
            JobRequest("pair", nodes=2, priority=3, preemptible=True), ("r1.c1.a-2", "r1.c1.a-3")
        ),
    ]
    plan = plan_preemption(JobRequest("hi", nodes=2, priority=5), nodes, running)
    assert plan is not None
    assert plan.victims == ("pair",), "one victim beats two"
    plan = plan_preemption(JobRequest("hi", nodes=1, priority=5), nodes, running)
    assert plan is not None
    assert plan.victims == ("p1",)
    assert plan_preemption(JobRequest("lo", nodes=1, priority=1), nodes, running) is None


def test_preemption_in_a_queue_pass_reserves_the_freed_nodes() -> None:
    nodes = _fleet({("c1", "a"): 2})
    running = [RunningJob(JobRequest("low", nodes=2, preemptible=True), ("r1.c1.a-0", "r1.c1.a-1"))]
    queue = [JobRequest("high", nodes=2, priority=5), JobRequest("other", nodes=1, priority=4)]
    result = schedule_queue(queue, nodes, running)
    [plan] = result.preemptions
    assert plan.job_id == "high"
    assert plan.victims == ("low",)
    assert sorted(plan.placement.nodes) == ["r1.c1.a-0", "r1.c1.a-1"]
    assert not result.placements, "the freed nodes are promised to 'high'"
    assert [b.job_id for b in result.blocked] == ["other"]


def test_request_from_job() -> None:
    job = Job(
        job_id="j1",
        name="t",
        nodes=4,
        gpus_per_node=8,
        priority=3,
        max_spread="zone",
        sensitive=True,
    )
    req = request_from_job(job, exclude=["r1.c1.n1"])
    assert (req.nodes, req.gpus_per_node, req.priority, req.max_spread, req.sensitive) == (
        4,
        8,
        3,
        "zone",
        True,
    )
    assert req.exclude == frozenset({"r1.c1.n1"})


def test_release_undoes_commit_including_the_leaf_rule() -> None:
    nodes = _fleet({("c1", "a"): 3})  # leaves: a-0 and a-1 on a-l0, a-2 on a-l1
    index = FleetIndex(nodes)
    other = JobRequest("other", nodes=1, tenant="t2", gpus_per_node=2)
    secret = JobRequest("secret", nodes=1, tenant="t1", gpus_per_node=2, sensitive=True)
    index.commit(other, ("r1.c1.a-0",))
    index.commit(other, ("r1.c1.a-2",))
    assert index.place(secret) is None, "t2 is on every leaf"
    index.release(other, ("r1.c1.a-2",))
    assert index.free("r1.c1.a-2") == (8, 64, 512)
    placed = index.place(secret)
    assert placed is not None
    assert placed.nodes == ("r1.c1.a-2",)
    whole = FleetIndex(nodes, [RunningJob(JobRequest("w", nodes=1), ("r1.c1.a-0",))])
    assert whole.free("r1.c1.a-0") == (-1, -1, -1), "held whole"
    whole.release(JobRequest("w", nodes=1), ("r1.c1.a-0",))
    assert whole.free("r1.c1.a-0") == (8, 64, 512)
