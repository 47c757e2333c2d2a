"""End to end: real agents (a simulated fleet, each running real trainer processes through
its workload runner), real NATS, the region controller and the job manager.

A fault written into one node's sysfs makes the controller grade it FAILING; the job
manager checkpoints the job, stops it, places it again without that node and starts it
from the checkpoint; its final digest equals an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.controller.jobs.manager import JobManager, JobSettings
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.demo.run import WorkloadFleet
from metalguard.proto.codec import decode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import TERMINAL_JOB_STATES, JobStatus
from metalguard.proto.subjects import Subjects
from tests.waiting import wait_until

REGION = "r1"
ROOT = Path(__file__).parents[2]
TRAINER = ROOT / "examples" / "trainer.py"
INTERVAL_S = 0.5
SETTINGS = JobSettings(
    tick_s=0.2,
    checkpoint_deadline_s=3.0,
    stop_grace_s=2.0,
    start_timeout_s=5.0,
    master_addr="127.0.0.1",
    progress_write_s=1.0,
)
LIFECYCLE = LifecycleConfig(rail_max_fraction=1.0, rail_min_nodes=1000)
"""No safety rail: every fault may isolate its node (the tests count moves)."""


def trainer_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mg_example_trainer", TRAINER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_digest(steps: int) -> str:
    """The digest of an uninterrupted run of ``steps`` steps."""
    return str(trainer_module().digest_after(steps))


@dataclass
class JobsEnv:
    """A region: fleet, controller (ingest + lifecycle) and job manager."""

    nc: Client
    subjects: Subjects
    fleet: WorkloadFleet
    region: RegionController
    ingest: Ingest
    manager: JobManager
    ckpt_root: Path
    events: list[ControllerEvent] = field(default_factory=list)

    async def on_event(self, msg: Msg) -> None:
        self.events.append(decode(msg.data, ControllerEvent))

    def of(self, kind: str, job_id: str | None = None) -> list[ControllerEvent]:
        return [e for e in self.events if e.kind == kind and job_id in (None, e.job_id)]

    def handle(self, name: str) -> str:
        return f"{REGION}.{self.fleet.nodes[name].config.node.cluster}.{name}"

    def job(self, job_id: str) -> JobStatus:
        return self.manager.jobs[job_id]

    async def submit(self, name: str, steps: int, **extra: Any) -> str:
        args = ["--steps", str(steps), "--step-seconds", str(extra.pop("step_s", 0.03))]
        args += extra.pop("trainer_args", [])
        doc = {
            "name": name,
            "nodes": extra.pop("nodes", 4),
            "command": "python",
            "args": [str(TRAINER), *args],
            "checkpoint_dir": str(self.ckpt_root / name),
            "checkpoint_every": extra.pop("checkpoint_every", 1.0),
            **extra,
        }
        status = await self.manager.submit(doc)
        return status.job_id

    async def wait_state(
        self, job_id: str, states: AbstractSet[str], timeout_s: float = 30.0
    ) -> JobStatus:
        await wait_until(
            lambda: self.job(job_id).state in states,
            timeout_s,
            f"{job_id} in {states} (now {self.manager.jobs[job_id].state})",
        )
        return self.job(job_id)

    async def wait_step(self, job_id: str, step: int, timeout_s: float = 30.0) -> None:
        def reached() -> bool:
            s = self.job(job_id)
            return s.state == "running" and max((m.step for m in s.members), default=0) >= step

        await wait_until(reached, timeout_s, f"{job_id} at step {step}")

    async def restart_manager(self, store: JobStore | None = None) -> None:
        """Kill the job manager (its tasks cancelled, nothing graceful) and start a new one
        from MG_JOBS, as a restarted controller would."""
        await self.manager.stop()
        js = self.nc.jetstream(timeout=5)
        store = store or await JobStore.open(js, self.subjects)
        self.manager = JobManager(
            self.nc, js, store, self.region.store, self.subjects, REGION, SETTINGS,
            fleet=self.region.topology.fleet,
        )  # fmt: skip
        await self.manager.start()

    def invariant(self) -> None:
        """Every job is queued, running (or moving) or finished; no node runs two jobs'
        members and no job is placed on more nodes than it asked for."""
        holders: dict[str, str] = {}
        for s in self.manager.jobs.values():
            assert s.job is not None
            if s.state in TERMINAL_JOB_STATES or s.state == "queued":
                continue
            assert len(s.placement) in (0, s.job.nodes), s
            for node in s.placement:
                assert node not in holders, f"{node} holds {holders.get(node)} and {s.job_id}"
                holders[node] = s.job_id


@contextlib.asynccontextmanager
async def jobs_env(
    tmp_path: Path,
    nats_url: str,
    nc: Client,
    subjects: Subjects,
    *,
    racks: int = 2,
    nodes_per_rack: int = 5,
    store_factory: Callable[[Any], Any] | None = None,
) -> AsyncIterator[JobsEnv]:
    js = nc.jetstream(timeout=5)
    store = await NodeStore.open(js, subjects)
    region = RegionController(js, store, subjects, REGION, LIFECYCLE)
    await region.start(silence_interval_s=0.25)
    ingest = Ingest(js, subjects, IngestSettings(region=REGION), region)
    await ingest.start()
    fleet = WorkloadFleet(
        tmp_path / "fleet", nats_url, racks=racks, nodes_per_rack=nodes_per_rack,
        interval_s=INTERVAL_S, prefix=subjects.prefix,
    )  # fmt: skip
    manager = JobManager(
        nc, js, await JobStore.open(js, subjects), store, subjects, REGION, SETTINGS,
        fleet=region.topology.fleet,
    )  # fmt: skip
    env = JobsEnv(nc, subjects, fleet, region, ingest, manager, tmp_path / "ckpt")
    sub = await nc.subscribe(subjects.control_all(REGION), cb=env.on_event)
    try:
        await fleet.start()
        names = fleet.node_names
        await wait_until(
            lambda: all(
                (r := store.records.get(env.handle(n))) is not None and r.grade == "HEALTHY"
                for n in names
            ),
            60,
            "every node graded HEALTHY",
        )
        await manager.start()
        yield env
    finally:
        await env.manager.stop()
        await sub.unsubscribe()
        await fleet.stop()
        await ingest.stop()
        await region.stop()


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

    def __init__(self, kv: Any, phase: str) -> None:
        super().__init__(kv)
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
    dying = DiesAfterWriting(await js.key_value(env.subjects.bucket("jobs")), phase)
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
