"""A small twin setting shared by the engine's and the stragglers' hand-worked tests: one
2-node job of known costs, no faults, a fleet of a few nodes, and where the real
scheduler puts the job."""

from __future__ import annotations

from metalguard.controller.jobs.scheduler import place, request_from_job
from metalguard.twin import jobs as twin_jobs
from metalguard.twin.fleet import fleet_from_count
from metalguard.twin.model import FailureModel, JobSpec, TwinInputs
from metalguard.twin.policies import POLICIES

REACTIVE = POLICIES["reactive"]
NO_FAULTS = FailureModel(causes=(), source="none")

# one 2-node job: 1 h of work, a checkpoint every 600 s of work costing 60 s, 300 s to
# (re)start; it arrives at t=100 and the first pass places it at once
JOB = JobSpec(
    job_id="j",
    submit_s=100.0,
    nodes=2,
    gpus_per_node=8,
    work_s=3600.0,
    checkpoint_interval_s=600.0,
    checkpoint_cost_s=60.0,
    restart_cost_s=300.0,
    source="gang",
)
START = 100.0
# 300 restart + 3600 work + 5 checkpoints (at 600 ... 3000; none at the finish) x 60
CLEAN_END = START + 300.0 + 3600.0 + 5 * 60.0


def inputs(jobs: tuple[JobSpec, ...] = (JOB,), n: int = 3, days: float = 1.0) -> TwinInputs:
    """``jobs`` on a fleet of ``n`` nodes (racks of 4), no faults, ``days`` long."""
    return TwinInputs(
        nodes=fleet_from_count(n, rack_nodes=4), jobs=jobs, failures=NO_FAULTS, days=days, seed=1
    )


def placement(inp: TwinInputs, spec: JobSpec = JOB) -> tuple[str, ...]:
    """Where the real scheduler puts ``spec`` on the idle fleet."""
    job = twin_jobs.make_job(spec, REACTIVE, spec.job_id, spec.submit_s)
    placed = place(request_from_job(job), inp.nodes)
    assert placed is not None
    return placed.nodes


def first_node(inp: TwinInputs, spec: JobSpec = JOB) -> str:
    """Rank 0's node of ``spec`` on the idle fleet."""
    return placement(inp, spec)[0]
