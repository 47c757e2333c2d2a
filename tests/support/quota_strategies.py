"""Hypothesis strategies for tenant quota tests: fleets, queued and running jobs, and
quotas (tests/unit/test_quota_properties.py, tests/unit/test_quota_holdings.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from metalguard.controller.jobs.scheduler import LEVELS, FleetNode, JobRequest, RunningJob
from metalguard.proto.tenants import TenantQuota

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TENANTS = ("t1", "t2", "t3", "nobody")
"""``nobody`` never has a quota."""


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
