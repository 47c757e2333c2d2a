"""Tenant holdings kept across queue passes (``controller.jobs.quota.TenantHoldings``):
the same decisions as counting them from the running jobs each pass, and the counts
themselves the same as :func:`held_by_tenant`'s, through commits, releases, node changes
(a node's GPUs changed: counted again) and many passes on one kept index."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metalguard.controller.jobs import quota
from metalguard.controller.jobs.quota import (
    TenantHoldings,
    held_by_tenant,
    schedule_with_quotas,
    usage,
    usage_of,
)
from metalguard.controller.jobs.scheduler import FleetIndex, FleetNode, JobRequest, RunningJob
from metalguard.proto.tenants import TenantQuota
from metalguard.twin.allocation import Pool, TenantMeter, contract_quotas, contracts
from metalguard.twin.engine import Engine
from metalguard.twin.health import HealthModel
from metalguard.twin.policies import POLICIES
from tests.support.quota_strategies import SETTINGS, quotas, situations
from tests.support.twin_small import JOB, inputs


def _positive(held: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """The counts without zeros and empty tenants (what decisions depend on)."""
    out = {t: {k: n for k, n in g.items() if n} for t, g in held.items()}
    return {t: g for t, g in out.items() if g}


NODES = [
    FleetNode(
        handle=f"n{i}",
        region="r1",
        cluster="c1",
        rack=f"k{i // 2}",
        gpus=8,
        cpu_cores=16,
        memory_gb=128,
        gpu_type="h100" if i < 3 else "a100",
    )
    for i in range(4)
]


def test_holdings_follow_commits_and_releases() -> None:
    whole = JobRequest("w", nodes=1, tenant="a")  # asks no resources: the node's GPUs
    part = JobRequest("p", nodes=2, tenant="b", gpus_per_node=2)
    lost = JobRequest("x", nodes=1, tenant="b", gpus_per_node=4, gpu_type="h100")
    kept = TenantHoldings(NODES)
    kept.commit(whole, ("n3",))
    kept.commit(part, ("n0", "n1"))
    kept.commit(lost, ("gone",))  # a node not in the fleet: its own ask
    assert kept.held == {"a": {"a100": 8}, "b": {"h100": 8}}
    assert kept.fleet_gpus == 32
    kept.release(part, ("n0", "n1"))
    assert _positive(kept.held) == {"a": {"a100": 8}, "b": {"h100": 4}}
    kept.release(whole, ("n3",))
    kept.release(lost, ("gone",))
    assert kept.held == {}


def test_a_node_whose_gpus_change_makes_the_holdings_stale() -> None:
    job = RunningJob(JobRequest("w", nodes=1, tenant="a"), ("n0",))
    kept = TenantHoldings(NODES, [job])
    assert kept.held == {"a": {"h100": 8}}
    cordoned = msgspec.structs.replace(NODES[0], cordoned=True)
    kept.update_node(cordoned)  # its GPUs stay: nothing to count again
    assert not kept.stale
    smaller = msgspec.structs.replace(NODES[0], gpus=4)
    kept.update_node(smaller)
    assert kept.stale
    assert kept.fleet_gpus == 28
    index = FleetIndex([smaller, *NODES[1:]], [job])
    quota_map = {"a": TenantQuota(name="a", gpus=8)}
    schedule_with_quotas([], (), [job], quota_map, index=index, holdings=kept)
    assert not kept.stale
    assert kept.held == {"a": {"h100": 4}}
    with pytest.raises(ValueError, match="not in the holdings"):
        kept.update_node(FleetNode(handle="other", region="r1", cluster="c1"))


def _pass_both(
    nodes: Sequence[FleetNode],
    running: Sequence[RunningJob],
    queue: Sequence[JobRequest],
    quota_map: Mapping[str, TenantQuota],
) -> None:
    """One pass counted from the running jobs and one with kept holdings: the same."""
    plain = schedule_with_quotas(queue, nodes, running, quota_map)
    index = FleetIndex(nodes, running)
    kept = TenantHoldings(nodes, running)
    got = schedule_with_quotas(queue, (), running, quota_map, index=index, holdings=kept)
    assert got == plain
    queued = {r.job_id: r for r in queue}
    after = [*running, *(RunningJob(queued[p.job_id], p.nodes) for p in got.placements)]
    fleet = {n.handle: n for n in nodes}
    assert _positive(kept.held) == _positive(held_by_tenant(after, fleet))
    assert kept.fleet_gpus == sum(n.gpus for n in nodes)


@SETTINGS
@given(st.data())
def test_kept_holdings_decide_as_counted_ones(data: st.DataObject) -> None:
    nodes, running, queue = data.draw(situations())
    _pass_both(nodes, running, queue, data.draw(quotas(nodes, typed=data.draw(st.booleans()))))
    _pass_both(nodes, running, queue, {})  # no quotas: schedule_on, placements counted


@SETTINGS
@given(st.data())
def test_many_passes_on_a_kept_index_and_holdings(data: st.DataObject) -> None:
    """Passes on one kept index and holdings (placements start, victims and some running
    jobs stop, nodes change grade, cordon and sometimes GPUs), each the same as a pass
    counted afresh from the fleet and the running jobs."""
    nodes, running, queue = data.draw(situations())
    quota_map = data.draw(quotas(nodes, typed=data.draw(st.booleans())))
    fleet = {n.handle: n for n in nodes}
    index, empty = FleetIndex(nodes, running), FleetIndex(nodes)
    kept = TenantHoldings(nodes, running)
    running = list(running)
    for step in range(data.draw(st.integers(1, 4))):
        plain = schedule_with_quotas(queue, list(fleet.values()), running, quota_map)
        got = schedule_with_quotas(
            queue, (), running, quota_map, index=index, empty=empty, holdings=kept
        )
        assert got == plain, step
        queued = {r.job_id: r for r in queue}
        running += [RunningJob(queued[p.job_id], p.nodes) for p in got.placements]
        stopping = {v for p in got.preemptions for v in p.victims}
        stopping |= {j.request.job_id for j in running if data.draw(st.booleans())}
        for job in [j for j in running if j.request.job_id in stopping]:
            index.release(job.request, job.placement)
            kept.release(job.request, job.placement)
            running.remove(job)
        for handle in data.draw(st.lists(st.sampled_from(sorted(fleet)), max_size=2)):
            node = msgspec.structs.replace(
                fleet[handle],
                grade=data.draw(st.sampled_from(["HEALTHY", "FAILING"])),
                cordoned=data.draw(st.booleans()),
                gpus=data.draw(st.sampled_from([fleet[handle].gpus] * 3 + [4, 8])),
            )
            fleet[handle] = node
            for kept_index in (index, empty):
                kept_index.update_node(node)
            kept.update_node(node)
        done = {p.job_id for p in got.placements}
        queue = [replace(r, job_id=f"{r.job_id}.{step}") for r in queue if r.job_id not in done]
        queue += data.draw(st.lists(st.sampled_from(queue or [JobRequest("x", tenant="t1")])))
        queue = [replace(r, job_id=f"{r.job_id}.{i}") for i, r in enumerate(queue)]


def test_usage_of_is_usage_from_the_counts() -> None:
    quota_map = {"a": TenantQuota(name="a", gpus=8), "b": TenantQuota(name="b", gpus=16)}
    running = [
        RunningJob(JobRequest("w", nodes=1, tenant="a"), ("n0",)),
        RunningJob(JobRequest("x", nodes=2, tenant="a", gpus_per_node=4), ("n1", "n2")),
        RunningJob(JobRequest("y", nodes=1, tenant="c", gpus_per_node=2), ("n3",)),
    ]
    queued = [JobRequest("q", nodes=2, tenant="b"), JobRequest("r", tenant="d", gpus_per_node=1)]
    fleet = {n.handle: n for n in NODES}
    asked = {"b": 16, "d": 1}
    counted = usage_of(quota_map, held_by_tenant(running, fleet), 32, asked, {"b": 1, "d": 1})
    assert counted == usage(quota_map, NODES, running, queued)
    assert counted["a"].borrowed == 8
    assert counted["b"].lent == 2


def test_the_meter_counts_as_usage_over_the_fleet() -> None:
    meter = TenantMeter(NODES, {"a": TenantQuota(name="a", gpus=8)})
    meter.held = {"a": 12, "b": 6, "c": 0}
    running = [
        RunningJob(JobRequest(f"{t}:held", tenant=t, gpus_per_node=n), ("",))
        for t, n in sorted(meter.held.items())
        if n > 0
    ]
    want = usage(meter.quotas, NODES, running)
    assert meter._rates() == {
        t: {
            "used": u.in_use,
            "within": u.in_use - u.borrowed,
            "borrowed": u.borrowed,
            "lent": u.lent,
        }
        for t, u in want.items()
    }


def test_a_pooled_twin_keeps_its_holdings_as_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pass of a pooled twin run (tenants borrowing, reclaiming, preempting) finds
    the pool's holdings as counted from its running jobs."""
    rng = random.Random(7)
    jobs = tuple(
        replace(
            JOB,
            job_id=f"j{i}",
            submit_s=100.0 + rng.uniform(0, 20_000),
            nodes=rng.choice([1, 1, 2, 3]),
            gpus_per_node=rng.choice([0, 2, 8, 8]),
            work_s=rng.uniform(600, 7200),
            priority=rng.choice([0, 0, 1]),
            preemptible=rng.random() < 0.5,
            tenant=rng.choice("abc"),
        )
        for i in range(60)
    )
    inp = inputs(jobs, n=8)
    handles = [n.handle for n in inp.nodes]
    parts = {"a": tuple(handles[:4]), "b": tuple(handles[4:6]), "c": tuple(handles[6:])}
    inp = replace(inp, allocation="pooled", partitions=parts)
    seen: list[int] = []
    real = quota.schedule_with_quotas

    def checked(*args: object, **kwargs: object) -> object:
        kept = kwargs["holdings"]
        index = kwargs["index"]
        assert isinstance(kept, TenantHoldings)
        assert isinstance(index, FleetIndex)
        running = args[2]
        assert isinstance(running, list)
        assert not kept.stale
        assert _positive(kept.held) == _positive(held_by_tenant(running, index.nodes))
        seen.append(len(running))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quota, "schedule_with_quotas", checked)
    policy = POLICIES["metalguard"]
    Engine(inp, policy, faults=(), health=HealthModel(inp.nodes, policy)).run()
    assert len(seen) > 10
    assert max(seen) > 3
    pool = Pool(inp.nodes, contract_quotas(contracts(inp.nodes, parts)))
    assert pool.holdings.held == {}
    assert pool.holdings.fleet_gpus == 64
