"""An operator's actions end to end (docs/decisions.md, "operator action"): real agents,
real NATS, the region controller and the job manager. A cordon keeps the node's job
running and gives it no new one; a maintenance moves the job from a fresh checkpoint
(cause ``maintenance``); an uncordon gives the node work again."""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client

from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import expected_digest, jobs_env
from tests.support.waiting import wait_until

STEPS = 300
STEP_S = 0.05


async def test_cordon_keeps_the_job_maintenance_moves_it_uncordon_gives_work_again(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4) as env:
        records = env.region.store.records
        job_id = await env.submit("operated", STEPS, nodes=2, step_s=STEP_S)
        first = await env.wait_state(job_id, {"running"})
        await env.wait_step(job_id, 10)
        node = first.placement[1]

        await env.region.operator_action(node, "cordon", "firmware check", "ann")
        assert records[node].cordoned
        # no new work for it: the scheduler's view of the node (busy or not)
        (seen,) = [n for n in env.region.topology.fleet(records) if n.handle == node]
        assert not seen.schedulable
        step_then = max(m.step for m in env.job(job_id).members)
        await env.wait_step(job_id, step_then + 10)  # the cordoned node's job runs on
        assert env.job(job_id).generation == first.generation
        assert not env.of("job.rescheduled", job_id)

        await env.region.operator_action(node, "maintenance", "swap the NIC", "ann")
        await wait_until(lambda: bool(env.of("job.rescheduled", job_id)), 60, "the move")
        (moved,) = env.of("job.rescheduled", job_id)
        assert moved.attributes["cause"] == "maintenance"
        assert env.of("job.checkpointed", job_id)[0].attributes["fresh"] is True
        assert node not in env.job(job_id).placement
        await wait_until(lambda: bool(env.of("node.maintenance")), 30, "node.maintenance")
        maintenance = [e for e in env.of("node.maintenance") if e.node and e.node.handle == node]
        assert maintenance[0].attributes["by"] == "operator:ann"

        await env.region.operator_action(node, "uncordon", "NIC swapped", "ann")
        assert records[node].grade == "HEALTHY"
        assert not records[node].cordoned
        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 90)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(STEPS)
        # the node takes work again: a 4-node job needs every node
        full = await env.submit("everyone", 40, nodes=4)
        everywhere = await env.wait_state(full, {"running", "succeeded"}, 60)
        assert node in everywhere.placement
