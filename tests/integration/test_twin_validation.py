"""The fleet twin's engine validated (issue 19, "Validation, in tests"): against the closed
forms of metalguard.twin.theory (ETTR within 2 %, the best checkpoint interval of a sweep
within 10 % of Young/Daly), conservation and determinism on a mixed run under every
policy, and Llama 3 405B's fleet (2,048 nodes x 8 GPUs, one 16,384-GPU job, 54 days):
unexpected interruptions within the Poisson range of 419, ETTR next to the paper's >90 %.

These run the REAL engine (metalguard.twin.engine.run) with the real scheduler, health
model and job machine. The small ones take ~10 s together; the Llama 3 run is marked slow
(~50 s of CPU: ~470 moves of a 2,048-member gang through the real job machine).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import pytest

from metalguard.twin import theory
from metalguard.twin.engine import run
from metalguard.twin.failures import default_failure_model
from metalguard.twin.fleet import fleet_from_count
from metalguard.twin.generator import GangParams, generate_gangs
from metalguard.twin.model import (
    DAY_S,
    POLICY_NAMES,
    Distribution,
    FailureCause,
    FailureModel,
    JobSpec,
    Policy,
    TwinInputs,
    TwinResult,
)
from metalguard.twin.policies import POLICIES
from metalguard.twin.report import build_report, dumps_report

# -- one job under constant-rate hardware faults ------------------------------------------

JOB_NODES = 8
SPARES = 2
"""Idle nodes beside the job's: a failed node is replaced at once (and repaired in a
minute), so its repair never delays the job — the closed form has no repair term."""


def _quiet_reactive() -> Policy:
    """The reactive policy (automatic isolation, restart from the last checkpoint, no
    precursors) with the engine's own overheads folded away: queue passes at once, so a
    restart costs exactly the job's restart_cost_s, as in the closed form."""
    return dataclasses.replace(POLICIES["reactive"], pass_interval_s=1e-3, delivery_s=0.0)


def _one_job_inputs(
    *, mttf_job_s: float, work_s: float, interval_s: float, ckpt_s: float, restart_s: float,
    days: float, seed: int,
) -> TwinInputs:  # fmt: skip
    """One gang of JOB_NODES whole nodes on JOB_NODES + SPARES nodes, every node failing
    (hardware, no precursor) so that the job sees one fault per ``mttf_job_s``."""
    per_node_day = DAY_S / mttf_job_s / JOB_NODES
    cause = FailureCause(
        "constant",
        per_node_day,
        kind="hardware",
        precursor_fraction=0.0,
        repair=Distribution("fixed", 60.0),
    )
    job = JobSpec(
        job_id="job",
        submit_s=0.0,
        nodes=JOB_NODES,
        gpus_per_node=8,
        work_s=work_s,
        checkpoint_interval_s=interval_s,
        checkpoint_cost_s=ckpt_s,
        restart_cost_s=restart_s,
        source="gang",
        origin="test",
    )
    return TwinInputs(
        nodes=fleet_from_count(JOB_NODES + SPARES),
        jobs=(job,),
        failures=FailureModel(causes=(cause,), source="test: constant rate"),
        days=days,
        seed=seed,
    )


def _finished_wall(result: TwinResult) -> tuple[float, int]:
    """The one job's wall seconds from its first start to its end, and its interruptions."""
    (job,) = result.jobs
    assert job.state == "succeeded", job
    assert job.first_start_s is not None
    assert job.end_s is not None
    assert job.done_s == pytest.approx(job.work_s)
    return job.end_s - job.first_start_s, job.unplanned


def test_one_job_ettr_matches_the_closed_form() -> None:
    # The job's MTTF 4 h, checkpoints every 30 min (60 s each), restart 5 min: ETTR ~0.89.
    # 8 seeds x ~70 failures: the relative standard error of the mean wall is ~0.4 %
    # (0.09 / sqrt(560), the per-failure loss's spread), so 2 % is ~5 sigma.
    mttf, tau, ckpt, restart = 4 * 3600.0, 1800.0, 60.0, 300.0
    rate = 1 / mttf
    work = 10 * DAY_S
    expect = theory.expected_wall_s(work, tau, ckpt, restart, rate)
    walls, failures = [], 0
    for seed in range(8):
        inputs = _one_job_inputs(
            mttf_job_s=mttf, work_s=work, interval_s=tau, ckpt_s=ckpt, restart_s=restart,
            days=1.3 * expect / DAY_S, seed=seed,
        )  # fmt: skip
        wall, hits = _finished_wall(run(inputs, _quiet_reactive()))
        walls.append(wall)
        failures += hits
    sim_ettr = work * len(walls) / sum(walls)
    want = theory.expected_ettr(work, tau, ckpt, restart, rate)
    print(
        f"\nclosed form: simulated ETTR {sim_ettr:.4f} vs theory {want:.4f} "
        f"({100 * (sim_ettr / want - 1):+.2f} %), {failures} failures "
        f"(theory {len(walls) * rate * expect:.0f})"
    )
    assert abs(sim_ettr - want) / want <= 0.02
    expected_failures = len(walls) * rate * expect
    assert abs(failures - expected_failures) <= 4 * math.sqrt(expected_failures)


SWEEP_MTTF_S, SWEEP_CKPT_S, SWEEP_RESTART_S = 4 * 3600.0, 10.0, 120.0
SWEEP_WORK_S = 60 * DAY_S


def sweep(seed: int, points: int = 9) -> tuple[list[float], list[float], list[int]]:
    """The one job's wall and interruptions for checkpoint intervals log-spaced around
    Young/Daly (ratio 2^(1/3), yd / 2.5 .. yd * 2.5 for 9 points), every point with the
    same seed (common random numbers: the same faults hit the job at every interval)."""
    mttf, ckpt, restart = SWEEP_MTTF_S, SWEEP_CKPT_S, SWEEP_RESTART_S
    yd = theory.young_daly_interval(mttf, ckpt)
    half = points // 2
    grid = [yd * 2 ** (k / 3) for k in range(-half, points - half)]
    longest = max(theory.expected_wall_s(SWEEP_WORK_S, t, ckpt, restart, 1 / mttf) for t in grid)
    walls, hits = [], []
    for tau in grid:
        inputs = _one_job_inputs(
            mttf_job_s=mttf, work_s=SWEEP_WORK_S, interval_s=tau, ckpt_s=ckpt,
            restart_s=restart, days=1.2 * longest / DAY_S, seed=seed,
        )  # fmt: skip
        wall, n = _finished_wall(run(inputs, _quiet_reactive()))
        walls.append(wall)
        hits.append(n)
    return grid, walls, hits


def fitted_best(grid: list[float], walls: list[float]) -> float:
    """The minimum of the least-squares fit ``a / tau + b tau + c`` of the sweep."""
    a, b, _ = _least_squares([(1 / t, t, 1.0) for t in grid], walls)
    assert a > 0, "the sweep's curve has a minimum"
    assert b > 0, "the sweep's curve has a minimum"
    return math.sqrt(a / b)


def test_checkpoint_sweep_best_interval_is_young_daly() -> None:
    # The job's MTTF 4 h, checkpoint 10 s, restart 2 min: Young/Daly sqrt(2 M C) = 537 s
    # (the exact optimum of the model is 1.2 % below). The wall's curve is flat at its
    # bottom (10 % off the optimum costs 0.5 % of the overhead, ~0.03 % of the wall), so
    # a fine grid's raw argmin wanders by more than 10 % with the per-failure noise
    # unless ~10^5 failures are simulated; the sweep's best is therefore the minimum of a
    # least-squares fit of its 9 points with a / tau + b tau + c (the shape of checkpoint
    # cost + lost work), every point with the same seed (common random numbers: the same
    # faults hit the job at every interval), ~390 failures a point. Measured over seeds
    # 0-9: the fitted best -7.2 % .. +0.4 % of Young/Daly (mean -2.5 %, sd 2.5 %), the raw
    # argmin on Young/Daly's grid point 9 times, one step (-21 %) below once.
    mttf, ckpt = SWEEP_MTTF_S, SWEEP_CKPT_S
    yd = theory.young_daly_interval(mttf, ckpt)
    grid, walls, hits = sweep(seed=7)
    best = fitted_best(grid, walls)
    raw = grid[walls.index(min(walls))]
    # Young/Daly with the MTTF the job actually saw (the same faults at every point)
    seen = sum(walls) / sum(hits)
    print(
        f"\nsweep: fitted best {best:.0f} s, raw argmin {raw:.0f} s, Young/Daly {yd:.0f} s "
        f"({100 * (best / yd - 1):+.1f} %), with the MTTF seen "
        f"{theory.young_daly_interval(seen, ckpt):.0f} s, exact "
        f"{theory.optimal_interval(mttf, ckpt):.0f} s; {sum(hits) / len(hits):.0f} failures "
        "a point"
    )
    assert abs(best - yd) / yd <= 0.10
    # the raw argmin is no further than the grid's step (26 %) from Young/Daly: the
    # neighbours of the optimum cost ~2.6 % more overhead, above this sweep's noise
    assert abs(math.log(raw / yd)) <= math.log(2) / 3 + 1e-9
    # the theory's own curve over the same grid lies within the sweep's noise
    expect = [
        theory.expected_wall_s(SWEEP_WORK_S, t, ckpt, SWEEP_RESTART_S, 1 / mttf) for t in grid
    ]
    assert max(abs(w - e) / e for w, e in zip(walls, expect, strict=True)) < 0.02


def _least_squares(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Ordinary least squares by the normal equations (a few columns, well scaled)."""
    k = len(rows[0])
    scale = [max(abs(r[i]) for r in rows) for i in range(k)]
    x = [[r[i] / scale[i] for i in range(k)] for r in rows]
    ata = [[sum(row[i] * row[j] for row in x) for j in range(k)] for i in range(k)]
    aty = [sum(row[i] * y for row, y in zip(x, ys, strict=True)) for i in range(k)]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(ata[r][col]))
        ata[col], ata[pivot] = ata[pivot], ata[col]
        aty[col], aty[pivot] = aty[pivot], aty[col]
        for r in range(k):
            if r != col:
                f = ata[r][col] / ata[col][col]
                ata[r] = [v - f * p for v, p in zip(ata[r], ata[col], strict=True)]
                aty[r] -= f * aty[col]
    return [aty[i] / ata[i][i] / scale[i] for i in range(k)]


# -- conservation and determinism on a mixed run ------------------------------------------

MIXED_NODES = 128
MIXED_DAYS = 10.0


def _mixed_inputs(seed: int) -> TwinInputs:
    """128 nodes, 10 days: the gang generator's gangs (16-256 GPUs, 0.5-4 days of work,
    checkpoints, priorities, preemptible ones) at 60 % offered load, small jobs of 1-8
    GPUs (some failing by themselves), Llama 3's cause mix at 20x its rate so that ~100
    faults hit a small fleet in a short run."""
    rng = random.Random(f"{seed}:mixed")
    params = GangParams(
        sizes=((16, 30.0), (32, 20.0), (64, 12.0), (128, 8.0), (256, 4.0)),
        duration_median_days=1.5,
        duration_min_days=0.5,
        duration_max_days=4.0,
        offered_load=0.6,
    )
    nodes = fleet_from_count(MIXED_NODES)
    jobs = list(generate_gangs(params, sum(n.gpus for n in nodes), MIXED_DAYS, rng))
    for i in range(120):
        jobs.append(
            JobSpec(
                job_id=f"task{i:03d}",
                submit_s=rng.uniform(0, 0.9 * MIXED_DAYS * DAY_S),
                nodes=1,
                gpus_per_node=rng.choice([1, 2, 4, 8]),
                work_s=rng.expovariate(1 / (6 * 3600)),
                cpu=8,
                memory_gb=64,
                outcome="failed" if rng.random() < 0.1 else "succeeded",
                origin=f"test task #{i}",
            )
        )
    return TwinInputs(
        nodes=nodes,
        jobs=tuple(jobs),
        failures=default_failure_model(20 * 419 / (2048 * 54)),
        days=MIXED_DAYS,
        seed=seed,
    )


@pytest.fixture(scope="module")
def mixed_runs() -> dict[str, TwinResult]:
    inputs = _mixed_inputs(3)
    return {name: run(inputs, POLICIES[name]) for name in POLICY_NAMES}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_conservation(mixed_runs: dict[str, TwinResult], name: str) -> None:
    result = mixed_runs[name]
    inputs = result.inputs
    horizon = inputs.days * DAY_S
    gpus = sum(n.gpus for n in inputs.nodes)
    assert result.gpu_seconds_available == pytest.approx(gpus * horizon)
    assert 0 < result.gpu_seconds_busy <= result.gpu_seconds_available
    # busy and out-of-service GPU-seconds together fit in the fleet
    assert result.gpu_seconds_busy + result.gpu_seconds_down <= (
        result.gpu_seconds_available * (1 + 1e-9)
    )
    # every job exactly once
    ids = Counter(j.job_id for j in result.jobs)
    assert ids == Counter(s.job_id for s in inputs.jobs)
    states = Counter(j.state for j in result.jobs)
    assert set(states) <= {"succeeded", "failed", "running", "queued"}
    counts = build_report(result)["jobs"]
    assert counts["submitted"] == len(inputs.jobs)
    assert counts["submitted"] == (
        counts["finished"] + counts["failed"] + counts["running"] + counts["queued"]
    )
    assert counts["finished"] > 0
    # the busy GPU-seconds are the jobs' held time
    held = sum(j.held_s * j.gpus for j in result.jobs)
    assert held == pytest.approx(result.gpu_seconds_busy, rel=1e-6)
    specs = {s.job_id: s for s in inputs.jobs}
    for job in result.jobs:
        spec = specs[job.job_id]
        assert 0 <= job.done_s <= spec.work_s * (1 + 1e-9)
        assert job.redone_s >= 0
        if job.state == "succeeded":
            assert job.done_s == pytest.approx(spec.work_s)
        if job.first_start_s is None:
            assert job.state in ("queued", "failed")
            assert job.held_s == 0
        else:
            assert spec.submit_s <= job.first_start_s <= horizon
            # a job holds its nodes at most from its first start to the end
            end = job.end_s if job.end_s is not None else horizon
            assert job.held_s <= end - job.first_start_s + 1e-6
            # wall held >= progress kept and redone
            assert job.done_s + job.redone_s <= job.held_s + 1e-6
        assert all(w >= 0 for w in job.queue_wait_s)
    for point in result.timeline:
        assert 0 <= point.busy_gpus <= point.in_service_nodes * 8
        assert 0 <= point.in_service_nodes <= len(inputs.nodes)
    # the faults were there and interrupted jobs (not a vacuous run)
    assert len(result.faults) > 50
    assert sum(j.unplanned for j in result.jobs) > 0


def test_the_same_faults_for_every_policy(mixed_runs: dict[str, TwinResult]) -> None:
    faults = {name: r.faults for name, r in mixed_runs.items()}
    assert faults["static"] == faults["reactive"] == faults["metalguard"]


def test_same_seed_same_report_other_seed_other_report(
    mixed_runs: dict[str, TwinResult],
) -> None:
    # the same seed in another interpreter with another PYTHONHASHSEED (the order of
    # str sets and dicts differs there): byte-identical report
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.integration.test_twin_validation import _mixed_inputs;"
        "from metalguard.twin.engine import run; from metalguard.twin.policies import POLICIES;"
        "from metalguard.twin.report import build_report, dumps_report;"
        "result = run(_mixed_inputs(3), POLICIES['metalguard']);"
        "sys.stdout.write(dumps_report(build_report(result)))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    again = subprocess.run(
        [sys.executable, "-c", code, root], capture_output=True, text=True, env=env,
        timeout=120, check=True,
    ).stdout  # fmt: skip
    first = dumps_report(build_report(mixed_runs["metalguard"]))
    assert again == first
    # another seed: other faults and other gangs, another report
    other = run(_mixed_inputs(4), POLICIES["metalguard"])
    assert other.faults != mixed_runs["metalguard"].faults
    assert dumps_report(build_report(other)) != first


# -- Llama 3 405B's fleet -----------------------------------------------------------------

LLAMA_NODES = 2048
LLAMA_SPARES = 64
"""3 % spare nodes: Meta's cluster had more GPUs than the 16,384 the job used, and a job
that restarts on spares does not wait for a repair (without them every hardware fault
would leave the gang one node short until the repair ends)."""
LLAMA_DAYS = 54.0
LLAMA_UNEXPECTED = 419


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama3_fleet_interruptions_and_ettr(
    record_property: Callable[[str, object], None],
) -> None:
    # ~50 s of CPU: every one of the ~470 moves of a 2,048-member gang goes through the
    # real job machine (per-member stop/start commands) and the scheduler's index.
    #
    # The job's checkpointing is an assumption (the paper gives no interval): a
    # checkpoint costs 30 s (the paper: 1 MB - 4 GB of state per GPU, <= 65 TB, into
    # storage of 2 TB/s sustained, 7 TB/s peak), taken every 15 min (Young/Daly for a
    # 3.1 h job MTTF and 30 s is 14 min); a restart costs 5 min (reload, NCCL set-up at
    # 16k GPUs, warm-up). The closed form for these costs and Llama's rate is 90.3 %.
    # Policy: reactive (Meta's automation: isolation and restart, no precursors) with
    # hang detection at PyTorch's default NCCL timeout (10 min): the paper's "NCCL
    # watchdog timeouts" are hangs its watchdog ended, not ones a person found hours on.
    tau, ckpt, restart = 900.0, 30.0, 300.0
    job = JobSpec(
        job_id="llama3-405b",
        submit_s=0.0,
        nodes=LLAMA_NODES,
        gpus_per_node=8,
        work_s=10 * LLAMA_DAYS * DAY_S,  # more than the run: it trains to the end
        priority=9,
        checkpoint_interval_s=tau,
        checkpoint_cost_s=ckpt,
        restart_cost_s=restart,
        source="gang",
        origin="llama3",
    )
    model = default_failure_model()
    inputs = TwinInputs(
        nodes=fleet_from_count(LLAMA_NODES + LLAMA_SPARES),
        jobs=(job,),
        failures=model,
        days=LLAMA_DAYS,
        seed=1,
    )
    policy = dataclasses.replace(POLICIES["reactive"], hang_detection=True, hang_timeout_s=600.0)
    result = run(inputs, policy)
    report = build_report(result)
    (rec,) = result.jobs
    unexpected = rec.unplanned
    sigma3 = 3 * math.sqrt(LLAMA_UNEXPECTED)
    ettr = report["ettr"]["fleet"]
    rate = theory.job_rate(LLAMA_NODES, model.total_rate_per_node_day)
    want = theory.expected_ettr(rec.done_s, tau, ckpt, restart, rate)
    print(
        f"\nLlama 3 fleet: {unexpected} unexpected interruptions (paper 419, Poisson range "
        f"{LLAMA_UNEXPECTED - sigma3:.0f}-{LLAMA_UNEXPECTED + sigma3:.0f}), {rec.planned} "
        f"planned (paper 47); ETTR {100 * ettr:.1f} % (paper: >90 %; the closed form for "
        f"the unexpected ones alone {100 * want:.1f} %)"
    )
    record_property("llama3_unexpected", unexpected)
    record_property("llama3_planned", rec.planned)
    record_property("llama3_ettr", ettr)
    assert rec.state == "running"
    assert abs(unexpected - LLAMA_UNEXPECTED) <= sigma3
    # the planned moves (a fresh checkpoint and a restart each, ~0.35 %) and the hangs'
    # timeouts (~0.15 %) come on top of the closed form's losses; the sampling spread of
    # the ETTR over ~420 failures is ~0.5 point
    assert want - 0.02 <= ettr <= want + 0.01
