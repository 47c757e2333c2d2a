"""End to end: a running job's node loses its HCA port, and the port then flaps.

Same region as test_jobs_e2e.py: real agents (each reading its simulated
``class/infiniband`` with the real rdma collector and running real trainer processes),
real NATS, the region controller (the RDMA rules) and the job manager.  The port going
down makes the node FAILING and the job moves off it once, from a fresh checkpoint; the
port coming back and flapping (counted flaps, then down and up again) moves nothing
more: the job runs on elsewhere and ends with the digest of an uninterrupted run, and
the flapping node is kept out of new work.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.demo.sim.faults import Applied, LinkFlap, PortDown
from metalguard.demo.sim.tree import port_name
from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import JobsEnv, expected_digest, jobs_env
from tests.support.waiting import wait_until

STEPS = 1000
"""At 0.03 s a step: ~30 s of work, long enough to flap the port (each phase waits for
an rdma scan, every 2.5 s here) while the job runs on."""
DOWN_RULES = {"rdma_port_down", "rdma_cabled_port_down"}


@pytest.fixture
async def env(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> AsyncIterator[JobsEnv]:
    async with jobs_env(tmp_path, nats_url, nc, subjects) as e:
        yield e


def rules_of(env: JobsEnv, handle: str) -> set[str]:
    """The rules behind the node's current score."""
    record = env.region.store.records.get(handle)
    return set() if record is None else {r.rule for r in record.reasons}


def flaps_per_hour(env: JobsEnv, handle: str) -> float:
    """The node's link-flap rate (link_downed + link_error_recovery per hour), 0 if none."""
    record = env.region.store.records.get(handle)
    rates = [
        r.value
        for r in (record.reasons if record is not None else ())
        if r.rule == "rdma_link_flap_rate" and isinstance(r.value, float | int)
    ]
    return float(max(rates, default=0))


def come_back(applied: Applied) -> None:
    """Bring a downed port up now (its duration is over: time injected, not waited)."""
    assert isinstance(applied.process, PortDown)
    assert applied.process.step(math.inf) is True


async def test_a_downed_then_flapping_hca_port_moves_its_job_once(env: JobsEnv) -> None:
    job_id = await env.submit("over-rdma", STEPS)
    first = await env.wait_state(job_id, {"running"})
    await env.wait_step(job_id, 20)
    victim = first.placement[1].rsplit(".", 1)[-1]
    handle = env.handle(victim)

    t_down = time.monotonic()
    down = env.fleet.apply("rdma_port_down", victim, duration_s=3600)
    await wait_until(lambda: bool(env.of("job.rescheduled", job_id)), 30, "job.rescheduled")
    isolated = [e for e in env.of("node.isolated") if e.node and e.node.node == victim]
    assert len(isolated) == 1
    assert isinstance(down.process, PortDown)
    port = port_name(down.process.port)  # mlx5_0/1
    assert any(r.rule in DOWN_RULES and port in r.message for r in isolated[0].reasons)
    moved_s = time.monotonic() - t_down
    moved = env.job(job_id)
    assert handle not in moved.placement
    assert len(moved.placement) == 4
    checkpointed = env.of("job.checkpointed", job_id)
    assert checkpointed[0].attributes["fresh"] is True
    assert moved.resumed_from_step == checkpointed[0].attributes["step"]

    # the port comes back, then flaps: counted flaps, then down (seen) and up again
    come_back(down)
    await wait_until(lambda: not rules_of(env, handle) & DOWN_RULES, 30, "the port seen up")
    flap = env.fleet.apply("rdma_link_flap", victim, count=3)
    assert isinstance(flap.process, LinkFlap)
    while not flap.process.step(0.0):
        pass
    # each flap: link_downed and link_error_recovery +1 on the flapping port (either one),
    # so at least 6 in the rule's hour: severe
    await wait_until(lambda: flaps_per_hour(env, handle) >= 6, 30, "the flaps counted")
    again = env.fleet.apply("rdma_port_down", victim, duration_s=3600)
    await wait_until(lambda: bool(rules_of(env, handle) & DOWN_RULES), 30, "the port down again")
    come_back(again)
    await wait_until(lambda: not rules_of(env, handle) & DOWN_RULES, 30, "the port up again")
    assert env.job(job_id).state == "running"  # still on its new nodes meanwhile
    flapped_s = time.monotonic() - t_down

    done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 90)
    assert done.state == "succeeded", done.history
    assert done.digest == expected_digest(STEPS)
    assert done.restarts == 1  # moved once: the flaps moved nothing more
    assert len(env.of("job.rescheduled", job_id)) == 1
    assert handle not in done.placement
    # the flaps in the rules' hour keep the node out of new work (it may have returned
    # between the port coming back and the flaps: one link_downed an hour is a warning)
    assert env.region.store.records[handle].grade in ("FAILING", "SUB_HEALTHY", "MAINTENANCE")
    env.invariant()
    print(
        f"\nport down to job resumed: {moved_s:.1f} s; flaps done {flapped_s:.1f} s after "
        f"the port went down; job done {time.monotonic() - t_down:.1f} s after"
    )
