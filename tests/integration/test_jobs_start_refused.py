"""Refused starts end to end: real agents' workload runners refuse a command they cannot
run; the job manager fails the job at once for a permanent cause (no such file) and after
its restart budget, with backoff, for a transient one (text file busy); each refusal is
logged once per generation."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import JobsEnv, jobs_env
from tests.support.waiting import wait_until

MANAGER_LOG = "metalguard.controller.jobs.manager"


@pytest.fixture
async def env(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> AsyncIterator[JobsEnv]:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4) as e:
        yield e


def refusal_lines(caplog: pytest.LogCaptureFixture, job_id: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == MANAGER_LOG and r.levelno == logging.WARNING and job_id in r.getMessage()
    ]


async def test_a_command_that_does_not_exist_fails_the_job_at_once(
    env: JobsEnv, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, MANAGER_LOG)
    status = await env.manager.submit(
        {"name": "bad", "nodes": 4, "command": "examples/trainer.py", "max_restarts": 3}
    )
    job_id = status.job_id
    failed = await env.wait_state(job_id, TERMINAL_JOB_STATES, 30)
    assert failed.state == "failed"
    assert "cannot run 'examples/trainer.py'" in failed.reason
    assert "No such file or directory" in failed.reason
    assert failed.generation == 1  # never tried again
    assert failed.restarts == 0
    await wait_until(lambda: bool(env.of("job.failed", job_id)), 10, "job.failed")
    assert len(env.of("job.failed", job_id)) == 1
    assert "No such file" in str(env.of("job.failed", job_id)[0].attributes["reason"])
    lines = refusal_lines(caplog, job_id)
    print("refusals logged:", lines)
    assert len(lines) == 1  # four members refused: one line
    assert "ENOENT" in lines[0]
    assert "[permanent]" in lines[0]
    env.invariant()
    # the nodes are free again: a good job runs on them
    good = await env.submit("good", 10)
    assert (await env.wait_state(good, TERMINAL_JOB_STATES, 60)).state == "succeeded"


async def test_a_transient_refusal_is_retried_with_backoff_within_the_budget(
    env: JobsEnv, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, MANAGER_LOG)
    script = tmp_path / "busy.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    with open(script, "a") as writer:  # noqa: ASYNC230 - held open: exec fails with ETXTBSY
        status = await env.manager.submit(
            {"name": "busy", "nodes": 2, "command": str(script), "max_restarts": 2}
        )
        job_id = status.job_id
        failed = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
        writer.write("")
    assert failed.state == "failed"
    assert "restart budget of 2 spent" in failed.reason
    assert "Text file busy" in failed.reason
    assert failed.generation == 3  # the first start and two restarts
    assert failed.restarts == 2
    assert failed.crashes == 3
    await wait_until(lambda: bool(env.of("job.failed", job_id)), 10, "job.failed")
    crashed = env.of("job.crashed", job_id)
    assert len(crashed) == 3
    assert {e.attributes["cause"] for e in crashed} == {"ETXTBSY"}
    assert len(env.of("job.failed", job_id)) == 1
    starts = [e.ts for e in env.of("job.started", job_id)]
    assert not starts  # never ran
    gaps = [b.ts - a.ts for a, b in itertools.pairwise(crashed)]
    print("seconds between refused tries:", [round(g, 2) for g in gaps])
    lines = refusal_lines(caplog, job_id)
    print("refusals logged:", lines)
    assert len(lines) == 3  # once per generation (two members each)
