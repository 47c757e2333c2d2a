"""The twin's engine (metalguard/twin/engine.py, jobs.py, metrics.py, policies.py):
small fleets over hours to days, with chosen faults, the real scheduler, health model
and job machine. Times below are worked out by hand from the job's costs."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.twin import jobs as twin_jobs
from metalguard.twin.engine import Engine, run
from metalguard.twin.failures import default_failure_model
from metalguard.twin.fleet import fleet_from_count
from metalguard.twin.generator import GangParams, generate_gangs
from metalguard.twin.health import HealthModel
from metalguard.twin.model import (
    Fault,
    FaultKind,
    JobOutcomeRecord,
    PlannedMaintenance,
    Policy,
    PolicyName,
    TwinInputs,
    TwinResult,
)
from metalguard.twin.policies import POLICIES
from tests.support.twin_small import (
    CLEAN_END,
    JOB,
    START,
    first_node,
    inputs,
    placement,
)

STATIC, REACTIVE, METALGUARD = POLICIES["static"], POLICIES["reactive"], POLICIES["metalguard"]

# a fault 2000 s after the start: 1700 s past the restart = 2 cycles of 660 + 380 of
# work, so progress 1580 and the last periodic checkpoint at 1200: 380 s are lost
FAULT_AT = START + 2000.0
LOST = 380.0
# from the 1200 checkpoint: 300 + 2400 + 3 checkpoints (1800, 2400, 3000) x 60
RESUMED_WALL = 300.0 + 2400.0 + 3 * 60.0


def fault(
    node: str,
    at: float = FAULT_AT,
    *,
    kind: FaultKind = "hardware",
    precursor: float | None = None,
    cause: str = "gpu_hbm3",
) -> Fault:
    return Fault(
        fault_id=1,
        node=node,
        at_s=at,
        cause=cause,
        kind=kind,
        signal="ecc" if kind == "hardware" else "",
        precursor_at_s=precursor,
        repair_s=3600.0,
    )


def simulate(
    inp: TwinInputs,
    policy: Policy,
    faults: tuple[Fault, ...] = (),
    planned: tuple[PlannedMaintenance, ...] = (),
    *,
    kept: bool = True,
) -> TwinResult:
    health = HealthModel(inp.nodes, policy)
    engine = Engine(inp, policy, faults=faults, planned=planned, health=health, kept=kept)
    return engine.run()


def record(result: TwinResult, job_id: str = "j") -> JobOutcomeRecord:
    (rec,) = [r for r in result.jobs if r.job_id == job_id]
    return rec


# --- progress, pure ----------------------------------------------------------------------


@pytest.mark.parametrize("remaining", [1.0, 599.0, 600.0, 601.0, 3600.0, 3725.5])
def test_wall_to_finish_is_where_the_work_is_done(remaining: float) -> None:
    wall = twin_jobs.wall_to_finish(remaining, 300.0, 600.0, 60.0)
    assert twin_jobs.work_done(wall, 300.0, 600.0, 60.0) == pytest.approx(remaining)
    assert twin_jobs.work_done(wall - 1.0, 300.0, 600.0, 60.0) < remaining


def test_progress_pauses_while_checkpointing() -> None:
    # cycle = 660: work 600, then a 60 s pause
    assert twin_jobs.work_done(300.0 + 630.0, 300.0, 600.0, 60.0) == 600.0
    assert twin_jobs.periodic_done(300.0 + 630.0, 300.0, 600.0, 60.0) == 0
    assert twin_jobs.periodic_done(300.0 + 660.0, 300.0, 600.0, 60.0) == 1
    assert twin_jobs.reached_offset(300.0 + 630.0, 300.0, 600.0, 60.0) == 900.0
    assert twin_jobs.checkpoints_before(3600.0, 600.0) == 5
    assert twin_jobs.checkpoints_before(3600.0, 0.0) == 0


# --- one job -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["static", "reactive", "metalguard"])
def test_one_job_without_faults_ends_at_work_plus_overheads(name: PolicyName) -> None:
    result = simulate(inputs(), POLICIES[name])
    rec = record(result)
    assert (rec.state, rec.first_start_s, rec.end_s) == ("succeeded", START, CLEAN_END)
    assert (rec.done_s, rec.redone_s, rec.unplanned, rec.planned) == (3600.0, 0.0, 0, 0)
    assert rec.held_s == CLEAN_END - START
    assert rec.queue_wait_s == (0.0,)
    assert result.gpu_seconds_busy == pytest.approx(16 * (CLEAN_END - START))
    assert result.gpu_seconds_available == 24 * 86_400.0


def test_reactive_moves_the_job_off_a_failed_node_losing_the_work_since_its_checkpoint() -> None:
    inp = inputs()
    result = simulate(inp, REACTIVE, (fault(first_node(inp)),))
    rec = record(result)
    assert result.decisions["job.rescheduled"] == 1
    assert result.decisions["move:node_failing"] == 1
    assert result.decisions["grade:HEALTHY->FAILING"] == 1
    assert (rec.unplanned, rec.planned) == (1, 0)
    assert rec.redone_s == LOST
    # evacuated at once (the checkpoint asked of crashed processes is refused), placed
    # on the other two nodes by the pass at the fault's time, resumed from 1200
    assert rec.end_s == FAULT_AT + RESUMED_WALL
    assert rec.state == "succeeded"
    assert rec.done_s == 3600.0


def test_static_fails_the_job_and_the_user_resubmits_it() -> None:
    inp = inputs()
    result = simulate(inp, STATIC, (fault(first_node(inp)),))
    rec = record(result)
    assert [r.job_id for r in result.jobs] == ["j"]  # attempts count as one job
    # the resubmission (2 h later) lands on the broken node again (nobody noticed it yet:
    # 4 h), crashes after its restart cost, and the next one (2 h later) runs
    first_retry = FAULT_AT + STATIC.resubmit_s
    second_retry = first_retry + JOB.restart_cost_s + STATIC.resubmit_s
    assert FAULT_AT + STATIC.human_notice_s < second_retry
    assert rec.end_s == second_retry + RESUMED_WALL
    assert (rec.state, rec.unplanned, rec.planned) == ("succeeded", 2, 0)
    assert result.decisions["job.failed"] == 2
    assert result.decisions["job.crashed"] == 2
    assert "job.rescheduled" not in result.decisions
    assert rec.redone_s == LOST
    assert len(rec.queue_wait_s) == 3


def test_a_sub_healthy_nodes_job_runs_on_and_a_fault_before_its_end_hits_it() -> None:
    """docs/decisions.md: SUB_HEALTHY takes no new work, its running jobs finish where
    they are; a fault before the job's end interrupts it (the precursor bought nothing
    for this job, only kept new work off the node)."""
    inp = inputs()
    node = first_node(inp)
    at = START + 4000.0  # before the job's end (CLEAN_END)
    result = simulate(inp, METALGUARD, (fault(node, at, precursor=at - 1800.0),))
    rec = record(result)
    assert result.decisions["grade:HEALTHY->SUB_HEALTHY"] == 1
    assert result.decisions["precursor:acted"] == 1
    assert result.decisions["fault:hit_while_sub_healthy"] == 1
    assert "fault:prevented" not in result.decisions
    assert (rec.unplanned, rec.planned) == (1, 0)


def test_a_sub_healthy_node_whose_job_ends_is_repaired_before_its_fault() -> None:
    inp = inputs()
    node = first_node(inp)
    at = CLEAN_END + 3000.0  # the job ends first
    result = simulate(inp, METALGUARD, (fault(node, at, precursor=START + 3000.0),))
    rec = record(result)
    assert rec.end_s == CLEAN_END  # undisturbed
    assert (rec.unplanned, rec.planned) == (0, 0)
    # its last job gone, the lifecycle drained it ("sub-healthy and its last job ended"):
    # repaired before the fault, which found nothing there
    assert result.decisions["grade:SUB_HEALTHY->MAINTENANCE"] == 1
    assert result.decisions["fault:prevented"] == 1


def test_at_the_drain_limit_the_job_moves_with_a_fresh_checkpoint() -> None:
    """``[lifecycle] sub_healthy_drain_after_s`` (24 h shipped; 600 s here) before the
    fault: MAINTENANCE with its jobs moved from a fresh checkpoint (planned)."""
    inp = inputs()
    node = first_node(inp)
    at = START + 4000.0
    health = HealthModel(
        inp.nodes, METALGUARD, lifecycle=LifecycleConfig(sub_healthy_drain_after_s=600.0)
    )
    faults = (fault(node, at, precursor=at - 1800.0),)
    result = Engine(inp, METALGUARD, faults=faults, planned=(), health=health).run()
    rec = record(result)
    assert result.decisions["precursor:drain_limit"] == 1
    assert result.decisions["move:maintenance"] == 1
    assert result.decisions["fault:prevented"] == 1
    assert (rec.unplanned, rec.planned, rec.redone_s) == (0, 1, 0.0)


def test_reactive_does_not_act_on_a_precursor() -> None:
    inp = inputs()
    at = START + 4000.0
    result = simulate(inp, REACTIVE, (fault(first_node(inp), at, precursor=at - 1800.0),))
    rec = record(result)
    assert (rec.unplanned, rec.planned) == (1, 0)
    assert "fault:prevented" not in result.decisions


def test_hang_found_by_the_hang_timeout_under_metalguard_by_a_person_otherwise() -> None:
    inp = inputs()
    hang = (fault(first_node(inp), kind="hang", cause="nccl_watchdog"),)
    mg = record(simulate(inp, METALGUARD, hang))
    timeout = METALGUARD.hang_timeout_s + JOB.restart_cost_s
    # detected hang_timeout after the last progress (the hang itself), restarted in place
    assert mg.end_s == pytest.approx(FAULT_AT + timeout + RESUMED_WALL, abs=0.01)
    assert (mg.unplanned, mg.redone_s) == (1, LOST)
    reactive = simulate(inp, REACTIVE, hang)
    rec = record(reactive)
    assert rec.end_s == FAULT_AT + REACTIVE.human_notice_s + RESUMED_WALL
    assert reactive.decisions["job.crashed"] == 1
    assert "job.hung" not in reactive.decisions
    assert (rec.unplanned, rec.redone_s) == (1, LOST)
    assert simulate(inp, METALGUARD, hang).decisions["job.hung"] == 1


def test_a_fault_the_rail_holds_back_waits_for_a_person() -> None:
    inp = inputs(n=6)
    on = placement(inp)
    idle = next(n.handle for n in inp.nodes if n.handle not in on)
    # the cluster's one isolation per hour goes to an idle node first ...
    first = replace(fault(idle, START + 100.0), fault_id=2)
    result = simulate(inp, REACTIVE, (first, fault(on[0])))
    rec = record(result)
    assert result.decisions["rail_held"] == 1
    # ... so the job's node stays HEALTHY: the job restarts in place on the broken node
    # and crashes again after each restart cost, until the person drains the node
    notice = FAULT_AT + REACTIVE.human_notice_s
    loops = int(REACTIVE.human_notice_s // JOB.restart_cost_s)
    assert rec.end_s == notice + RESUMED_WALL
    assert rec.unplanned == 1 + loops
    assert rec.redone_s == LOST  # the loops never got past their restart
    assert result.decisions["move:maintenance"] == 1
    assert result.decisions["operator:maintenance"] == 1


def test_software_fault_restarts_in_place_from_the_last_checkpoint() -> None:
    inp = inputs()
    crash = (fault(first_node(inp), kind="software", cause="software_bug"),)
    result = simulate(inp, REACTIVE, crash)
    rec = record(result)
    assert result.decisions["move:crash"] == 1
    assert rec.end_s == FAULT_AT + RESUMED_WALL
    assert (rec.unplanned, rec.redone_s) == (1, LOST)


def test_planned_maintenance_moves_the_job_with_a_fresh_checkpoint() -> None:
    inp = inputs()
    window = (PlannedMaintenance(first_node(inp), FAULT_AT, 3600.0),)
    rec = record(simulate(inp, REACTIVE, planned=window))
    assert (rec.unplanned, rec.planned, rec.redone_s) == (0, 1, 0.0)
    # static stops it at the window (a cancel): its user resubmits from the periodic one
    rec = record(simulate(inp, STATIC, planned=window))
    assert (rec.unplanned, rec.planned, rec.redone_s) == (0, 1, LOST)
    assert rec.end_s == FAULT_AT + STATIC.resubmit_s + RESUMED_WALL


# --- preemption ----------------------------------------------------------------------------

LOW = replace(JOB, job_id="low", submit_s=0.0, nodes=3, preemptible=True, priority=0)
HIGH = replace(JOB, job_id="high", submit_s=1000.0, nodes=3, priority=5)


def test_metalguard_preempts_a_preemptible_low_priority_job_for_a_high_one() -> None:
    result = simulate(inputs((LOW, HIGH)), METALGUARD)
    low, high = record(result, "low"), record(result, "high")
    assert result.decisions["scheduler:preemptions"] == 1
    assert result.decisions["job.preempted"] == 1
    assert (low.planned, low.unplanned) == (1, 0)
    # the victim's fresh checkpoint takes 60 s; its nodes then go to the high job
    assert high.first_start_s == HIGH.submit_s + LOW.checkpoint_cost_s
    assert high.end_s == high.first_start_s + CLEAN_END - START
    assert low.state == "succeeded"
    assert low.end_s is not None
    assert high.end_s is not None
    assert low.end_s > high.end_s
    assert low.redone_s == 0.0
    assert len(low.queue_wait_s) == 2
    assert low.queue_wait_s[0] == 0.0


@pytest.mark.parametrize("name", ["static", "reactive"])
def test_no_preemption_without_it(name: PolicyName) -> None:
    result = simulate(inputs((LOW, HIGH)), POLICIES[name])
    low, high = record(result, "low"), record(result, "high")
    assert "scheduler:preemptions" not in result.decisions
    assert low.end_s == CLEAN_END - START
    assert high.first_start_s == low.end_s


# --- the whole run ---------------------------------------------------------------------------


def busy_run(policy: Policy, seed: int = 3, *, kept: bool = True) -> TwinResult:
    nodes = fleet_from_count(24, rack_nodes=4)
    days = 4.0
    params = GangParams(
        sizes=((8, 4.0), (16, 3.0), (32, 2.0), (64, 1.0)),
        duration_median_days=0.5,
        duration_min_days=0.1,
        duration_max_days=2.0,
        offered_load=1.2,
    )
    gangs = generate_gangs(params, 24 * 8, days, random.Random(f"{seed}:gangs"))
    model = default_failure_model(0.05)  # ~13x Llama 3's rate: many faults in 4 days
    inp = TwinInputs(nodes=nodes, jobs=gangs, failures=model, days=days, seed=seed)
    if kept:
        return run(inp, policy)
    from metalguard.twin.failures import draw_faults, draw_planned

    faults = draw_faults(model, nodes, days, random.Random(f"{seed}:faults"))
    planned = draw_planned(model, nodes, days, random.Random(f"{seed}:planned"))
    return simulate(inp, policy, faults, planned, kept=False)


cached_run = functools.cache(busy_run)
"""The same run for the tests that only read it (deterministic: see below)."""


@pytest.mark.parametrize("name", ["static", "reactive", "metalguard"])
def test_conservation(name: PolicyName) -> None:
    result = cached_run(POLICIES[name])
    ids = [r.job_id for r in result.jobs]
    assert sorted(ids) == sorted(j.job_id for j in result.inputs.jobs)  # each exactly once
    assert len(set(ids)) == len(ids)
    assert result.gpu_seconds_busy <= result.gpu_seconds_available
    # a node out of service is down only once no job holds it: never busy and down
    assert result.gpu_seconds_down > 0
    total = result.gpu_seconds_busy + result.gpu_seconds_down
    assert total <= result.gpu_seconds_available * (1 + 1e-12)
    held = sum(r.held_s * r.gpus for r in result.jobs)
    assert held == pytest.approx(result.gpu_seconds_busy, rel=1e-9)
    assert all(p.busy_gpus <= 24 * 8 for p in result.timeline)
    assert len(result.timeline) == 401
    states = {r.state for r in result.jobs}
    assert states <= {"succeeded", "failed", "running", "queued"}
    assert result.decisions["scheduler:placements"] >= len(
        [r for r in result.jobs if r.first_start_s is not None]
    )
    for r in result.jobs:
        assert 0.0 <= r.done_s <= r.work_s
        assert r.redone_s >= 0.0
        assert (r.state == "succeeded") == (r.end_s is not None)
    assert sum(r.unplanned for r in result.jobs) > 0


def test_same_seed_same_result_other_seed_other_result() -> None:
    a, b = busy_run(METALGUARD), busy_run(METALGUARD)
    assert a == b
    assert busy_run(METALGUARD, seed=4).jobs != a.jobs


def test_kept_index_gives_what_a_rebuilt_one_gives() -> None:
    assert busy_run(METALGUARD, kept=False) == cached_run(METALGUARD)


def test_metalguard_beats_static_on_goodput() -> None:
    def useful(result: TwinResult) -> float:
        return sum(r.done_s * r.gpus for r in result.jobs)

    def unplanned(result: TwinResult) -> int:
        return sum(r.unplanned for r in result.jobs)

    static, metalguard = cached_run(STATIC), cached_run(METALGUARD)
    assert useful(metalguard) > useful(static)
    # static's resubmissions land on broken nodes nobody noticed yet, again and again
    assert unplanned(metalguard) < unplanned(static)
    assert metalguard.gpu_seconds_busy > static.gpu_seconds_busy
