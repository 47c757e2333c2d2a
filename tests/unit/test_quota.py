"""Tenant quotas: parsing, accounting, and the queue pass's admission and reclaim."""

from __future__ import annotations

from collections import Counter

import pytest

from metalguard.controller.jobs.quota import (
    QuotaError,
    check_against_fleet,
    fleet_capacity,
    held_gpus,
    may_hold,
    parse_quota,
    parse_tenants,
    schedule_with_quotas,
    usage,
)
from metalguard.controller.jobs.scheduler import FleetIndex, FleetNode, JobRequest, RunningJob
from metalguard.proto.tenants import TenantQuota


def _nodes(count: int, gpu_type: str = "h100", start: int = 0) -> list[FleetNode]:
    """``count`` nodes of 8 GPUs in one rack."""
    return [
        FleetNode(
            handle=f"r1.c1.n{i}",
            region="r1",
            cluster="c1",
            zone="z1",
            rack="a",
            gpus=8,
            gpu_type=gpu_type,
            cpu_cores=64,
            memory_gb=512,
        )
        for i in range(start, start + count)
    ]


def _job(job_id: str, tenant: str, nodes: int = 1, **kw: object) -> JobRequest:
    return JobRequest(job_id, nodes=nodes, tenant=tenant, gpus_per_node=8, **kw)  # type: ignore[arg-type]


def _run(req: JobRequest, *handles: int, started: float = 0.0) -> RunningJob:
    return RunningJob(req, tuple(f"r1.c1.n{i}" for i in handles), started_ts=started)


def _quotas(**gpus: int) -> dict[str, TenantQuota]:
    return {name: TenantQuota(name=name, gpus=n) for name, n in gpus.items()}


# --- parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "field", "problem"),
    [
        ({"gpus": 8, "gpu": 1}, "gpu", "unknown key"),
        ({"gpus": -8}, "gpus", "must not be negative, got -8"),
        ({"gpus": 8.5}, "gpus", "must be a whole number of GPUs, got 8.5"),
        ({"gpus": "8"}, "gpus", "must be a whole number of GPUs, got '8'"),
        ({"gpus": True}, "gpus", "must be a whole number of GPUs, got True"),
        ({"gpus": 8, "gpus_by_type": {"h100": 16}}, "gpus_by_type", "adds up to 16 GPUs"),
        ({"gpus_by_type": {"h100": -1}}, "gpus_by_type.h100", "must not be negative"),
        ({"gpus_by_type": ["h100"]}, "gpus_by_type", "must be a table"),
        ({"gpus": 8, "borrow_limit": -1}, "borrow_limit", "must not be negative"),
        ({"gpus": 8, "lend_limit": 16}, "lend_limit", "16 is more than the guarantee"),
        ({"name": "b", "gpus": 8}, "name", "'b' differs from the tenant 'a'"),
    ],
)
def test_a_bad_quota_names_the_field_and_the_problem(
    doc: dict[str, object], field: str, problem: str
) -> None:
    with pytest.raises(QuotaError) as caught:
        parse_quota("a", doc)
    assert caught.value.tenant == "a"
    assert caught.value.field == field
    assert problem in caught.value.problem
    assert str(caught.value).startswith(f"tenants.a.{field}: ")


def test_a_quota_parses_and_gpus_default_to_the_typed_shares() -> None:
    got = parse_quota("a", {"name": "a", "gpus_by_type": {"h100": 16, "a100": 8}})
    assert (got.gpus, got.gpus_by_type, got.borrow_limit, got.lend_limit) == (
        24,
        {"h100": 16, "a100": 8},
        None,
        None,
    )
    got = parse_quota("a", {"gpus": 32, "borrow_limit": 0, "lend_limit": 8})
    assert (got.gpus, got.borrow_limit, got.lend_limit) == (32, 0, 8)


def test_a_bad_tenant_name_is_refused() -> None:
    with pytest.raises(QuotaError, match=r"^tenants\.name: 'a\.b' is not a tenant name"):
        parse_quota("a.b", {"gpus": 8})


def test_tenant_tables_need_a_name_given_once() -> None:
    assert set(parse_tenants([{"name": "a", "gpus": 8}, {"name": "b"}])) == {"a", "b"}
    with pytest.raises(QuotaError, match=r"^tenants\.a\.name: given twice \(tables 0 and 2\)"):
        parse_tenants([{"name": "a"}, {"name": "b"}, {"name": "a", "gpus": 8}])
    with pytest.raises(QuotaError, match=r"^tenants\.\[1\]\.name: missing"):
        parse_tenants([{"name": "a"}, {"gpus": 8}])


def test_guarantees_beyond_the_fleet_are_refused() -> None:
    fleet = fleet_capacity([*_nodes(4), *_nodes(2, "a100", start=4)])
    assert fleet == (48, {"h100": 32, "a100": 16})
    check_against_fleet(
        {"a": parse_quota("a", {"gpus": 24, "gpus_by_type": {"h100": 16}}), **_quotas(b=24)},
        *fleet,
    )
    with pytest.raises(QuotaError) as caught:
        check_against_fleet(_quotas(a=56), *fleet)
    assert (caught.value.tenant, caught.value.field) == ("a", "gpus")
    with pytest.raises(QuotaError, match=r"^tenants\.gpus: the guarantees add up to 56 GPUs"):
        check_against_fleet(_quotas(a=32, b=24), *fleet)
    typed = {n: parse_quota(n, {"gpus_by_type": {"a100": 12}}) for n in ("a", "b")}
    with pytest.raises(QuotaError, match=r"^tenants\.gpus_by_type\.a100: .* 24 GPUs"):
        check_against_fleet(typed, *fleet)
    with pytest.raises(QuotaError, match=r"^tenants\.a\.gpus_by_type\.b200: 8 GPUs, .* has 0"):
        check_against_fleet({"a": parse_quota("a", {"gpus_by_type": {"b200": 8}})}, *fleet)


# --- accounting -------------------------------------------------------------------------


def test_a_whole_node_job_holds_the_nodes_gpus() -> None:
    fleet = {n.handle: n for n in [*_nodes(1), *_nodes(1, "a100", start=1)]}
    whole = JobRequest("w", nodes=2)
    assert held_gpus(whole, ("r1.c1.n0", "r1.c1.n1"), fleet) == Counter(h100=8, a100=8)
    assert held_gpus(_job("j", "a", 2), ("r1.c1.n0", "r1.c1.n1"), fleet) == Counter(h100=8, a100=8)
    assert held_gpus(JobRequest("cpu", cpu=4), ("r1.c1.n0",), fleet) == Counter()


def test_usage_counts_in_use_borrowed_lent_and_waiting() -> None:
    nodes = _nodes(8)  # 64 GPUs; a: 32 (lends 8), b: 16; 16 nobody's
    quotas = {"a": parse_quota("a", {"gpus": 32, "lend_limit": 8}), **_quotas(b=16)}
    running = [
        _run(_job("b1", "b", 4), 0, 1, 2, 3),  # b borrows 16 ...
        _run(_job("c1", "c", 2), 4, 5),  # ... c (no quota) 16: 32 borrowed, 16 unguaranteed
    ]
    queued = [_job("a1", "a", 2), _job("a2", "a"), JobRequest("c2", nodes=1, tenant="c")]
    got = usage(quotas, nodes, running, queued)
    assert [
        (u.name, u.guarantee, u.in_use, u.borrowed, u.lent, u.waiting, u.waiting_jobs)
        for u in got.values()
    ] == [
        # 16 borrowed beyond the unguaranteed 16: a lends its 8, then 8 more of its unused 32
        ("a", 32, 0, 0, 16, 24, 2),
        ("b", 16, 32, 16, 0, 0, 0),
        ("c", 0, 16, 16, 0, 8, 1),
    ]
    assert got["c"].quota is None
    assert got["b"].in_use_by_type == {"h100": 32}


def test_lent_is_shared_in_proportion_to_what_each_lends() -> None:
    quotas = {
        "a": parse_quota("a", {"gpus": 32, "lend_limit": 0}),
        "b": parse_quota("b", {"gpus": 16}),
        "c": parse_quota("c", {"gpus": 16}),
    }
    running = [_run(_job("d1", "d", 3), 0, 1, 2)]  # d (no quota) borrows 24
    got = usage(quotas, _nodes(8), running)
    assert [got[n].lent for n in "abcd"] == [0, 12, 12, 0]


def test_typed_guarantees_count_use_per_type() -> None:
    nodes = [*_nodes(2), *_nodes(2, "a100", start=2)]
    quotas = {"a": parse_quota("a", {"gpus": 24, "gpus_by_type": {"h100": 16}})}
    # 16 a100: 8 in the untyped share, 8 borrowed
    got = usage(quotas, nodes, [_run(_job("x", "a", 2, gpu_type="a100"), 2, 3)])
    assert (got["a"].in_use, got["a"].borrowed) == (16, 8)
    got = usage(quotas, nodes, [_run(_job("x", "a", 2, gpu_type="h100"), 0, 1)])
    assert (got["a"].in_use, got["a"].borrowed) == (16, 0)


# --- the queue pass ---------------------------------------------------------------------


def test_reclaim_takes_the_lowest_priority_then_the_most_recent_only_as_needed() -> None:
    nodes = _nodes(4)
    running = [
        _run(_job("b-old", "b", priority=1), 0, started=10),
        _run(_job("b-new", "b", priority=1), 1, started=20),
        _run(_job("b-high", "b", priority=5), 2, started=30),
        _run(_job("c-low", "c", priority=0), 3, started=5),
    ]
    got = schedule_with_quotas([_job("a1", "a", 2)], nodes, running, _quotas(a=16, b=8))
    assert not got.placements
    (plan,) = got.preemptions
    # c (no quota) and b (8 of its 24 guaranteed) borrow: c's job (lowest priority), then
    # b's most recent of priority 1
    assert (plan.job_id, plan.victims, plan.cause) == ("a1", ("c-low", "b-new"), "reclaim")
    assert set(plan.placement.nodes) == {"r1.c1.n1", "r1.c1.n3"}


def test_reclaim_stops_when_the_lender_is_back_inside_its_guarantee() -> None:
    nodes = _nodes(4)
    running = [
        _run(_job("b1", "b", priority=0, preemptible=True), 0, started=1),
        _run(_job("b2", "b", priority=0), 1, started=2),  # not preemptible: inside or not
        _run(_job("b3", "b", priority=9), 2, 3, started=3),
    ]
    # b's guarantee 24 of its 32: only one of its 8-GPU jobs lies on borrowed capacity
    got = schedule_with_quotas([_job("a1", "a", 2)], nodes, running, _quotas(a=32, b=24))
    assert got.preemptions == ()
    assert [b.job_id for b in got.blocked] == ["a1"]
    got = schedule_with_quotas([_job("a1", "a", 1)], nodes, running, _quotas(a=32, b=24))
    (plan,) = got.preemptions
    assert plan.victims == ("b2",)  # the most recent of the lowest priority, preemptible or not


def test_a_non_preemptible_job_inside_its_guarantee_is_never_reclaimed() -> None:
    running = [_run(_job("b1", "b", 2), 0, 1)]
    got = schedule_with_quotas([_job("a1", "a", 2)], _nodes(3), running, _quotas(a=16, b=16))
    # b is inside its guarantee; a waits for the idle node and one more
    assert got.preemptions == ()
    assert got.blocked[0].reason == "waiting for capacity"


def test_no_reclaim_for_a_tenant_past_its_guarantee() -> None:
    running = [_run(_job("a0", "a"), 0), _run(_job("b1", "b", 3), 1, 2, 3)]
    quotas = _quotas(a=16, b=8)
    got = schedule_with_quotas([_job("a1", "a", 2)], _nodes(4), running, quotas)
    assert got.preemptions == ()  # 8 + 16 is past a's 16
    got = schedule_with_quotas([_job("a1", "a", 1)], _nodes(4), running, quotas)
    assert [p.victims for p in got.preemptions] == [("b1",)]


def test_a_tenant_without_a_quota_runs_on_idle_capacity_and_never_reclaims() -> None:
    running = [_run(_job("b1", "b", 3), 0, 1, 2)]  # b borrows 16
    quotas = _quotas(b=8)
    got = schedule_with_quotas([_job("c1", "c"), _job("c2", "c")], _nodes(4), running, quotas)
    assert [p.job_id for p in got.placements] == ["c1"]
    assert got.preemptions == ()
    assert [b.job_id for b in got.blocked] == ["c2"]


def test_no_cross_tenant_priority_preemption_with_quotas() -> None:
    running = [_run(_job("b1", "b", 2, preemptible=True), 0, 1)]
    queue = [_job("a1", "a", 2, priority=5)]
    assert schedule_with_quotas(queue, _nodes(2), running, {}).preemptions  # as today
    got = schedule_with_quotas(queue, _nodes(2), running, _quotas(b=16))
    assert got.preemptions == ()


def test_inside_a_tenant_priority_preemption_as_today() -> None:
    running = [_run(_job("a0", "a", 2, preemptible=True), 0, 1), _run(_job("b1", "b", 2), 2, 3)]
    quotas = _quotas(a=16, b=16)
    got = schedule_with_quotas([_job("a1", "a", 2, priority=3)], _nodes(4), running, quotas)
    (plan,) = got.preemptions
    assert (plan.victims, plan.cause) == (("a0",), "priority")


def test_a_borrow_limit_blocks_without_reserving_and_own_lower_priority_work_makes_room() -> None:
    quotas = {"a": parse_quota("a", {"gpus": 8, "borrow_limit": 8})}
    running = [_run(_job("a0", "a", 2, preemptible=True), 0, 1)]  # a borrows 8 already
    got = schedule_with_quotas([_job("a1", "a")], _nodes(4), running, quotas)
    (blocked,) = got.blocked
    assert blocked.reason == "tenant a: would borrow 16 GPUs, its borrow_limit is 8"
    assert blocked.reserved == ()
    got = schedule_with_quotas([_job("a1", "a", priority=2)], _nodes(4), running, quotas)
    (plan,) = got.preemptions
    assert (plan.victims, plan.cause) == (("a0",), "priority")


def test_a_lend_limit_caps_what_others_borrow() -> None:
    quotas = {"a": parse_quota("a", {"gpus": 24, "lend_limit": 8})}  # 8 of 32 unguaranteed
    running = [_run(_job("b1", "b"), 0)]
    got = schedule_with_quotas([_job("b2", "b"), _job("b3", "b")], _nodes(4), running, quotas)
    assert [p.job_id for p in got.placements] == ["b2"]
    assert got.blocked[0].reason.startswith("tenant b: would borrow 24 GPUs, the others lend 16")


def test_jobs_inside_their_guarantee_go_first() -> None:
    queue = [_job("b-high", "b", priority=9), _job("a-low", "a", priority=0)]
    got = schedule_with_quotas(queue, _nodes(1), (), _quotas(a=8))
    assert [p.job_id for p in got.placements] == ["a-low"]
    assert [b.job_id for b in got.blocked] == ["b-high"]


def test_reclaim_per_gpu_type_takes_only_work_of_that_type() -> None:
    nodes = [*_nodes(2), *_nodes(2, "a100", start=2)]
    quotas = {
        "a": parse_quota("a", {"gpus_by_type": {"h100": 8}}),
        "b": parse_quota("b", {"gpus_by_type": {"a100": 16}}),
    }
    running = [
        _run(_job("b-h", "b", gpu_type="h100"), 0, started=1),
        _run(_job("b-h2", "b", gpu_type="h100"), 1, started=2),
        _run(_job("b-a", "b", 2, gpu_type="a100"), 2, 3, started=3),  # inside its a100 share
    ]
    got = schedule_with_quotas([_job("a1", "a", gpu_type="h100")], nodes, running, quotas)
    (plan,) = got.preemptions
    assert (plan.victims, plan.cause) == (("b-h2",), "reclaim")
    # asking any type, a's share is h100 only: an a100 node would not be inside it
    got = schedule_with_quotas([_job("a1", "a", 2)], nodes, running, quotas)
    assert got.preemptions == ()


def test_a_kept_index_holds_the_running_jobs_and_the_placements_after_a_pass() -> None:
    nodes = _nodes(4)
    running = [_run(_job("b1", "b", 2), 0, 1), _run(_job("c1", "c"), 2, started=5)]
    index = FleetIndex(nodes, running)
    cpu_only = JobRequest("b2", tenant="b", cpu=4)
    queue = [_job("a1", "a", 2), cpu_only]
    got = schedule_with_quotas(queue, nodes, running, _quotas(a=16), index=index)
    (plan,) = got.preemptions
    assert plan.victims == ("c1",)  # the most recent borrower (one job frees enough)
    assert plan.placement.nodes == ("r1.c1.n2", "r1.c1.n3")
    (placed,) = got.placements
    assert placed.job_id == "b2"
    assert set(placed.nodes) < {"r1.c1.n0", "r1.c1.n1"}  # not on nodes promised to a1
    expect = FleetIndex(nodes, [*running, RunningJob(cpu_only, placed.nodes)])
    assert {h: index.free(h) for h in index.nodes} == {h: expect.free(h) for h in expect.nodes}


def test_capacity_a_reclaim_frees_beyond_its_job_waits_for_the_next_pass() -> None:
    running = [
        _run(_job("c0", "c", 2), 0, 1, started=0),
        _run(_job("c1", "c", 2), 2, 3, started=1),
        _run(_job("a0", "a"), 4),
    ]
    queue = [_job("b1", "b", 3, priority=1), _job("a1", "a")]
    got = schedule_with_quotas(queue, _nodes(5), running, _quotas(a=16, b=24))
    (plan,) = got.preemptions
    assert (plan.job_id, set(plan.victims)) == ("b1", {"c0", "c1"})
    # the fourth node c's jobs free is a1's once they stop: nothing is taken for it now
    assert [(b.job_id, b.reason) for b in got.blocked] == [("a1", "waiting for capacity")]


# --- an elastic job's larger size (may_hold) ---------------------------------------------


def test_an_elastic_size_is_held_inside_the_guarantee_or_within_the_borrow_limit() -> None:
    nodes = {n.handle: n for n in _nodes(6)}
    elastic = _job("e", "a", nodes=2)
    other = _run(_job("o", "a"), 0)  # 8 GPUs of tenant a elsewhere
    foreign = _run(_job("x", "b", nodes=3), 3, 4, 5)  # another tenant's: not counted
    running = [other, foreign, _run(elastic, 1, 2)]
    bigger = ("r1.c1.n1", "r1.c1.n2", "r1.c1.n3")  # 24 GPUs for the elastic job
    assert may_hold(None, running, nodes, elastic, bigger)
    assert may_hold({}, running, nodes, elastic, bigger)
    assert may_hold(_quotas(a=32), running, nodes, elastic, bigger)  # 8 + 24 = its 32
    capped = {"a": TenantQuota(name="a", gpus=16, borrow_limit=8)}
    assert not may_hold(capped, running, nodes, elastic, bigger)  # borrows 16 > 8
    assert may_hold(capped, running, nodes, elastic, bigger[:2])  # borrows 8: its limit
    unlimited = {"a": TenantQuota(name="a", gpus=16)}
    assert may_hold(unlimited, running, nodes, elastic, bigger)  # no borrow limit
