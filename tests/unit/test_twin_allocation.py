"""The twin's allocations (metalguard/twin/allocation.py, issue 31): dedicated partitions
and one pool under the real tenant quotas, on 4 nodes of two tenants, with the GPU-hours
borrowed and lent and the reclaims worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from metalguard.controller.jobs.scheduler import JobRequest, RunningJob
from metalguard.twin.allocation import (
    Partitions,
    Pool,
    TenantMeter,
    contract_quotas,
    contracts,
)
from metalguard.twin.engine import Engine
from metalguard.twin.health import HealthModel
from metalguard.twin.model import AllocationMode, JobSpec, Policy, TwinResult
from metalguard.twin.policies import POLICIES
from metalguard.twin.report import build_report
from tests.support.twin_small import CLEAN_END, JOB, START, inputs

METALGUARD = POLICIES["metalguard"]
NODES = inputs(n=4).nodes
HANDLES = [n.handle for n in NODES]
PARTS = {"a": tuple(HANDLES[:2]), "b": tuple(HANDLES[2:])}
"""Two tenants of 2 nodes (16 GPUs) each."""
A1 = replace(JOB, job_id="a1", tenant="a")
A2 = replace(JOB, job_id="a2", tenant="a", submit_s=START + 10)
B1 = replace(JOB, job_id="b1", tenant="b", submit_s=START + 1000)


def simulate(
    mode: AllocationMode, jobs: tuple[JobSpec, ...], policy: Policy = METALGUARD
) -> TwinResult:
    inp = replace(inputs(jobs, n=4), allocation=mode, partitions=PARTS)
    engine = Engine(inp, policy, faults=(), health=HealthModel(inp.nodes, policy))
    return engine.run()


def held(result: TwinResult, job_id: str) -> set[str]:
    return {h for s in result.segments if s.job_id == job_id for h in s.nodes}


def starts(result: TwinResult) -> dict[str, float | None]:
    return {r.job_id: r.first_start_s for r in result.jobs}


def test_dedicated_keeps_each_tenants_jobs_on_its_partition() -> None:
    result = simulate("dedicated", (A1, A2))
    assert held(result, "a1") == held(result, "a2") == set(PARTS["a"])
    start = starts(result)
    assert start["a1"] == START
    assert start["a2"] is not None
    assert start["a2"] >= CLEAN_END
    usage = result.tenant_usage
    assert usage["a"]["borrowed"] == usage["b"]["lent"] == 0


def test_pooled_borrows_idle_nodes_and_the_owner_reclaims_them() -> None:
    result = simulate("pooled", (A1, A2, B1))
    start = starts(result)
    assert start["a2"] is not None
    assert start["a2"] < START + 60
    assert held(result, "a2") >= set(PARTS["b"])
    assert result.decisions["scheduler:reclaims"] == 1
    assert result.decisions["tenant.reclaim"] == 1  # the real job machine's event
    usage = result.tenant_usage
    assert usage["b"]["reclaims_made"] == 1
    assert usage["a"]["reclaims_suffered"] == 1
    # a2 held b's 16 GPUs from its start until the reclaim stopped it (checkpoint, stop)
    borrowed_s = usage["a"]["borrowed"]
    assert (
        16 * (START + 1000 - start["a2"]) <= borrowed_s <= 16 * (START + 1000 + 600 - start["a2"])
    )
    assert usage["b"]["lent"] == pytest.approx(borrowed_s)  # nobody else lends: b lent it all
    assert result.decisions["interruption:planned:reclaimed"] == 1


def test_the_same_jobs_run_sooner_in_the_pool() -> None:
    dedicated, pooled = simulate("dedicated", (A1, A2)), simulate("pooled", (A1, A2))
    assert pooled.gpu_seconds_busy >= dedicated.gpu_seconds_busy
    finished = [r.end_s for r in pooled.jobs], [r.end_s for r in dedicated.jobs]
    assert all(p is not None and d is not None and p <= d for p, d in zip(*finished, strict=True))


def test_the_report_has_each_tenants_contract_use_and_waits() -> None:
    report = build_report(simulate("pooled", (A1, A2, B1)))
    assert report["allocation"] == "pooled"
    a, b = report["tenants"]["a"], report["tenants"]["b"]
    assert a["guarantee_gpus"] == b["guarantee_gpus"] == 16
    assert a["nodes"] == 2
    assert a["gpu_hours_borrowed"] > 0
    assert b["gpu_hours_lent"] == pytest.approx(a["gpu_hours_borrowed"], abs=1e-5)
    assert a["reclaims"] == {"made": 0, "suffered": 1}
    assert a["jobs"]["submitted"] == 2
    assert b["jobs"]["submitted"] == 1
    guarantee_hours = 16 * 24.0
    assert 0 < a["guarantee_utilisation"] <= 1
    assert a["used_over_guarantee"] == pytest.approx(
        a["guarantee_utilisation"] + a["gpu_hours_borrowed"] / guarantee_hours, abs=1e-5
    )
    assert set(a["queue_wait_s"]) == {"p50", "p90"}
    assert build_report(simulate("dedicated", (A1,)))["tenants"]["b"]["queue_wait_s"] == {
        "p50": None,
        "p90": None,
    }


def test_a_job_still_waiting_at_the_end_counts_its_wait_so_far() -> None:
    long_job = replace(A1, work_s=2 * 86_400.0)
    waiting = replace(A2, work_s=600.0)
    report = build_report(simulate("dedicated", (long_job, waiting)))
    a = report["tenants"]["a"]
    assert a["still_waiting"] == 1
    assert a["queue_wait_s"]["p90"] == pytest.approx(0.9 * (86_400.0 - waiting.submit_s), rel=1e-6)


def test_without_an_allocation_there_are_no_tenants() -> None:
    inp = inputs()
    result = Engine(inp, METALGUARD, faults=(), health=HealthModel(inp.nodes, METALGUARD)).run()
    report = build_report(result)
    assert report["allocation"] is None
    assert report["tenants"] is None
    assert result.tenant_usage == {}


# --- the pieces ----------------------------------------------------------------------------


def test_partitions_schedule_each_tenant_on_its_own_nodes_only() -> None:
    parts = Partitions(NODES, PARTS)
    big = JobRequest("a-big", nodes=3, tenant="a", gpus_per_node=8)
    small = JobRequest("a-small", nodes=2, tenant="a", gpus_per_node=8, submitted_ts=1.0)
    other = JobRequest("c-1", nodes=1, tenant="c", gpus_per_node=8)
    decided = parts.schedule([big, small, other], [], METALGUARD)
    assert [(p.job_id, set(p.nodes)) for p in decided.placements] == [("a-small", set(PARTS["a"]))]
    reasons = {b.job_id: b.reason for b in decided.blocked}
    assert "does not fit" in reasons["a-big"]  # 3 nodes: more than its partition
    assert reasons["c-1"] == "tenant c has no partition"


def test_the_pool_is_the_real_quota_pass() -> None:
    pool = Pool(NODES, contract_quotas(contracts(NODES, PARTS)))
    assert {t: q.gpus for t, q in pool.quotas.items()} == {"a": 16, "b": 16}
    borrow = JobRequest("a-4", nodes=4, tenant="a", gpus_per_node=8)
    decided = pool.schedule([borrow], [], METALGUARD)
    assert [p.job_id for p in decided.placements] == ["a-4"]  # b's idle half borrowed
    running = [RunningJob(borrow, decided.placements[0].nodes, 10.0)]
    back = JobRequest("b-1", nodes=1, tenant="b", gpus_per_node=8)
    reclaim = pool.schedule([back], running, METALGUARD)
    assert [(p.job_id, p.victims, p.cause) for p in reclaim.preemptions] == [
        ("b-1", ("a-4",), "reclaim")
    ]


def test_the_meter_integrates_use_borrowing_and_lending() -> None:
    meter = TenantMeter(NODES, contract_quotas({"a": 16, "b": 16}))
    meter.hold(0.0, "a", 24)  # 8 GPUs beyond its guarantee: lent by b
    meter.hold(10.0, "b", 8)  # b uses half of its own: still lends the other 8
    meter.hold(30.0, "a", -24)
    meter.reclaim("b", "a")
    totals = meter.close(40.0)
    assert totals["a"] == {
        "borrowed": 8 * 30.0,
        "lent": 0.0,
        "reclaims_made": 0.0,
        "reclaims_suffered": 1.0,
        "used": 24 * 30.0,
        "within": 16 * 30.0,
    }
    assert totals["b"]["lent"] == 8 * 30.0
    assert totals["b"]["used"] == totals["b"]["within"] == 8 * 30.0
