"""Stragglers end to end (docs/jobs.md "Stragglers"): real agents run examples/trainer.py
in its synchronous mode (the ranks meet every step in a TCP all-reduce, so a slowed rank
really makes the others wait) and report their step timings through the client library;
the runner forwards one window per rank per ``timing_window_s``; the job manager's watch
names the slow rank's node, the region controller makes it SUB_HEALTHY with the evidence,
and the job is moved off it only when moving pays. The digest is the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nats.aio.client import Client

from metalguard.controller.core.stragglers import Settings
from metalguard.controller.jobs.manager import JobSettings
from metalguard.controller.jobs.straggler_watch import WatchSettings
from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import SETTINGS, expected_digest, jobs_env
from tests.support.waiting import wait_until

WINDOW_S = 1.0
STEP_S = 0.06
PERSISTENCE = 3
DETECTOR = Settings(persistence=PERSISTENCE, warmup_windows=1, threshold=0.2)
"""20 %: the slowed rank computes 2x (100 % slower); a loaded 2-core machine's jitter on
a 60 ms sleep stays far below it."""


def settings(restart_cost_s: float) -> JobSettings:
    """The job manager's settings with the test's detector and restart cost."""
    watch = WatchSettings(detector=DETECTOR, restart_cost_s=restart_cost_s)
    return replace(SETTINGS, stragglers=watch)


def sync_args(*extra: str) -> list[str]:
    return ["--sync", "--sync-timeout", "60", *extra]


async def test_a_slowed_rank_is_named_its_node_sub_healthy_and_the_job_moved_off_it(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    steps = 600  # ~36 s at 60 ms: a 100 % slowdown over the rest costs far more than 2 s
    async with jobs_env(
        tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=5,
        settings=settings(restart_cost_s=2.0),
    ) as env:  # fmt: skip
        job_id = await env.submit(
            "slowed", steps, nodes=4, step_s=STEP_S, timing_window_s=WINDOW_S,
            total_steps=steps, checkpoint_every=1.0,
            trainer_args=sync_args(
                "--slow-rank", "2", "--slow-factor", "2.0", "--faults-only-fresh"
            ),
        )  # fmt: skip
        first = await env.wait_state(job_id, {"running"})
        victim = first.placement[2]
        await wait_until(lambda: bool(env.of("node.straggler", job_id)), 60, "node.straggler")
        (found,) = env.of("node.straggler", job_id)
        assert found.node is not None
        assert found.node.handle == victim
        attrs = found.attributes
        assert attrs["windows"] == PERSISTENCE
        assert attrs["peers"] == 3
        assert isinstance(attrs["slowdown_pct"], float)
        assert attrs["slowdown_pct"] > 50
        assert attrs["action"] == "move"
        assert attrs["generation"] == first.generation
        await wait_until(
            lambda: env.region.store.records[victim].grade != "HEALTHY", 30, "the node's grade"
        )
        record = env.region.store.records[victim]
        assert record.grade in ("SUB_HEALTHY", "MAINTENANCE")
        assert record.straggler is not None
        assert record.straggler.signal == "jobs.straggler"
        assert job_id in record.straggler.message
        await wait_until(lambda: bool(env.of("job.rescheduled", job_id)), 60, "the move")
        (moved,) = env.of("job.rescheduled", job_id)
        assert moved.attributes["cause"] == "straggler"
        assert victim not in str(moved.attributes["to"])
        assert env.of("job.checkpointed", job_id)[0].attributes["fresh"] is True
        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 180)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(steps)
        assert victim not in done.placement
        # the other nodes were never blamed
        others = set(first.placement) - {victim}
        assert all(env.region.store.records[h].straggler is None for h in others)


async def test_when_moving_does_not_pay_the_job_finishes_where_it_is(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    steps = 250
    async with jobs_env(
        tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4,
        settings=settings(restart_cost_s=3600.0),
    ) as env:  # fmt: skip
        job_id = await env.submit(
            "finishes-slowed", steps, nodes=3, step_s=STEP_S, timing_window_s=WINDOW_S,
            total_steps=steps, trainer_args=sync_args("--slow-rank", "0", "--slow-factor", "2"),
        )  # fmt: skip
        first = await env.wait_state(job_id, {"running"})
        victim = first.placement[0]
        await wait_until(lambda: bool(env.of("node.straggler", job_id)), 60, "node.straggler")
        (found,) = env.of("node.straggler", job_id)
        assert found.node is not None
        assert found.node.handle == victim
        assert found.attributes["action"] == "finish"
        assert found.attributes["restart_cost_s"] == 3600.0
        await wait_until(
            lambda: env.region.store.records[victim].grade == "SUB_HEALTHY", 30, "SUB_HEALTHY"
        )
        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 120)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(steps)
        assert done.generation == first.generation
        assert not env.of("job.rescheduled", job_id)
        # sub-healthy with its job ended: the node drains (no new work until an uncordon)
        await wait_until(
            lambda: env.region.store.records[victim].grade == "MAINTENANCE", 30, "MAINTENANCE"
        )


async def test_a_heavier_pipeline_stage_by_design_marks_nobody(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """Stage 1 computes 1.5x by design: its ranks are compared with each other only (the
    role the trainer reports), so no node is named though the watch judged many rounds."""
    steps = 200
    async with jobs_env(
        tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4,
        settings=settings(restart_cost_s=2.0),
    ) as env:  # fmt: skip
        job_id = await env.submit(
            "two-stages", steps, nodes=4, step_s=STEP_S, timing_window_s=WINDOW_S,
            total_steps=steps,
            trainer_args=sync_args(
                "--pipeline-stages", "2", "--heavy-stage", "1", "--heavy-factor", "1.5"
            ),
        )  # fmt: skip
        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 120)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(steps)
        # the watch saw enough rounds to have named a node (warm-up + persistence + more)
        assert env.manager.straggler_rounds >= DETECTOR.warmup_windows + PERSISTENCE + 2
        assert not env.of("node.straggler")
        assert all(r.straggler is None for r in env.region.store.records.values())
