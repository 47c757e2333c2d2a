"""Tenant quota properties (hypothesis): reclaim within one pass, no preemption across
tenants for a tenant past its guarantee, and no quotas = the scheduler as before.

The guarantee is checked with an oracle written from its definition (GPUs matched to a
tenant's typed slots, then to its slots of any type; the rest is borrowed), not from
``controller.jobs.quota``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from metalguard.controller.jobs.quota import schedule_with_quotas
from metalguard.controller.jobs.scheduler import (
    FleetIndex,
    FleetNode,
    JobRequest,
    QueuePass,
    RunningJob,
    schedule_queue,
)
from metalguard.proto.tenants import TenantQuota
from tests.support.quota_strategies import SETTINGS, TENANTS, quotas, situations


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
