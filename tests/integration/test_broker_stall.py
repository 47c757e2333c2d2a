"""A broker stall is not dead nodes (issue 16, item 6; docs/lifecycle.md, "Receiving time").

A fleet of real agents runs a job under the region controller, its ingest and the job
manager, over a private nats-server. The server is frozen (SIGSTOP) for longer than the
silence threshold, and one agent, not under the job, really stops meanwhile. After SIGCONT:
no other node is announced ``node.unreachable``, the job is not moved, every batch the
agents made during the stall (spooled) reaches the stream and the controller's records,
and the stopped node is still declared UNREACHABLE within the threshold and a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import nats
import pytest
from nats.aio.client import Client

from metalguard.controller.broker.server import NatsServer
from metalguard.controller.core.lifecycle import silence_limit_s
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import INTERVAL_S, LIFECYCLE, JobsEnv, jobs_env
from tests.support.waiting import wait_until

STALL_S = 8.0
"""Longer than the silence threshold (3 intervals of 0.5 s, at least 5 s)."""
AFTER_RESUME_S = 20.0
"""Bound on the wait for the stopped node's UNREACHABLE (and the backlog) after SIGCONT,
beyond the threshold: a loaded machine takes seconds to catch up."""


@pytest.fixture
async def stall_env(tmp_path: Path, fresh_server: NatsServer) -> AsyncIterator[JobsEnv]:
    """A 6-node region with its job manager over a private server this test may freeze."""
    nc: Client = await nats.connect(
        fresh_server.url, connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.2
    )
    subjects = Subjects(f"t{uuid4().hex[:8]}")
    await ensure_streams(nc.jetstream(timeout=5), subjects)
    try:
        async with jobs_env(
            tmp_path, fresh_server.url, nc, subjects, racks=2, nodes_per_rack=3
        ) as env:
            yield env
    finally:
        if fresh_server.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(fresh_server.pid, signal.SIGCONT)
        await nc.close()


def sent_seq(env: JobsEnv, name: str) -> int:
    """The last seq the node's agent gave a batch (its seq file)."""
    text = (env.fleet.root_dir / name / "spool" / "seq").read_text().strip()
    return int(text or 0)


async def stream_counts(env: JobsEnv) -> dict[str, int]:
    """Telemetry messages in the stream, by node name."""
    js = env.nc.jetstream(timeout=5)
    info = await js.stream_info(env.subjects.stream_telemetry, subjects_filter=">")
    return {subject.rsplit(".", 1)[-1]: n for subject, n in (info.state.subjects or {}).items()}


@pytest.mark.slow
async def test_a_frozen_broker_is_not_dead_nodes(
    stall_env: JobsEnv, fresh_server: NatsServer
) -> None:
    env = stall_env
    limit = silence_limit_s(INTERVAL_S, LIFECYCLE)
    assert limit < STALL_S
    job_id = await env.submit("through-the-stall", 100_000, nodes=2, checkpoint_every=2.0)
    placed = await env.wait_state(job_id, {"running"}, 60)
    await env.wait_step(job_id, 5)
    names = env.fleet.node_names
    victim = next(n for n in names if env.handle(n) not in placed.placement)
    live = [n for n in names if n != victim]
    before = {n: sent_seq(env, n) for n in names}
    pid = fresh_server.pid
    assert pid is not None

    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        await asyncio.sleep(1.0)  # the fault's own timing: the agent dies during the stall
        env.fleet.kill_agent(victim)
        await asyncio.sleep(STALL_S - (time.monotonic() - stopped_at))
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed_at, resumed_wall = time.monotonic(), time.time()
    at_resume = {n: sent_seq(env, n) for n in live}
    made = {n: at_resume[n] - before[n] for n in live}
    print(f"\nstall {resumed_at - stopped_at:.1f} s; batches made meanwhile: {made}")
    assert all(m >= (STALL_S / INTERVAL_S) / 2 for m in made.values()), made

    # the stopped node: still declared, after the resume, within the threshold + a bound
    def declared() -> list[ControllerEvent]:
        return [e for e in env.of("node.unreachable") if e.node and e.node.node == victim]

    await wait_until(
        lambda: bool(declared()), limit + AFTER_RESUME_S, f"node.unreachable for {victim}"
    )
    declared_s = time.monotonic() - resumed_at
    (event,) = declared()
    assert event.ts >= resumed_wall - 0.5, "declared during the stall"
    print(f"{victim} declared {declared_s:.1f} s after the resume: {event.reasons[0].message}")

    # every batch the live agents made up to the resume is in the stream and taken in
    def taken_in(beyond: int = 0) -> bool:
        records = env.region.store.records
        return all(records[env.handle(n)].last_seq >= at_resume[n] + beyond for n in live)

    await wait_until(taken_in, AFTER_RESUME_S, "the records' last seq caught up with the agents")
    counts = await stream_counts(env)
    assert all(counts.get(n, 0) >= at_resume[n] for n in live), (counts, at_resume)
    await wait_until(
        lambda: env.ingest.intake.pending == 0, AFTER_RESUME_S, "the telemetry backlog drained"
    )
    await wait_until(
        lambda: bool(env.region.intake.stalls) and not env.region.intake.catching_up,
        AFTER_RESUME_S,
        "the controller's stall closed",
    )
    start, end = env.region.intake.stalls[-1]
    print(f"stall seen by the controller: {end - start:.1f} s")
    # more than a threshold of batches after the resume taken in: still nobody else silent
    more = math.ceil(limit / INTERVAL_S) + 2
    await wait_until(
        lambda: taken_in(more), limit + AFTER_RESUME_S, f"{more} more batches from every node"
    )
    unreachable = {e.node.node for e in env.of("node.unreachable") if e.node}
    assert unreachable == {victim}, unreachable
    grades = {n: env.region.store.records[env.handle(n)].grade for n in live}
    assert set(grades.values()) == {"HEALTHY"}, grades

    # the job was not moved
    status = env.job(job_id)
    assert status.state == "running", status.history
    assert status.placement == placed.placement
    assert status.restarts == 0
    moves = [e.kind for e in env.of("job.rescheduled", job_id) + env.of("job.stopped", job_id)]
    assert moves == []
