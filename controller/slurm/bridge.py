"""The Slurm bridge: the controller's decisions drive Slurm; Slurm's own view flows back.

In: a durable JetStream consumer on ``<P>_CONTROL`` (``<p>.ctl.<region>.>``), so a
restarted bridge resumes where it stopped without missing a decision.  Each decision is
planned against Slurm's current view (:mod:`controller.slurm.actions`, pure) and carried
out with Slurm's tools; the message is acknowledged once every action succeeded, else
redelivered later (planning again is idempotent).  Evacuations (checkpoint signal, wait,
requeue) run in the background, one per node at a time.

Out: every action as a ControllerEvent ``slurm.<what>`` on ``<p>.ctl.<region>.slurm.<what>``
(``drained``, ``resumed``, ``job_signalled``, ``job_requeued``, ``skipped``,
``command_failed``), and Slurm's DOWN / NOT_RESPONDING nodes as NodeEvents ``slurm_down``
(warning) / ``slurm_up`` (info) on the node's ``<p>.evt.<region>.<cluster>.<node>.*``,
and each node's count of active Slurm jobs, when it changes (and every
``JOBS_RESYNC_S``), as ``slurm_jobs`` (info): the region controller takes it in as the
node's job count (a SUB_HEALTHY node Slurm has drained enters MAINTENANCE once its last
job ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from metalguard.controller.slurm.actions import (
    Drain,
    Evacuate,
    Resume,
    Skip,
    Trigger,
    down_changes,
    job_count_changes,
    jobs_per_node,
    plan,
    trigger_of,
    trigger_of_record,
)
from metalguard.controller.slurm.announce import Announcer
from metalguard.controller.slurm.config import BridgeConfig
from metalguard.controller.slurm.parse import SlurmNode
from metalguard.controller.slurm.runner import SlurmCommandError
from metalguard.controller.slurm.tools import SlurmTools
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import AttrValue
from metalguard.proto.codec import CodecError, decode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]
FETCH_BATCH = 16
ACK_WAIT_S = 120.0
"""Beyond the checkpoint wait: how long an unacknowledged decision waits for redelivery."""
MAX_DELIVER = 20
NAK_DELAY_S = 5.0
JOBS_RESYNC_S = 300.0
"""How often every node's count of Slurm jobs is announced again, changed or not: a count
the controller could not take in (a node it had no record of yet, a round that failed
and was redelivered late) is put right within this."""


class SlurmBridge:
    """One bridge between a region's controller and one Slurm cluster."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        cfg: BridgeConfig,
        tools: SlurmTools,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self.cfg = cfg
        self.tools = tools
        self._clock = clock
        self._out = Announcer(js, subjects, cfg, clock)
        self._sleep = sleep
        self._down: frozenset[str] = frozenset()
        self._job_counts: dict[str, int] | None = None
        """Each Slurm node's count of active jobs as last announced (None: before the
        first poll that read squeue, which announces every node's)."""
        self._jobs_synced_ts = 0.0
        """When every node's count was last announced (:data:`JOBS_RESYNC_S`)."""
        self._evacuations: dict[str, asyncio.Task[bool]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._acks: set[asyncio.Task[None]] = set()
        self._sub: Any = None
        self.handled = 0
        """Decisions for Slurm carried out (and acknowledged)."""
        self.retried = 0
        """Decisions handed back for redelivery after a Slurm command failed."""

    # --- lifetime -------------------------------------------------------------------------

    async def start(self, *, poll: bool = True) -> None:
        """Create (or reattach to) the durable consumer, then consume and poll."""
        self._sub = await self._js.pull_subscribe(
            self._subjects.control_all(self.cfg.region),
            durable=self.cfg.consumer,
            stream=self._subjects.stream_control,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.NEW,
                ack_wait=max(ACK_WAIT_S, self.cfg.jobs.checkpoint_wait_s + ACK_WAIT_S),
                max_deliver=MAX_DELIVER,
            ),
        )
        self._tasks.append(asyncio.create_task(self._consume(), name="slurm-consume"))
        if poll:
            self._tasks.append(asyncio.create_task(self._poll_loop(), name="slurm-poll"))

    async def stop(self) -> None:
        """Stop consuming and polling; evacuations in flight are cancelled, their
        decisions left unacknowledged (redelivered to the next run, which plans again)."""
        tasks: list[asyncio.Task[Any]] = [*self._tasks, *self._acks, *self._evacuations.values()]
        self._tasks, self._evacuations, self._acks = [], {}, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(NatsError, TimeoutError):
                await self._sub.unsubscribe()
            self._sub = None

    # --- decisions in ---------------------------------------------------------------------

    async def reconcile(self) -> int:
        """Bring Slurm in line with the controller's node records (KV ``<P>_NODES``) of
        this region: drain what is out of service; how many nodes were planned."""
        store = await NodeStore.open(self._js, self._subjects)
        count = 0
        for handle in sorted(store.records):
            record = store.records[handle]
            trigger = trigger_of_record(record)
            if trigger is None or record.node.region != self.cfg.region:
                continue
            count += 1
            await self.carry_out(trigger)  # failures are announced; the next start retries
        log.info("slurm bridge: reconciled %d out-of-service node(s)", count)
        return count

    async def _consume(self) -> None:
        if self.cfg.reconcile_on_start:
            try:
                await self.reconcile()
            except Exception:  # a reconcile that fails must not stop the bridge
                log.exception("slurm bridge: start-up reconciliation failed")
        while True:
            try:
                msgs = await self._sub.fetch(batch=FETCH_BATCH, timeout=1.0)
            except (NatsTimeoutError, TimeoutError):
                continue
            except NatsError as exc:
                log.warning("slurm bridge: fetch failed: %s", exc)
                await self._sleep(1.0)
                continue
            for msg in msgs:
                await self._take(msg)

    async def _take(self, msg: Any) -> None:
        try:
            event = decode(msg.data, ControllerEvent)
        except CodecError as exc:
            log.warning("slurm bridge: ignoring %s: %s", msg.subject, exc)
            await msg.ack()
            return
        try:
            ok, evacuation = await self.handle(event)
        except Exception:  # never let one decision stop the bridge
            log.exception("slurm bridge: handling %s failed", event.event_id)
            ok, evacuation = False, None
        if evacuation is not None:  # acknowledged once its jobs are requeued
            task = asyncio.create_task(self._settle_after(msg, event, ok, evacuation))
            self._acks.add(task)
            task.add_done_callback(self._acks.discard)
            return
        await self._settle(msg, event, ok)

    async def _settle_after(
        self, msg: Any, event: ControllerEvent, ok: bool, evacuation: asyncio.Task[bool]
    ) -> None:
        try:
            evacuated = await asyncio.shield(evacuation)
        except Exception:
            evacuated = False
        await self._settle(msg, event, ok and evacuated)

    async def _settle(self, msg: Any, event: ControllerEvent, ok: bool) -> None:
        """Acknowledge a decision carried out; hand a failed one back for redelivery."""
        with contextlib.suppress(NatsError, TimeoutError):
            if ok:
                await msg.ack()
                self.handled += trigger_of(event) is not None
            else:
                await msg.nak(delay=NAK_DELAY_S)
                self.retried += 1

    async def handle(self, event: ControllerEvent) -> tuple[bool, asyncio.Task[bool] | None]:
        """Carry out one decision: (False when a Slurm command failed: retry later, the
        evacuation it started or joined, which goes on in the background)."""
        if event.kind == "rail.tripped":
            log.warning("slurm bridge: the controller's safety rail tripped: %s", event.message)
            return True, None
        trigger = trigger_of(event)
        if trigger is None or trigger.node.region != self.cfg.region:
            return True, None
        return await self.carry_out(trigger)

    async def carry_out(self, trigger: Trigger) -> tuple[bool, asyncio.Task[bool] | None]:
        """Plan one trigger against Slurm's view and do it (see :meth:`handle`)."""
        slurm_node = self.cfg.slurm_name(trigger.handle)
        try:
            nodes = {n.name: n for n in await self.tools.nodes()}
            jobs = await self.tools.jobs() if trigger.intent == "evacuate" else ()
        except SlurmCommandError as exc:
            await self._out.failed(trigger, exc)
            return False, None
        actions = plan(
            trigger,
            slurm_node,
            nodes,
            jobs,
            prefix=self.cfg.reason_prefix,
            max_fraction=self.cfg.drain.max_fraction,
            min_nodes=self.cfg.drain.min_nodes,
        )
        ok, evacuation = True, None
        for action in actions:
            match action:
                case Drain(node, reason):
                    ok &= await self._do(
                        trigger, "drained", self.tools.drain(node, reason), reason=reason
                    )
                case Resume(node):
                    ok &= await self._do(trigger, "resumed", self.tools.resume(node))
                case Skip(node, why):
                    log.info("slurm bridge: %s: %s", node, why)
                    await self._out.announce(trigger, "skipped", why, {"slurm_node": node})
                case Evacuate(node, job_ids):
                    evacuation = self._evacuate_later(trigger, node, job_ids)
        return ok, evacuation

    async def _do(
        self, trigger: Trigger, what: str, command: Awaitable[None], **attrs: AttrValue
    ) -> bool:
        node = self.cfg.slurm_name(trigger.handle)
        try:
            await command
        except SlurmCommandError as exc:
            await self._out.failed(trigger, exc)
            return False
        log.info("slurm bridge: %s %s (%s %s)", what, node, trigger.kind, trigger.event_id)
        message = f"Slurm node {node} {what} after {trigger.kind}"
        await self._out.announce(trigger, what, message, {"slurm_node": node, **attrs})
        return True

    # --- evacuation -----------------------------------------------------------------------

    def _evacuate_later(
        self, trigger: Trigger, node: str, job_ids: tuple[str, ...]
    ) -> asyncio.Task[bool]:
        running = self._evacuations.get(node)
        if running is not None and not running.done():
            return running  # one evacuation per node at a time: repeated events don't stack
        task = asyncio.create_task(self._evacuate(trigger, node, job_ids), name=f"evac-{node}")
        self._evacuations[node] = task
        task.add_done_callback(functools.partial(self._evacuation_done, node))
        return task

    def _evacuation_done(self, node: str, task: asyncio.Task[bool]) -> None:
        if self._evacuations.get(node) is task:
            del self._evacuations[node]
        if not task.cancelled() and task.exception() is not None:
            log.error("slurm bridge: evacuation of %s failed: %r", node, task.exception())

    async def _evacuate(self, trigger: Trigger, node: str, job_ids: tuple[str, ...]) -> bool:
        """Checkpoint signal, wait, requeue; False when a command failed."""
        jobs_cfg = self.cfg.jobs
        ok = True
        for job in job_ids:
            try:
                await self.tools.signal(job, jobs_cfg.checkpoint_signal, jobs_cfg.signal_scope)
            except SlurmCommandError as exc:
                await self._out.failed(trigger, exc, job=job)
                ok = False
                continue
            message = f"job {job} on {node} asked to checkpoint (SIG{jobs_cfg.checkpoint_signal})"
            await self._out.announce(
                trigger, "job_signalled", message, {"slurm_node": node}, job=job
            )
        deadline = time.monotonic() + jobs_cfg.checkpoint_wait_s
        step = min(1.0, jobs_cfg.checkpoint_wait_s / 10)
        still = set(job_ids)
        while still and time.monotonic() < deadline:
            await self._sleep(step)
            still = await self._active_here(node, still)
        still = await self._active_here(node, set(job_ids))
        for job in sorted(set(job_ids) - still):
            why = f"job {job} left {node} before its requeue: not requeued"
            await self._out.announce(trigger, "skipped", why, {"slurm_node": node}, job=job)
        for job in sorted(still):
            try:
                await self.tools.requeue(job)
            except SlurmCommandError as exc:
                await self._out.failed(trigger, exc, job=job)
                ok = False
                continue
            message = f"job {job} requeued off {node} after its checkpoint"
            await self._out.announce(
                trigger, "job_requeued", message, {"slurm_node": node}, job=job
            )
        return ok

    async def _active_here(self, node: str, job_ids: set[str]) -> set[str]:
        try:
            jobs = await self.tools.jobs()
        except SlurmCommandError:
            return job_ids  # cannot tell: assume they still run
        return {j.job_id for j in jobs if j.job_id in job_ids and j.active and node in j.nodes}

    # --- Slurm's view back ----------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # the loop outlives any one bad poll
                log.exception("slurm bridge: poll failed")
            await self._sleep(self.cfg.slurm.poll_s)

    async def poll_once(self) -> tuple[str, ...]:
        """Read Slurm's nodes and jobs once; announce nodes newly DOWN / NOT_RESPONDING
        (and those back) and the nodes whose count of active jobs changed (:meth:`_poll_jobs`);
        the names newly down."""
        try:
            nodes = await self.tools.nodes()
        except SlurmCommandError as exc:
            await self._out.failed(None, exc)
            return ()
        newly, recovered, self._down = down_changes(self._down, nodes)
        for node in newly:
            await self._out.node_event(node.name, "slurm_down", "warning", node)
        for name in recovered:
            await self._out.node_event(name, "slurm_up", "info", None)
        await self._poll_jobs(nodes)
        return tuple(n.name for n in newly)

    async def _poll_jobs(self, nodes: tuple[SlurmNode, ...]) -> None:
        """Announce a ``slurm_jobs`` NodeEvent for each node whose count of active Slurm jobs
        changed since the last poll (every node at the first, and every ``JOBS_RESYNC_S``).
        A failed squeue announces no count (no node is said to be empty because Slurm could
        not be read); a count not published is announced again at the next poll."""
        try:
            jobs = await self.tools.jobs()
        except SlurmCommandError as exc:
            await self._out.failed(None, exc)
            return
        now = self._clock()
        current = jobs_per_node(nodes, jobs)
        previous = self._job_counts
        resync = previous is None or now - self._jobs_synced_ts >= JOBS_RESYNC_S
        counts = {name: len(ids) for name, ids in current.items()}
        for name, ids in job_count_changes(None if resync else previous, current).items():
            if await self._out.jobs_event(name, ids):
                continue
            if previous is not None and name in previous:
                counts[name] = previous[name]
            else:
                del counts[name]
        self._job_counts = counts
        if resync:
            self._jobs_synced_ts = now
