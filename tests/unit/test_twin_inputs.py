"""The twin's inputs: fleets, the Alibaba trace, the gang generator, the failure model,
their draws, and every bad input named with its file and row or key."""

from __future__ import annotations

import csv
import math
import random
import re
import statistics
from collections import Counter
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.errors import TwinInputError
from metalguard.twin.failures import (
    DEFAULT_FAILURES_PATH,
    LLAMA3_INTERRUPTIONS,
    LLAMA3_NODE_DAYS,
    default_failure_model,
    draw_faults,
    draw_planned,
    load_failure_model,
    model_dict,
    sample,
)
from metalguard.twin.fleet import fleet_dict, fleet_from_count, fleet_from_csv, load_fleet
from metalguard.twin.generator import (
    DEFAULT_GANGS_PATH,
    GangParams,
    gang_capacity_gpus,
    generate_gangs,
    load_gang_params,
    mean_duration_s,
    params_dict,
)
from metalguard.twin.model import DAY_S, Distribution, FailureCause, FailureModel, JobSpec
from metalguard.twin.trace import Trace, check_fits, load_trace, read_trace

ALIBABA = Path(__file__).parent.parent / "fixtures" / "traces" / "alibaba-gpu-2023"
NODE_LIST = ALIBABA / "openb_node_list_gpu_node.csv"
POD_LIST = ALIBABA / "openb_pod_list_default.csv"
POD_LIST_NO_TIMES = ALIBABA / "openb_pod_list_multigpu20.csv"

POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time"
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _raises(
    path: Path | str, where: str, problem: str
) -> AbstractContextManager[pytest.ExceptionInfo[TwinInputError]]:
    """The error's three parts: the file, the place (row or key), what is wrong (a
    substring of the problem)."""
    head = re.escape(f"{path}: {where}: " if where else f"{path}: ")
    return pytest.raises(TwinInputError, match="^" + head + ".*" + re.escape(problem))


@pytest.fixture(scope="module")
def pods() -> list[dict[str, str]]:
    with open(POD_LIST, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def real_nodes() -> tuple[FleetNode, ...]:
    return fleet_from_csv(NODE_LIST)


@pytest.fixture(scope="module")
def real_trace() -> Trace:
    return read_trace(POD_LIST)


# --- errors -----------------------------------------------------------------------------


def test_error_text_names_file_place_and_problem() -> None:
    e = TwinInputError("f.toml", "key causes.gpu.precursor_fraction", "1.5 is above 1")
    assert str(e) == "f.toml: key causes.gpu.precursor_fraction: 1.5 is above 1"
    assert (e.path, e.where, e.problem) == (
        "f.toml",
        "key causes.gpu.precursor_fraction",
        "1.5 is above 1",
    )
    assert str(TwinInputError("f.csv", "", "empty file")) == "f.csv: empty file"


# --- fleets -----------------------------------------------------------------------------


def test_fleet_from_count_racks_clusters_and_handle_order() -> None:
    nodes = fleet_from_count(1100, rack_nodes=16, racks_per_cluster=32)
    handles = [n.handle for n in nodes]
    assert handles[0] == "twin.c0001.n000001"
    assert handles[-1] == "twin.c0003.n001100"
    assert sorted(handles) == handles
    assert len(set(handles)) == 1100
    assert Counter(n.cluster for n in nodes) == {"c0001": 512, "c0002": 512, "c0003": 76}
    racks = Counter(n.rack_key for n in nodes)
    assert len(racks) == 32 + 32 + 5
    assert max(racks.values()) == 16
    assert min(racks.values()) == 12
    assert nodes[16].rack == "r002"
    assert nodes[512].rack == "r001"
    assert {(n.gpus, n.gpu_type, n.cpu_cores, n.memory_gb, n.region) for n in nodes} == {
        (8, "H100", 192, 2048, "twin")
    }
    assert fleet_dict(nodes, 1100)["gpus"] == 8800
    with pytest.raises(ValueError, match="at least one node"):
        fleet_from_count(0)


def test_alibaba_node_list_parses_with_its_real_gpu_counts(
    real_nodes: tuple[FleetNode, ...],
) -> None:
    assert len(real_nodes) == 1213
    assert Counter(n.gpus for n in real_nodes) == {8: 617, 2: 518, 4: 54, 1: 24}
    by_model = Counter(n.gpu_type for n in real_nodes)
    assert by_model == {
        "G2": 549,
        "T4": 404,
        "P100": 134,
        "V100M16": 55,
        "G3": 39,
        "V100M32": 30,
        "A10": 2,
    }
    first = next(n for n in real_nodes if n.handle.endswith(".openb-node-0000"))
    assert (first.gpu_type, first.gpus, first.cpu_cores, first.memory_gb) == ("P100", 2, 64, 256)
    assert first.handle == "twin.p100-c01.openb-node-0000"
    assert first.rack == "r001"
    # one model per cluster, 549 G2 nodes: 512 in the first cluster, 37 in the second
    g2 = Counter(n.cluster for n in real_nodes if n.gpu_type == "G2")
    assert g2 == {"g2-c01": 512, "g2-c02": 37}
    assert all(len({n.gpu_type for n in real_nodes if n.cluster == c}) == 1 for c in g2)
    assert max(Counter(n.rack_key for n in real_nodes).values()) == 16
    assert len({n.handle for n in real_nodes}) == 1213
    assert load_fleet(str(NODE_LIST)) == real_nodes


def test_load_fleet_count_and_zero(tmp_path: Path) -> None:
    assert len(load_fleet("16")) == 16
    assert len(load_fleet(3)) == 3
    with _raises("--nodes", "", "0 nodes: the fleet needs at least one node"):
        load_fleet("0")
    with _raises(tmp_path / "nope.csv", "", "cannot read"):
        load_fleet(str(tmp_path / "nope.csv"))


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("sn,cpu_milli,memory_mib\na,1,1\n", "row 1", "missing columns gpu, model"),
        (
            "sn,cpu_milli,memory_mib,gpu,model\na,1000,1024,8,A\nb,1000,1024,2.5,A\n",
            "row 3",
            "column gpu: '2.5' is not a whole number",
        ),
        (
            "sn,cpu_milli,memory_mib,gpu,model\na,-1000,1024,8,A\n",
            "row 2",
            "column cpu_milli: -1000 is negative",
        ),
        (
            "sn,cpu_milli,memory_mib,gpu,model\na,1000,lots,8,A\n",
            "row 2",
            "column memory_mib: 'lots' is not a number",
        ),
        (
            "sn,cpu_milli,memory_mib,gpu,model\na,1,1,8,A\na,1,1,8,A\n",
            "row 3",
            "sn a repeats row 2",
        ),
        ("sn,cpu_milli,memory_mib,gpu,model\na.b,1,1,8,A\n", "row 2", "is not a node name"),
        ("sn,cpu_milli,memory_mib,gpu,model\na,1,1,8\n", "row 2", "4 cells but the header has 5"),
        ("sn,cpu_milli,memory_mib,gpu,model\n", "", "no nodes"),
        ("", "", "empty file"),
    ],
)
def test_bad_node_lists_name_file_and_row(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    path = _write(tmp_path, "nodes.csv", text)
    with _raises(path, where, problem):
        fleet_from_csv(path)


# --- the trace --------------------------------------------------------------------------


def test_alibaba_pod_list_parses(real_trace: Trace, pods: list[dict[str, str]]) -> None:
    never_ran = [p for p in pods if p["pod_phase"] == "Pending" and p["scheduled_time"] == ""]
    assert len(pods) == 8152
    assert len(never_ran) == 897
    assert real_trace.rows == 8152
    assert real_trace.skipped == {"pending_never_scheduled": 897}
    jobs = real_trace.jobs
    assert len(jobs) == 8152 - 897
    skipped = {p["name"] for p in never_ran}
    kept = {p["name"]: p for p in pods if p["name"] not in skipped}
    assert {j.job_id for j in jobs} == set(kept)
    assert Counter(j.outcome for j in jobs)["failed"] == sum(
        p["pod_phase"] == "Failed" for p in kept.values()
    )
    assert Counter(j.gpus_per_node for j in jobs) == Counter(
        int(p["num_gpu"]) for p in kept.values()
    )
    assert real_trace.cpu_only == sum(p["num_gpu"] == "0" for p in kept.values())
    assert real_trace.gpu_shared_rounded_up == sum(
        p["num_gpu"] == "1" and int(p["gpu_milli"]) < 1000 for p in kept.values()
    )
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    by_id = {j.job_id: j for j in jobs}
    # openb-pod-0001: LS, 6 cores, 12 GiB, 0.46 of a GPU (-> one whole GPU)
    j = by_id["openb-pod-0001"]
    assert (j.submit_s, j.work_s) == (427061.0, 12902960.0 - 427061.0)
    assert (j.nodes, j.gpus_per_node, j.cpu, j.memory_gb) == (1, 1, 6, 12)
    assert (j.priority, j.preemptible, j.checkpoint_interval_s) == (1, False, 0.0)
    assert j.origin == f"{POD_LIST}:row 3"
    assert j.source == "trace"
    be = next(j for j in jobs if kept[j.job_id]["qos"] == "BE")
    assert (be.priority, be.preemptible) == (0, True)
    cpu_only = next(j for j in jobs if j.gpus_per_node == 0)
    assert cpu_only.cpu >= 1
    assert all(j.work_s >= 0 for j in jobs)


def test_the_real_trace_fits_the_real_fleet(
    real_trace: Trace, real_nodes: tuple[FleetNode, ...]
) -> None:
    check_fits(real_trace.jobs, real_nodes)


def test_pod_list_without_times_is_refused() -> None:
    with _raises(POD_LIST_NO_TIMES, "row 1", "missing columns creation_time, deletion_time"):
        load_trace(POD_LIST_NO_TIMES)


def test_trace_mapping_rules(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "pods.csv",
        POD_HEADER + "\n"
        "p1,4000,8192,1,1000,A10,LS,Succeeded,100,400,150\n"
        "p2,500,100,0,0,A|B,BE,Failed,160,200,170\n"
        "p3,1000,1024,2,1000,,Guaranteed,Pending,200,300,\n"
        "p4,1000,1024,8,1000,,weird,Running,250,1000,0\n",
    )
    jobs = {j.job_id: j for j in load_trace(path, start_s=1000.0, restart_cost_s=5.0)}
    assert set(jobs) == {"p1", "p2", "p4"}  # p3 was deleted while pending
    p1, p2, p4 = jobs["p1"], jobs["p2"], jobs["p4"]
    assert (p1.submit_s, p1.work_s, p1.gpu_type, p1.gpus_per_node, p1.cpu, p1.memory_gb) == (
        1000.0,
        250.0,
        "A10",
        1,
        4,
        8,
    )
    assert (p2.gpus_per_node, p2.cpu, p2.memory_gb, p2.gpu_type, p2.outcome) == (
        0,
        1,
        1,
        "",
        "failed",
    )
    assert (p2.priority, p2.preemptible, p2.restart_cost_s) == (0, True, 5.0)
    # scheduled 0 while created at 250: it never got a start time; counts from creation
    assert (p4.submit_s, p4.work_s, p4.priority, p4.gpus_per_node) == (1150.0, 750.0, 0, 8)
    without = _write(
        tmp_path,
        "plain.csv",
        "name,num_gpu,creation_time,deletion_time\na,1,10,50\nb,2,20,20\n",
    )
    plain = load_trace(without)
    assert [(j.job_id, j.submit_s, j.work_s, j.cpu, j.memory_gb) for j in plain] == [
        ("a", 0.0, 40.0, 0, 0),
        ("b", 10.0, 0.0, 0, 0),
    ]


@pytest.mark.parametrize(
    ("row", "where", "problem"),
    [
        ("p,1,1,1,1000,,LS,Running,-5,10,0", "row 2", "column creation_time: -5 is negative"),
        (
            "p,1,1,1,1000,,LS,Running,50,10,50",
            "row 2",
            "deletion_time 10 is before creation_time 50",
        ),
        ("p,1,1,x,1000,,LS,Running,0,10,0", "row 2", "column num_gpu: 'x' is not a number"),
        (
            "p,1,1,1.5,1000,,LS,Running,0,10,0",
            "row 2",
            "column num_gpu: '1.5' is not a whole number",
        ),
        (
            "p,1,1,1,1000,,LS,Running,0,10,soon",
            "row 2",
            "column scheduled_time: 'soon' is not a number",
        ),
        ("p,1,1,1,1000,,LS,Running,5,10,2", "row 2", "scheduled_time 2 is before creation_time 5"),
        (
            "p,1,1,1,1000,,LS,Running,5,10,20",
            "row 2",
            "deletion_time 10 is before scheduled_time 20",
        ),
        ("p,1,1,1,1000,,LS,Running,0,nan,0", "row 2", "column deletion_time: 'nan' is not finite"),
        (",1,1,1,1000,,LS,Running,0,10,0", "row 2", "column name is empty"),
    ],
)
def test_bad_pod_lists_name_file_and_row(
    tmp_path: Path, row: str, where: str, problem: str
) -> None:
    path = _write(tmp_path, "pods.csv", f"{POD_HEADER}\n{row}\n")
    with _raises(path, where, problem):
        load_trace(path)


def test_bad_row_after_good_ones_names_its_row(tmp_path: Path) -> None:
    good = "p{},1,1,1,1000,,LS,Running,0,10,0"
    text = "\n".join(
        [POD_HEADER, *(good.format(i) for i in range(5)), "q,1,1,-1,1000,,LS,Running,0,10,0"]
    )
    path = _write(tmp_path, "pods.csv", text + "\n")
    with _raises(path, "row 7", "column num_gpu: -1 is negative"):
        load_trace(path)


def test_check_fits_names_the_job_that_cannot_fit(real_trace: Trace) -> None:
    small = fleet_from_count(4, gpus_per_node=2, gpu_type="T4", cpu_cores=96, memory_gb=512)
    first_big = next(j for j in real_trace.jobs if j.gpus_per_node > 2)
    row = first_big.origin.rpartition(":")[2]
    with _raises(POD_LIST, row, f"needs 1 node with {first_big.gpus_per_node} GPUs"):
        check_fits(real_trace.jobs, small)
    with pytest.raises(TwinInputError, match="the fleet's largest node has 2 GPUs"):
        check_fits(real_trace.jobs, small)

    fleet = fleet_from_count(256)
    gang = JobSpec("gang-00001", 0.0, 300, 8, 3600.0, source="gang", origin="gang generator #1")
    with _raises("gang generator #1", "job gang-00001", "needs 300 nodes with 8 GPUs each"):
        check_fits([gang], fleet)
    with pytest.raises(TwinInputError, match="but the fleet has only 256 such nodes"):
        check_fits([gang], fleet)
    typed = JobSpec("t", 0.0, 1, 1, 60.0, gpu_type="A10", origin="x.csv:row 9")
    with _raises("x.csv", "row 9", "the fleet has no A10 nodes (its GPU types: H100)"):
        check_fits([typed], fleet)
    hungry = JobSpec("m", 0.0, 1, 8, 60.0, cpu=16, memory_gb=4096, origin="x.csv:row 4")
    with _raises("x.csv", "row 4", "the fleet's largest such node has 2048 GB of memory"):
        check_fits([hungry], fleet)
    check_fits([JobSpec("w", 0.0, 256, 0, 60.0)], fleet)  # 256 whole nodes: fits


# --- the gang generator -----------------------------------------------------------------


def test_default_gang_file_is_the_dataclass_defaults() -> None:
    assert load_gang_params(DEFAULT_GANGS_PATH) == GangParams()
    d = params_dict(GangParams())
    assert d["sizes"] == {
        "8": 30.0,
        "16": 20.0,
        "32": 15.0,
        "64": 12.0,
        "128": 9.0,
        "256": 6.0,
        "512": 4.0,
        "1024": 2.5,
        "2048": 1.5,
    }
    assert d["offered_load"] == 0.8
    assert d["mean_gpus"] == pytest.approx(121.76)


def test_generate_gangs_hits_its_offered_load() -> None:
    params = GangParams()
    fleet_gpus, days = 100_000, 120.0
    jobs = generate_gangs(params, fleet_gpus, days, random.Random(7))
    assert len(jobs) > 10_000
    asked = sum(j.gpus * j.work_s for j in jobs)
    assert asked / (fleet_gpus * days * DAY_S) == pytest.approx(0.8, rel=0.10)
    # the clipped lognormal's closed-form mean against the draws
    assert statistics.fmean(j.work_s for j in jobs) == pytest.approx(
        mean_duration_s(params), rel=0.03
    )
    assert all(DAY_S <= j.work_s <= 28 * DAY_S for j in jobs)
    assert Counter(j.gpus for j in jobs).keys() == {8, 16, 32, 64, 128, 256, 512, 1024, 2048}
    assert [j.job_id for j in jobs[:3]] == ["gang-00001", "gang-00002", "gang-00003"]
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    assert all(0 <= j.submit_s < days * DAY_S for j in jobs)
    high = sum(j.priority == 1 for j in jobs) / len(jobs)
    pre = sum(j.preemptible for j in jobs) / len(jobs)
    assert high == pytest.approx(0.2, abs=0.02)
    assert pre == pytest.approx(0.3, abs=0.02)
    assert not any(j.preemptible and j.priority for j in jobs)
    j = jobs[0]
    assert (j.gpus_per_node, j.checkpoint_interval_s, j.checkpoint_cost_s, j.restart_cost_s) == (
        8,
        3600.0,
        120.0,
        600.0,
    )
    assert (j.source, j.origin, j.nodes * 8) == ("gang", "gang generator #1", j.gpus)


def test_generate_gangs_sizes_bounded_and_deterministic() -> None:
    params = GangParams()
    a = generate_gangs(params, 512, 365.0, random.Random(3))
    assert a == generate_gangs(params, 512, 365.0, random.Random(3))
    assert a != generate_gangs(params, 512, 365.0, random.Random(4))
    assert {j.gpus for j in a} == {8, 16, 32, 64, 128, 256, 512}
    capped = generate_gangs(params, 100_000, 30.0, random.Random(3), largest_gang_gpus=64)
    assert {j.gpus for j in capped} == {8, 16, 32, 64}
    asked = sum(j.gpus * j.work_s for j in capped) / (100_000 * 30 * DAY_S)
    assert asked == pytest.approx(0.8, rel=0.10)  # the renormalised sizes still offer 0.8
    with _raises("gang generator", "key sizes", "no gang size fits the fleet's 4 GPUs"):
        generate_gangs(params, 4, 10.0, random.Random(1))
    assert generate_gangs(GangParams(offered_load=0.0), 512, 10.0, random.Random(1)) == ()


def test_gang_capacity_of_a_mixed_fleet(real_nodes: tuple[FleetNode, ...]) -> None:
    assert gang_capacity_gpus(real_nodes, 8) == 8 * 617


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("offered_lod = 0.8\n", "key offered_lod", "unknown key"),
        ("restart_cost_s = -1\n", "key restart_cost_s", "-1.0 is negative"),
        ("preemptible_share = 1.5\n", "key preemptible_share", "1.5 is above 1"),
        (
            "high_priority_share = 0.6\npreemptible_share = 0.6\n",
            "key preemptible_share",
            "is above 1",
        ),
        ("gpus_per_node = 8.5\n", "key gpus_per_node", "not a whole number"),
        ("offered_load = 'lots'\n", "key offered_load", "is not a number"),
        ("duration_min_days = 30.0\n", "key duration_min_days", "is above duration_max_days"),
        ("[sizes]\n8 = 1.0\n16 = 0\n", "key sizes.16", "weight 0 is not positive"),
        ("[sizes]\n12 = 1.0\n", "key sizes.12", "not a positive multiple of gpus_per_node (8)"),
        ("[sizes]\nbig = 1.0\n", "key sizes.big", "is not a GPU count"),
        ("offered_load = \n", "", "not valid TOML"),
    ],
)
def test_bad_gang_params_name_the_key(tmp_path: Path, text: str, where: str, problem: str) -> None:
    path = _write(tmp_path, "gangs.toml", text)
    with _raises(path, where, problem):
        load_gang_params(path)


def test_gang_params_file_overrides_some_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "gangs.toml", "offered_load = 0.5\n[sizes]\n16 = 1\n32 = 3\n")
    params = load_gang_params(path)
    assert params == GangParams(offered_load=0.5, sizes=((16, 1.0), (32, 3.0)))


# --- the failure model ------------------------------------------------------------------

GPU = "[causes.gpu]\nrate_per_node_day = 0.1\n"
"""A cause's table start, for the bad-file cases below."""

TABLE5 = {
    "faulty_gpu": 148,
    "gpu_hbm3": 72,
    "software_bug": 54,
    "network_switch_cable": 35,
    "host_maintenance": 32,
    "gpu_sram": 19,
    "gpu_system_processor": 17,
    "nic": 7,
    "nccl_watchdog": 7,
    "silent_data_corruption": 6,
    "gpu_thermal": 6,
    "ssd": 3,
    "power_supply": 3,
    "server_chassis": 2,
    "io_expansion_board": 2,
    "dependency": 2,
    "cpu": 2,
    "system_memory": 2,
}


def test_default_model_is_llama3_table5() -> None:
    model = default_failure_model()
    assert sum(TABLE5.values()) == LLAMA3_INTERRUPTIONS == 419
    assert model.total_rate_per_node_day == pytest.approx(419 / (2048 * 54), rel=1e-12)
    assert {
        c.name: round(c.rate_per_node_day * LLAMA3_NODE_DAYS, 9) for c in model.causes
    } == TABLE5
    assert model.planned_rate_per_node_day * LLAMA3_NODE_DAYS == pytest.approx(47)
    kinds = {c.name: c.kind for c in model.causes}
    assert kinds["software_bug"] == kinds["dependency"] == "software"
    assert kinds["nccl_watchdog"] == "hang"
    assert Counter(kinds.values())["hardware"] == 15
    by_name = {c.name: c for c in model.causes}
    assert by_name["gpu_hbm3"].signal == "ecc"
    assert by_name["ssd"].signal == "smart"
    assert all(c.signal for c in model.causes if c.precursor_fraction > 0)
    assert model.source == "llama3 (default)"
    scaled = default_failure_model(total_rate_per_node_day=0.01)
    assert scaled.total_rate_per_node_day == pytest.approx(0.01, rel=1e-12)
    assert scaled.causes[0].rate_per_node_day == pytest.approx(0.01 * 148 / 419)
    d = model_dict(model)
    assert d["causes"]["faulty_gpu"]["share"] == pytest.approx(148 / 419)  # type: ignore[index]
    assert load_failure_model(DEFAULT_FAILURES_PATH).source == str(DEFAULT_FAILURES_PATH)


def test_rates_without_a_total(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "f.toml",
        '[causes.gpu]\nrate_per_node_day = 0.002\nsignal = "gpu"\nprecursor_fraction = 0.5\n'
        'lead_time = {kind = "exponential", mean_s = 60}\n'
        '[causes.bug]\nrate_per_node_day = 0.001\nkind = "software"\n',
    )
    model = load_failure_model(path)
    assert [(c.name, c.rate_per_node_day, c.kind) for c in model.causes] == [
        ("gpu", 0.002, "hardware"),
        ("bug", 0.001, "software"),
    ]
    assert model.causes[0].lead_time == Distribution("exponential", 60.0, 1.0)
    assert model.planned_rate_per_node_day == 0.0
    doubled = load_failure_model(path, total_rate_per_node_day=0.006)
    assert [c.rate_per_node_day for c in doubled.causes] == pytest.approx([0.004, 0.002])


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        (
            GPU + "signal = 'gpu'\nprecursor_fraction = 1.5\n",
            "key causes.gpu.precursor_fraction",
            "1.5 is above 1",
        ),
        (
            "[causes.gpu]\nrate_per_node_day = -0.1\n",
            "key causes.gpu.rate_per_node_day",
            "-0.1 is negative",
        ),
        (
            "total_rate_per_node_day = 0.1\n[causes.gpu]\nshare = -2\n",
            "key causes.gpu.share",
            "-2 is negative",
        ),
        ("total_rate_per_node_day = -0.1\n", "key total_rate_per_node_day", "-0.1 is negative"),
        ("[planned]\nrate_per_node_day = -1\n", "key planned.rate_per_node_day", "is negative"),
        (
            GPU + "kind = 'meteor'\n",
            "key causes.gpu.kind",
            "'meteor' is not one of",
        ),
        (
            GPU + "signal = 'smoke'\n",
            "key causes.gpu.signal",
            "'smoke' is not one of",
        ),
        (
            GPU + "colour = 'red'\n",
            "key causes.gpu.colour",
            "unknown key",
        ),
        ("severity = 3\n", "key severity", "unknown key"),
        (
            GPU + "repair = {kind = 'gamma', mean_s = 5}\n",
            "key causes.gpu.repair.kind",
            "'gamma' is not one of",
        ),
        (
            GPU + "repair = {kind = 'fixed', mean_s = -5}\n",
            "key causes.gpu.repair.mean_s",
            "-5 is negative",
        ),
        (
            GPU + "repair = {kind = 'fixed', mean_s = 5, sigma = 1}\n",
            "key causes.gpu.repair.sigma",
            "only a lognormal has a sigma",
        ),
        (
            GPU + "repair = {kind = 'lognormal'}\n",
            "key causes.gpu.repair.mean_s",
            "missing",
        ),
        (
            GPU + "repair = 5\n",
            "key causes.gpu.repair",
            "is not a table",
        ),
        (
            "[planned]\nduration = {kind = 'lognormal', mean_s = 5, sigma = -1}\n",
            "key planned.duration.sigma",
            "-1 is negative",
        ),
        (
            "[causes.gpu]\nshare = 1\n",
            "key causes.gpu.share",
            "needs a top-level total_rate_per_node_day",
        ),
        (
            "total_rate_per_node_day = 0.1\n[causes.gpu]\nrate_per_node_day = 0.1\n",
            "key causes.gpu.rate_per_node_day",
            "give a share, not a rate",
        ),
        ("[causes.gpu]\nkind = 'hardware'\n", "key causes.gpu.rate_per_node_day", "missing"),
        (
            GPU + "precursor_fraction = 0.5\n",
            "key causes.gpu.precursor_fraction",
            "needs a signal",
        ),
        (
            "total_rate_per_node_day = 0.1\n[causes.gpu]\nshare = 0\n",
            "key causes",
            "no cause has a positive share",
        ),
        (
            "[causes.gpu]\nrate_per_node_day = true\n",
            "key causes.gpu.rate_per_node_day",
            "True is not a number",
        ),
        ("[causes.gpu\n", "", "not valid TOML"),
    ],
)
def test_bad_failure_models_name_the_key(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    path = _write(tmp_path, "failures.toml", text)
    with _raises(path, where, problem):
        load_failure_model(path)


def test_precursor_fraction_error_reads_as_documented(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "f.toml",
        GPU + "signal = 'gpu'\nprecursor_fraction = 1.5\n",
    )
    with pytest.raises(TwinInputError) as info:
        load_failure_model(path)
    assert str(info.value) == f"{path}: key causes.gpu.precursor_fraction: 1.5 is above 1"


# --- drawing faults ---------------------------------------------------------------------


def test_draw_faults_count_matches_the_rate_and_is_deterministic() -> None:
    model = default_failure_model()
    nodes = fleet_from_count(2048)
    days = 540.0  # 10 x Llama 3's run: 4,190 expected
    faults = draw_faults(model, nodes, days, random.Random(11))
    expected = model.total_rate_per_node_day * len(nodes) * days
    assert expected == pytest.approx(4190)
    assert abs(len(faults) - expected) < 4 * math.sqrt(expected)
    by_cause = Counter(f.cause for f in faults)
    for cause in model.causes:
        mean = cause.rate_per_node_day * len(nodes) * days
        assert abs(by_cause[cause.name] - mean) < 4 * math.sqrt(mean) + 1, cause.name
    assert [(f.at_s, f.fault_id) for f in faults] == sorted((f.at_s, f.fault_id) for f in faults)
    assert [f.fault_id for f in faults] == list(range(1, len(faults) + 1))
    assert all(0 <= f.at_s < days * DAY_S for f in faults)
    assert draw_faults(model, nodes, days, random.Random(11)) == faults
    assert draw_faults(model, nodes, days, random.Random(12)) != faults
    # precursors: about the cause's fraction, always before the fault, never before 0
    hbm = [f for f in faults if f.cause == "gpu_hbm3"]
    shown = [f for f in hbm if f.precursor_at_s is not None]
    assert len(shown) / len(hbm) == pytest.approx(0.7, abs=0.08)
    assert all(0 <= f.precursor_at_s < f.at_s for f in shown)  # type: ignore[operator]
    assert all(f.precursor_at_s is None for f in faults if f.cause == "software_bug")
    assert {f.kind for f in faults if f.cause == "nccl_watchdog"} == {"hang"}
    assert all(f.repair_s > 0 for f in faults if f.kind == "hardware")
    assert all(f.repair_s == 0 for f in faults if f.kind != "hardware")
    # nodes uniformly: every node's count is Poisson(~2.05); none far out
    per_node = Counter(f.node for f in faults)
    assert set(per_node) <= {n.handle for n in nodes}
    assert max(per_node.values()) <= 12


def test_draw_faults_counts_are_poisson() -> None:
    """Over many seeds the count's variance equals its mean (a Poisson count, not a
    fixed or rounded one) and per-node counts have the Poisson zero share."""
    model = FailureModel((FailureCause("x", 0.01),))
    counts = [len(draw_faults(model, ["a", "b"], 1000.0, random.Random(s))) for s in range(300)]
    mean = statistics.fmean(counts)
    assert mean == pytest.approx(20.0, rel=0.05)
    assert statistics.variance(counts) / mean == pytest.approx(1.0, abs=0.25)
    assert draw_faults(model, ["a"], 0.0, random.Random(1)) == ()
    assert draw_faults(FailureModel(()), ["a"], 10.0, random.Random(1)) == ()


def test_precursor_before_the_run_is_none() -> None:
    cause = FailureCause(
        "x", 1.0, signal="ecc", precursor_fraction=1.0, lead_time=Distribution("fixed", 10 * DAY_S)
    )
    faults = draw_faults(FailureModel((cause,)), ["a"], 5.0, random.Random(2))
    assert faults
    assert all(f.precursor_at_s is None for f in faults)


def test_draw_planned_rate_and_durations() -> None:
    model = default_failure_model()
    nodes = fleet_from_count(2048)
    planned = draw_planned(model, nodes, 540.0, random.Random(5))
    assert abs(len(planned) - 470) < 4 * math.sqrt(470)
    assert [p.at_s for p in planned] == sorted(p.at_s for p in planned)
    assert statistics.median(p.duration_s for p in planned) == pytest.approx(3600.0, rel=0.15)
    assert draw_planned(model, nodes, 540.0, random.Random(5)) == planned


def test_sample_distributions() -> None:
    rng = random.Random(9)
    assert sample(Distribution("fixed", 5.0), rng) == 5.0
    expo = [sample(Distribution("exponential", 100.0), rng) for _ in range(4000)]
    assert statistics.fmean(expo) == pytest.approx(100.0, rel=0.06)
    logn = [sample(Distribution("lognormal", 100.0, 0.5), rng) for _ in range(4000)]
    assert statistics.median(logn) == pytest.approx(100.0, rel=0.05)
    assert statistics.fmean(logn) == pytest.approx(100.0 * math.exp(0.125), rel=0.05)
    assert sample(Distribution("lognormal", 0.0), rng) == 0.0
