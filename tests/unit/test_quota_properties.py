"""Tenant quota properties (hypothesis): reclaim within one pass, no preemption across
tenants for a tenant past its guarantee, and no quotas = the scheduler as before.

The guarantee is checked with an oracle written from its definition (GPUs matched to a
tenant's typed slots, then to its slots of any type; the rest is borrowed), not from
``controller.jobs.quota``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from metalguard.controller.jobs.quota import schedule_with_quotas
from metalguard.controller.jobs.scheduler import (
    LEVELS,
    FleetIndex,
    FleetNode,
    JobRequest,
    QueuePass,
    RunningJob,
    schedule_queue,
)
from metalguard.proto.tenants import TenantQuota

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TENANTS = ("t1", "t2", "t3", "nobody")
"""``nobody`` never has a quota."""


def _borrowed(quota: TenantQuota | None, use: Mapping[str, int]) -> int:
    """GPUs of ``use`` that the quota's slots do not hold: each type fills its own slots,
    what is left over the slots of any type."""
    if quota is None:
        return sum(use.values())
    typed = {t: min(n, quota.gpus_by_type.get(t, 0)) for t, n in use.items()}
    left = sum(use.values()) - sum(typed.values())
    return max(0, left - (quota.gpus - sum(quota.gpus_by_type.values())))


def _held(
    req: JobRequest, placement: Sequence[str], nodes: Mapping[str, FleetNode]
) -> Counter[str]:
    out: Counter[str] = Counter()
    for handle in placement:
        node = nodes[handle]
        per = node.gpus if req.exclusive else req.gpus_per_node
        if per:
            out[node.gpu_type] += per
    return out


@st.composite
def fleets(draw: st.DrawFn, whole: bool) -> list[FleetNode]:
    """``whole``: healthy nodes of one type and size in one region (placement is then a
    count of free nodes); else mixed types, sizes, racks and grades."""
    nodes = []
    for i in range(draw(st.integers(2, 8))):
        nodes.append(
            FleetNode(
                handle=f"n{i}",
                region="r1" if whole else draw(st.sampled_from(["r1", "r1", "r2"])),
                cluster=draw(st.sampled_from(["c1", "c2"])),
                zone="z1",
                rack=draw(st.sampled_from(["a", "b"])),
                leaf=draw(st.sampled_from(["", "l1"])),
                gpus=8 if whole else draw(st.sampled_from([4, 8])),
                gpu_type="h100" if whole else draw(st.sampled_from(["h100", "h100", "a100"])),
                cpu_cores=16,
                memory_gb=128,
                grade="HEALTHY" if whole else draw(st.sampled_from(["HEALTHY"] * 6 + ["FAILING"])),
                cordoned=False if whole else draw(st.sampled_from([False] * 6 + [True])),
            )
        )
    return nodes


@st.composite
def requests(draw: st.DrawFn, job_id: str, whole: bool) -> JobRequest:
    exclusive = not whole and draw(st.sampled_from([False, False, True]))
    return JobRequest(
        job_id=job_id,
        nodes=draw(st.integers(1, 3)),
        tenant=draw(st.sampled_from(TENANTS)),
        gpus_per_node=8 if whole else (0 if exclusive else draw(st.sampled_from([0, 2, 4, 8]))),
        gpu_type="" if whole else draw(st.sampled_from(["", "", "h100", "a100"])),
        cpu=0 if exclusive else draw(st.sampled_from([1, 4])),
        max_spread="region" if whole else draw(st.sampled_from(LEVELS)),
        priority=draw(st.integers(0, 4)),
        preemptible=draw(st.booleans()),
        submitted_ts=float(draw(st.integers(0, 3))),
    )


@st.composite
def situations(
    draw: st.DrawFn, whole: bool = False
) -> tuple[list[FleetNode], list[RunningJob], list[JobRequest]]:
    """A fleet, running jobs on disjoint nodes (each fits its nodes), a queue."""
    nodes = draw(fleets(whole))
    free = list(nodes)
    running = []
    for j in range(draw(st.integers(0, 6))):
        req = draw(requests(f"run{j}", whole))
        size = min(req.nodes, len(free))
        if not size:
            break
        chosen = [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(size)]
        fitting = JobRequest(
            req.job_id,
            nodes=size,
            tenant=req.tenant,
            gpus_per_node=min(req.gpus_per_node, *(n.gpus for n in chosen)),
            cpu=req.cpu,
            priority=req.priority,
            preemptible=req.preemptible,
        )
        running.append(RunningJob(fitting, tuple(n.handle for n in chosen), float(j)))
    queue = draw(st.lists(requests("q", whole), max_size=4))
    queue = [replace(r, job_id=f"q{i}") for i, r in enumerate(queue)]
    return nodes, running, queue


@st.composite
def quotas(draw: st.DrawFn, nodes: Sequence[FleetNode], typed: bool) -> dict[str, TenantQuota]:
    """Guarantees of t1-t3 (some absent) adding up to at most the fleet, per type too."""
    left = Counter({n.gpu_type: 0 for n in nodes})
    for node in nodes:
        left[node.gpu_type] += node.gpus
    out = {}
    for name in TENANTS[:3]:
        if not draw(st.booleans()) and name != "t1":
            continue
        by_type = {}
        if typed:
            for gpu_type in sorted(left):
                share = draw(st.integers(0, left[gpu_type] // 8)) * 8
                if share:
                    by_type[gpu_type] = share
                    left[gpu_type] -= share
        spare = sum(left.values())
        extra = draw(st.integers(0, spare // 8)) * 8
        take = extra
        for gpu_type in sorted(left):  # the untyped part comes out of the fleet too
            used = min(take, left[gpu_type])
            left[gpu_type] -= used
            take -= used
        out[name] = TenantQuota(
            name=name,
            gpus=sum(by_type.values()) + extra,
            gpus_by_type=by_type,
            borrow_limit=draw(st.sampled_from([None, None, 0, 8])),
            lend_limit=None,
        )
    return out


def _decided_once(got: QueuePass, queue: Sequence[JobRequest]) -> None:
    ids = [p.job_id for p in got.placements] + [p.job_id for p in got.preemptions]
    ids += [b.job_id for b in got.blocked]
    assert sorted(ids) == sorted(r.job_id for r in queue)


@SETTINGS
@given(st.data())
def test_a_tenant_inside_its_guarantee_gets_its_capacity_back_in_one_pass(
    data: st.DataObject,
) -> None:
    """(a) t1's queued job fits inside its guarantee: it is placed, or a reclaim frees
    enough for it in the same pass (the rest of the fleet is other tenants' work: inside
    their guarantees it leaves room enough, beyond them it is reclaimed)."""
    nodes, running, others = data.draw(situations(whole=True))
    quota = data.draw(quotas(nodes, typed=False))
    by_handle = {n.handle: n for n in nodes}
    mine = sum(
        sum(_held(j.request, j.placement, by_handle).values())
        for j in running
        if j.request.tenant == "t1"
    )
    room = (quota["t1"].gpus - mine) // 8
    if room < 1:
        return
    job = JobRequest("mine", nodes=data.draw(st.integers(1, room)), tenant="t1", gpus_per_node=8)
    queue = [job, *(r for r in others if r.tenant != "t1")]
    got = schedule_with_quotas(queue, nodes, running, quota)
    _decided_once(got, queue)
    placed = [p for p in got.placements if p.job_id == "mine"]
    plans = [p for p in got.preemptions if p.job_id == "mine"]
    if not (placed or plans):
        # a reclaim for a job ahead of it freed more than that job takes: it fits there
        # once those victims stop (the same one reclaim away), and nothing else stands in
        # its way
        victims = {v for p in got.preemptions for v in p.victims}
        assert victims, got
        after = [j for j in running if j.request.job_id not in victims]
        after += [
            RunningJob(queued, p.nodes)
            for p in got.placements
            for queued in queue
            if queued.job_id == p.job_id
        ]
        after += [
            RunningJob(queued, p.placement.nodes)
            for p in got.preemptions
            for queued in queue
            if queued.job_id == p.job_id
        ]
        assert FleetIndex(nodes, after).place(job) is not None, got
    event("placed" if placed else "reclaimed" if plans else "freed by a reclaim ahead")
    for plan in plans:
        assert plan.cause == "reclaim"
        taken = [j for j in running if j.request.job_id in plan.victims]
        assert all(j.request.tenant != "t1" for j in taken)
        held = {h for j in running if j.request.job_id not in plan.victims for h in j.placement}
        assert not held & set(plan.placement.nodes), "the plan's nodes are not freed by it"


@settings(SETTINGS, max_examples=300)
@given(st.data())
def test_no_tenant_preempts_another_past_its_guarantee(data: st.DataObject) -> None:
    """(b) a preemption with another tenant's victims is a reclaim for a job whose tenant
    stays inside its guarantee with it; each victim's tenant was borrowing when it was
    taken (its removal lowered what it borrowed); priority preemption stays inside a
    tenant; no tenant ends the pass borrowing past its ``borrow_limit``."""
    typed = data.draw(st.booleans())
    nodes, running, queue = data.draw(situations())
    # mostly t1 waiting for work of the others: reclaims worth checking
    running = [
        replace(j, request=replace(j.request, tenant=data.draw(st.sampled_from(TENANTS[1:]))))
        if j.request.tenant == "t1" and data.draw(st.booleans())
        else j
        for j in running
    ]
    queue = [replace(r, tenant="t1") if data.draw(st.booleans()) else r for r in queue]
    quota = data.draw(quotas(nodes, typed))
    by_handle = {n.handle: n for n in nodes}
    got = schedule_with_quotas(queue, nodes, running, quota)
    _decided_once(got, queue)
    held: dict[str, Counter[str]] = {t: Counter() for t in TENANTS}
    for j in running:
        held[j.request.tenant].update(_held(j.request, j.placement, by_handle))
    held_at_start = {t: Counter(c) for t, c in held.items()}
    jobs = {j.request.job_id: j for j in running}
    queued = {r.job_id: r for r in queue}
    victims = [v for p in got.preemptions for v in p.victims]
    assert len(victims) == len(set(victims))
    for plan in got.preemptions:  # in decision order
        req = queued[plan.job_id]
        gone = [jobs[v] for v in plan.victims]
        if plan.cause == "priority":
            assert all(j.request.tenant == req.tenant for j in gone)
            assert all(j.request.preemptible and j.request.priority < req.priority for j in gone)
        else:
            tenant = req.tenant
            wanted = _held(req, plan.placement.nodes, by_handle)
            assert sum(wanted.values()) > 0
            assert _borrowed(quota.get(tenant), held[tenant] + wanted) == 0
            assert all(j.request.tenant != tenant for j in gone)
            for j in sorted(
                gone, key=lambda j: (j.request.priority, -j.started_ts, j.request.job_id)
            ):
                theirs = held[j.request.tenant]
                after = theirs - _held(j.request, j.placement, by_handle)
                q = quota.get(j.request.tenant)
                assert _borrowed(q, after) < _borrowed(q, theirs), "reclaimed inside a guarantee"
                held[j.request.tenant] = after
        for j in gone:
            if plan.cause == "priority":
                held[j.request.tenant] -= _held(j.request, j.placement, by_handle)
        held[req.tenant] += _held(req, plan.placement.nodes, by_handle)
    start = {t: _borrowed(quota.get(t), held_at_start[t]) for t in TENANTS}
    for placed in got.placements:
        held[queued[placed.job_id].tenant] += _held(queued[placed.job_id], placed.nodes, by_handle)
    for t, q in quota.items():  # nobody borrows past its limit (unless it already did)
        if q.borrow_limit is not None:
            assert _borrowed(q, held[t]) <= max(q.borrow_limit, start[t])
    event(f"preemptions: {sorted(p.cause for p in got.preemptions)}")


@SETTINGS
@given(st.data())
def test_without_quotas_the_pass_is_the_scheduler_as_before(data: st.DataObject) -> None:
    """(c) no quotas: the same QueuePass as ``schedule_queue``."""
    nodes, running, queue = data.draw(situations())
    running = [RunningJob(j.request, j.placement) for j in running]
    assert schedule_with_quotas(queue, nodes, running, {}) == schedule_queue(queue, nodes, running)
    assert schedule_with_quotas(queue, nodes, running) == schedule_queue(queue, nodes, running)
