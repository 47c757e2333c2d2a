"""DMA isolation end to end (docs/security.md "DMA isolation"): simulated nodes whose
sysfs trees have an IOMMU (a group per GPU and NIC, ACS on the root ports), their agents'
real ``iommu`` collector, the region controller and the job manager over real NATS.

- Every node reports ``isolated``; the posture is in its record.
- A sensitive job is placed only on ``isolated`` nodes: with all but two nodes ``shared``
  a 2-node sensitive job lands on those two; a 3-node one waits.
- A node of a running sensitive job whose posture drops (a NIC falls into a GPU's group)
  publishes ``node.isolation_lost`` once, naming the job; the job runs on to its end
  (an operator decides; no automatic kill).
"""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client

from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import jobs_env
from tests.support.waiting import wait_until


async def test_sensitive_jobs_go_only_where_dma_is_isolated_and_a_lost_isolation_is_said(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4) as env:
        records = env.region.store.records
        handles = [env.handle(n) for n in env.fleet.node_names]
        await wait_until(
            lambda: all(records[h].dma_posture == "isolated" for h in handles),
            60,
            "every node's DMA isolation reported",
        )
        assert all(records[h].dma_reasons == () for h in handles)
        # two nodes lose their isolation before anything is placed
        for name in env.fleet.node_names[2:]:
            env.fleet.apply("iommu_shared", name)
        shared = set(handles[2:])
        await wait_until(
            lambda: all(records[h].dma_posture == "shared" for h in shared), 60, "shared"
        )
        assert all("shares IOMMU group" in " ".join(records[h].dma_reasons) for h in shared)

        too_big = await env.submit("secret-3", 20, nodes=3, sensitive=True, tenant="t1")
        secret = await env.running_counted("secret-2", 150, nodes=2, sensitive=True,
                                           tenant="t1", step_s=0.05)  # fmt: skip
        assert set(secret.placement) == set(handles[:2])
        assert env.job(too_big).state == "queued"  # only two isolated nodes
        await env.wait_step(secret.job_id, 5)

        victim = secret.placement[0]
        env.fleet.apply("iommu_shared", victim.rsplit(".", 1)[-1])
        await wait_until(lambda: bool(env.of("node.isolation_lost")), 60, "node.isolation_lost")
        (lost,) = env.of("node.isolation_lost")
        assert lost.node is not None
        assert lost.node.handle == victim
        assert lost.job_id == secret.job_id
        assert lost.attributes["posture"] == "shared"
        assert "the job runs on" in lost.message
        done = await env.wait_state(secret.job_id, TERMINAL_JOB_STATES, 90)
        assert done.state == "succeeded", done.history
        assert (done.generation, done.restarts) == (secret.generation, 0)
        assert len(env.of("node.isolation_lost")) == 1  # said once
        await env.manager.cancel(too_big)
