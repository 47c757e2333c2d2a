"""Elastic jobs end to end (docs/jobs.md "Elastic jobs"): a real region controller, job
manager and simulated agents running real trainer processes.

On six nodes with three taken by a fixed job, an elastic job (2 to 6 nodes) starts on the
three idle ones, grows to six once the fixed job ends (a fresh checkpoint, a restart with
``MG_WORLD_SIZE`` 6), shrinks to three — never stopped whole — when a higher-priority job
needs nodes, and still ends with the digest of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import expected_digest, jobs_env
from tests.support.waiting import wait_until

STEPS = 700


@pytest.mark.slow
async def test_an_elastic_job_grows_into_idle_nodes_and_shrinks_before_a_preemption(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=2, nodes_per_rack=3) as env:
        fixed = await env.running_counted("fixed", 120, nodes=3)
        elastic = await env.submit(
            "elastic", STEPS, nodes=2, min_nodes=2, max_nodes=6, resize_interval_s=1.0,
            preemptible=True, checkpoint_every=0.5,
        )  # fmt: skip
        first = await env.wait_state(elastic, {"running"})
        assert len(first.placement) == 3  # the largest size idle now, not its minimum
        assert not set(first.placement) & set(fixed.placement)

        await env.wait_state(fixed.job_id, {"succeeded"})

        def grown() -> bool:
            s = env.job(elastic)
            return s.state == "running" and len(s.placement) == 6

        await wait_until(grown, 60, "the elastic job grown to 6 nodes")
        grow = env.of("job.resized", elastic)
        assert [e.attributes["reason"] for e in grow] == ["grow"]
        assert (grow[0].attributes["from"], grow[0].attributes["to"]) == (3, 6)
        await env.wait_step(elastic, (env.job(elastic).resumed_from_step or 0) + 5)

        urgent = await env.submit("urgent", 60, nodes=3, priority=10)
        running = await env.wait_state(urgent, {"running", "succeeded"})
        shrink = [e for e in env.of("job.resized", elastic) if e.attributes["reason"] == "shrink"]
        assert len(shrink) == 1
        assert shrink[0].attributes["by"] == urgent
        assert shrink[0].attributes["to"] == 3
        kept = set(str(shrink[0].attributes["to_nodes"]).split(","))
        assert not kept & set(running.placement)
        assert not env.of("job.preempted", elastic)  # shrunk, never stopped whole

        await env.wait_state(urgent, {"succeeded"}, timeout_s=60)
        done = await env.wait_state(elastic, {"succeeded"}, timeout_s=120)
        assert done.digest == expected_digest(STEPS)
        assert env.job(urgent).digest == expected_digest(60)
        sizes = [int(str(e.attributes["to"])) for e in env.of("job.resized", elastic)]
        assert min(sizes) >= 2
        assert max(sizes) <= 6
