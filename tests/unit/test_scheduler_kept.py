"""Kept indexes (docs/scheduler.md "Kept indexes"): an index changed step by step
(``update_node``, ``commit``, ``release``) places exactly as one built from the final
nodes and jobs; ``schedule_on`` on it decides as ``schedule_queue`` on those inputs and
leaves it holding what it placed; the early exits (the fit bound, the remembered
failures, the shape map, the preemption trials) agree with the slow path and with a
node-by-node oracle."""

from __future__ import annotations

import random
from dataclasses import replace

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalguard.controller.jobs.scheduler import (
    LEVELS,
    FleetIndex,
    FleetNode,
    JobRequest,
    Placement,
    RunningJob,
    _first_prefix,
    _groups_of,
    _least_prefix,
    _Without,
    schedule_on,
    schedule_queue,
)

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEEDS = st.integers(0, 2**32 - 1)
"""Each example is a seed: the fleets, jobs and steps come from ``random.Random(seed)``
(hypothesis's own draws cost more than the scheduler here)."""
GRADES = ["HEALTHY"] * 5 + ["SUB_HEALTHY", "FAILING", "MAINTENANCE"]
DATASETS = ("ds", "other")


def fleet(rng: random.Random) -> list[FleetNode]:
    """3-8 nodes in two regions, two clusters, racks a/b (or none), leaves l1/l2/""."""
    return [
        FleetNode(
            handle=f"n{i}",
            region=rng.choice(["r1", "r1", "r1", "r2"]),
            cluster=rng.choice(["c1", "c1", "c2"]),
            zone="z1",
            rack=rng.choice(["a", "a", "b", ""]),
            leaf=rng.choice(["", "l1", "l2"]),
            gpus=rng.choice([4, 8]),
            gpu_type=rng.choice(["h100", "h100", "a100"]),
            cpu_cores=16,
            memory_gb=128,
            bandwidth_tier=rng.choice([1, 2]),
            grade=rng.choice(GRADES),
            cordoned=rng.random() < 0.15,
            warm_datasets=_warm(rng),
            dma_posture=rng.choice(["isolated", "isolated", "isolated", "shared", "off", ""]),
        )
        for i in range(rng.randint(3, 8))
    ]


def _warm(rng: random.Random) -> frozenset[str]:
    return frozenset(d for d in DATASETS if rng.random() < 0.4)


def changed(rng: random.Random, node: FleetNode) -> FleetNode:
    """The same node (handle, leaf) with another grade, cordon, warm set and now and then
    another capacity."""
    return msgspec.structs.replace(
        node,
        grade=rng.choice(GRADES),
        cordoned=rng.random() < 0.3,
        warm_datasets=_warm(rng),
        gpus=rng.choice([node.gpus] * 4 + [4, 8]),
    )


def request(rng: random.Random, job_id: str = "new") -> JobRequest:
    whole = rng.random() < 0.3
    return JobRequest(
        job_id=job_id,
        nodes=rng.choice([1, 1, 2, 2, 3, 4]),
        tenant=rng.choice(["t1", "t2", "t3"]),
        gpus_per_node=0 if whole else rng.choice([0, 2, 4, 8]),
        gpu_type=rng.choice(["", "", "h100", "a100"]),
        cpu=0 if whole else rng.choice([1, 4, 8]),
        memory_gb=0 if whole else rng.choice([0, 32, 64]),
        bandwidth_tier=rng.choice([0, 0, 1, 2]),
        max_spread=rng.choice(LEVELS),
        allowed_regions=rng.choice([(), (), (), ("r1",), ("r2",)]),
        priority=rng.randint(0, 5),
        preemptible=rng.random() < 0.7,
        sensitive=rng.random() < 0.2,
        exclude=frozenset([f"n{rng.randrange(8)}"] if rng.random() < 0.3 else []),
        dataset=rng.choice(["", "", *DATASETS]),
    )


def requests(
    rng: random.Random, count: int, kinds: list[JobRequest] | None = None
) -> list[JobRequest]:
    """``count`` requests; with ``kinds``, variants of those (another size, spread,
    exclusion, priority, dataset, now and then tenant) so that the memos meet the same
    kind again, and kinds that differ only in their tenant."""
    if kinds is None:
        return [request(rng) for _ in range(count)]
    out = []
    for _ in range(count):
        kind = rng.choice(kinds)
        out.append(
            replace(
                kind,
                nodes=rng.choice([1, 2, 3, 4]),
                max_spread=rng.choice(LEVELS),
                exclude=frozenset(f"n{rng.randrange(8)}" for _ in range(rng.choice([0, 0, 1, 2]))),
                priority=rng.randint(0, 5),
                dataset=rng.choice(["", *DATASETS]),
                tenant=rng.choice(["t1", "t2"]) if rng.random() < 0.3 else kind.tenant,
            )
        )
    return out


def jobs_on(rng: random.Random, nodes: list[FleetNode], prefix: str) -> list[RunningJob]:
    """Jobs holding some of ``nodes`` (anywhere: over capacity too, the index just adds up),
    mostly preemptible and of low priority so that queue passes preempt."""
    handles = [n.handle for n in nodes]
    out = []
    for j in range(rng.randint(0, 4)):
        held = rng.sample(handles, rng.randint(1, min(3, len(handles))))
        req = replace(request(rng, f"{prefix}{j}"), nodes=len(held), priority=rng.randint(0, 2))
        out.append(RunningJob(req, tuple(held)))
    return out


def _view(index: FleetIndex, req: JobRequest) -> list[object]:
    """``eligible`` as plain values (pool order inside a leaf does not matter)."""
    return [
        (leaf.key, count, sorted((shape, tuple(handles)) for shape, handles in pools))
        for leaf, count, pools in index.eligible(req)
    ]


def _same(kept: FleetIndex, rebuilt: FleetIndex, probes: list[JobRequest]) -> None:
    """``kept`` answers every probe (its memo at work) as ``rebuilt`` does, and as its own
    slow path; the group sizes and free capacities agree."""
    groups = sorted(
        {
            (depth, n.group_key(level))
            for n in rebuilt.nodes.values()
            for depth, level in enumerate(LEVELS)
        }
    )
    for within in groups:
        assert kept.group_size(*within) == rebuilt.group_size(*within)
    for handle in rebuilt.nodes:
        assert kept.free(handle) == rebuilt.free(handle)
    for i, probe in enumerate(probes):
        assert kept.place(probe) == rebuilt.place(probe), probe
        assert kept.place(probe) == kept._place(probe, None), "an early exit changed a result"
        assert _view(kept, probe) == _view(rebuilt, probe)
        for within in groups[i::3]:
            assert kept.place(probe, within) == rebuilt.place(probe, within)


def _oracle(
    nodes: dict[str, FleetNode], held: list[RunningJob], req: JobRequest
) -> list[tuple[tuple[str, ...], frozenset[str]]]:
    """Per leaf (in key order), the nodes one member of ``req`` may go on, node by node
    from the rules (docs/scheduler.md "Placement")."""
    on: dict[str, list[JobRequest]] = {h: [] for h in nodes}
    for job in held:
        for h in job.placement:
            on[h].append(job.request)
    leaf_jobs: dict[tuple[str, ...], list[JobRequest]] = {}
    for h, reqs in on.items():
        leaf_jobs.setdefault(nodes[h].leaf_key, []).extend(reqs)
    out: dict[tuple[str, ...], set[str]] = {}
    for h, node in nodes.items():
        here = on[h]
        others = [r for r in leaf_jobs.get(node.leaf_key, []) if r.tenant != req.tenant]
        ok = (
            node.schedulable
            and h not in req.exclude
            and (not req.allowed_regions or node.region in req.allowed_regions)
            and (not req.gpu_type or node.gpu_type == req.gpu_type)
            and node.bandwidth_tier >= req.bandwidth_tier
            and not (req.sensitive and others)
            and not any(r.sensitive for r in others)
            and (not req.sensitive or node.dma_posture == "isolated")
        )
        if ok and req.exclusive:
            ok = not here
        elif ok:
            ok = (
                not any(r.exclusive for r in here)
                and sum(r.gpus_per_node for r in here) + req.gpus_per_node <= node.gpus
                and sum(r.cpu for r in here) + req.cpu <= node.cpu_cores
                and sum(r.memory_gb for r in here) + req.memory_gb <= node.memory_gb
            )
        if ok:
            out.setdefault(node.leaf_key, set()).add(h)
    return [(key, frozenset(out[key])) for key in sorted(out)]


@SETTINGS
@given(SEEDS)
def test_an_index_kept_up_to_date_places_as_one_rebuilt(seed: int) -> None:
    """(a) Random update_node / commit / release / place steps: after each, the kept index
    answers like one built from the nodes and jobs of now, and like the oracle."""
    rng = random.Random(seed)
    nodes = fleet(rng)
    held = jobs_on(rng, nodes, "run")
    kept = FleetIndex(nodes, held)
    current = {n.handle: n for n in nodes}
    kinds = requests(rng, 3)
    failed: list[JobRequest] = []
    """Probes that found nothing: asked again after every step (the memo must let go)."""
    for step in range(rng.randint(1, 8)):
        op = rng.choice(["update", "update", "heal", "commit", "release", "place"])
        if op in ("update", "heal"):
            handle = rng.choice(sorted(current))
            if op == "heal":
                new = msgspec.structs.replace(current[handle], grade="HEALTHY", cordoned=False)
            else:
                new = changed(rng, current[handle])
            current[handle] = new
            kept.update_node(new)
        elif op == "commit":
            req = replace(requests(rng, 1, kinds)[0], job_id=f"c{step}")
            placed = kept.place(req)
            if placed is None or rng.random() < 0.5:  # anywhere: the index only adds up
                placement = tuple(rng.sample(sorted(current), rng.randint(1, 3)))
            else:
                placement = placed.nodes
            job = RunningJob(replace(req, nodes=len(placement)), placement)
            kept.commit(job.request, job.placement)
            held.append(job)
        elif op == "release" and held:
            job = held.pop(rng.randrange(len(held)))
            kept.release(job.request, job.placement)
        else:
            kept.place(requests(rng, 1, kinds)[0])  # something for the memo to remember
        probes = requests(rng, 3, kinds)
        _same(kept, FleetIndex(list(current.values()), held), [*probes, *failed[-3:]])
        failed += [p for p in probes if kept.place(p) is None]
        for probe in probes:
            got = [
                (leaf.key, frozenset(h for _, hs in p for h in hs))
                for leaf, _, p in kept.eligible(probe)
            ]
            assert got == _oracle(current, held, probe)


@SETTINGS
@given(SEEDS)
def test_schedule_on_a_kept_index_decides_as_schedule_queue(seed: int) -> None:
    """(b) A kept index (and a kept empty one) brought to the fleet of now by update_node,
    release and commit: the pass decides as schedule_queue on the fleet of now, and the
    index then holds the running jobs and the pass's placements, nothing else (the
    preemptions' promised nodes are free again)."""
    rng = random.Random(seed)
    before = fleet(rng)
    old_jobs = jobs_on(rng, before, "old")
    kept, empty = FleetIndex(before, old_jobs), FleetIndex(before)
    kinds = requests(rng, 3)
    for probe in requests(rng, 3, kinds):  # memos from the past
        kept.place(probe)
        empty.place(probe)
    now = [changed(rng, n) if rng.random() < 0.5 else n for n in before]
    for node in now:
        kept.update_node(node)
        empty.update_node(node)
    stay = [j for j in old_jobs if rng.random() < 0.5]
    for job in old_jobs:
        if job not in stay:
            kept.release(job.request, job.placement)
    new_jobs = jobs_on(rng, now, "new")
    for job in new_jobs:
        kept.commit(job.request, job.placement)
    running = stay + new_jobs
    queue = [
        replace(r, job_id=f"q{i}", submitted_ts=float(rng.randint(0, 3)))
        for i, r in enumerate(requests(rng, rng.randint(1, 7), kinds))
    ]
    preempt, backfill = rng.random() < 0.7, rng.random() < 0.7

    expected = schedule_queue(queue, now, running, preempt=preempt, backfill=backfill)
    given_empty = empty if rng.random() < 0.5 else None
    got = schedule_on(kept, queue, running, empty=given_empty, preempt=preempt, backfill=backfill)
    assert got == expected

    by_id = {r.job_id: r for r in queue}
    placed = [RunningJob(by_id[p.job_id], p.nodes) for p in got.placements]
    probes = requests(rng, 3, kinds)
    _same(kept, FleetIndex(now, running + placed), probes)
    _same(empty, FleetIndex(now), probes)


@SETTINGS
@given(SEEDS)
def test_preemption_trials_match_an_index_without_the_jobs(seed: int) -> None:
    """(c) The planner's trials (jobs released and committed back, moved by the
    difference from one trial to the next, skipped by the fit bound) place as an index
    built without those jobs; afterwards the index is as it was, memo included."""
    rng = random.Random(seed)
    nodes = fleet(rng)
    running = jobs_on(rng, nodes, "run")
    index = FleetIndex(nodes, running)
    kinds = requests(rng, 2)
    for probe in requests(rng, 2, kinds):
        index.place(probe)
    trials = _Without(index)
    for _ in range(rng.randint(1, 6)):
        gone = [j for j in running if rng.random() < 0.5]
        req = requests(rng, 1, kinds)[0]
        within = None
        if rng.random() < 0.5:
            depth = rng.randrange(len(LEVELS))
            within = (depth, rng.choice(nodes).group_key(LEVELS[depth]))
        rest = [j for j in running if all(j is not g for g in gone)]
        assert trials.place(req, gone, within) == FleetIndex(nodes, rest).place(req, within)
    trials.restore()
    _same(index, FleetIndex(nodes, running), requests(rng, 3, kinds))


def _fit_oracle(
    nodes: dict[str, FleetNode], held: list[RunningJob], req: JobRequest
) -> list[dict[tuple[str, ...], int]]:
    """Per depth and group, the schedulable nodes (in the allowed regions) whose free
    capacity takes one member of ``req``, node by node."""
    out: list[dict[tuple[str, ...], int]] = [{} for _ in LEVELS]
    for h, node in nodes.items():
        here = [j.request for j in held if h in j.placement]
        ok = (
            node.schedulable
            and (not req.allowed_regions or node.region in req.allowed_regions)
            and (not req.gpu_type or node.gpu_type == req.gpu_type)
            and node.bandwidth_tier >= req.bandwidth_tier
            and (not req.sensitive or node.dma_posture == "isolated")
        )
        if ok and req.exclusive:
            ok = not here
        elif ok:
            ok = (
                not any(r.exclusive for r in here)
                and sum(r.gpus_per_node for r in here) + req.gpus_per_node <= node.gpus
                and sum(r.cpu for r in here) + req.cpu <= node.cpu_cores
                and sum(r.memory_gb for r in here) + req.memory_gb <= node.memory_gb
            )
        if ok:
            for depth, level in enumerate(LEVELS):
                key = node.group_key(level)
                out[depth][key] = out[depth].get(key, 0) + 1
    return out


@SETTINGS
@given(SEEDS)
def test_the_preemption_bounds_hold_and_the_prefix_search_finds_the_shortest(seed: int) -> None:
    """(c) The greedy planner's bounds: ``fit_by_group`` / ``fit_count`` count the nodes
    that fit a member as the oracle does; and the prefix search started from the bound
    (doubling from the shortest prefix that might free enough nodes, then bisecting)
    finds the shortest prefix whose removal lets the job fit, as trying each does."""
    rng = random.Random(seed)
    nodes = fleet(rng)
    running = jobs_on(rng, nodes, "a") + jobs_on(rng, nodes, "b")
    index = FleetIndex(nodes, running)
    current = {n.handle: n for n in nodes}
    req = request(rng)
    fit = index.fit_by_group(req)
    assert [dict(d) for d in fit] == _fit_oracle(current, running, req)
    assert index.fit_count(req) == max(fit[len(LEVELS) - 1].values(), default=0)
    jobs = rng.sample(running, len(running))
    within = None
    if rng.random() < 0.7:
        depth = rng.randrange(len(LEVELS))
        within = (depth, rng.choice(nodes).group_key(LEVELS[depth]))
        cache: dict[int, tuple[dict[tuple[str, ...], int], ...]] = {}
        freed = (_groups_of(index, j, cache)[depth].get(within[1], 0) for j in jobs)
        least = _least_prefix(req.nodes - fit[depth].get(within[1], 0), freed)
    else:
        least = _least_prefix(req.nodes - index.fit_count(req), (len(j.placement) for j in jobs))
    shortest = next(
        (
            length
            for length in range(1, len(jobs) + 1)
            if FleetIndex(nodes, jobs[length:]).place(req, within) is not None
        ),
        None,
    )
    trials = _Without(index)
    assert _first_prefix(trials, req, jobs, within, least) == shortest
    trials.restore()
    _same(index, FleetIndex(nodes, running), requests(rng, 2))


# --- worked examples -----------------------------------------------------------------


def _rack(count: int, rack: str = "a", first: int = 0) -> list[FleetNode]:
    return [
        FleetNode(
            handle=f"r1.c1.n{i}",
            region="r1",
            cluster="c1",
            zone="z1",
            rack=rack,
            leaf=f"l{i // 2}",
            gpus=8,
            gpu_type="h100",
            cpu_cores=64,
            memory_gb=512,
            dma_posture="isolated",
        )
        for i in range(first, first + count)
    ]


def test_update_node_refuses_a_stranger_and_a_move() -> None:
    nodes = _rack(4)
    index = FleetIndex(nodes)
    stranger = msgspec.structs.replace(nodes[0], handle="r1.c1.n9")
    with pytest.raises(ValueError, match="not in the index"):
        index.update_node(stranger)
    with pytest.raises(ValueError, match="moves from leaf"):
        index.update_node(msgspec.structs.replace(nodes[0], leaf="l7"))


def test_a_remembered_failure_is_forgotten_when_room_comes_back() -> None:
    """Two racks of three, a 3-node gang that must fit one rack: four nodes fit a member
    (so the fit bound lets it try) but no rack has three, and the index remembers the
    failure; it still fails after another commit, and fits again as soon as a node comes
    back (update_node) or a job is released."""
    nodes = _rack(3, rack="a") + _rack(3, rack="b", first=3)
    sick = msgspec.structs.replace(nodes[0], grade="FAILING")
    small = JobRequest("small", nodes=1, gpus_per_node=8)
    gang = JobRequest("gang", nodes=3, gpus_per_node=8, max_spread="rack")
    index = FleetIndex([sick, *nodes[1:]], [RunningJob(small, ("r1.c1.n3",))])
    assert index.could_fit(gang)
    assert index.place(gang) is None
    assert index.place(replace(gang, nodes=4)) is None
    index.commit(small, ("r1.c1.n4",))
    assert index.place(gang) is None
    index.update_node(nodes[0])
    placed = index.place(gang)
    assert placed == Placement(
        "gang", ("r1.c1.n0", "r1.c1.n1", "r1.c1.n2"), "rack", nodes[0].rack_key
    )
    index.update_node(sick)
    assert index.place(gang) is None
    assert index.group_size(0, nodes[0].rack_key) == 2
    index.release(small, ("r1.c1.n4",))
    index.release(small, ("r1.c1.n3",))
    assert index.place(gang) == Placement(
        "gang", ("r1.c1.n3", "r1.c1.n4", "r1.c1.n5"), "rack", nodes[3].rack_key
    )


def test_a_pass_leaves_its_placements_committed_and_its_promises_released() -> None:
    """A high-priority job preempts a low one; a small job is placed. After the pass the
    kept index holds the small job and still the victim (the caller stops it), not the
    promise; releasing the victim then lets the preempting job fit in the next pass."""
    nodes = _rack(4)
    victim = RunningJob(
        JobRequest("low", nodes=2, gpus_per_node=8, preemptible=True),
        ("r1.c1.n0", "r1.c1.n1"),
    )
    other = RunningJob(JobRequest("other", nodes=1, gpus_per_node=8), ("r1.c1.n2",))
    running = [victim, other]
    vip = JobRequest("vip", nodes=2, gpus_per_node=8, priority=5)
    tiny = JobRequest("tiny", nodes=1, gpus_per_node=4, priority=1)
    index = FleetIndex(nodes, running)
    result = schedule_on(index, [vip, tiny], running)
    assert result == schedule_queue([vip, tiny], nodes, running)
    assert [p.victims for p in result.preemptions] == [("low",)]
    assert [p.nodes for p in result.placements] == [("r1.c1.n3",)]
    assert index.free("r1.c1.n0") == (0, 64, 512), "the victim still holds its node"
    assert index.free("r1.c1.n3") == (4, 64, 512), "the placement stays committed"
    index.release(victim.request, victim.placement)
    started = [other, RunningJob(tiny, ("r1.c1.n3",))]
    again = schedule_on(index, [vip], started)
    assert [p.nodes for p in again.placements] == [("r1.c1.n0", "r1.c1.n1")]


def test_on_a_full_fleet_only_the_leaves_with_room_are_walked_in_order() -> None:
    """40 one-node racks, all busy but four: the walk visits only those four leaves (the
    shape map), still in leaf order, so the gang's ranks are the same as a full walk's."""
    nodes = [
        FleetNode(
            handle=f"r1.c1.k{i:02}",
            region="r1",
            cluster="c1",
            zone="z1",
            rack=f"k{i:02}",
            gpus=8,
            gpu_type="h100",
            cpu_cores=64,
            memory_gb=512,
            dma_posture="isolated",
        )
        for i in range(40)
    ]
    free = [33, 9, 17, 3]
    busy = JobRequest("busy", nodes=1, gpus_per_node=8)
    running = [RunningJob(busy, (n.handle,)) for i, n in enumerate(nodes) if i not in free]
    index = FleetIndex(nodes, running)
    gang = JobRequest("gang", nodes=4, gpus_per_node=8)
    order = [f"r1.c1.k{i:02}" for i in sorted(free)]
    assert [leaf.node.handle for leaf, _, _ in index.eligible(gang)] == order
    placed = index.place(gang)
    assert placed is not None
    assert placed.nodes == tuple(order)


def test_trials_leave_no_stale_pools_in_what_the_index_remembers() -> None:
    """A trial that releases a job empties the pool its node was in (the node moves to
    another shape) and committing it back makes a new one: what the index remembered of
    the old pools must not be used afterwards."""
    nodes = _rack(2)
    half = RunningJob(JobRequest("half", nodes=1, gpus_per_node=4), ("r1.c1.n0",))
    index = FleetIndex(nodes, [half])
    one = JobRequest("one", nodes=1, gpus_per_node=2)
    assert index.place(one) == Placement("one", ("r1.c1.n0",), "rack", nodes[0].rack_key)
    trials = _Without(index)
    assert trials.place(replace(one, nodes=2, gpus_per_node=8), [half]) is not None
    trials.restore()
    two = replace(one, nodes=2)
    assert index.place(two) == FleetIndex(nodes, [half]).place(two)


def test_what_an_index_remembers_minds_the_tenant() -> None:
    """A sensitive job of t1 on leaf l0: a t1 request may join it, one of t2 may not, even
    right after the t1 answer was remembered; on the empty index both go the same way."""
    nodes = _rack(4)
    secret = JobRequest("secret", nodes=1, tenant="t1", gpus_per_node=4, sensitive=True)
    index = FleetIndex(nodes, [RunningJob(secret, ("r1.c1.n0",))])
    mine = JobRequest("mine", nodes=1, tenant="t1", gpus_per_node=4)
    assert index.place(mine) == Placement("mine", ("r1.c1.n0",), "rack", nodes[0].rack_key)
    theirs = replace(mine, job_id="theirs", tenant="t2", nodes=2)
    placed = index.place(theirs)
    assert placed is not None
    assert placed.nodes == ("r1.c1.n2", "r1.c1.n3"), "never on the sensitive tenant's leaf"
    empty = FleetIndex(nodes)
    assert empty.place(mine) == Placement("mine", ("r1.c1.n0",), "rack", nodes[0].rack_key)
    other = empty.place(replace(theirs, nodes=1))
    assert other == Placement("theirs", ("r1.c1.n0",), "rack", nodes[0].rack_key)
