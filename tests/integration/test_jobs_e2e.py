"""End to end: real agents (a simulated fleet, each running real trainer processes through
its workload runner), real NATS, the region controller and the job manager.

A fault written into one node's sysfs makes the controller grade it FAILING; the job
manager checkpoints the job, stops it, places it again without that node and starts it
from the checkpoint; its final digest equals an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from metalguard.controller.jobs.store import JobStore
from metalguard.proto.jobs import TERMINAL_JOB_STATES, JobStatus
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import JobsEnv, expected_digest, jobs_env
from tests.support.waiting import wait_until


@pytest.fixture
async def env(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> AsyncIterator[JobsEnv]:
    async with jobs_env(tmp_path, nats_url, nc, subjects) as e:
        yield e


def rack(handle: str) -> str:
    name = handle.rsplit(".", 1)[-1]
    return name[name.index("k") : name.rindex("n")]


STEPS = 120


async def test_fault_moves_the_job_and_its_digest_is_unchanged(env: JobsEnv) -> None:
    job_id = await env.submit("move-me", STEPS)
    first = await env.wait_state(job_id, {"running"})
    assert len({rack(n) for n in first.placement}) == 1  # one rack
    await env.wait_step(job_id, 30)
    victim = first.placement[1].rsplit(".", 1)[-1]
    t_fault = time.monotonic()
    env.fleet.apply("ecc_ue", victim)
    await wait_until(lambda: bool(env.of("job.rescheduled", job_id)), 30, "job.rescheduled")
    resumed_s = time.monotonic() - t_fault
    moved = env.job(job_id)
    assert env.handle(victim) not in moved.placement
    assert len(moved.placement) == 4
    assert {rack(n) for n in moved.placement} == {rack(first.placement[0])}  # same rack
    checkpointed = env.of("job.checkpointed", job_id)
    assert checkpointed[0].attributes["fresh"] is True
    ckpt_step = checkpointed[0].attributes["step"]
    assert isinstance(ckpt_step, int)
    assert ckpt_step >= 30
    assert moved.resumed_from_step == ckpt_step
    assert [e.kind for e in env.events if e.job_id == job_id and e.kind != "job.started"][:6] == [
        "job.queued",
        "job.placed",
        "job.checkpointed",
        "job.stopped",
        "job.placed",
        "job.rescheduled",
    ]
    done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
    assert done.state == "succeeded", done.history
    assert done.digest == expected_digest(STEPS)
    assert done.restarts == 1
    print(f"\nfault-to-resumed: {resumed_s:.2f} s; recorded downtime {done.downtime_s:.2f} s")
    env.invariant()


async def test_dead_agent_resumes_from_the_last_periodic_checkpoint(env: JobsEnv) -> None:
    job_id = await env.submit("dead-node", STEPS, checkpoint_every=0.5)
    first = await env.wait_state(job_id, {"running"})
    await wait_until(
        lambda: (c := env.job(job_id).last_checkpoint) is not None and c.step >= 20,
        30,
        "a periodic checkpoint past step 20",
    )
    victim = first.placement[2].rsplit(".", 1)[-1]
    env.fleet.kill_agent(victim)
    await wait_until(lambda: bool(env.of("job.rescheduled", job_id)), 30, "job.rescheduled")
    moved = env.job(job_id)
    assert env.handle(victim) not in moved.placement
    assert any(h.reason.startswith("lost") for h in moved.history), moved.history
    # no fresh checkpoint was asked of a gang with a dead member: the periodic one is used
    checkpointed = env.of("job.checkpointed", job_id)
    assert checkpointed[0].attributes["fresh"] is False
    assert moved.resumed_from_step == checkpointed[0].attributes["step"]
    done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
    assert done.state == "succeeded", done.history
    assert done.digest == expected_digest(STEPS)
    env.invariant()


class DiesAfterWriting(JobStore):
    """A store whose controller dies right after MG_JOBS records a move's ``phase``: the
    write is durable, the step it announces is never taken by this controller."""

    def __init__(self, kv: Any, js: Any, phase: str) -> None:
        super().__init__(kv, js)
        self.phase = phase
        self.died = asyncio.Event()

    async def put(self, status: JobStatus) -> None:
        await super().put(status)
        move = status.move
        if move is not None and move.from_nodes and move.phase == self.phase:  # a move
            self.died.set()
            await asyncio.Event().wait()  # dead: blocks until cancelled


@pytest.mark.parametrize("phase", ["stopping", "starting"])
async def test_controller_killed_mid_move_finishes_the_move(env: JobsEnv, phase: str) -> None:
    js = env.nc.jetstream(timeout=5)
    dying = DiesAfterWriting(await js.key_value(env.subjects.bucket("jobs")), js, phase)
    await env.restart_manager(dying)
    job_id = await env.submit("mid-move", STEPS)
    first = await env.wait_state(job_id, {"running"})
    await env.wait_step(job_id, 20)
    env.fleet.apply("ecc_ue", first.placement[0].rsplit(".", 1)[-1])
    await asyncio.wait_for(dying.died.wait(), 30)
    await env.restart_manager()  # a new controller from MG_JOBS
    assert env.job(job_id).move is not None
    done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
    assert done.state == "succeeded", done.history
    assert done.digest == expected_digest(STEPS)
    assert done.restarts == 1  # moved once: not lost, not started twice
    assert len(env.of("job.rescheduled", job_id)) == 1
    env.invariant()
