"""Elastic jobs (docs/jobs.md "Elastic jobs"): the sizes' validation, the size a job starts
at, when it grows, and what a preemption victim gives up to keep running."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalguard.controller.jobs import machine
from metalguard.controller.jobs.elastic import (
    Resize,
    grow_decision,
    initial_size,
    largest_placement,
    may_grow,
    node_range,
    release_order,
    shrink_plan,
    shrink_victims,
)
from metalguard.controller.jobs.scheduler import (
    FleetIndex,
    FleetNode,
    JobRequest,
    Placement,
    Preemption,
    RunningJob,
    plan_preemption,
    request_from_job,
)
from metalguard.controller.jobs.spec import (
    MAX_NODES,
    JobFileError,
    JobRejectedError,
    parse_job,
    parse_job_file,
)
from metalguard.proto.jobs import Job, JobStatus

T0 = 1_000.0
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def node(handle: str, rack: str = "a", leaf: str = "", **caps: object) -> FleetNode:
    """One 8-GPU node of region r1, cluster c1, zone z1 (``caps`` change any field)."""
    fields: dict[str, object] = {"gpus": 8, "gpu_type": "h100", "cpu_cores": 64}
    fields.update(memory_gb=512, **caps)
    return msgspec.convert(
        {
            "handle": handle,
            "region": "r1",
            "cluster": "c1",
            "zone": "z1",
            "rack": rack,
            "leaf": leaf,
            **fields,
        },
        FleetNode,
    )


def rack(name: str, count: int, per_leaf: int = 2) -> list[FleetNode]:
    """``count`` nodes ``<name>-<i>`` in rack ``name``, ``per_leaf`` to a leaf."""
    return [node(f"{name}-{i}", name, f"{name}-l{i // per_leaf}") for i in range(count)]


def elastic(job_id: str = "e", **keys: object) -> Job:
    return msgspec.convert({"job_id": job_id, "name": job_id, "command": "p", **keys}, Job)


def free(index: FleetIndex) -> dict[str, tuple[int, int, int]]:
    return {h: index.free(h) for h in index.nodes}


# --- validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "reasons"),
    [
        ({"min_nodes": 8, "max_nodes": 4}, ["min_nodes: must be <= max_nodes (8 > 4)"]),
        ({"nodes": 9, "min_nodes": 2, "max_nodes": 8}, ["nodes: must be <= max_nodes (9 > 8)"]),
        ({"nodes": 1, "min_nodes": 2, "max_nodes": 8}, ["nodes: must be >= min_nodes (1 < 2)"]),
        ({"nodes": 3, "min_nodes": 4}, ["nodes: must be >= min_nodes (3 < 4)"]),
        ({"nodes": 5, "max_nodes": 4}, ["nodes: must be <= max_nodes (5 > 4)"]),
        ({"min_nodes": 0, "max_nodes": 4}, ["min_nodes: Expected `int` >= 1"]),
        ({"max_nodes": "8"}, ["max_nodes: Expected `int | null`, got `str`"]),
        ({"max_nodes": MAX_NODES + 1}, [f"max_nodes: at most {MAX_NODES}"]),
        ({"resize_interval_s": -1}, ["resize_interval_s: must be >= 0 seconds"]),
        ({"resize_interval_s": float("nan")}, ["resize_interval_s: must be >= 0 seconds"]),
        (
            {"min_nodes": 9, "max_nodes": 2, "resize_interval_s": -5},
            ["min_nodes: must be <= max_nodes (9 > 2)", "resize_interval_s: must be >= 0"],
        ),
    ],
)
def test_nonsense_sizes_are_rejected_naming_the_field(
    keys: dict[str, object], reasons: list[str]
) -> None:
    with pytest.raises(JobRejectedError) as info:
        parse_job({"name": "x", "command": "p", **keys}, T0)
    got = info.value.reasons
    assert len(got) == len(reasons), got
    for expected, reason in zip(reasons, got, strict=True):
        assert reason.startswith(expected), got


def test_a_job_file_with_min_above_max_names_the_file_and_the_field() -> None:
    text = 'name = "x"\ncommand = "p"\nmin_nodes = 4\nmax_nodes = 2\n'
    with pytest.raises(JobFileError, match=r"job\.toml: min_nodes: must be <= max_nodes"):
        parse_job_file(text, "job.toml", T0)


def test_nodes_defaults_to_min_nodes_and_the_bounds_to_nodes() -> None:
    job = parse_job({"name": "x", "command": "p", "min_nodes": 2, "max_nodes": 8}, T0)
    assert (job.nodes, job.min_nodes, job.max_nodes) == (2, 2, 8)
    assert node_range(job).elastic
    assert (node_range(job).low, node_range(job).high, node_range(job).first) == (2, 8, 2)
    only_max = parse_job({"name": "x", "command": "p", "max_nodes": 4}, T0)
    assert (node_range(only_max).low, node_range(only_max).high) == (1, 4)
    fixed = parse_job({"name": "x", "command": "p", "nodes": 3}, T0)
    assert fixed.resize_interval_s == 300.0
    assert not node_range(fixed).elastic
    same = parse_job({"name": "x", "command": "p", "min_nodes": 3, "max_nodes": 3}, T0)
    assert same.nodes == 3
    assert not node_range(same).elastic


# --- the size it starts at -----------------------------------------------------------


def test_it_starts_with_the_most_nodes_that_fit_up_to_max() -> None:
    nodes = rack("a", 6)
    busy = RunningJob(JobRequest("busy", nodes=2), ("a-0", "a-1"))
    index = FleetIndex(nodes, [busy])
    placed = initial_size(elastic(min_nodes=2, max_nodes=8), index)
    assert placed is not None
    assert sorted(placed.nodes) == ["a-2", "a-3", "a-4", "a-5"]
    capped = initial_size(elastic(min_nodes=1, max_nodes=3), index)
    assert capped is not None
    assert len(capped.nodes) == 3


def test_it_waits_when_not_even_min_nodes_fit() -> None:
    index = FleetIndex(rack("a", 3), [RunningJob(JobRequest("busy", nodes=2), ("a-0", "a-1"))])
    assert initial_size(elastic(min_nodes=2, max_nodes=8), index) is None
    one = initial_size(elastic(min_nodes=1, max_nodes=8), index)
    assert one is not None
    assert one.nodes == ("a-2",)


def test_a_fixed_job_gets_exactly_its_nodes() -> None:
    index = FleetIndex(rack("a", 6))
    placed = initial_size(elastic(nodes=2), index)
    assert placed is not None
    assert len(placed.nodes) == 2
    assert initial_size(elastic(nodes=7), index) is None


def test_the_start_size_keeps_max_spread_and_exclusions() -> None:
    index = FleetIndex([*rack("a", 3), *rack("b", 4)])
    one_rack = initial_size(elastic(min_nodes=2, max_nodes=8, max_spread="rack"), index)
    assert one_rack is not None
    assert sorted(one_rack.nodes) == [f"b-{i}" for i in range(4)]
    avoid = initial_size(
        elastic(min_nodes=2, max_nodes=8, max_spread="rack"), index, exclude=("b-0", "b-1")
    )
    assert avoid is not None
    assert sorted(avoid.nodes) == ["a-0", "a-1", "a-2"]
    anywhere = initial_size(elastic(min_nodes=2, max_nodes=8), index)
    assert anywhere is not None
    assert len(anywhere.nodes) == 7


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[FleetNode], list[RunningJob]]:
    nodes = [
        node(
            f"n{i}",
            draw(st.sampled_from(["a", "b", "c"])),
            draw(st.sampled_from(["", "l1", "l2"])),
            grade=draw(st.sampled_from(["HEALTHY"] * 5 + ["FAILING"])),
            gpus=draw(st.sampled_from([4, 8])),
        )
        for i in range(draw(st.integers(2, 10)))
    ]
    handles = [n.handle for n in nodes]
    taken = draw(st.lists(st.sampled_from(handles), unique=True, max_size=len(handles)))
    running = [RunningJob(JobRequest(f"r{h}", nodes=1, gpus_per_node=4), (h,)) for h in taken]
    return nodes, running


@SETTINGS
@given(fleets(), st.integers(1, 6), st.integers(0, 6), st.sampled_from([0, 4, 8]))
def test_the_start_size_is_the_largest_that_place_finds(
    fleet: tuple[list[FleetNode], list[RunningJob]], low: int, extra: int, gpus: int
) -> None:
    nodes, running = fleet
    job = elastic(min_nodes=low, max_nodes=low + extra, nodes=low, gpus_per_node=gpus)
    index = FleetIndex(nodes, running)
    before = free(index)
    placed = initial_size(job, index)
    fits = [
        n
        for n in range(low, low + extra + 1)
        if FleetIndex(nodes, running).place(request_from_job(msgspec.structs.replace(job, nodes=n)))
    ]
    if not fits:
        assert placed is None
    else:
        assert placed is not None
        assert low <= len(placed.nodes) <= low + extra
        assert len(placed.nodes) == max(fits)
    assert free(index) == before


def test_largest_placement_of_an_empty_range_is_none() -> None:
    assert largest_placement(JobRequest("j"), FleetIndex(rack("a", 2)), 3, 2) is None


# --- growing ---------------------------------------------------------------------------


def grow_setup() -> tuple[Job, tuple[str, ...], FleetIndex]:
    """An elastic job on 2 of a 6-node rack, 4 nodes idle."""
    job = elastic(min_nodes=2, max_nodes=6, resize_interval_s=60)
    placement = ("a-0", "a-1")
    index = FleetIndex(rack("a", 6), [RunningJob(request_from_job(job), placement)])
    return job, placement, index


def test_it_grows_into_idle_nodes_once_the_interval_passed() -> None:
    job, placement, index = grow_setup()
    before = free(index)
    assert grow_decision(job, placement, index, T0 + 59.9, T0) is None
    grown = grow_decision(job, placement, index, T0 + 60, T0)
    assert grown is not None
    assert grown == Resize("e", "grow", placement, grown.to_nodes)
    assert sorted(grown.to_nodes) == [f"a-{i}" for i in range(6)]
    assert grown.attributes() == {
        "from": 2,
        "to": 6,
        "reason": "grow",
        "from_nodes": "a-0,a-1",
        "to_nodes": ",".join(grown.to_nodes),
    }
    assert free(index) == before, "the index holds what it held"


def test_it_grows_only_as_far_as_nodes_are_idle_and_max_allows() -> None:
    job, placement, index = grow_setup()
    index.commit(JobRequest("other", nodes=3), ("a-3", "a-4", "a-5"))
    grown = grow_decision(job, placement, index, T0 + 600, T0)
    assert grown is not None
    assert sorted(grown.to_nodes) == ["a-0", "a-1", "a-2"]
    small = msgspec.structs.replace(job, max_nodes=3)
    index.release(JobRequest("other", nodes=3), ("a-3", "a-4", "a-5"))
    capped = grow_decision(small, placement, index, T0 + 600, T0)
    assert capped is not None
    assert len(capped.to_nodes) == 3


def test_no_growth_without_idle_nodes_or_at_max() -> None:
    job, placement, index = grow_setup()
    index.commit(JobRequest("other", nodes=4), ("a-2", "a-3", "a-4", "a-5"))
    assert grow_decision(job, placement, index, T0 + 600, T0) is None
    full = ("a-0", "a-1", "a-2", "a-3", "a-4", "a-5")
    at_max = FleetIndex(rack("a", 8), [RunningJob(request_from_job(job), full)])
    assert grow_decision(job, full, at_max, T0 + 600, T0) is None


def test_no_growth_while_a_waiting_job_could_use_the_idle_nodes() -> None:
    job, placement, index = grow_setup()
    waiting = [JobRequest("small", nodes=2), JobRequest("e", nodes=2)]
    assert grow_decision(job, placement, index, T0 + 600, T0, waiting) is None
    too_big = [JobRequest("big", nodes=10)]
    assert grow_decision(job, placement, index, T0 + 600, T0, too_big) is not None


def test_growth_never_takes_nodes_reserved_for_a_blocked_job() -> None:
    job, placement, index = grow_setup()
    grown = grow_decision(job, placement, index, T0 + 600, T0, reserved=("a-4", "a-5", "a-0"))
    assert grown is not None
    assert sorted(grown.to_nodes) == ["a-0", "a-1", "a-2", "a-3"], "its own nodes stay usable"


def test_only_a_running_elastic_job_below_max_and_not_moving_may_grow() -> None:
    def started(job: Job, nodes: tuple[str, ...]) -> JobStatus:
        status = machine.placed(machine.submitted(job, T0).status, nodes, T0).status
        return msgspec.structs.replace(status, state="running", move=None)

    job = elastic(nodes=2, min_nodes=2, max_nodes=4)
    assert not may_grow(machine.submitted(job, T0).status)  # queued
    assert may_grow(started(job, ("a-0", "a-1")))
    assert not may_grow(started(job, ("a-0", "a-1", "a-2", "a-3")))  # at max_nodes
    assert not may_grow(started(elastic(nodes=2), ("a-0", "a-1")))  # a fixed job
    moving = machine.resize(started(job, ("a-0", "a-1")), T0, ("a-0", "a-1", "a-2"), "grow", {})
    assert not may_grow(moving.status)  # a resize under way


def test_a_fixed_job_never_grows() -> None:
    job = elastic(nodes=2)
    index = FleetIndex(rack("a", 6), [RunningJob(request_from_job(job), ("a-0", "a-1"))])
    assert grow_decision(job, ("a-0", "a-1"), index, T0 + 10**6, T0) is None


@SETTINGS
@given(fleets(), st.integers(1, 3), st.integers(1, 5), st.data())
def test_a_growth_stays_within_max_and_changes_no_index(
    fleet: tuple[list[FleetNode], list[RunningJob]], low: int, extra: int, data: st.DataObject
) -> None:
    nodes, running = fleet
    job = elastic(min_nodes=low, max_nodes=low + extra, nodes=low, resize_interval_s=0)
    placed = FleetIndex(nodes, running).place(request_from_job(job))
    if placed is None:
        return
    size = data.draw(st.integers(low, low + extra))
    start = largest_placement(request_from_job(job), FleetIndex(nodes, running), low, size)
    assert start is not None
    index = FleetIndex(nodes, [*running, RunningJob(request_from_job(job), start.nodes)])
    before = free(index)
    grown = grow_decision(job, start.nodes, index, T0, T0)
    assert free(index) == before
    if grown is not None:
        assert len(start.nodes) < len(grown.to_nodes) <= low + extra
        assert len(set(grown.to_nodes)) == len(grown.to_nodes)


# --- shrinking instead of a whole preemption ------------------------------------------


def preempt_setup(
    victim_nodes: int = 6, min_nodes: int = 2, need: int = 2
) -> tuple[JobRequest, Preemption, RunningJob, FleetIndex, Job]:
    """A full 6-node rack held by one preemptible elastic job; a higher-priority job of
    ``need`` nodes arrives."""
    job = elastic("victim", min_nodes=min_nodes, max_nodes=8, nodes=min_nodes, preemptible=True)
    nodes = rack("a", victim_nodes)
    victim = RunningJob(request_from_job(job), tuple(n.handle for n in nodes))
    req = JobRequest("urgent", nodes=need, priority=10)
    plan = plan_preemption(req, nodes, [victim])
    assert plan is not None
    assert plan.victims == ("victim",)
    return req, plan, victim, FleetIndex(nodes, [victim]), job


def test_a_victim_gives_up_only_the_nodes_the_preempting_job_needs() -> None:
    req, plan, victim, index, _ = preempt_setup(need=2)
    before = free(index)
    shrink = shrink_plan(req, plan, victim, 2, index)
    assert shrink is not None
    assert shrink.reason == "shrink"
    assert shrink.by == "urgent"
    assert len(shrink.released) == 2
    assert len(shrink.to_nodes) == 4
    assert [h for h in victim.placement if h in shrink.to_nodes] == list(shrink.to_nodes)
    assert shrink.attributes()["by"] == "urgent"
    assert free(index) == before
    after = FleetIndex(index.nodes.values(), [RunningJob(victim.request, shrink.to_nodes)])
    assert after.place(req) is not None, "the preempting job fits beside the shrunk victim"


def test_a_victim_is_never_shrunk_below_min_nodes() -> None:
    req, plan, victim, index, _ = preempt_setup(need=4, min_nodes=2)
    at_min = shrink_plan(req, plan, victim, 2, index)
    assert at_min is not None
    assert len(at_min.to_nodes) == 2
    req, plan, victim, index, _ = preempt_setup(need=5, min_nodes=2)
    assert shrink_plan(req, plan, victim, 2, index) is None, "preempted whole"


def test_a_fixed_victim_is_preempted_whole() -> None:
    req, plan, victim, index, job = preempt_setup(need=1)
    fixed = msgspec.structs.replace(job, min_nodes=None, max_nodes=None, nodes=6)
    assert shrink_plan(req, plan, victim, 6, index) is None
    assert shrink_victims(req, plan, [victim], {"victim": fixed}, index) == {}


def test_shrinking_empties_the_leaves_where_it_has_the_fewest_nodes() -> None:
    """The victim has 1 node on leaf l0 and 3 on l1 of the plan's rack, and the plan's
    member goes elsewhere: the l0 node is released first, the rest stays on one leaf."""
    nodes = [
        node("x-0", "a", "l0"),
        node("x-1", "a", "l1"),
        node("x-2", "a", "l1"),
        node("x-3", "a", "l1"),
        node("y-0", "a", "l2"),
    ]
    planned = Placement("urgent", ("y-0",), "rack", ("r1", "z1", "c1", "a"))
    order = release_order(("x-1", "x-2", "x-0", "x-3", "gone"), planned, FleetIndex(nodes))
    assert order == ("x-0", "x-1", "x-2", "x-3", "gone")


def test_shrinking_gives_up_a_lone_node_and_keeps_whole_leaves() -> None:
    """The victim holds leaf l0 (1 node) and l1, l2 (2 nodes each) of one rack; the
    preempting job needs 1 node there: the victim gives up its lone l0 node."""
    nodes = [
        node("a-0", "a", "l0"),
        *(node(f"a-{i}", "a", f"l{(i + 1) // 2}") for i in range(1, 5)),
    ]
    job = elastic("victim", min_nodes=2, max_nodes=8, nodes=2, preemptible=True)
    victim = RunningJob(request_from_job(job), ("a-1", "a-2", "a-3", "a-4", "a-0"))
    req = JobRequest("urgent", nodes=1, priority=10, max_spread="rack")
    plan = plan_preemption(req, nodes, [victim])
    assert plan is not None
    shrink = shrink_plan(req, plan, victim, 2, FleetIndex(nodes, [victim]))
    assert shrink is not None
    assert shrink.released == ("a-0",)
    assert shrink.to_nodes == ("a-1", "a-2", "a-3", "a-4")


def test_victims_shrink_in_turn_and_still_make_room() -> None:
    """Two elastic victims of 3 nodes fill a 6-node rack and a 4-node job needs both: the
    first gives up 1 node (down to its minimum of 2), so the second, which could give up
    only 2 of its 3, is preempted whole; the preempting job fits beside the first."""
    nodes = rack("a", 6)
    first = elastic("v1", min_nodes=2, max_nodes=3, nodes=2, preemptible=True)
    second = elastic("v2", min_nodes=1, max_nodes=3, nodes=1, preemptible=True)
    running = [
        RunningJob(request_from_job(first), ("a-0", "a-1", "a-2")),
        RunningJob(request_from_job(second), ("a-3", "a-4", "a-5")),
    ]
    req = JobRequest("urgent", nodes=4, priority=10)
    plan = plan_preemption(req, nodes, running)
    assert plan is not None
    assert plan.victims == ("v1", "v2")
    index = FleetIndex(nodes, running)
    plans = shrink_victims(req, plan, running, {"v1": first, "v2": second}, index)
    assert list(plans) == ["v1"]
    assert len(plans["v1"].to_nodes) == 2
    assert len(plans["v1"].released) == 1
    after = FleetIndex(nodes, [RunningJob(running[0].request, plans["v1"].to_nodes)])
    assert after.place(req) is not None


@SETTINGS
@given(fleets(), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3))
def test_a_shrink_keeps_min_nodes_and_makes_room(
    fleet: tuple[list[FleetNode], list[RunningJob]], low: int, size: int, need: int
) -> None:
    nodes, running = fleet
    job = elastic("victim", min_nodes=low, max_nodes=low + size, nodes=low, preemptible=True)
    start = largest_placement(request_from_job(job), FleetIndex(nodes, running), low, low + size)
    if start is None:
        return
    victim = RunningJob(request_from_job(job), start.nodes)
    everyone = [*running, victim]
    req = JobRequest("urgent", nodes=need, gpus_per_node=8, priority=10)
    plan = plan_preemption(req, nodes, everyone)
    if plan is None or "victim" not in plan.victims:
        return
    index = FleetIndex(nodes, everyone)
    before = free(index)
    others = [r for r in everyone if r.request.job_id in plan.victims and r is not victim]
    shrink = shrink_plan(req, plan, victim, low, index, others)
    assert free(index) == before
    if shrink is None:
        return
    assert low <= len(shrink.to_nodes) < len(victim.placement)
    assert set(shrink.to_nodes) < set(victim.placement)
    on_victim = set(plan.placement.nodes) & set(victim.placement)
    assert len(shrink.released) <= len(on_victim), "no more than the plan's own nodes"
    left = [r for r in everyone if r.request.job_id not in plan.victims]
    after = FleetIndex(nodes, [*left, RunningJob(victim.request, shrink.to_nodes)])
    assert after.place(req) is not None
