"""The PyTorch DDP example (gloo on CPU) survives a node fault: moved from its checkpoint,
its loss curve continues where it was and its final parameters equal an uninterrupted
run's.  Runs where torch is installed (the ``torch`` extra); skipped otherwise."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support import ROOT
from tests.support.harness.jobs_env import JobsEnv, jobs_env
from tests.support.waiting import wait_until

if importlib.util.find_spec("torch") is None:
    pytest.skip(
        "torch is not installed (pip install '.[torch]'): DDP example not run",
        allow_module_level=True,
    )

DDP = ROOT / "examples" / "train_ddp.py"
STEPS = 80
LOSS = re.compile(r"^step=(\d+) loss=(\S+)$", re.MULTILINE)


@pytest.fixture
async def env(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> AsyncIterator[JobsEnv]:
    async with jobs_env(tmp_path, nats_url, nc, subjects) as e:
        yield e


def output(env: JobsEnv, handle: str, job_id: str) -> str:
    """Rank 0's output on ``handle`` (the runner's ``output.log``)."""
    name = handle.rsplit(".", 1)[-1]
    return (env.fleet.root_dir / name / "work" / f"{job_id}.0" / "output.log").read_text()


def losses(text: str) -> dict[int, str]:
    return {int(step): loss for step, loss in LOSS.findall(text)}


async def submit_ddp(env: JobsEnv, name: str) -> str:
    status = await env.manager.submit(
        {
            "name": name,
            "nodes": 2,
            "command": sys.executable,
            "args": [str(DDP), "--steps", str(STEPS), "--step-seconds", "0.02"],
            "checkpoint_dir": str(env.ckpt_root / name),
            "checkpoint_every": 2.0,
        }
    )
    return status.job_id


@pytest.mark.slow
async def test_ddp_job_survives_a_node_fault(env: JobsEnv) -> None:
    reference = await submit_ddp(env, "ddp-reference")
    moved = await submit_ddp(env, "ddp-moved")
    first = await env.wait_state(moved, {"running"}, 60)
    await env.wait_step(moved, 20, 90)
    env.fleet.apply("ecc_ue", first.placement[1].rsplit(".", 1)[-1])
    await wait_until(lambda: bool(env.of("job.rescheduled", moved)), 60, "job.rescheduled")
    done = await env.wait_state(moved, TERMINAL_JOB_STATES, 120)
    ref = await env.wait_state(reference, TERMINAL_JOB_STATES, 120)
    assert done.state == "succeeded", done.history
    assert ref.state == "succeeded", ref.history
    assert done.resumed_from_step is not None
    assert done.resumed_from_step >= 20
    assert done.digest == ref.digest  # the same parameters as an uninterrupted run
    log = output(env, done.placement[0], moved)  # may hold the first run's lines too
    resumed = log[log.rindex(f"resumed step={done.resumed_from_step} ") :]
    after = losses(resumed)
    assert min(after) == done.resumed_from_step + 1  # the curve continues from there
    before = losses(output(env, ref.placement[0], reference))
    assert {s: after[s] for s in after} == {s: before[s] for s in after}
