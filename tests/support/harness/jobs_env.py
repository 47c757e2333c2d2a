"""A region for the job tests: a simulated fleet of real agents (each running real trainer
processes through its workload runner), the region controller with its ingest, and the job
manager, over the session nats-server (``jobs_env``); and the digest an uninterrupted run
of examples/trainer.py reaches (``expected_digest``)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.controller.jobs.manager import JobManager, JobSettings
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.jobs.tenant_store import TenantStore
from metalguard.controller.region import RegionController
from metalguard.controller.remediation import Remediation
from metalguard.controller.state.store import NodeStore
from metalguard.controller.task_dump import task_stacks
from metalguard.demo.run import WorkloadFleet
from metalguard.proto.codec import decode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import TERMINAL_JOB_STATES, JobStatus
from metalguard.proto.subjects import Subjects
from metalguard.proto.tenants import TenantQuota
from tests.support import ROOT
from tests.support.waiting import wait_until

REGION = "r1"
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
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def expected_digest(steps: int) -> str:
    """The digest of an uninterrupted run of ``steps`` steps."""
    return str(trainer_module().digest_after(steps))


@dataclass
class JobsEnv:
    """A region: fleet, controller (ingest + lifecycle), job manager and remediation."""

    nc: Client
    subjects: Subjects
    fleet: WorkloadFleet
    region: RegionController
    ingest: Ingest
    manager: JobManager
    ckpt_root: Path
    settings: JobSettings = SETTINGS
    remediation: Remediation | None = None
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

    async def running_counted(self, name: str, steps: int, **extra: Any) -> JobStatus:
        """Submit a job, wait until it runs and the controller counts it on its nodes
        (``NodeRecord.running_jobs``); its running status."""
        job_id = await self.submit(name, steps, **extra)
        running = await self.wait_state(job_id, {"running"})
        records = self.region.store.records
        await wait_until(
            lambda: all(records[h].running_jobs == 1 for h in running.placement),
            30,
            "the job's nodes counted by the controller",
        )
        return running

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
            self.nc, js, store, self.region.store, self.subjects, REGION, self.settings,
            fleet=self.region.topology.fleet, report_running=self.region.report_running,
            report_suspects=self.region.report_suspects,
            report_stragglers=self.region.report_stragglers,
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
    lifecycle: LifecycleConfig = LIFECYCLE,
    settings: JobSettings = SETTINGS,
    tenants: Sequence[TenantQuota] | None = None,
) -> AsyncIterator[JobsEnv]:
    """A started region of ``racks`` x ``nodes_per_rack`` simulated nodes, every node graded
    HEALTHY before it is yielded; everything stopped afterwards (``lifecycle``: the
    region's, no safety rail unless given; ``settings``: the job manager's; ``tenants``:
    the quotas MG_TENANTS is seeded with, None: a job manager without quotas)."""
    js = nc.jetstream(timeout=5)
    tenant_store = None
    if tenants is not None:
        tenant_store = await TenantStore.open(js, subjects)
        await tenant_store.seed(tenants)
    store = await NodeStore.open(js, subjects)
    region = RegionController(js, store, subjects, REGION, lifecycle)
    await region.start(silence_interval_s=0.25)
    ingest = Ingest(js, subjects, IngestSettings(region=REGION), region)
    await ingest.start()
    fleet = WorkloadFleet(
        tmp_path / "fleet", nats_url, racks=racks, nodes_per_rack=nodes_per_rack,
        interval_s=INTERVAL_S, prefix=subjects.prefix,
    )  # fmt: skip
    manager = JobManager(
        nc, js, await JobStore.open(js, subjects), store, subjects, REGION, settings,
        fleet=region.topology.fleet, report_running=region.report_running,
        report_suspects=region.report_suspects, report_stragglers=region.report_stragglers,
        tenants=tenant_store,
    )  # fmt: skip
    remediation = Remediation(nc, js, store, subjects, REGION, tick_s=0.2, timeout_s=30.0)
    env = JobsEnv(
        nc, subjects, fleet, region, ingest, manager, tmp_path / "ckpt", settings, remediation
    )
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
        await remediation.start()
        yield env
    finally:
        await _stopped("remediation", remediation.stop())
        await _stopped("the job manager", env.manager.stop())
        await _stopped("the subscription", sub.unsubscribe())
        await _stopped("the fleet", fleet.stop())
        await _stopped("ingest", ingest.stop())
        await _stopped("the region controller", region.stop())


STOP_DEADLINE_S = 30.0


async def _stopped(what: str, stopping: Awaitable[object]) -> None:
    """Await one part's stop; past the deadline print every task's stack and fail naming
    the part (a stop that hangs is a bug to see, not a test timeout to guess at)."""
    try:
        await asyncio.wait_for(stopping, STOP_DEADLINE_S)
    except TimeoutError:
        print(task_stacks())
        raise AssertionError(f"stopping {what} took over {STOP_DEADLINE_S:.0f} s") from None
