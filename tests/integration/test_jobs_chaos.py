"""Chaos: 50 random faults over a 32-node fleet running 8 jobs.

At the end every job is finished, running or queued; none lost and none running twice
(checked against the controller's state all along, and against what the agents actually
run, asked with the ``status`` command); every finished job's digest is right.

The first fault is aimed at a node of the running job with the most steps left, so at
least one move happens whatever the schedule (random faults alone could all land on idle
nodes or after short jobs ended: a CI run beside a busy core saw 0 moves).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.errors import Error as NatsError

from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import Command, CommandReply
from metalguard.proto.jobs import TERMINAL_JOB_STATES, JobStatus
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import REGION, JobsEnv, expected_digest, jobs_env
from tests.support.waiting import wait_until

SEED = 6
FAULTS = 50
JOBS = 8
KINDS = ("ecc_ue", "aer_fatal", "pcie_downgrade", "smart_fail", "agent_kill")
WEIGHTS = (4, 3, 2, 1, 1)


async def actual_members(env: JobsEnv) -> list[tuple[str, str, int]]:
    """(node handle, job id, rank) of every member the live agents say is running."""
    found = []
    for name in env.fleet.running():
        cluster = env.fleet.nodes[name].config.node.cluster
        command = Command(
            command_id=uuid.uuid4().hex,
            ts=time.time(),
            node=NodeIdentity(region=REGION, cluster=cluster, node=name),
            verb="status",
        )
        subject = env.subjects.command(REGION, cluster, name, "status")
        try:
            msg = await env.nc.request(subject, encode(command), timeout=5)
        except (NatsError, TimeoutError):
            continue  # an agent stopping right now
        reply = decode(msg.data, CommandReply)
        jobs = reply.result.get("jobs")
        assert isinstance(jobs, list)
        for item in jobs:
            job_id, rank, state, _ = item.rsplit(":", 3)
            if state == "running":
                found.append((env.handle(name), job_id, int(rank)))
    return found


def aim(env: JobsEnv, steps: dict[str, int]) -> str:
    """A node of the running job with the most steps left (its fleet name)."""

    def left(s: JobStatus) -> int:
        return steps[s.job_id] - max((m.step for m in s.members), default=0)

    running = [s for s in env.manager.jobs.values() if s.state == "running" and s.placement]
    assert running, "no job running to aim the first fault at"
    target = max(running, key=left)
    by_handle = {env.handle(name): name for name in env.fleet.node_names}
    return by_handle[target.placement[0]]


@pytest.mark.slow
async def test_fifty_faults_lose_no_job_and_run_none_twice(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    rng = random.Random(SEED)
    async with jobs_env(
        tmp_path, nats_url, nc, subjects, racks=4, nodes_per_rack=8
    ) as env:  # fmt: skip
        steps: dict[str, int] = {}
        for i in range(JOBS):
            n = rng.choice((2, 3, 4))
            count = rng.randrange(80, 160)
            job_id = await env.submit(
                f"chaos-{i}", count, nodes=n, step_s=0.03, checkpoint_every=0.5
            )
            steps[job_id] = count

        def started(s: JobStatus) -> bool:  # a short job may be done before the last starts
            return s.state == "running" or s.state in TERMINAL_JOB_STATES

        await wait_until(
            lambda: sum(started(s) for s in env.manager.jobs.values()) == JOBS,
            60,
            "every job running (or already finished)",
        )
        violations: list[str] = []

        async def watch_invariant() -> None:
            while True:
                try:
                    env.invariant()
                except AssertionError as exc:
                    violations.append(str(exc))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_invariant())
        try:
            names = env.fleet.node_names
            aimed = aim(env, steps)
            env.fleet.apply("ecc_ue", aimed)
            for _ in range(FAULTS - 1):
                kind = rng.choices(KINDS, WEIGHTS)[0]
                node = rng.choice(names)
                if kind == "agent_kill" and node not in env.fleet.running():
                    kind = "ecc_ue"
                env.fleet.apply(kind, node)
                await asyncio.sleep(0.1)

            def settled_one(state: str) -> bool:
                return state in TERMINAL_JOB_STATES or state == "queued"

            def settled() -> bool:
                return all(settled_one(s.state) for s in env.manager.jobs.values())

            try:
                await wait_until(settled, 120, "every job finished or waiting in the queue")
            except AssertionError:
                left = [s for s in env.manager.jobs.values() if not settled_one(s.state)]
                raise AssertionError([(s.job_id, s.state, s.move) for s in left]) from None
            # what the agents run matches the controller: no member left behind or doubled
            running = await actual_members(env)
            assert not running, running
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        assert not violations, violations[:3]
        states = Counter(s.state for s in env.manager.jobs.values())
        assert len(env.manager.jobs) == JOBS
        assert set(states) <= {"succeeded", "queued"}, states
        for job_id, s in env.manager.jobs.items():
            if s.state == "succeeded":
                assert s.digest == expected_digest(steps[job_id]), s.job_id
        moves = len(env.of("job.rescheduled"))
        print(f"\nchaos: {dict(states)}; {moves} moves; {len(env.fleet.applied)} faults")
        assert moves >= 1
