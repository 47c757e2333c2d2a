"""bench/soak.py: the short variant of the soak (issue 16, item 9) and its pure parts.

The short soak runs the demo fleet (2 regions x 8 nodes) with random faults and jobs for
90 s, a sample every 10 s, and asserts the invariants only: nothing lost or duplicated,
the demo exited 0 with its report, and no growth of asyncio tasks or open file
descriptors beyond the bounds below between the first sample after the warm-up and the
last.  No timing is asserted (the figures are printed; docs/benchmarks.md "Soak").
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metalguard.demo.sim.scenario import parse_scenario
from metalguard.runtime.tasks import TaskCountCollector

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"

TASK_GROWTH_BOUND = 40
"""Tasks the demo process may hold more at the last sample than at the first after the
warm-up.  The count moves with the work in flight, not with time: each running job member
costs its agent a few tasks (the process wait, its output and progress readers) and a job
move or a fault's handling a few more while it lasts; the short soak's seeded plan runs
3 jobs of 1-4 members, so ~5 members more at one sample than at another (~25 tasks) plus
a handful of in-flight requests.  A leak grows with time: one task per agent cycle would
add 16 x 60 ≈ 960 over the minute, one per event about 30-60, far above this."""
FD_GROWTH_BOUND = 16
"""Open descriptors the demo process may hold more at the last sample than at the first
after the warm-up: a job member costs its agent 1-3 (pipes, the workload socket's
connection), so ~5 more members account for ~15; a leak per cycle or per publish adds
hundreds."""


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mg_bench_soak", SOAK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_fault_plan_keeps_within_the_rail(soak: ModuleType) -> None:
    fleet = soak.Fleet()
    rng = random.Random(16)
    faults = soak.plan_faults(rng, fleet, 3 * 3600.0)
    assert soak.rail_limit(fleet.cluster_size) == 3
    assert {f["kind"] for f in faults} <= set(soak.KNOWN_KINDS)
    nodes = [f["node"] for f in faults]
    assert len(nodes) == len(set(nodes)), "each fault on its own node"
    for cluster in fleet.cluster_nodes():
        times = sorted(
            f["at"] for f in faults if f["node"].startswith(cluster) and f["expect"] == "FAILING"
        )
        assert times, cluster
        for i, t in enumerate(times):
            in_hour = [u for u in times[i:] if u - t < soak.RAIL_WINDOW_S]
            assert len(in_hour) <= 3, (cluster, times)
    text = soak.scenario_toml(faults, soak.plan_jobs(rng, fleet, 600.0, 40.0), 16)
    scenario = parse_scenario(text)
    assert len(scenario.fault) == len(faults)
    assert scenario.job


def test_fault_plan_puts_dcqcn_on_roce_nodes_and_expects_no_grade(soak: ModuleType) -> None:
    """A kind that changes no grade is planned without ``expect`` (so the demo does not
    judge it) and only on RoCE nodes (racks k2, k4)."""
    fleet = soak.Fleet()
    faults = soak.plan_faults(random.Random(21), fleet, 7200.0)
    assert {f["kind"] for f in faults} <= set(soak.KNOWN_KINDS)
    dcqcn = [f for f in faults if f["kind"] == "dcqcn_no_cnp"]
    assert dcqcn
    assert all(f["expect"] is None and soak.is_roce(f["node"]) for f in dcqcn)
    assert soak.is_roce("r1c1k2n3")
    assert not soak.is_roce("r1c1k3n3")
    scenario = parse_scenario(soak.scenario_toml(faults, [], 21))
    judged = {(f.node, f.kind): f.expect for f in scenario.fault}
    assert all(judged[(f["node"], f["kind"])] is None for f in dcqcn)
    assert judged[next((f["node"], f["kind"]) for f in faults if f["expect"])] is not None
    assert soak.take_node(["r1c1k1n1", "r1c1k3n2"], "dcqcn_no_cnp") is None  # no RoCE node


def test_checks_count_losses_and_duplicates(soak: ModuleType) -> None:
    stream = [
        {"id": "a", "kind": "node.isolated", "node": "n1"},
        {"id": "b", "kind": "node.isolated", "node": "n1"},
        {"id": "c", "kind": "job.queued", "node": None},
        {"id": "c", "kind": "job.queued", "node": None},
    ]
    report = [
        {"t": 1.0, "id": "a", "kind": "node.isolated"},
        {"t": 2.0, "id": "b", "kind": "node.isolated"},
        {"t": 3.0, "id": "z", "kind": "job.placed"},  # never stored
        {"t": 99.0, "id": "late", "kind": "job.placed"},  # after the cutoff: not judged
    ]
    faults = [{"node": "n1", "expect": "FAILING"}]
    out = soak.check_events(stream, report, faults, cutoff_t=10.0)
    assert out["missing_from_report"] == ["c"]
    assert out["missing_from_stream"] == ["z"]
    assert out["lost"] == 2
    assert out["duplicated_in_stream"] == 1
    assert out["isolated_twice_for_one_fault"] == {"n1": 2}
    assert out["duplicated"] == 1 + 2

    jobs = soak.check_jobs(
        {"j1": "id1", "j2": "id2"},
        {"jobs": [{"id": "id1", "name": "j1", "state": "running", "reason": ""}],
         "jobs_submitted": 2},
    )  # fmt: skip
    assert jobs["missing"] == ["j2"]
    assert jobs["lost"] == 2
    assert jobs["duplicated"] == 0


def test_growth_per_hour_is_the_fitted_slope(soak: ModuleType) -> None:
    samples = [{"t_s": t, "rss_mb": 100.0 + t / 360.0} for t in (0.0, 60.0, 120.0, 180.0)]
    assert soak.growth_per_hour(samples, "rss_mb", 60.0) == pytest.approx(10.0)
    assert soak.growth_per_hour(samples[:1], "rss_mb", 0.0) is None


async def test_task_count_gauge_counts_the_running_loops_tasks() -> None:
    registry = CollectorRegistry()
    registry.register(TaskCountCollector())
    values = [
        s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name == "metalguard_asyncio_tasks"
    ]
    assert len(values) == 1
    assert values[0] >= 1.0  # this test's own task at least


def test_task_count_gauge_is_absent_outside_a_loop() -> None:
    registry = CollectorRegistry()
    registry.register(TaskCountCollector())
    assert "metalguard_asyncio_tasks" not in generate_latest(registry).decode()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_soak_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [
        sys.executable, str(SOAK), "--minutes", "1.5", "--sample-s", "10", "--seed", "16",
        "--racks", "2", "--nodes-per-rack", "4", "--job-every-s", "15", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=280, check=False
    )
    print(result.stdout)  # the table and the figures (pytest -s)
    assert out.is_file(), result.stdout[-4000:] + result.stderr[-4000:]
    doc: dict[str, Any] = json.loads(out.read_text())

    demo = doc["demo"]
    assert demo["exit_status"] == 0, demo
    assert demo["report"], demo
    events, jobs = doc["events"], doc["jobs"]
    assert events["stream_events"] > 0, "the soak produced no events"
    assert events["lost"] == 0, events
    assert events["duplicated"] == 0, events
    assert events["undecodable"] == 0, events
    assert jobs["submitted"] > 0, jobs
    assert jobs["lost"] == 0, jobs
    assert jobs["duplicated"] == 0, jobs

    samples = doc["samples"]
    assert len(samples) == 10, samples  # t = 0, 10, ... 90 s
    assert all(s["tasks"] is not None for s in samples), "metalguard_asyncio_tasks missing"
    after = [s for s in samples if s["t_s"] >= doc["figures"]["warmup_s"]]
    first, last = after[0], after[-1]
    assert last["tasks"] - first["tasks"] <= TASK_GROWTH_BOUND, (first, last)
    assert last["fds"] - first["fds"] <= FD_GROWTH_BOUND, (first, last)
    assert result.returncode == 0, result.stdout[-4000:]
