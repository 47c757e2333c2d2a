"""Elastic jobs in the twin's pooled runs (issue 31; docs/twin.md "Elastic jobs"): the
real ``elastic.start_placement``, ``grow_decision`` and ``shrink_victims`` on 4 nodes of
one tenant, a job's progress following its size, and the figures worked out by hand."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from metalguard.twin.engine import Engine
from metalguard.twin.errors import TwinInputError
from metalguard.twin.fleet import fleet_from_count
from metalguard.twin.health import HealthModel
from metalguard.twin.jobs import make_job
from metalguard.twin.model import AllocationMode, JobSpec, Policy, TwinResult
from metalguard.twin.policies import POLICIES
from metalguard.twin.report import build_report
from metalguard.twin.tenants import (
    JobMix,
    Tenant,
    elastic_range,
    generate_tenant_jobs,
    load_tenants,
)
from tests.support.twin_small import CLEAN_END, JOB, START, inputs

METALGUARD = POLICIES["metalguard"]
NODES = inputs(n=4).nodes
PARTS = {"a": tuple(n.handle for n in NODES)}
"""One tenant whose guarantee is the whole fleet: nothing is borrowed or reclaimed."""
ELASTIC = replace(JOB, job_id="e", tenant="a", min_nodes=1, max_nodes=4, resize_interval_s=600)
"""JOB (2 nodes, 1 h of work, 300 s restart, a 60 s checkpoint every 600 s) from 1 to 4
nodes."""
WALL = CLEAN_END - START
"""JOB's wall time at its own 2 nodes: 4,200 s."""


def simulate(
    jobs: tuple[JobSpec, ...], mode: AllocationMode = "pooled", policy: Policy = METALGUARD
) -> TwinResult:
    inp = replace(inputs(jobs, n=4), allocation=mode, partitions=PARTS)
    engine = Engine(inp, policy, faults=(), health=HealthModel(inp.nodes, policy))
    return engine.run()


def record(result: TwinResult, job_id: str):  # type: ignore[no-untyped-def]
    return next(r for r in result.jobs if r.job_id == job_id)


def held(result: TwinResult, job_id: str) -> list[tuple[int, float, float]]:
    """Each holding of ``job_id``: (nodes, from, to)."""
    return [(len(s.nodes), s.start_s, s.end_s) for s in result.segments if s.job_id == job_id]


def test_the_real_job_carries_its_node_range() -> None:
    job = make_job(ELASTIC, METALGUARD, "e", 0.0)
    assert (job.nodes, job.min_nodes, job.max_nodes, job.resize_interval_s) == (2, 1, 4, 600)
    fixed = make_job(JOB, METALGUARD, "j", 0.0)
    assert (fixed.min_nodes, fixed.max_nodes) == (None, None)
    assert not JOB.elastic
    assert ELASTIC.elastic


def test_an_elastic_job_starts_at_the_largest_size_and_runs_as_fast_as_its_size() -> None:
    result = simulate((ELASTIC,))
    e = record(result, "e")
    # 4 nodes of its nominal 2: the whole schedule (restart, work, checkpoints) at 2x
    assert e.first_start_s == START
    assert e.end_s == pytest.approx(START + WALL / 2)
    assert e.done_s == e.work_s == 3600.0
    assert [n for n, _, _ in held(result, "e")] == [4]
    assert result.decisions["elastic:size:+2"] == 1
    # the GPU-seconds it held (32 GPUs x 2,100 s) against its work (16 GPUs x 3,600 s)
    assert e.held_gpu_s == pytest.approx(32 * WALL / 2)
    report = build_report(result)
    assert report["ettr"]["fleet"] == pytest.approx(3600 / WALL)  # what the fixed job has
    assert report["utilisation"] == pytest.approx(32 * WALL / 2 / (32 * 86_400), abs=1e-6)


def test_a_dedicated_partition_runs_the_same_job_at_its_own_size() -> None:
    e = record(simulate((ELASTIC,), "dedicated"), "e")
    assert e.end_s == pytest.approx(CLEAN_END)
    assert e.held_gpu_s is None  # not elastic there


def test_it_grows_into_the_nodes_a_fixed_job_leaves() -> None:
    # f holds 2 nodes for 300 + 1,200 + one 60 s checkpoint = 1,560 s; e starts on the
    # other 2 at START + 10 and grows to 4 once f ends (its 600 s interval long past)
    f = replace(JOB, job_id="f", tenant="a", work_s=1200.0)
    e = replace(ELASTIC, submit_s=START + 10, min_nodes=2, work_s=3 * 3600.0)
    grown = simulate((f, e))
    f_end = START + 300 + 1200 + 60
    assert record(grown, "f").end_s == pytest.approx(f_end)
    assert grown.decisions["elastic:grows"] == 1
    assert grown.decisions["job.resized"] == 1
    assert grown.decisions["interruption:planned:resized"] == 1
    sizes = [n for n, _, _ in held(grown, "e")]
    assert sizes[0] == 2
    assert sizes[-1] == 4
    r = record(grown, "e")
    assert r.done_s == r.work_s
    assert r.redone_s == 0.0
    fixed = record(simulate((f, replace(e, min_nodes=0, max_nodes=0))), "e")
    assert r.end_s is not None
    assert fixed.end_s is not None
    # at 4 nodes its work goes twice as fast: it ends well before the fixed one
    assert r.end_s < fixed.end_s - 3600


def test_it_shrinks_for_a_higher_priority_job_instead_of_stopping() -> None:
    e = replace(ELASTIC, min_nodes=2, work_s=3 * 3600.0, preemptible=True)
    high = replace(JOB, job_id="h", tenant="a", submit_s=START + 1000, priority=1)
    result = simulate((e, high))
    assert result.decisions["elastic:shrinks"] == 1
    assert result.decisions.get("scheduler:preemptions", 0) == 0
    sizes = [n for n, _, _ in held(result, "e")]
    assert sizes[0] == 4
    assert 2 in sizes
    h = record(result, "h")
    # the fresh checkpoint (60 s) and the stop free 2 nodes within the next passes
    assert h.first_start_s is not None
    assert h.first_start_s < START + 1000 + 300
    r = record(result, "e")
    assert r.done_s == r.work_s
    assert r.redone_s == 0.0
    assert r.unplanned == 0
    assert r.planned >= 1


def test_elastic_jobs_are_drawn_from_their_own_stream() -> None:
    part = fleet_from_count(64, rack_nodes=16)
    mix = JobMix(sizes=((8, 1.0), (32, 1.0)))
    base = Tenant(name="t", share=1.0, load=0.5, jobs=mix)
    some = replace(base, jobs=replace(mix, elastic_share=0.5))
    plain = generate_tenant_jobs(base, part, 10, random.Random(1), random.Random(2))
    drawn = generate_tenant_jobs(some, part, 10, random.Random(1), random.Random(2))
    assert [replace(j, min_nodes=0, max_nodes=0, resize_interval_s=0.0) for j in drawn] == list(
        plain
    )
    elastic = [j for j in drawn if j.elastic]
    assert elastic
    assert all((j.min_nodes, j.max_nodes) == elastic_range(j.nodes) for j in elastic)
    assert all(j.nodes >= 2 and j.resize_interval_s == 3600.0 for j in elastic)
    assert not any(j.elastic for j in plain)
    assert elastic_range(1) == (0, 0)
    assert elastic_range(4) == (2, 8)
    assert elastic_range(3) == (2, 6)


def test_a_tenants_file_with_an_elastic_share_above_one_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.toml"
    path.write_text(
        '[[tenant]]\nname = "a"\nshare = 1.0\nload = 0.5\n[tenant.jobs]\nelastic_share = 1.5\n'
    )
    with pytest.raises(TwinInputError, match=r"tenant\[0\]\.jobs\.elastic_share.*above 1"):
        load_tenants(path)


def test_the_report_counts_the_elastic_jobs_and_what_they_held_beyond_nominal() -> None:
    f = replace(JOB, job_id="f", tenant="a", work_s=1200.0)
    e = replace(ELASTIC, submit_s=START + 10, min_nodes=2, work_s=3 * 3600.0)
    result = simulate((f, e))
    section = build_report(result)["elastic"]
    r = record(result, "e")
    assert r.held_gpu_s is not None
    assert section["jobs"] == 1
    assert section["grows"] == 1
    assert section["shrinks"] == 0
    assert section["generations_above_nominal"] == 1  # the 4-node run after the growth
    assert section["gpu_hours_beyond_nominal"] == pytest.approx(
        (r.held_gpu_s - r.held_s * 16) / 3600, abs=1e-5
    )
    assert section["gpu_hours_beyond_nominal"] > 0
    assert section["size_over_nominal"] == pytest.approx(r.held_gpu_s / (r.held_s * 16), abs=1e-5)
    assert section["size_over_nominal"] > 1
    assert build_report(simulate((f, e), "dedicated"))["elastic"]["jobs"] == 0
