"""End to end with healthy hardware: a hung rank, a job that always crashes, preemption.

Same region as test_jobs_e2e.py: real agents running real trainer processes, real NATS,
the region controller and the job manager.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.demo.sim import gpus
from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import SETTINGS, JobsEnv, expected_digest, jobs_env
from tests.support.waiting import wait_until


@pytest.fixture
async def env(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> AsyncIterator[JobsEnv]:
    async with jobs_env(tmp_path, nats_url, nc, subjects) as e:
        yield e


async def test_a_hung_rank_is_detected_and_restarted_from_its_checkpoint(env: JobsEnv) -> None:
    steps, hang_at, timeout = 200, 30, 2.0
    job_id = await env.submit(
        "hangs",
        steps,
        checkpoint_every=0.5,
        hang_timeout=timeout,
        trainer_args=["--hang-at-step", str(hang_at), "--fault-rank", "1", "--faults-only-fresh"],
    )
    first = await env.wait_state(job_id, {"running"})
    await wait_until(lambda: bool(env.of("job.hung", job_id)), 30, "job.hung")
    hung = env.of("job.hung", job_id)[0]
    last_steps = dict(p.split("=") for p in str(hung.attributes["last_steps"]).split(","))
    assert int(last_steps["1"]) == hang_at  # the hung rank's last step, per member
    # detected within hang_timeout of the last progress (plus a tick and a heartbeat)
    await wait_until(lambda: bool(env.of("job.rescheduled", job_id)), 30, "restart")
    restarted = env.job(job_id)
    assert restarted.placement == first.placement  # healthy nodes: the same ones
    chosen = env.of("job.checkpointed", job_id)[0].attributes
    assert chosen["fresh"] is False  # the last periodic one: a hung rank cannot checkpoint
    assert restarted.resumed_from_step == chosen["step"]
    assert restarted.resumed_from_step is not None
    assert restarted.resumed_from_step > 0
    done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
    assert done.state == "succeeded", done.history
    assert done.digest == expected_digest(steps)
    assert done.crashes == 1


async def test_a_job_that_sets_no_hang_timeout_is_caught_by_the_default(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """``[jobs] hang_timeout_s`` (30 min shipped, 2 s here) judges a job that sets none."""
    settings = dataclasses.replace(SETTINGS, hang_timeout_s=2.0)
    async with jobs_env(tmp_path, nats_url, nc, subjects, settings=settings) as env:
        steps, hang_at = 200, 30
        job_id = await env.submit(
            "hangs-by-default",
            steps,
            checkpoint_every=0.5,
            trainer_args=[
                "--hang-at-step",
                str(hang_at),
                "--fault-rank",
                "1",
                "--faults-only-fresh",
            ],
        )
        assert env.job(job_id).job.hang_timeout is None  # type: ignore[union-attr]
        await wait_until(lambda: bool(env.of("job.hung", job_id)), 30, "job.hung")
        hung = env.of("job.hung", job_id)[0]
        assert hung.attributes["by_default"] is True
        assert hung.attributes["hang_timeout"] == 2.0
        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(steps)
        assert done.crashes == 1


async def test_a_node_that_hangs_three_different_jobs_becomes_sub_healthy_naming_them(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """docs/jobs.md "Blame": the failed generations of [jobs] blame_min_jobs (3) different
    jobs on one node make it SUB_HEALTHY, the jobs named in its reason."""
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=1) as env:
        (name,) = env.fleet.node_names
        node = env.handle(name)
        records = env.region.store.records
        failed = []
        for k in range(3):
            assert records[node].grade == "HEALTHY"  # two jobs' failures are not enough
            job_id = await env.submit(
                f"hangs-{k}",
                100,
                nodes=1,
                hang_timeout=1.0,
                max_restarts=0,
                trainer_args=["--hang-at-step", "5"],
            )
            done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
            assert done.state == "failed", done.history
            failed.append(job_id)
        # SUB_HEALTHY, and with no job left on it MAINTENANCE at its next batch (a
        # sub-healthy node drains), its clean batches no cure while the suspicion holds
        await wait_until(
            lambda: bool(env.of("node.sub_healthy")) and records[node].grade == "MAINTENANCE",
            30,
            "SUB_HEALTHY, then MAINTENANCE",
        )
        assert records[node].suspect_jobs == tuple(sorted(failed))
        (event,) = [e for e in env.of("node.sub_healthy") if e.node and e.node.handle == node]
        assert event.reasons[0].signal == "jobs.failures"
        for job_id in failed:
            assert job_id in event.reasons[0].message
        # no new work for it: the scheduler's view of it, and a new job waits in the queue
        (seen,) = [n for n in env.region.topology.fleet(records) if n.handle == node]
        assert not seen.schedulable
        waiting = await env.submit("waits", 20, nodes=1)
        await env.wait_state(waiting, {"queued"})
        await env.region.operator_action(node, "uncordon", "GPU swapped", "ann")
        assert records[node].suspect_jobs == ()
        done = await env.wait_state(waiting, TERMINAL_JOB_STATES, 60)
        assert done.state == "succeeded"


def _blamed(env: JobsEnv, count: int) -> bool:
    return len(env.manager.failures) == count


async def test_the_same_app_xid_on_one_gpu_under_three_jobs_suspects_the_node(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """docs/jobs.md "Blame": an application XID (13) costs a node nothing once, but the
    same XID on the same GPU while three different jobs ran there points at the GPU."""
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=1) as env:
        (name,) = env.fleet.node_names
        node = env.handle(name)
        records = env.region.store.records
        nvml = gpus.state_dir(env.fleet.tree(name).root)
        hit = []
        for k in range(3):
            assert records[node].grade == "HEALTHY"  # two jobs' XIDs are not enough
            job_id = await env.submit(f"xid-{k}", 10_000, nodes=1)
            await env.wait_state(job_id, {"running"})
            gpus.raise_xid(nvml, 3, 13)  # graphics engine exception on gpu3
            await wait_until(functools.partial(_blamed, env, k + 1), 30, "XID blamed")
            assert env.manager.failures[-1].cause == "XID 13 on gpu3"
            await env.manager.cancel(job_id)
            await env.wait_state(job_id, TERMINAL_JOB_STATES, 30)
            hit.append(job_id)
        await wait_until(lambda: bool(env.of("node.sub_healthy")), 30, "node.sub_healthy")
        assert records[node].suspect_jobs == tuple(sorted(hit))
        (event,) = env.of("node.sub_healthy")
        assert event.reasons[0].signal == "jobs.failures"
        assert "application XID" in event.reasons[0].message


async def test_a_job_that_always_crashes_fails_without_blocking_the_fleet(env: JobsEnv) -> None:
    crasher = await env.submit(
        "crashes", 100, max_restarts=2, checkpoint_every=0.3, trainer_args=["--crash-at-step", "15"]
    )
    good = await env.submit("good", 60)
    failed = await env.wait_state(crasher, TERMINAL_JOB_STATES, 60)
    assert failed.state == "failed"
    assert "restart budget of 2 spent" in failed.reason
    # The events follow the KV write through the outbox: wait for them, then count.
    await wait_until(lambda: bool(env.of("job.failed", crasher)), 30, "job.failed")
    assert len(env.of("job.crashed", crasher)) == 3
    ok = await env.wait_state(good, TERMINAL_JOB_STATES, 60)
    assert ok.state == "succeeded"
    assert ok.restarts == 0  # never disturbed by its neighbour's crashes
    # the failed job's nodes are free again: a gang needing them is placed
    after = await env.submit("after", 20, nodes=8)
    done = await env.wait_state(after, TERMINAL_JOB_STATES, 60)
    assert done.state == "succeeded"
    assert done.digest == expected_digest(20)
    env.invariant()


async def test_preemption_checkpoints_the_victim_which_later_resumes(env: JobsEnv) -> None:
    low = await env.submit("low", 100, nodes=8, preemptible=True, priority=1)
    await env.wait_step(low, 20)
    high = await env.submit("high", 30, nodes=4, priority=9)
    await wait_until(lambda: bool(env.of("job.preempted", low)), 30, "job.preempted")
    await env.wait_state(high, {"running"})
    victim = env.job(low)
    assert victim.state == "queued"  # back in the queue, not lost
    assert victim.last_checkpoint is not None
    assert victim.last_checkpoint.step >= 20
    env.invariant()
    assert (await env.wait_state(high, TERMINAL_JOB_STATES, 60)).state == "succeeded"
    done = await env.wait_state(low, TERMINAL_JOB_STATES, 60)
    assert done.state == "succeeded", done.history
    assert done.resumed_from_step == victim.last_checkpoint.step
    assert done.digest == expected_digest(100)
    env.invariant()
