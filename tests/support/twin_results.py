"""Hand-made fleet twin results shared by the report and figure tests: one policy, a
failure model, a 4-node fleet and a handful of job outcomes covering every state."""

from __future__ import annotations

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.model import (
    DAY_S,
    Distribution,
    FailureCause,
    FailureModel,
    Fault,
    JobOutcomeRecord,
    Policy,
    TimePoint,
    TwinInputs,
    TwinResult,
)

POLICY = Policy(
    name="metalguard",
    auto_isolation=True,
    precursors=True,
    preemption=True,
    backfill=True,
    priorities=True,
    hang_detection=True,
    hang_timeout_s=600.0,
    human_notice_s=3600.0,
    resubmit_s=0.0,
    delivery_s=720.0,
)
MODEL = FailureModel(
    causes=(
        FailureCause(
            "gpu_hbm3",
            0.002,
            signal="ecc",
            precursor_fraction=0.6,
            lead_time=Distribution("exponential", 7200.0),
            repair=Distribution("lognormal", 14400.0, 0.5),
        ),
        FailureCause("software_bug", 0.001, kind="software"),
    ),
    planned_rate_per_node_day=0.0005,
    source="test",
)


def fleet(n: int = 4) -> tuple[FleetNode, ...]:
    return tuple(
        FleetNode(handle=f"twin.c0.n{i}", region="twin", cluster="c0", rack="k0", gpus=8)
        for i in range(n)
    )


def job(job_id: str, **kw: object) -> JobOutcomeRecord:
    values: dict[str, object] = {
        "job_id": job_id,
        "source": "trace",
        "gpus": 8,
        "submit_s": 0.0,
        "first_start_s": None,
        "end_s": None,
        "state": "queued",
        "work_s": 1000.0,
        "done_s": 0.0,
        "redone_s": 0.0,
        "held_s": 0.0,
        "unplanned": 0,
        "planned": 0,
        "queue_wait_s": (),
    }
    values.update(kw)
    return JobOutcomeRecord(**values)  # type: ignore[arg-type]


JOBS = (
    # a gang that finished: 900 s of work in 1,000 s of wall (ETTR 0.9), 50 s redone
    job(
        "g1",
        source="gang",
        gpus=16,
        first_start_s=100.0,
        end_s=1100.0,
        state="succeeded",
        work_s=900.0,
        done_s=900.0,
        redone_s=50.0,
        held_s=1000.0,
        unplanned=1,
        queue_wait_s=(100.0, 30.0),
    ),
    # still running at the end of the run (2 days): 43,000 s kept of 43,200 s since start
    job(
        "t1",
        first_start_s=DAY_S * 2 - 43_200.0,
        state="running",
        work_s=1e6,
        done_s=43_000.0,
        held_s=43_200.0,
        planned=2,
        queue_wait_s=(10.0,),
    ),
    job(
        "t2",
        first_start_s=0.0,
        end_s=400.0,
        state="failed",
        work_s=200.0,
        done_s=200.0,
        held_s=400.0,
        queue_wait_s=(0.0,),
    ),
    job("t3", submit_s=500.0),
    # a big job: 3 unplanned interruptions in 15 days held -> 6 per 30 days
    job(
        "big",
        source="gang",
        gpus=2048,
        submit_s=0.0,
        first_start_s=0.0,
        state="running",
        work_s=1e9,
        done_s=DAY_S,
        redone_s=3600.0,
        held_s=15 * DAY_S,
        unplanned=3,
        planned=1,
        queue_wait_s=(0.0,),
    ),
)


def result(**kw: object) -> TwinResult:
    inputs = TwinInputs(
        nodes=fleet(),
        jobs=(),
        failures=MODEL,
        days=2.0,
        seed=7,
        workload={"trace": "t.csv", "gang_generator": {"sizes": (8, 16)}},
    )
    values: dict[str, object] = {
        "policy": POLICY,
        "inputs": inputs,
        "jobs": JOBS,
        "gpu_seconds_available": 32 * 2 * DAY_S,
        "gpu_seconds_busy": 32 * DAY_S * 0.75,
        "gpu_seconds_down": 8 * 3600.0,
        "faults": (
            Fault(0, "twin.c0.n1", 900.0, "gpu_hbm3", "hardware", "ecc", 100.0, 3600.0),
            Fault(1, "twin.c0.n2", 9000.0, "software_bug", "software", "", None, 0.0),
        ),
        "timeline": (TimePoint(0.0, 0, 0, 4), TimePoint(3600.0, 16, 1, 4)),
        "events": 1234,
        "decisions": {
            "interruption:unplanned:gpu_hbm3": 3,
            "interruption:unplanned:software_bug": 1,
            "interruption:planned:precursor": 2,
            "interruption:planned:preempted": 1,
            "grade:HEALTHY->FAILING": 2,
        },
    }
    values.update(kw)
    return TwinResult(**values)  # type: ignore[arg-type]
