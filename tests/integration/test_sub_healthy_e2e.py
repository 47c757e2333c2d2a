"""SUB_HEALTHY keeps its promise end to end (docs/lifecycle.md, "Grades"): no new work,
running jobs finish. Real agents, real NATS, the region controller and the job manager,
which hands the controller each node's count of unfinished job members.

A PCIe link trained down on a node of a running 2-node job makes it SUB_HEALTHY; the job
runs to its end on the same nodes in the same generation (no ``job.rescheduled``), and
only then does the node enter MAINTENANCE: "sub-healthy and its last job ended"."""

from __future__ import annotations

from pathlib import Path

import msgspec
from nats.aio.client import Client

from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import LIFECYCLE, expected_digest, jobs_env
from tests.support.waiting import wait_until

STEPS = 160
STEP_S = 0.05
"""About 8 s of training: many of the agents' 0.5 s batch intervals after the fault."""


async def test_a_sub_healthy_nodes_job_finishes_where_it_runs_then_the_node_drains(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4) as env:
        records = env.region.store.records
        first = await env.running_counted("finishes", STEPS, nodes=2, step_s=STEP_S)
        job_id = first.job_id
        await env.wait_step(job_id, 20)
        victim = first.placement[1]
        env.fleet.apply("pcie_downgrade", victim.rsplit(".", 1)[-1])
        # the record changes before its event reaches the subscriber: wait for the event
        await wait_until(lambda: bool(env.of("node.sub_healthy")), 30, "node.sub_healthy")
        assert records[victim].grade == "SUB_HEALTHY"
        sub_healthy = env.of("node.sub_healthy")
        assert [e.node.handle for e in sub_healthy if e.node] == [victim]

        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(STEPS)
        assert done.generation == first.generation
        assert done.restarts == 0
        assert not env.of("job.rescheduled", job_id)

        def maintenance() -> list[ControllerEvent]:
            return [e for e in env.of("node.maintenance") if e.node and e.node.handle == victim]

        await wait_until(lambda: bool(maintenance()), 30, "node.maintenance")
        (entered,) = maintenance()
        assert records[victim].grade == "MAINTENANCE"
        assert entered.message == "sub-healthy and its last job ended"
        assert entered.attributes["grade_from"] == "SUB_HEALTHY"
        assert any(r.signal == "lifecycle.running_jobs" for r in entered.reasons)
        # the node sent sub-healthy batches all along; it entered MAINTENANCE (once) only
        # when its job had ended
        assert entered.ts >= done.updated_ts - 1.0
        assert records[victim].running_jobs == 0
        # the healthy node of the job is counted free again and stays HEALTHY
        other = first.placement[0]
        assert records[other].running_jobs == 0
        assert records[other].grade == "HEALTHY"


async def test_past_the_drain_limit_the_job_is_moved_with_a_fresh_checkpoint(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """``[lifecycle] sub_healthy_drain_after_s`` (24 h shipped, 2 s here): a job still on
    the sub-healthy node then is moved as a planned move, from a fresh checkpoint."""
    lifecycle = msgspec.structs.replace(LIFECYCLE, sub_healthy_drain_after_s=2.0)
    async with jobs_env(
        tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4, lifecycle=lifecycle
    ) as env:
        steps = 400
        job_id = await env.submit("outlives-the-limit", steps, nodes=2, step_s=STEP_S)
        first = await env.wait_state(job_id, {"running"})
        await env.wait_step(job_id, 20)
        victim = first.placement[1]
        env.fleet.apply("pcie_downgrade", victim.rsplit(".", 1)[-1])
        await wait_until(lambda: bool(env.of("job.rescheduled", job_id)), 60, "the move")
        await wait_until(lambda: bool(env.of("node.maintenance")), 30, "node.maintenance")
        entered = [e for e in env.of("node.maintenance") if e.node and e.node.handle == victim]
        assert entered[0].attributes["action"] == "isolate"
        assert "its remaining jobs are moved" in entered[0].message
        moved = env.job(job_id)
        assert victim not in moved.placement
        assert env.of("job.checkpointed", job_id)[0].attributes["fresh"] is True
        (rescheduled,) = env.of("job.rescheduled", job_id)
        assert rescheduled.attributes["cause"] == "maintenance"
        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 90)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(steps)
