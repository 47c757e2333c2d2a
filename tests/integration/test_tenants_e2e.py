"""Tenant quotas end to end (docs/scheduler.md "Tenant quotas"): a real region controller,
job manager (with MG_TENANTS) and simulated agents running real trainer processes.

Two tenants, 24 GPUs (three 8-GPU nodes) guaranteed each on a 6-node fleet. ``team-b``
runs one job inside its guarantee and borrows the idle half of the fleet for a second;
``team-a`` then submits inside its own guarantee: the borrowed job (and only it) is
checkpointed and stopped (``tenant.reclaim``), team-a's job starts on the freed nodes,
and the borrower's job resumes from its checkpoint later with the uninterrupted digest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.proto.subjects import Subjects
from metalguard.proto.tenants import TenantQuota
from tests.support.harness.jobs_env import expected_digest, jobs_env
from tests.support.waiting import wait_until

QUOTAS = (TenantQuota(name="team-a", gpus=24), TenantQuota(name="team-b", gpus=24))


@pytest.mark.slow
async def test_a_tenant_inside_its_guarantee_reclaims_borrowed_capacity(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(
        tmp_path, nats_url, nc, subjects, racks=2, nodes_per_rack=3, tenants=QUOTAS
    ) as env:  # fmt: skip
        own = await env.running_counted(
            "b-own", 400, nodes=3, tenant="team-b", checkpoint_every=0.5
        )  # fmt: skip
        borrowed_steps = 300
        borrowed = await env.submit(
            "b-borrowed", borrowed_steps, nodes=3, tenant="team-b", checkpoint_every=0.5
        )  # fmt: skip
        first = await env.wait_state(borrowed, {"running"})
        await env.wait_step(borrowed, 20)
        await wait_until(
            lambda: env.job(borrowed).last_checkpoint is not None, 30, "a periodic checkpoint"
        )
        _, usage = env.manager.tenant_usage()
        assert (usage["team-b"].in_use, usage["team-b"].borrowed) == (48, 24)
        assert usage["team-a"].lent == 24

        owner = await env.submit("a-own", 60, nodes=3, tenant="team-a")
        started = await env.wait_state(owner, {"running", "succeeded"})
        # within one reclaim: the borrowed job was stopped for it, and its nodes are the
        # owner's; the job inside team-b's guarantee was left alone
        reclaims = env.of("tenant.reclaim")
        assert [e.job_id for e in reclaims] == [borrowed]
        assert reclaims[0].attributes["reclaim_for"] == "team-a"
        assert reclaims[0].attributes["by"] == owner
        assert set(started.placement) == set(first.placement)
        assert [e.job_id for e in env.of("job.preempted")] == [borrowed]
        assert env.job(own.job_id).generation == own.generation

        for job_id in (own.job_id, owner, borrowed):
            await env.wait_state(job_id, {"succeeded"}, timeout_s=120)
        done = env.job(borrowed)
        assert done.digest == expected_digest(borrowed_steps)
        assert done.resumed_from_step is not None
        assert done.resumed_from_step > 0
        assert env.job(own.job_id).digest == expected_digest(400)
        assert env.job(owner).digest == expected_digest(60)
        assert not env.of("job.rescheduled", own.job_id)
