"""The job manager: the thin I/O around the job state machine (docs/jobs.md).

Every ``tick_s`` (and at once when something happens) one pass:

1. each unfinished job is advanced by :func:`metalguard.controller.jobs.machine.advance`
   against the node grades (MG_NODES, read from the region controller's store) and the
   replies to its commands; a changed status is written to MG_JOBS **before** its events
   are published and its commands sent, its events to the jobs' outbox (MG_JOBS
   ``_outbox.*``) before the status: a manager stopped between the write and the publish
   (a crash, a lost connection) leaves them there, and the next pass of this manager or
   of a restarted one publishes them (deterministic event ids: the stream drops a
   repeat), then deletes them;
2. the queue pass (:func:`metalguard.controller.jobs.quota.schedule_with_quotas`: the
   scheduler's ``schedule_queue`` under the tenants' quotas, MG_TENANTS) places queued
   jobs and moves waiting for a placement, on the nodes the region's topology gives
   (``fleet``), and starts preemptions (a tenant's reclaim among them).

It hears from the nodes through their ``job_*`` NodeEvents (progress, periodic
checkpoints, exits; docs/workloads.md) and talks to them with ``start`` / ``checkpoint`` /
``stop`` commands, idempotent by id, so a restarted manager re-sends what its stored
status says and the agents answer repeats from their memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.core.decide import changed_counts
from metalguard.controller.jobs import blame, dma_watch, elastic, machine
from metalguard.controller.jobs.machine import Emit, MoveOff, Send, Step, Timings, World
from metalguard.controller.jobs.quota import (
    check_against_fleet,
    fleet_capacity,
    may_hold,
    schedule_with_quotas,
    usage,
)
from metalguard.controller.jobs.scheduler import (
    FleetIndex,
    FleetNode,
    JobRequest,
    Placement,
    Preemption,
    RunningJob,
    request_from_job,
)
from metalguard.controller.jobs.spec import NotLeaderError, parse_job
from metalguard.controller.jobs.store import JobConflictError, JobStore
from metalguard.controller.jobs.straggler_watch import (
    Finding,
    Slowed,
    StragglerWatch,
    WatchSettings,
    slowed_event,
    straggler_event,
    window_from,
)
from metalguard.controller.jobs.tenant_store import TenantStore
from metalguard.controller.stopping import cancel_within
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import Command, CommandReply, ControllerEvent, NodeEvent
from metalguard.proto.jobs import TERMINAL_JOB_STATES, CheckpointRef, Job, JobStatus
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import NodeEventSubject, SubjectError, Subjects
from metalguard.proto.tenants import TenantQuota, TenantUsage
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)


class NodeRecords(Protocol):
    """The node records, by handle (``NodeStore``)."""

    @property
    def records(self) -> Mapping[str, NodeRecord]: ...


@dataclass(frozen=True, slots=True)
class JobSettings:
    """The job manager's knobs (``[jobs]`` in the controller config; docs/jobs.md)."""

    tick_s: float = 1.0
    checkpoint_deadline_s: float = 30.0
    stop_grace_s: float = 10.0
    start_timeout_s: float = 10.0
    master_addr: str = ""
    """MG_MASTER_ADDR for every gang ("" = rank 0's node name; the demo uses 127.0.0.1)."""
    progress_write_s: float = 5.0
    """A progress-only change (steps) is written to MG_JOBS at most this often."""
    restart_backoff_s: float = 1.0
    """The wait before trying a refused start again, doubled at every restart ..."""
    restart_backoff_max_s: float = 60.0
    """... up to this (docs/jobs.md "Refused starts")."""
    hang_timeout_s: float = 1800.0
    """The hang timeout of a job that sets none (``[jobs] hang_timeout_s``; 0: off)."""
    blame_min_jobs: int = 3
    """A node blamed by the failed generations of this many different jobs ..."""
    blame_window_s: float = 86_400.0
    """... within this window is suspected (SUB_HEALTHY for the window; docs/jobs.md)."""
    stragglers: WatchSettings = field(default_factory=WatchSettings)
    """The straggler watch (docs/jobs.md "Stragglers")."""


FleetView = Callable[[Mapping[str, NodeRecord]], list[FleetNode]]
"""The scheduler's nodes for the node records: the region's topology
(``TopologyView.fleet``, :mod:`metalguard.controller.core.topology`)."""


STOP_WAIT_S = 10.0
"""How long :meth:`JobManager.stop` waits for its cancelled command tasks."""


class JobManager:
    """Runs the jobs of one region over NATS, MG_JOBS and the node records; ``fleet``
    turns the records into the scheduler's nodes (the region's ``TopologyView.fleet``)."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        store: JobStore,
        nodes: NodeRecords,
        subjects: Subjects,
        region: str,
        settings: JobSettings | None = None,
        *,
        fleet: FleetView,
        clock: Callable[[], float] = time.time,
        leading: Callable[[], bool] = lambda: True,
        report_running: Callable[[Mapping[str, int]], Awaitable[object]] | None = None,
        report_suspects: Callable[[Mapping[str, tuple[str, ...]], float], Awaitable[object]]
        | None = None,
        report_stragglers: Callable[[Mapping[str, Reason], float], Awaitable[object]] | None = None,
        tenants: TenantStore | None = None,
    ) -> None:
        self._nc = nc
        self._tenants = tenants
        """The tenants' quotas (MG_TENANTS; None: no quotas, the plain scheduler)."""
        self._report_stragglers = report_stragglers
        """Takes the nodes found slowing a job, their evidence and when the mark ends
        (the region controller's ``report_stragglers``)."""
        self._report_running = report_running
        """Takes each node's changed count of unfinished job members (the region
        controller's ``report_running``: a decision round)."""
        self._report_suspects = report_suspects
        """Takes the nodes newly blamed for other jobs' failures and when their suspicion
        ends (the region controller's ``report_suspects``)."""
        self._isolation_said: dict[str, str] = {}
        """The ``node.isolation_lost`` announcements made for running jobs: event id ->
        job (a job's go once it ends)."""
        self._straggling: list[Finding] = []
        """Findings not yet announced and handed over (a failure is retried next pass)."""
        self._slowed: list[Slowed] = []
        """Whole-job slowdowns not yet announced."""
        self._moves_off: dict[str, MoveOff] = {}
        """Job id → the move off a straggler that pays, until the job's generation moves."""
        self._failures: list[blame.Failure] = []
        """Failed generations blamed on nodes, within the blame window (in memory: a
        restarted controller starts counting again)."""
        self._js = js
        self.store = store
        self._nodes = nodes
        self._subjects = subjects
        self.region = region
        self.settings = settings or JobSettings()
        self._stragglers = StragglerWatch(self.settings.stragglers)
        self._clock = clock
        self._fleet = fleet
        self._leading = leading
        self._led = True
        """Whether the last pass ran as the leader (a new leader reloads MG_JOBS first)."""
        self._timings = Timings(
            checkpoint_deadline_s=self.settings.checkpoint_deadline_s,
            stop_deadline_s=self.settings.stop_grace_s + 5.0,
            start_deadline_s=self.settings.start_timeout_s * 3,
            restart_backoff_s=self.settings.restart_backoff_s,
            restart_backoff_max_s=self.settings.restart_backoff_max_s,
            hang_timeout_s=self.settings.hang_timeout_s,
        )
        self._live: dict[str, JobStatus] = {}
        """The newest status of each job (may be ahead of MG_JOBS in progress only)."""
        self._written_ts: dict[str, float] = {}
        self._replies: dict[str, CommandReply] = {}
        self._inflight: set[str] = set()
        self._refusals = RefusalLog()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sub: Any = None
        self.bad_events = 0
        """Node events not taken: undecodable, or a job event whose payload names another
        node than its subject (the ingest consumer dead-letters both)."""

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Load MG_JOBS, listen to the nodes' job events and start the passes."""
        await self._reload()
        subject = self._subjects.node_event(self.region, "*", "*", "*")
        self._sub = await self._nc.subscribe(subject, cb=self._on_event)
        self._task = asyncio.create_task(self._run(), name="job-manager")

    async def stop(self) -> None:
        """Stop the passes and the subscription (jobs keep running on the nodes)."""
        if self._task is not None:  # bounded too: a pass loop that lost its cancel
            await cancel_within([self._task], STOP_WAIT_S, "job manager passes")
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(NatsError):
                await self._sub.unsubscribe()
            self._sub = None
        # bounded: a command that ignores its cancel does not hold the stop
        await cancel_within(list(self._tasks), STOP_WAIT_S, "job manager stop")

    def wake(self) -> None:
        """Run a pass now (something changed)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job pass failed; retrying on the next tick")
            await wait_event(self._wake, self.settings.tick_s)
            self._wake.clear()

    # --- the API ------------------------------------------------------------------------

    @property
    def jobs(self) -> Mapping[str, JobStatus]:
        """Every job's newest status, by id."""
        return self._live

    @property
    def straggler_rounds(self) -> int:
        """Rounds of timing windows (one from every rank) the straggler watch judged."""
        return self._stragglers.rounds

    @property
    def failures(self) -> tuple[blame.Failure, ...]:
        """The failures blamed on nodes that the job manager keeps (docs/jobs.md "Blame")."""
        return tuple(self._failures)

    async def submit(self, raw: Any) -> JobStatus:
        """Validate and queue a job (JobRejectedError with every reason when invalid)."""
        job = parse_job(raw, self._clock())
        return await self.submit_job(job)

    def _check_leading(self) -> None:
        if not self._leading():
            raise NotLeaderError("this controller does not lead the region; ask the leader")

    async def submit_job(self, job: Job, reason: str = "submitted") -> JobStatus:
        """Queue a valid job; JobExistsError when its id is taken."""
        self._check_leading()
        step = machine.submitted(job, self._clock(), reason)
        async with self._lock:
            events = self._events(step.status, step.emits)
            await self.store.add_pending(events)
            try:
                await self.store.create(step.status)
            except BaseException:
                await self._abandon(events)
                raise
            self._live[job.job_id] = step.status
            self._written_ts[job.job_id] = self._clock()
            await self._publish(events)
        self.wake()
        return step.status

    async def hand_over(self, job_id: str, send: Callable[[Job], Awaitable[bool]]) -> bool:
        """Give a job that never started to another region: ``send`` it and, when it was
        taken, forget it here (MG_JOBS delete).  Under the manager's lock, so the queue
        pass cannot start it meanwhile; False when it is no longer a never-started queued
        job or ``send`` failed."""
        async with self._lock:
            status = self._live.get(job_id)
            if status is None or not handed_over_ok(status) or status.job is None:
                return False
            if not await send(status.job):
                return False
            await self.store.delete(job_id)
            self._live.pop(job_id, None)
            self._written_ts.pop(job_id, None)
        return True

    async def cancel(self, job_id: str) -> JobStatus | None:
        """Ask for a job's cancellation (None: no such job)."""
        self._check_leading()
        async with self._lock:
            status = self._live.get(job_id)
            if status is None:
                return None
            new = machine.request_cancel(status, self._clock())
            if new != status:
                await self._write(new, force=True)
        self.wake()
        return self._live[job_id]

    # --- one pass -----------------------------------------------------------------------

    async def run_pass(self) -> None:
        """Advance every unfinished job, then place what waits for a placement.

        Only the region's leader acts; a follower (or a controller that just took the
        lease) reloads MG_JOBS instead, so it serves fresh reads and resumes any move.
        """
        async with self._lock:
            leading = self._leading()
            if not leading or not self._led:
                await self._reload()
            self._led = leading
            if not leading:
                return
            await self._publish(self._pending())
            records = self._nodes.records
            await self._watch_stragglers()
            world = World(
                now=self._clock(),
                grades={h: r.grade for h, r in records.items()},
                replies=self._replies,
                master_addr=self.settings.master_addr,
                timings=self._timings,
                moves_off=self._moves_off,
            )
            for job_id in list(self._live):
                status = self._live[job_id]
                if status.state in TERMINAL_JOB_STATES:
                    continue
                await self._apply(machine.advance(status, world))
            await self._queue_pass(records, world)
            self._forget_replies()
            await self._report(records)
            await self._blame(records)
            await self._watch_isolation(records)

    async def _watch_isolation(self, records: Mapping[str, NodeRecord]) -> None:
        """Announce ``node.isolation_lost`` for each node of a running sensitive job whose
        DMA isolation posture dropped (docs/security.md "DMA isolation"); the job runs on:
        an operator decides. Once per job, node, generation and posture (in memory; a
        restarted manager's repeat carries the same event id, which the stream drops)."""
        running = {j for j, s in self._live.items() if s.state not in TERMINAL_JOB_STATES}
        self._isolation_said = {e: j for e, j in self._isolation_said.items() if j in running}
        found = [
            lost
            for lost in dma_watch.lost_isolation(self._live.values(), records)
            if lost.event_id not in self._isolation_said
        ]
        now = self._clock()
        for lost in found:
            record = records[lost.handle]
            why = "; ".join(lost.reasons) or "no reason given"
            event = ControllerEvent(
                event_id=lost.event_id,
                ts=now,
                region=self.region,
                kind=dma_watch.ISOLATION_LOST,
                node=record.node,
                job_id=lost.job_id,
                message=f"DMA isolation {lost.posture} on a node of sensitive job "
                f"{lost.job_id}: {why}; the job runs on (an operator decides)",
                attributes={"posture": lost.posture, "generation": lost.generation},
            )
            if not await self._announce(event):
                continue  # the next pass announces it
            self._isolation_said[lost.event_id] = lost.job_id
            log.warning("%s", event.message)

    async def _watch_stragglers(self) -> None:
        """Announce each straggler found (``node.straggler``), hand it to the region
        controller (SUB_HEALTHY with the evidence) and, when moving pays, ask the job's
        move off it; announce whole-job slowdowns (``job.slowed``, no node blamed).
        docs/jobs.md "Stragglers". A failed publish or hand-over is retried next pass."""
        running = [j for j, s in self._live.items() if s.state not in TERMINAL_JOB_STATES]
        self._stragglers.forget(running)
        self._moves_off = {
            j: off
            for j, off in self._moves_off.items()
            if (s := self._live.get(j)) is not None and s.generation == off.generation
            and s.state not in TERMINAL_JOB_STATES
        }  # fmt: skip
        found, slowed = self._stragglers.take()
        self._straggling += found
        self._slowed += slowed
        now = self._clock()
        pending, self._slowed = self._slowed, []
        for slow in pending:
            if not await self._announce(slowed_event(slow, self.region, now)):
                self._slowed.append(slow)
        pending_found, self._straggling = self._straggling, []
        for f in pending_found:
            record = self._nodes.records.get(f.handle)
            event = straggler_event(f, self.region, record.node if record else None, now)
            if not await self._hand_over(f, now) or not await self._announce(event):
                self._straggling.append(f)
                continue
            if f.move:
                why = f"straggler: {f.handle} {f.percent:g} % slower than its peers"
                self._moves_off[f.job_id] = MoveOff(f.generation, (f.handle,), "straggler", why)
            log.warning("%s", event.message)

    async def _hand_over(self, found: Finding, now: float) -> bool:
        """The straggler to the region controller (SUB_HEALTHY for ``hold_s``); False when
        that failed (NATS down, a store conflict: the next pass tries again)."""
        if self._report_stragglers is None:
            return True
        try:
            await self._report_stragglers(
                {found.handle: found.reason()}, now + self.settings.stragglers.hold_s
            )
        except Exception as exc:
            log.warning("straggler %s not handed to the region controller: %s", found.handle, exc)
            return False
        return True

    async def _announce(self, event: ControllerEvent) -> bool:
        """Publish one controller event (its id deduplicates); False when not published."""
        try:
            await self._js.publish(
                self._subjects.control(self.region, event.kind),
                encode(event),
                headers={"Nats-Msg-Id": event.event_id},
            )
        except NatsError as exc:
            log.warning("%s %s not published: %s", event.kind, event.event_id, exc)
            return False
        return True

    async def _blame(self, records: Mapping[str, NodeRecord]) -> None:
        """Hand the region controller the nodes newly blamed by ``blame_min_jobs`` jobs'
        failures (docs/jobs.md "Blame"); a failure is logged, the next pass tries again."""
        now = self._clock()
        window = self.settings.blame_window_s
        self._failures = blame.recent(self._failures, now, window)
        if self._report_suspects is None or not self._failures:
            return
        found = blame.suspects(self._failures, now, window, self.settings.blame_min_jobs)
        new = {
            h: jobs
            for h, jobs in found.items()
            if (r := records.get(h)) is not None and r.suspect_jobs != jobs
        }
        if not new:
            return
        try:
            await self._report_suspects(new, now + window)
        except Exception as exc:  # NATS down, a store conflict: next pass tries again
            log.warning("suspected nodes not handed to the region controller: %s", exc)

    async def _report(self, records: Mapping[str, NodeRecord]) -> None:
        """Hand the nodes whose count of unfinished job members changed to the region
        controller; a failure is logged and the counts are handed again next pass (the
        records still differ)."""
        if self._report_running is None:
            return
        counts = machine.members_per_node(self._live.values())
        changed = changed_counts(records, counts, self.region)
        if not changed:
            return
        try:
            await self._report_running(changed)
        except Exception as exc:  # NATS down, a store conflict: next pass tries again
            log.warning("running job counts not handed to the region controller: %s", exc)

    async def _reload(self) -> None:
        await self.store.load()
        if self._tenants is not None:
            await self._tenants.load()  # a quota the leader stored since
        now = self._clock()
        self._live = {k: machine.resumed(s, now) for k, s in self.store.jobs.items()}

    async def _queue_pass(self, records: Mapping[str, NodeRecord], world: World) -> None:
        """Place what waits (an elastic job at the largest size that fits now), start the
        preemptions (an elastic victim shrinks when that makes room), then grow the
        running elastic jobs into idle nodes (docs/jobs.md "Elastic jobs")."""
        live = self._live.values()
        growing = [s for s in live if elastic.may_grow(s)]
        if not growing and not any(machine.needs_placement(s) for s in live):
            return
        queue, running = queue_and_running(live)
        fleet = self._fleet(records)
        index = FleetIndex(fleet, running)
        quotas = self._tenants.quotas if self._tenants is not None else None
        decided = schedule_with_quotas(queue, fleet, running, quotas, index=index)
        reserved = {h for b in decided.blocked for h in b.reserved}

        def allowed(req: JobRequest, nodes: Sequence[str]) -> bool:
            return may_hold(quotas, running, index.nodes, req, nodes)

        for p in decided.placements:
            status = self._live[p.job_id]
            nodes, level = elastic_start(status, p, index, reserved, allowed)
            await self._apply(machine.placed(status, nodes, world.now, level))
            await self._apply(machine.advance(self._live[p.job_id], world))
        requests = {r.job_id: r for r in queue}
        jobs = {s.job_id: s.job for s in live if s.job is not None}
        for pre in decided.preemptions:
            await self._preempt(pre, requests, running, jobs, index, world)
        for status in growing:
            status = self._live[status.job_id]
            if not elastic.may_grow(status) or status.job is None:
                continue  # a victim of this pass
            grown = elastic.grow_decision(
                status.job, status.placement, index, world.now, run_started(status),
                queue, reserved,
            )  # fmt: skip
            held = request_from_job(status.job)
            if grown is None or not allowed(held, grown.to_nodes):
                continue  # no room, or more than its tenant may borrow
            index.release(held, status.placement)
            index.commit(held, grown.to_nodes)
            step = machine.resize(status, world.now, grown.to_nodes, "grow", grown.attributes())
            await self._apply(step)
            await self._apply(machine.advance(self._live[status.job_id], world))

    async def _preempt(
        self,
        pre: Preemption,
        requests: Mapping[str, JobRequest],
        running: list[RunningJob],
        jobs: Mapping[str, Job],
        index: FleetIndex,
        world: World,
    ) -> None:
        """Start one preemption: each victim checkpointed and stopped (back to the queue),
        or an elastic victim shrunk onto the nodes the plan leaves it; a tenant's reclaim
        says so (``tenant.reclaim``)."""
        owner = self._live.get(pre.job_id)
        reclaim_for = ""
        if pre.cause == "reclaim" and owner is not None and owner.job is not None:
            reclaim_for = owner.job.tenant
        req = requests.get(pre.job_id)
        shrinks = {}
        if req is not None and pre.cause == "priority":
            shrinks = elastic.shrink_victims(req, pre, running, jobs, index)
        for victim in pre.victims:
            held = self._live.get(victim)
            if held is None:
                continue
            shrink = shrinks.get(victim)
            if shrink is not None:
                attrs = shrink.attributes()
                step = machine.resize(held, world.now, shrink.to_nodes, "shrink", attrs)
            else:
                step = machine.preempt(held, world.now, pre.job_id, reclaim_for)
            await self._apply(step)
            await self._apply(machine.advance(self._live[victim], world))

    # --- tenants (docs/scheduler.md "Tenant quotas") -------------------------------------

    def tenant_usage(self) -> tuple[int, dict[str, TenantUsage]]:
        """The fleet's GPUs and each tenant's quota and use (``GET /v1/tenants``)."""
        fleet = self._fleet(self._nodes.records)
        queue, running = queue_and_running(self._live.values())
        quotas = self._tenants.quotas if self._tenants is not None else {}
        return fleet_capacity(fleet)[0], usage(quotas, fleet, running, queue)

    async def set_quota(self, quota: TenantQuota) -> TenantQuota:
        """Store a tenant's quota (``PUT /v1/tenants/NAME``): QuotaError when the
        guarantees would go beyond the fleet, TenantConflictError on a concurrent write,
        NotLeaderError on a follower; the next pass schedules under it."""
        self._check_leading()
        if self._tenants is None:
            raise NotLeaderError("this controller runs without tenant quotas")
        total, by_type = fleet_capacity(self._fleet(self._nodes.records))
        check_against_fleet({**self._tenants.quotas, quota.name: quota}, total, by_type)
        async with self._lock:
            stored = await self._tenants.put(quota)
        self.wake()
        return stored

    async def _apply(self, step: Step) -> None:
        """Put its events in the outbox, persist the new status, then publish the events
        (deleting them from the outbox), then send its commands. A status another writer
        changed first takes neither: its events leave the outbox, its commands stay unsent
        (the next pass decides again from the fresh status)."""
        status = step.status
        before = self._live.get(status.job_id)
        events = self._events(status, step.emits)
        await self.store.add_pending(events)
        if status != before and not await self._write(status, force=True):
            await self._abandon(events)
            return
        await self._publish(events)
        members = before.members if before is not None else ()
        for emit in step.emits:
            for node in blame.blamed_nodes(emit.kind, emit.attributes, members):
                self._failures.append(blame.Failure(node, status.job_id, self._clock()))
        for send in step.sends:
            self._send(status, send)

    async def _write(self, status: JobStatus, *, force: bool) -> bool:
        """Write ``status`` to MG_JOBS; False (the fresh value taken) on a conflict."""
        now = self._clock()
        try:
            await self.store.put(status)
        except JobConflictError:
            fresh = await self.store.refresh(status.job_id)
            log.warning("job %s changed in MG_JOBS by another writer; reloaded", status.job_id)
            if fresh is not None:
                self._live[status.job_id] = fresh
            return False
        self._live[status.job_id] = status
        self._written_ts[status.job_id] = now
        return True

    def _events(self, status: JobStatus, emits: Iterable[Emit]) -> list[ControllerEvent]:
        """The ControllerEvents of a step's emits (ids from the machine: deterministic)."""
        now = self._clock()
        return [
            ControllerEvent(
                event_id=e.event_id,
                ts=now,
                region=self.region,
                kind=e.kind,
                job_id=status.job_id,
                message=e.message,
                attributes=e.attributes,
            )
            for e in emits
        ]

    def _pending(self) -> list[ControllerEvent]:
        """What the outbox holds (left by a publish that failed, or by a manager stopped
        between a write and its publish), oldest first."""
        return sorted(self.store.outbox.values(), key=lambda e: (e.ts, e.event_id))

    async def _abandon(self, events: Iterable[ControllerEvent]) -> None:
        """Take events of a status that was not written out of the outbox."""
        for event in events:
            try:
                await self.store.remove_pending(event.event_id)
            except NatsError as exc:  # left there: published by a later pass (a repeat)
                log.warning("pending event %s not removed: %s", event.event_id, exc)

    async def _publish(self, events: Iterable[ControllerEvent]) -> None:
        """Publish each event (message id = event id) and delete it from the outbox once
        the stream acknowledged it; a failed publish leaves it and the ones after it for
        the next pass."""
        for event in events:
            try:
                await self._js.publish(
                    self._subjects.control(self.region, event.kind),
                    encode(event),
                    headers={"Nats-Msg-Id": event.event_id},
                )
                await self.store.remove_pending(event.event_id)
            except NatsError as exc:  # the rest waits too: the order is kept
                log.warning(
                    "event %s not published yet (kept in the outbox): %s", event.event_id, exc
                )
                return

    # --- commands -----------------------------------------------------------------------

    def _send(self, status: JobStatus, send: Send) -> None:
        if send.command_id in self._inflight or send.command_id in self._replies:
            return
        self._inflight.add(send.command_id)
        task = asyncio.create_task(self._request(send), name=f"cmd-{send.command_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request(self, send: Send) -> None:
        region, cluster, node = send.node.split(".", 2)
        args = dict(send.args)
        timeout = self.settings.start_timeout_s
        if send.verb == "checkpoint":
            args["timeout_s"] = self.settings.checkpoint_deadline_s
            timeout = self.settings.checkpoint_deadline_s + 5.0
        elif send.verb == "stop":
            args["grace_s"] = self.settings.stop_grace_s
            timeout = self.settings.stop_grace_s + 5.0
        command = Command(
            command_id=send.command_id,
            ts=self._clock(),
            node=NodeIdentity(region=region, cluster=cluster, node=node),
            verb=send.verb,
            args=args,
            issued_by="controller:jobs",
        )
        subject = self._subjects.command(region, cluster, node, send.verb)
        try:
            msg = await self._nc.request(subject, encode(command), timeout=timeout)
            reply = decode(msg.data, CommandReply)
        except (NatsError, TimeoutError, CodecError) as exc:
            log.info("%s %s to %s: no answer (%s)", send.verb, send.command_id, send.node, exc)
        else:
            self._replies[send.command_id] = reply
            if not reply.ok:
                self._refusals.refused(send, reply)
            self.wake()
        finally:
            self._inflight.discard(send.command_id)

    def _forget_replies(self) -> None:
        """Drop replies of jobs that ended (ids start with the job id)."""
        if len(self._replies) < 4096:
            return
        ended = {j for j, s in self._live.items() if s.state in TERMINAL_JOB_STATES}
        for cid in [c for c in self._replies if c.split(".", 1)[0] in ended]:
            del self._replies[cid]

    # --- the nodes' job events ------------------------------------------------------------

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode(msg.data, NodeEvent)
        except CodecError:
            self.bad_events += 1  # ingest dead-letters (and logs) the same message
            return
        if event.kind not in ("gpu_xid",) and not event.kind.startswith("job_"):
            return
        if not self._leading():
            return
        if not on_its_subject(self._subjects, msg.subject, event):
            self.bad_events += 1  # another node's report: ingest dead-letters it too
            return
        if event.kind == "gpu_xid":
            self._blame_xid(event)
            return
        if event.kind == "job_timing":
            self._timing(event)
            return
        job_id = event.attributes.get("job_id") or event.device
        status = self._live.get(str(job_id))
        if status is None:
            return
        node = event.node.handle
        new = observe(status, node, event, self._clock())
        if new == status:
            return
        async with self._lock:
            current = self._live.get(status.job_id)
            if current is None:
                return
            new = observe(current, node, event, self._clock())
            self._live[status.job_id] = new
            significant = _significant(new) != _significant(current)
            stale = self._clock() - self._written_ts.get(status.job_id, 0.0)
            if significant or stale >= self.settings.progress_write_s:
                await self._write(new, force=True)
        if significant:
            self.wake()

    def _timing(self, event: NodeEvent) -> None:
        """One rank's timing window (docs/jobs.md "Stragglers") into the straggler watch;
        a finding wakes the pass that acts on it."""
        status = self._live.get(str(event.attributes.get("job_id") or event.device))
        rank = event.attributes.get("rank")
        if status is None or isinstance(rank, bool) or not isinstance(rank, int):
            return
        window = window_from(rank, event.node.handle, event.attributes)
        if window is None:
            self.bad_events += 1
            return
        generation = event_generation(event, status.generation)
        self._stragglers.add(status, generation, window, self._nodes.records, self._clock())
        if self._stragglers.pending:
            self.wake()

    def _blame_xid(self, event: NodeEvent) -> None:
        """An application XID blames each job running on its node (docs/jobs.md "Blame");
        the next pass hands any new suspect to the region controller."""
        node = event.node.handle
        running = [
            s.job_id
            for s in self._live.values()
            if s.state not in TERMINAL_JOB_STATES and any(m.node == node for m in s.members)
        ]
        found = blame.xid_failures(node, event.attributes, running, self._clock())
        if found:
            self._failures.extend(found)
            self.wake()


class RefusalLog:
    """Logs each distinct refusal once per job generation (not once per member, nor once
    per try of a repeated command): a job whose every member is refused logs one line."""

    KEEP = 4096

    def __init__(self) -> None:
        self._seen: dict[tuple[str, object, str, str], None] = {}

    def refused(self, send: Send, reply: CommandReply) -> bool:
        """Log ``reply`` unless this refusal was logged for its job and generation."""
        key = (str(send.args.get("job_id", "")), send.args.get("generation"), send.verb,
               reply.message)  # fmt: skip
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > self.KEEP:
            del self._seen[next(iter(self._seen))]
        cause = reply.result.get("cause")
        log.warning(
            "job %s generation %s: %s refused by %s (logged once a generation): %s%s%s",
            key[0], key[1], send.verb, send.node, reply.message,
            f" ({cause})" if cause else "",
            " [permanent]" if reply.result.get("permanent") is True else "",
        )  # fmt: skip
        return True


def queue_and_running(
    statuses: Iterable[JobStatus],
) -> tuple[list[JobRequest], list[RunningJob]]:
    """The scheduler's queue (jobs waiting for a placement, each with the nodes its move
    excludes) and its running jobs (with when their run started) from the statuses."""
    queue: list[JobRequest] = []
    running: list[RunningJob] = []
    for s in statuses:
        if s.job is None or s.state in TERMINAL_JOB_STATES:
            continue
        if machine.needs_placement(s):
            exclude = s.move.exclude if s.move is not None else ()
            queue.append(request_from_job(s.job, exclude))
        elif s.placement:
            held = machine.held_nodes(s)
            running.append(RunningJob(request_from_job(s.job), held, run_started(s)))
    return queue, running


def elastic_start(
    status: JobStatus,
    placed: Placement,
    index: FleetIndex,
    reserved: Collection[str],
    allowed: Callable[[JobRequest, Sequence[str]], bool] = lambda _req, _nodes: True,
) -> tuple[tuple[str, ...], str]:
    """Where a placed job starts, and the level (:func:`elastic.start_placement`; ``index``
    holds the one chosen)."""
    job = status.job
    if job is None or not elastic.node_range(job).elastic:
        return placed.nodes, placed.level
    exclude = status.move.exclude if status.move is not None else ()
    req = request_from_job(job, exclude)
    index.release(req, placed.nodes)
    chosen = elastic.start_placement(job, placed, index, exclude, reserved, allowed)
    index.commit(req, chosen.nodes)
    return chosen.nodes, chosen.level


def run_started(status: JobStatus) -> float:
    """When the job's current run started: its latest move into ``running`` (0: never)."""
    for transition in reversed(status.history):
        if transition.state == "running":
            return transition.ts
    return 0.0


def on_its_subject(subjects: Subjects, subject: str, event: NodeEvent) -> bool:
    """Whether ``event`` came on its own node's event subject (pure): a node reports on
    its own members only."""
    try:
        parsed = subjects.parse(subject)
    except SubjectError:
        return False
    n = event.node
    return isinstance(parsed, NodeEventSubject) and (
        (parsed.region, parsed.cluster, parsed.node) == (n.region, n.cluster, n.node)
    )


def handed_over_ok(status: JobStatus) -> bool:
    """Whether a job may still go to another region: queued, never started, no move,
    no cancel asked (pure)."""
    return (
        status.state == "queued"
        and status.generation == 0
        and status.move is None
        and not status.cancel_requested
    )


def event_generation(event: NodeEvent, current: int) -> int:
    """The run a ``job_*`` event reports on: its ``generation`` attribute (the start
    command's, echoed by the agent), ``current`` when it has none (an older agent)."""
    generation = event.attributes.get("generation")
    if isinstance(generation, int) and not isinstance(generation, bool):
        return generation
    return current


def observe(status: JobStatus, node: str, event: NodeEvent, now: float) -> JobStatus:
    """Take one ``job_*`` NodeEvent into the status (pure). An event of another run
    than the job's current generation (a late progress, checkpoint or exit of a run
    already replaced) changes nothing: it would overstate steps or end the new run."""
    attrs = event.attributes
    member = next((m for m in status.members if m.node == node), None)
    if member is None:
        return status
    generation = event_generation(event, status.generation)
    if generation != status.generation:
        return status
    if event.kind == "job_progress":
        step = attrs.get("step")
        if isinstance(step, int) and step >= 0:
            return machine.observe_member(status, node, generation, now, step=step)
    elif event.kind == "job_checkpointed":
        step, path = attrs.get("step"), attrs.get("path")
        if isinstance(step, int) and isinstance(path, str) and path:
            status = machine.observe_member(status, node, generation, now, step=step)
            return machine.observe_checkpoint(status, CheckpointRef(path=path, step=step, ts=now))
    elif event.kind == "job_exited":
        if attrs.get("stopped") is True:
            return status  # we stopped it (a move); not a crash
        code = attrs.get("exit_code")
        if not isinstance(code, int):
            signal = attrs.get("signal")
            code = -9 if signal else 1
        digest = attrs.get("digest")
        step = attrs.get("step")
        cause = attrs.get("cause")
        return machine.observe_member(
            status,
            node,
            generation,
            now,
            exit_code=code,
            digest=digest if isinstance(digest, str) else "",
            step=step if isinstance(step, int) and step >= 0 else None,
            exit_cause=cause if isinstance(cause, str) else "",
        )
    return status


def _significant(status: JobStatus) -> bytes:
    """The status without progress-only fields (what must be written at once)."""
    members = tuple(msgspec.structs.replace(m, step=0, progress_ts=0.0) for m in status.members)
    return encode(msgspec.structs.replace(status, members=members, updated_ts=0.0))
