"""A controller's stop always ends: the intermittent stop hang of the jobs tests' teardown.

Cause: the job manager's pass loop (and every other paced loop of the agent and the
controller) waited with ``suppress(TimeoutError): await asyncio.wait_for(wake.wait(),
tick)``. On Python 3.11 a cancel that lands in the loop iteration in which the wake
completes the inner wait is swallowed (CPython gh-86296): the loop runs on, and the stop's
``await gather(task)`` never returned. The loops now wait through
metalguard.runtime.deadlines (``asyncio.timeout``), and the manager's stop is bounded.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import LIFECYCLE, REGION, SETTINGS, jobs_env
from tests.support.harness.private_streams import drop_streams, private_subjects

SPIN = "while True:\n    pass\n"


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """One core kept busy by another process for the test's length."""
    hog = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        yield
    finally:
        hog.kill()
        hog.wait(timeout=10)


async def test_job_manager_pass_loop_ends_on_one_cancel_when_a_wake_lands_with_it(
    nc: Client, subjects: Subjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exact interleaving: the loop waits for its next tick, a wake completes that
    wait, and the cancel arrives before the loop resumes. One cancel must end it."""
    js = nc.jetstream(timeout=5)
    nodes = await NodeStore.open(js, subjects)
    region = RegionController(js, nodes, subjects, REGION, LIFECYCLE)
    manager = JobManager(
        nc, js, await JobStore.open(js, subjects), nodes, subjects, REGION, SETTINGS,
        fleet=region.topology.fleet,
    )  # fmt: skip
    passed = asyncio.Event()
    run_pass = manager.run_pass

    async def counted_pass() -> None:
        await run_pass()
        passed.set()

    monkeypatch.setattr(manager, "run_pass", counted_pass)
    await manager.start()
    try:
        await asyncio.wait_for(passed.wait(), 10)  # the loop now waits for its tick
        loop_task = manager._task  # the pass loop itself
        assert loop_task is not None
        manager.wake()
        await asyncio.sleep(0)  # the wake completes the loop's wait; the loop not resumed
        loop_task.cancel()
        done, _ = await asyncio.wait({loop_task}, timeout=5)
        assert done, "the pass loop ran on after its cancel (a swallowed cancel)"
    finally:
        await asyncio.wait_for(manager.stop(), 30)


ROUNDS = 10


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_jobs_region_starts_and_stops_repeatedly_beside_a_cpu_hog(
    tmp_path: Path, nats_url: str, nc: Client, cpu_hog: None
) -> None:
    """The jobs tests' fixture, start to stop, with a job running through the stop each
    time (its commands wake the manager's loop), while another process keeps a core busy.
    Each part's stop is bounded by jobs_env (30 s, every task's stack printed past it)."""
    js = nc.jetstream(timeout=5)
    for round_ in range(ROUNDS):
        own = await private_subjects(js)  # a fresh region: no job of the round before
        try:
            async with jobs_env(
                tmp_path / f"round{round_}", nats_url, nc, own, racks=1, nodes_per_rack=2
            ) as env:
                job_id = await env.submit(f"stops-{round_}", steps=400, nodes=2, step_s=0.05)
                await env.wait_step(job_id, 2, timeout_s=60)
        finally:
            await drop_streams(js, own)
