"""Scheduler properties against an independent brute-force oracle on small fleets.

Fleets carry warm datasets and requests name one now and then, so every property below
holds with the dataset tie-breaker at work; the last ones check that tie-breaker itself:
it never changes the level (nor the best fit) and, of equal groups, the warm one wins."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalguard.controller.jobs.scheduler import (
    LEVELS,
    FleetNode,
    JobRequest,
    Level,
    Placement,
    RunningJob,
    place,
    plan_preemption,
    schedule_queue,
)

DATASETS = ("ds", "other")
"""The datasets warm here and there in the generated fleets."""
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fleets(draw: st.DrawFn, max_nodes: int = 8, one_rack: bool = False) -> list[FleetNode]:
    """Small fleets; ``one_rack``: every node in rack r1/z1/c1/a, on leaf l1 or l2."""
    count = draw(st.integers(3, max_nodes))
    nodes = []
    for i in range(count):
        nodes.append(
            FleetNode(
                handle=f"n{i}",
                region=draw(st.sampled_from(["r1", "r1", "r1", "r2"])),
                cluster=draw(st.sampled_from(["c1", "c1", "c2"])),
                zone=draw(st.sampled_from(["z1", "z1", "z2"])),
                rack=draw(st.sampled_from(["a", "a", "b", ""])),
                leaf=draw(st.sampled_from(["l1", "l2"] if one_rack else ["", "l1", "l2"])),
                gpus=draw(st.sampled_from([4, 8, 8])),
                gpu_type=draw(st.sampled_from(["h100", "h100", "h100", "a100"])),
                cpu_cores=draw(st.sampled_from([8, 16])),
                memory_gb=draw(st.sampled_from([64, 128])),
                bandwidth_tier=draw(st.sampled_from([1, 2, 2])),
                grade=draw(
                    st.sampled_from(["HEALTHY"] * 8 + ["SUB_HEALTHY", "FAILING", "MAINTENANCE"])
                ),
                cordoned=draw(st.sampled_from([False] * 7 + [True])),
                warm_datasets=frozenset(draw(st.sets(st.sampled_from(DATASETS)))),
                dma_posture=draw(st.sampled_from(["isolated"] * 4 + ["shared", "off", ""])),
            )
        )
    if one_rack:
        nodes = [
            msgspec.structs.replace(n, region="r1", zone="z1", cluster="c1", rack="a")
            for n in nodes
        ]
    return nodes


@st.composite
def requests(draw: st.DrawFn, job_id: str = "new", max_nodes: int = 4) -> JobRequest:
    whole = draw(st.sampled_from([False, False, True]))
    return JobRequest(
        job_id=job_id,
        nodes=draw(st.sampled_from([1, 1, 2, 2, 3, 4][: max_nodes + 2])),
        tenant=draw(st.sampled_from(["t1", "t2", "t3"])),
        gpus_per_node=0 if whole else draw(st.sampled_from([0, 2, 4, 8])),
        gpu_type=draw(st.sampled_from(["", "", "", "h100", "a100"])),
        cpu=0 if whole else draw(st.sampled_from([1, 4, 8])),
        memory_gb=0 if whole else draw(st.sampled_from([0, 32, 64])),
        bandwidth_tier=draw(st.sampled_from([0, 0, 0, 1, 2])),
        max_spread=draw(st.sampled_from(LEVELS)),
        allowed_regions=draw(st.sampled_from([(), (), (), ("r1",), ("r2",)])),
        priority=draw(st.integers(0, 5)),
        preemptible=draw(st.booleans()),
        sensitive=draw(st.sampled_from([False, False, False, True])),
        exclude=frozenset(draw(st.lists(st.sampled_from([f"n{i}" for i in range(8)]), max_size=1))),
        dataset=draw(st.sampled_from(["", "", *DATASETS, "cold"])),
    )


@st.composite
def situations(
    draw: st.DrawFn,
    max_nodes: int = 8,
    max_jobs: int = 4,
    preemption: bool = False,
    one_rack: bool = False,
) -> tuple[list[FleetNode], list[RunningJob], JobRequest]:
    """A fleet, jobs holding some of its nodes, and a new request.

    With ``preemption`` the running jobs are mostly low-priority and preemptible and the
    request outranks them, so that victim sets are worth searching.
    """
    nodes = draw(fleets(max_nodes, one_rack))
    running: list[RunningJob] = []
    for j in range(draw(st.integers(1 if preemption else 0, max_jobs))):
        req = draw(requests(f"run{j}", max_nodes=3))
        holders = draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=3, unique=True))
        changes: dict[str, object] = {"nodes": len(holders)}
        if preemption:
            changes["priority"] = draw(st.integers(0, 3))
            changes["preemptible"] = draw(st.sampled_from([True, True, True, False]))
        running.append(RunningJob(replace(req, **changes), tuple(n.handle for n in holders)))  # type: ignore[arg-type]
    req = draw(requests())
    if preemption:
        spread = draw(st.sampled_from(LEVELS[1:]))
        req = replace(
            req,
            priority=draw(st.integers(2, 5)),
            gpu_type="",
            allowed_regions=(),
            max_spread=spread,
        )
    return nodes, running, req


# --- the oracle: written from the rules, not from the implementation ----------------


def _leaf(node: FleetNode) -> tuple[str, ...]:
    return (node.region, node.zone, node.cluster, node.rack or node.handle, node.leaf)


def _group(node: FleetNode, level: Level) -> tuple[str, ...]:
    keys = {
        "rack": (node.region, node.zone, node.cluster, node.rack or node.handle),
        "cluster": (node.region, node.zone, node.cluster),
        "zone": (node.region, node.zone),
        "region": (node.region,),
    }
    return keys[level]


def _span(chosen: Sequence[FleetNode]) -> int:
    for i, level in enumerate(LEVELS):
        if len({_group(n, level) for n in chosen}) == 1:
            return i
    return len(LEVELS)


def _exclusive(req: JobRequest) -> bool:
    return req.gpus_per_node == 0 and req.cpu == 0 and req.memory_gb == 0


def _member_ok(node: FleetNode, req: JobRequest, running: Sequence[RunningJob]) -> bool:
    if node.grade != "HEALTHY" or node.cordoned or node.handle in req.exclude:
        return False
    if req.allowed_regions and node.region not in req.allowed_regions:
        return False
    if req.gpu_type and node.gpu_type != req.gpu_type:
        return False
    if req.sensitive and node.dma_posture != "isolated":
        return False  # docs/security.md "DMA isolation"
    if node.bandwidth_tier < req.bandwidth_tier:
        return False
    here = [j.request for j in running if node.handle in j.placement]
    if _exclusive(req):
        return not here
    if any(_exclusive(r) for r in here):
        return False
    gpus = sum(r.gpus_per_node for r in here) + req.gpus_per_node
    cpu = sum(r.cpu for r in here) + req.cpu
    mem = sum(r.memory_gb for r in here) + req.memory_gb
    return gpus <= node.gpus and cpu <= node.cpu_cores and mem <= node.memory_gb


def _tenants_ok(
    chosen: Sequence[FleetNode],
    req: JobRequest,
    nodes: Sequence[FleetNode],
    running: Sequence[RunningJob],
) -> bool:
    by_handle = {n.handle: n for n in nodes}
    for leaf in {_leaf(n) for n in chosen}:
        for job in running:
            if not any(_leaf(by_handle[h]) == leaf for h in job.placement):
                continue
            other = job.request.tenant != req.tenant
            if other and (req.sensitive or job.request.sensitive):
                return False
    return True


def _feasible(
    chosen: Sequence[FleetNode],
    req: JobRequest,
    nodes: Sequence[FleetNode],
    running: Sequence[RunningJob],
) -> bool:
    return (
        len(chosen) == req.nodes
        and len({n.handle for n in chosen}) == req.nodes
        and all(_member_ok(n, req, running) for n in chosen)
        and _tenants_ok(chosen, req, nodes, running)
        and _span(chosen) <= LEVELS.index(req.max_spread)
    )


def _tightest(
    req: JobRequest, nodes: Sequence[FleetNode], running: Sequence[RunningJob]
) -> int | None:
    """The tightest level index over every feasible gang (None: no gang fits)."""
    spans = [
        _span(combo)
        for combo in itertools.combinations(nodes, req.nodes)
        if _feasible(combo, req, nodes, running)
    ]
    return min(spans) if spans else None


def _check(
    placed: Placement, req: JobRequest, nodes: Sequence[FleetNode], running: Sequence[RunningJob]
) -> None:
    by_handle = {n.handle: n for n in nodes}
    chosen = [by_handle[h] for h in placed.nodes]
    assert len(placed.nodes) == req.nodes, "partial gang"
    assert all(n.grade == "HEALTHY" and not n.cordoned for n in chosen), "non-HEALTHY node"
    assert all(_member_ok(n, req, running) for n in chosen), "over capacity or wrong kind"
    assert _tenants_ok(chosen, req, nodes, running), "anti-affinity broken"
    assert _span(chosen) == LEVELS.index(placed.level)
    assert all(_group(n, placed.level) == placed.group for n in chosen)


# --- properties -------------------------------------------------------------------


@SETTINGS
@given(situations())
def test_placement_is_valid_and_tightest(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest],
) -> None:
    nodes, running, req = case
    placed = place(req, nodes, running)
    best = _tightest(req, nodes, running)
    if best is None:
        assert placed is None
        return
    assert placed is not None, "a gang fits but none was placed"
    _check(placed, req, nodes, running)
    assert LEVELS.index(placed.level) == best, "not the tightest level that fits"


@SETTINGS
@given(situations(one_rack=True))
def test_sensitive_tenants_never_share_a_leaf(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest],
) -> None:
    """Crowded single-rack fleets: the case where the leaf rule decides most often."""
    nodes, running, req = case
    placed = place(req, nodes, running)
    if _tightest(req, nodes, running) is None:
        assert placed is None
    else:
        assert placed is not None
        _check(placed, req, nodes, running)


@SETTINGS
@given(situations(), situations(max_nodes=7, max_jobs=4, preemption=True))
def test_a_sensitive_job_never_lands_on_a_node_whose_dma_isolation_is_not_isolated(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest],
    crowded: tuple[list[FleetNode], list[RunningJob], JobRequest],
) -> None:
    """docs/security.md "DMA isolation": placement, preemption and the queue put a
    sensitive job only on ``isolated`` nodes (never ``shared``, ``off``, ``unknown`` or
    unreported); one that is not sensitive may go anywhere the other rules allow."""
    for nodes, running, req in (case, crowded):
        by_handle = {n.handle: n for n in nodes}
        secret = replace(req, sensitive=True)
        placed = place(secret, nodes, running)
        if placed is not None:
            assert {by_handle[h].dma_posture for h in placed.nodes} == {"isolated"}
        plan = plan_preemption(secret, nodes, running)
        if plan is not None:
            assert {by_handle[h].dma_posture for h in plan.placement.nodes} == {"isolated"}
        for decision in schedule_queue([secret], nodes, running).placements:
            assert {by_handle[h].dma_posture for h in decision.nodes} == {"isolated"}
        if all(n.dma_posture != "isolated" for n in nodes):
            assert placed is None


@SETTINGS
@given(situations(max_nodes=7, max_jobs=4, preemption=True))
def test_preemption_victims_are_minimal(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest],
) -> None:
    nodes, running, req = case
    plan = plan_preemption(req, nodes, running)
    if _tightest(req, nodes, running) is not None:
        assert plan is None, "preempted although the job fits"
        return
    candidates = [j for j in running if j.request.preemptible and j.request.priority < req.priority]
    fewest = None
    for k in range(1, len(candidates) + 1):
        for combo in itertools.combinations(candidates, k):
            gone = {j.request.job_id for j in combo}
            if (
                _tightest(req, nodes, [j for j in running if j.request.job_id not in gone])
                is not None
            ):
                fewest = k
                break
        if fewest is not None:
            break
    if fewest is None:
        assert plan is None
        return
    assert plan is not None, "preemption would help but none was planned"
    assert len(plan.victims) == fewest, "not the fewest victims"
    by_id = {j.request.job_id: j for j in running}
    assert all(
        by_id[v].request.preemptible and by_id[v].request.priority < req.priority
        for v in plan.victims
    )
    rest = [j for j in running if j.request.job_id not in plan.victims]
    _check(plan.placement, req, nodes, rest)


@SETTINGS
@given(situations(max_nodes=7, max_jobs=4, preemption=True))
def test_greedy_preemption_is_valid_and_keeps_no_needless_victim(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest],
) -> None:
    """The big-fleet fallback (budget exhausted at once): not minimal, but every victim
    is needed and the placement is valid."""
    nodes, running, req = case
    plan = plan_preemption(req, nodes, running, budget=0)
    exact = plan_preemption(req, nodes, running)
    assert (plan is None) == (exact is None)
    if plan is None:
        return
    rest = [j for j in running if j.request.job_id not in plan.victims]
    _check(plan.placement, req, nodes, rest)
    for spared in plan.victims:
        others = [
            j for j in running if j.request.job_id not in plan.victims or j.request.job_id == spared
        ]
        assert _tightest(req, nodes, others) is None, f"{spared} did not need to go"


@SETTINGS
@given(
    situations(max_nodes=7, max_jobs=3, preemption=True),
    st.lists(requests(max_nodes=3), min_size=1, max_size=4),
)
def test_queue_pass_keeps_every_invariant(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest], reqs: list[JobRequest]
) -> None:
    nodes, running, first = case
    queue = [replace(r, job_id=f"q{i}") for i, r in enumerate([first, *reqs])]
    result = schedule_queue(queue, nodes, running)
    decided = [p.job_id for p in result.placements] + [p.job_id for p in result.preemptions]
    decided += [b.job_id for b in result.blocked]
    assert sorted(decided) == sorted(r.job_id for r in queue), "a job was lost or decided twice"
    victims = [v for p in result.preemptions for v in p.victims]
    assert len(victims) == len(set(victims)), "a job preempted twice"
    by_id = {r.job_id: r for r in queue}
    running_ids = {j.request.job_id: j for j in running}
    for plan in result.preemptions:
        for v in plan.victims:
            victim = running_ids[v].request
            assert victim.preemptible
            assert victim.priority < by_id[plan.job_id].priority
    # the state once the victims stop and every decision is carried out
    after = [j for j in running if j.request.job_id not in victims]
    decisions = [*result.placements, *(p.placement for p in result.preemptions)]
    for placed in decisions:
        _check(
            placed,
            by_id[placed.job_id],
            nodes,
            [j for j in after if j.request.job_id != placed.job_id],
        )
        after.append(RunningJob(by_id[placed.job_id], placed.nodes))
    order = {r.job_id: (-r.priority, r.submitted_ts, r.job_id) for r in queue}
    for placed in result.placements:
        ahead = {
            h for b in result.blocked if order[b.job_id] < order[placed.job_id] for h in b.reserved
        }
        assert not set(placed.nodes) & ahead, "backfill took a node reserved for a job ahead of it"


def test_greedy_preemption_spares_the_last_victim_of_its_group_when_not_needed() -> None:
    """Found by the property above: the greedy plan picked run0 and run1 for a rack-level
    fit and never tried to spare run1, the last of its group's prefix, although the job
    fits at region level with run0 alone."""

    def node(handle: str, *, zone: str = "z1", cluster: str = "c1", leaf: str = "") -> FleetNode:
        return FleetNode(
            handle=handle, region="r1", cluster=cluster, zone=zone, rack="a", leaf=leaf,
            gpus=4, gpu_type="h100", cpu_cores=8, memory_gb=64, bandwidth_tier=1,
            dma_posture="isolated",
        )  # fmt: skip

    def job(job_id: str, placement: tuple[str, ...]) -> RunningJob:
        request = JobRequest(
            job_id=job_id, nodes=len(placement), tenant="t1", cpu=1, max_spread="rack",
            priority=0, preemptible=True,
        )  # fmt: skip
        return RunningJob(request=request, placement=placement)

    nodes = [
        node("n0"), node("n1", zone="z2"), node("n2"), node("n3", cluster="c2"), node("n4"),
        node("n5", leaf="l1"),
    ]  # fmt: skip
    running = [job("run0", ("n0", "n1")), job("run1", ("n0", "n2", "n3")), job("run2", ("n3",))]
    req = JobRequest(job_id="new", nodes=2, tenant="t2", cpu=1, priority=2, sensitive=True)
    plan = plan_preemption(req, nodes, running, budget=0)
    assert plan is not None
    assert plan.victims == ("run0",)


# --- the dataset tie-breaker ----------------------------------------------------------


def _cold(nodes: Sequence[FleetNode]) -> list[FleetNode]:
    return [msgspec.structs.replace(n, warm_datasets=frozenset()) for n in nodes]


def _eligible(
    req: JobRequest, nodes: Sequence[FleetNode], running: Sequence[RunningJob]
) -> list[FleetNode]:
    """The nodes one member of ``req`` may go on (the oracle's rules, node by node)."""
    return [
        n for n in nodes if _member_ok(n, req, running) and _tenants_ok([n], req, nodes, running)
    ]


@SETTINGS
@given(situations())
def test_warm_datasets_never_change_the_level_nor_the_best_fit(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest],
) -> None:
    """The same job on the same fleet with and without warm sets: the same level, a group
    as good (as many eligible nodes), a valid placement; without a dataset, or with every
    node cold, exactly the placement of before."""
    nodes, running, req = case
    cold_nodes = _cold(nodes)
    before = place(req, cold_nodes, running)
    assert place(replace(req, dataset=""), nodes, running) == place(
        replace(req, dataset=""), cold_nodes, running
    ), "a job without a dataset does not see warmth"
    assert before == place(replace(req, dataset=""), cold_nodes, running)
    after = place(req, nodes, running)
    if before is None:
        assert after is None
        return
    assert after is not None
    _check(after, req, nodes, running)
    assert after.level == before.level, "warmth changed the level"
    ok = _eligible(req, nodes, running)
    size = {g: sum(_group(n, after.level) == g for n in ok) for g in (before.group, after.group)}
    assert size[after.group] == size[before.group], "warmth beat the best fit"
    if not req.dataset:
        assert after == before
        return
    # the tie-breaker itself: no equally good group has more warm eligible nodes ...
    warm = [n for n in ok if req.dataset in n.warm_datasets]
    groups = {_group(n, after.level) for n in ok}
    tied = [g for g in groups if sum(_group(n, after.level) == g for n in ok) == size[after.group]]
    count = {g: sum(_group(n, after.level) == g for n in warm) for g in tied}
    fits = [g for g in tied if sum(_group(n, after.level) == g for n in ok) >= req.nodes]
    assert count[after.group] == max(count[g] for g in fits)
    # ... and inside the group warm nodes come first
    here = {n.handle for n in warm if _group(n, after.level) == after.group}
    assert len(here & set(after.nodes)) == min(req.nodes, len(here))


@st.composite
def equal_racks(
    draw: st.DrawFn,
) -> tuple[list[FleetNode], list[RunningJob], JobRequest, str, set[str]]:
    """Identical racks of one cluster (the same job on the first node of each, or none),
    a gang that fits one rack, and one rack (any: its name sorts anywhere) with a few
    nodes where the gang's dataset is warm; returns the warm nodes it may use."""
    racks = draw(st.integers(2, 4))
    per_rack = draw(st.integers(2, 4))
    busy = draw(st.booleans())
    gpus = draw(st.sampled_from([0, 2, 4, 8]))
    warm_rack = draw(st.integers(0, racks - 1))
    warm_slots = draw(st.sets(st.integers(0, per_rack - 1), min_size=1))
    nodes, running = [], []
    for r in range(racks):
        for i in range(per_rack):
            warm = frozenset({"ds"} if r == warm_rack and i in warm_slots else ())
            node = FleetNode(
                handle=f"r1.c1.k{r}n{i}", region="r1", cluster="c1", zone="z1", rack=f"k{r}",
                gpus=8, gpu_type="h100", cpu_cores=16, memory_gb=128, warm_datasets=warm,
            )  # fmt: skip
            nodes.append(node)
        if busy:
            held = JobRequest(job_id=f"run{r}", gpus_per_node=4, cpu=1)
            running.append(RunningJob(held, (f"r1.c1.k{r}n0",)))
    first_usable = busy and (gpus == 0 or gpus > 4)  # whole nodes, or more than is left
    usable = per_rack - first_usable
    gang = JobRequest(
        job_id="new", nodes=draw(st.integers(1, usable)), gpus_per_node=gpus,
        cpu=1 if gpus else 0, dataset="ds", max_spread=draw(st.sampled_from(LEVELS)),
    )  # fmt: skip
    skip = f"r1.c1.k{warm_rack}n0" if first_usable else ""
    warm_usable = {n.handle for n in nodes if n.warm_datasets and n.handle != skip}
    return nodes, running, gang, f"k{warm_rack}", warm_usable


@SETTINGS
@given(equal_racks())
def test_of_equal_groups_the_warm_one_wins_and_its_warm_nodes_first(
    case: tuple[list[FleetNode], list[RunningJob], JobRequest, str, set[str]],
) -> None:
    nodes, running, req, warm_rack, warm = case
    placed = place(req, nodes, running)
    assert placed is not None
    _check(placed, req, nodes, running)
    assert placed.level == "rack"
    if warm:
        assert placed.group == ("r1", "z1", "c1", warm_rack)
    assert len(set(placed.nodes) & warm) == min(req.nodes, len(warm))
    cold = place(req, _cold(nodes), running)
    assert cold is not None
    assert cold.group == ("r1", "z1", "c1", "k0"), "without warmth: by name, as before"


def test_warmth_never_picks_an_unhealthy_node_nor_a_worse_fit() -> None:
    """The warm nodes are FAILING, cordoned, or in a rack that fits worse: ignored."""

    def node(handle: str, rack: str, **kw: object) -> FleetNode:
        return FleetNode(
            handle=handle, region="r1", cluster="c1", zone="z1", rack=rack, gpus=8,
            gpu_type="h100", cpu_cores=16, memory_gb=128, **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    warm = frozenset({"ds"})
    nodes = [
        node("a1", "a"), node("a2", "a"),
        node("b1", "b", warm_datasets=warm, grade="FAILING"),
        node("b2", "b", warm_datasets=warm, cordoned=True), node("b3", "b"), node("b4", "b"),
        node("c1", "c", warm_datasets=warm), node("c2", "c", warm_datasets=warm),
        node("c3", "c", warm_datasets=warm),
    ]  # fmt: skip
    req = JobRequest(job_id="j", nodes=2, gpus_per_node=8, dataset="ds")
    placed = place(req, nodes)
    assert placed is not None
    # a has 2 eligible nodes, b 2 (b1, b2 out), c 3: a and b fit best; b's warm nodes
    # do not count, so the tie stays with a (by name), never the warmer but bigger c
    assert (placed.level, placed.nodes) == ("rack", ("a1", "a2"))
    assert place(replace(req, nodes=3), nodes) == Placement(
        "j", ("c1", "c2", "c3"), "rack", ("r1", "z1", "c1", "c")
    )
