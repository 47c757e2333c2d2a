"""The fleet twin's discrete-event simulation (issue 19): the real scheduler, health
decisions and job machine, driven in simulated time.

One heap of ``(time, sequence, handler, args)`` (no sleeping; equal times in the order
they were scheduled). The events: job arrivals, fault precursors and faults, a person
noticing, repairs, planned maintenance, checkpoint answers, the ends of generations
(finish, a crash on a broken node, a hang timeout), resubmissions (static), stragglers
(a node slowing down, its slowdown ending, the detector's verdict) and the queue passes
(coalesced: at most one every ``policy.pass_interval_s``, only after the queue or the
capacity changed).

Stragglers (docs/twin.md "Stragglers"): a fail-slow node slows every generation running
on it to its pace (:class:`~metalguard.twin.jobs.Generation`'s clock) until it clears by
itself, its node is repaired, or the generation ends. With ``straggler_detection`` the
detector's verdict comes ``straggler_delay_s`` after the slowdown (or after a slowed
generation's restart) for a job of 2 nodes or more whose node is at least the threshold
slower: the node is marked (``decide_stragglers``: SUB_HEALTHY, no new work), and the job
is moved off it (the job machine's ``World.moves_off``: a fresh checkpoint, a restart
elsewhere) when :func:`metalguard.controller.core.stragglers.move_pays` says so, else it
finishes slowed. A marked node whose last job ended drains (MAINTENANCE) and is repaired.

The real code: every job's ``JobStatus`` is changed only by
:mod:`metalguard.controller.jobs.machine` (``submitted``, ``placed``, ``preempt``,
``advance``, ``observe_member``, ``observe_checkpoint``, ``request_cancel``); placement by
:mod:`metalguard.controller.jobs.scheduler` on one kept ``FleetIndex`` (node grades from
the health model; cordoned = out of service); node grades by the health model
(:mod:`metalguard.twin.health`: the real scoring, lifecycle and rail). The twin plays the
agents (:mod:`metalguard.twin.jobs`) and the people (noticing, repairing, resubmitting).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import msgspec

from metalguard.controller.core import stragglers as detector
from metalguard.controller.core.lifecycle_model import OUT_OF_SERVICE
from metalguard.controller.jobs import elastic, machine, quota, scheduler, straggler_watch
from metalguard.controller.jobs.machine import MoveOff, Step, World
from metalguard.controller.jobs.scheduler import (
    FleetIndex,
    FleetNode,
    JobRequest,
    Placement,
    Preemption,
    QueuePass,
    RunningJob,
    request_from_job,
)
from metalguard.proto.base import Reason
from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.twin.allocation import (
    Allocator,
    Pool,
    TenantMeter,
    allocator,
    contract_quotas,
    contracts,
)
from metalguard.twin.failures import draw_faults, draw_planned, draw_stragglers
from metalguard.twin.health import HealthModel
from metalguard.twin.jobs import Generation, TwinJob, reached_offset
from metalguard.twin.metrics import FleetMeter, kept_progress, outcome_record
from metalguard.twin.model import (
    DAY_S,
    Fault,
    JobSpec,
    PlannedMaintenance,
    Policy,
    Straggler,
    TwinInputs,
    TwinResult,
)
from metalguard.twin.sync import GangSegment, scheduler_view

Allowed = Callable[[JobRequest, Sequence[str]], bool]
"""Whether a tenant may hold a placement for a job (its quota's borrow limit)."""
SAMPLES = 400
"""Timeline samples per run when ``sample_s`` is not given."""
HANG_MARGIN_S = 1e-3
"""A hang check runs this long after the timeout (the machine compares with ``>=``)."""


class GradeChangeLike(Protocol):
    """What the engine reads of a health model's grade change."""

    @property
    def node(self) -> str: ...

    @property
    def after(self) -> str: ...


class Health(Protocol):
    """The health model (:class:`metalguard.twin.health.HealthModel`)."""

    decisions: Counter[str]
    running: Callable[[str], int]
    """Each node's count of unfinished job members (the engine sets it)."""

    @property
    def drain_after_s(self) -> float: ...

    def grade(self, handle: str) -> str: ...

    def fleet_node(self, node: FleetNode) -> FleetNode: ...

    def precursor(self, fault: Fault, now: float) -> Sequence[GradeChangeLike]: ...

    def still_degraded(self, fault: Fault, now: float) -> Sequence[GradeChangeLike]: ...

    def report_running(self, handles: Sequence[str], now: float) -> Sequence[GradeChangeLike]: ...

    def fault(self, fault: Fault, now: float) -> Sequence[GradeChangeLike]: ...

    def drain(self, handle: str, now: float, reason: str) -> Sequence[GradeChangeLike]: ...

    def repaired(self, handle: str, now: float) -> Sequence[GradeChangeLike]: ...

    def straggler(
        self, handle: str, evidence: Reason, until: float, now: float
    ) -> Sequence[GradeChangeLike]: ...


def run(inputs: TwinInputs, policy: Policy, *, sample_s: float | None = None) -> TwinResult:
    """Simulate ``inputs`` under ``policy``: faults and planned maintenance drawn from the
    failure model with the run's seed (the same for every policy)."""
    faults = draw_faults(
        inputs.failures, inputs.nodes, inputs.days, random.Random(f"{inputs.seed}:faults")
    )
    planned = draw_planned(
        inputs.failures, inputs.nodes, inputs.days, random.Random(f"{inputs.seed}:planned")
    )
    stragglers = draw_stragglers(
        inputs.failures.stragglers,
        inputs.nodes,
        inputs.days,
        random.Random(f"{inputs.seed}:stragglers"),
    )
    health = HealthModel(inputs.nodes, policy)
    engine = Engine(
        inputs,
        policy,
        faults=faults,
        planned=planned,
        stragglers=stragglers,
        health=health,
        sample_s=sample_s,
    )
    return engine.run()


class Engine:
    """One run: the fleet, the jobs, the event heap (use :func:`run`; tests build it with
    chosen faults and a stand-in health model)."""

    def __init__(
        self,
        inputs: TwinInputs,
        policy: Policy,
        *,
        faults: Sequence[Fault],
        planned: Sequence[PlannedMaintenance] = (),
        stragglers: Sequence[Straggler] = (),
        health: Health,
        sample_s: float | None = None,
        kept: bool = True,
    ) -> None:
        self.inputs = inputs
        self.policy = policy
        self.faults = tuple(faults)
        self.planned = tuple(planned)
        self.stragglers = tuple(stragglers)
        self.health = health
        self.end = inputs.days * DAY_S
        self.now = 0.0
        self.events = 0
        self.counts: Counter[str] = Counter()
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.base: dict[str, FleetNode] = {n.handle: n for n in inputs.nodes}
        if len(self.base) != len(inputs.nodes):
            raise ValueError("two nodes have the same handle")
        self.nodes = {h: scheduler_view(n, inputs.placement) for h, n in self.base.items()}
        """The scheduler's view: the health model's record (grade; cordoned = cordoned or
        held: the controller's own ``topology.fleet_node``), cordoned while out of
        service; its topology collapsed under ``blind`` placement."""
        self.segments: list[GangSegment] = []
        """Each multi-node gang's holdings, for the sync model (on the real topology)."""
        self._handles = tuple(self.nodes)
        self.grades: dict[str, str] = {h: n.grade for h, n in self.nodes.items()}
        """What the job machine reads (MG_NODES); static has no health system: never
        changes."""
        self.total_gpus = sum(n.gpus for n in self.nodes.values())
        self.meter = FleetMeter(
            end_s=self.end, sample_s=sample_s or max(self.end, 1.0) / SAMPLES, nodes=len(self.nodes)
        )
        self._down: set[str] = set()
        """Nodes counted down: out of service (not schedulable) and holding no job (a job
        still leaving a drained node keeps its GPUs busy, not down)."""
        for n in self.nodes.values():  # nothing runs yet
            if not n.schedulable:
                self._down.add(n.handle)
                self.meter.down(0.0, n.gpus, 1)
        self.index: FleetIndex | None = None
        self.empty: FleetIndex | None = None
        self.alloc: Allocator | None = None
        """The tenants' queue side (``inputs.allocation``; None: one pool, no tenants)."""
        self.tenant_meter: TenantMeter | None = None
        if inputs.allocation is not None:
            views = tuple(self.nodes.values())
            self.alloc = allocator(inputs.allocation, views, inputs.partitions)
            quotas = contract_quotas(contracts(views, inputs.partitions))
            self.tenant_meter = TenantMeter(views, quotas)
        elif kept:
            self.index = FleetIndex(self.nodes.values())
            self.empty = FleetIndex(self.nodes.values())
        self.twins: dict[str, TwinJob] = {}
        """By the JobSpec's id, in arrival order."""
        self.attempts: dict[str, TwinJob] = {}
        """By each attempt's job id (static resubmissions get new ids)."""
        self.waiting: dict[str, JobRequest] = {}
        """Attempts waiting for the queue pass, with their exclusions."""
        self.holders: dict[str, RunningJob] = {}
        self.jobs_on: dict[str, set[str]] = {}
        """Node handle -> the attempts holding it."""
        self.broken: dict[str, Fault] = {}
        """Nodes whose hardware failed and is not repaired yet."""
        self.out: set[str] = set()
        """Nodes out of service (in repair, delivery or a maintenance window)."""
        self.averted: set[int] = set()
        """Faults whose node was drained on their precursor."""
        self.draining: dict[str, Fault] = {}
        """SUB_HEALTHY nodes on a precursor, their jobs running to their end (or to the
        lifecycle's drain limit): node -> the fault to come."""
        self.slow: dict[str, Straggler] = {}
        """Nodes slowed now: node -> its fail-slow episode."""
        self.marked: dict[str, Straggler] = {}
        """Nodes the detector marked (SUB_HEALTHY), not yet drained: node -> episode."""
        self.moves_off: dict[str, MoveOff] = {}
        """The job manager's planned moves off a straggler, by attempt id, until begun."""
        self.detect = policy.straggler_detection and policy.auto_isolation
        self.elastic = inputs.allocation == "pooled"
        """Whether jobs run elastic (``pooled`` only: a dedicated partition's job, or one
        of the single pool without tenants, runs at its ``nodes``)."""
        self.growable: set[str] = set()
        """Attempts of running elastic jobs below their ``max_nodes``, not moving."""
        health.running = self._running_on
        self._pass_at: float | None = None
        self._last_pass = -math.inf
        self._dirty = False

    # --- the loop ------------------------------------------------------------------------

    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self) -> TwinResult:
        """Run to the end of the horizon and return the result."""
        for spec in self.inputs.jobs:
            if spec.submit_s <= self.end:
                self._at(max(0.0, spec.submit_s), self._arrive, spec)
        for f in self.faults:
            p = f.precursor_at_s
            if self.policy.precursors and f.kind == "hardware" and p is not None and p < f.at_s:
                self._at(max(0.0, p), self._precursor, f)
            self._at(f.at_s, self._fault, f)
        for pm in self.planned:
            self._at(pm.at_s, self._planned, pm)
        for sg in self.stragglers:
            self._at(sg.at_s, self._straggle, sg)
        heap, end = self._heap, self.end
        while heap and heap[0][0] <= end:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        return self._result()

    def _result(self) -> TwinResult:
        self.now = self.end
        records = []
        for tj in self.twins.values():
            self._segment(tj)  # what still holds its nodes at the end
            done = kept_progress(tj, self.end)
            self._count_interruption(tj.settle(self.end))
            records.append(outcome_record(tj, self.end, done))
        timeline = self.meter.close()
        decisions = Counter(self.counts)
        decisions.update(self.health.decisions)
        return TwinResult(
            policy=self.policy,
            inputs=self.inputs,
            jobs=tuple(records),
            gpu_seconds_available=float(self.total_gpus) * self.end,
            gpu_seconds_busy=self.meter.busy_s,
            gpu_seconds_down=self.meter.down_s,
            faults=self.faults,
            timeline=timeline,
            events=self.events,
            decisions={k: decisions[k] for k in sorted(decisions)},
            stragglers=self.stragglers,
            segments=tuple(self.segments),
            tenant_usage=self.tenant_meter.close(self.end) if self.tenant_meter else {},
        )

    # --- jobs: the machine and the agents --------------------------------------------------

    def _arrive(self, spec: JobSpec) -> None:
        if spec.job_id in self.twins:
            raise ValueError(f"job {spec.job_id!r} submitted twice")
        if spec.elastic and not self.elastic:
            spec = dataclasses.replace(spec, min_nodes=0, max_nodes=0)
        tj, step = TwinJob.submit(spec, self.policy, self.now)
        self.twins[spec.job_id] = tj
        self.attempts[tj.job.job_id] = tj
        self._apply(tj, step)
        self._sync(tj)

    def _resubmit(self, tj: TwinJob) -> None:
        step = tj.resubmit(self.now)
        self.attempts[tj.job.job_id] = tj
        self._apply(tj, step)
        self._sync(tj)

    def _apply(self, tj: TwinJob, step: Step) -> None:
        """Take a machine step: its status, its events, a generation it started."""
        tj.status = st = step.status
        for e in step.emits:
            self.counts[e.kind] += 1
            if e.kind == "job.rescheduled":
                self.counts[f"move:{e.attributes.get('cause', '')}"] += 1
        if st.generation > 0 and st.members and tj.live_gen() is None:
            self._count_interruption(tj.close_gen(self.now))
            g = tj.open_gen(self.now)
            if tj.first_start_s is None:
                tj.first_start_s = self.now
            slow = self._pace_of(g.nodes) if self.slow else 1.0
            if slow * g.base != 1.0:  # an elastic size, or started on a straggler
                g.set_pace(self.now, slow * g.base)
            if slow != 1.0:
                self.counts["straggler:slowed_generations"] += 1
                for node in sorted({n for n in g.nodes if n in self.slow}):
                    self._watch(tj, g, self.slow[node])
            if tj.spec.elastic:
                self.counts[f"elastic:size:{len(g.nodes) - tj.spec.nodes:+d}"] += 1
            self._at(tj.finish_at(g), self._finish, tj, g)
            rs = tj.spec.restart_cost_s
            for node in g.nodes:
                if node in self.broken:  # the job dies once it touches the broken hardware
                    self._at(self.now + rs, self._broken_crash, tj, g, node)
                    break

    def _drive(self, tj: TwinJob) -> None:
        """Advance one job until its commands wait for something later."""
        now = self.now
        while True:
            st = tj.status
            if st.state in TERMINAL_JOB_STATES:
                break
            if st.state == "running" and st.move is None:
                tj.report(now)
            world = World(
                now=now,
                grades=self.grades,
                replies=tj.replies,
                timings=tj.timings,
                moves_off=self.moves_off,
            )
            step = machine.advance(tj.status, world)
            self._apply(tj, step)
            again, later, ckpt_step = tj.answer(step.sends, now)
            if later:
                g = tj.live_gen()
                self._at(now + tj.spec.checkpoint_cost_s, self._checkpoints, tj, g,
                         tuple(later), ckpt_step)  # fmt: skip
            if not again:
                break
        if tj.status.move is None and tj.replies:
            tj.replies = {}  # a move's answers are never asked again (ids per generation)
        off = self.moves_off.get(tj.job.job_id)
        if off is not None:
            st = tj.status
            if st.move is not None or st.generation != off.generation or st.state != "running":
                del self.moves_off[tj.job.job_id]  # begun, or overtaken
        self._sync(tj)

    def _drive_all(self, jobs: Iterable[TwinJob]) -> None:
        seen: set[str] = set()
        for tj in jobs:
            if tj.spec.job_id not in seen:
                seen.add(tj.spec.job_id)
                self._drive(tj)

    def _sync(self, tj: TwinJob) -> None:
        """Mirror the status into the fleet: nodes held, the queue, the job's end."""
        st = tj.status
        holds = machine.held_nodes(st) if st.state not in TERMINAL_JOB_STATES else ()
        if holds != tj.held:
            if tj.held:  # a resize keeps its generation (the machine opens the next)
                self._release(tj, close=not holds)
            if holds:
                self._take(tj, holds, commit=True)
        aid = tj.job.job_id
        if self._may_grow(tj):
            if aid not in self.growable:
                self.growable.add(aid)
                self._at(self.now + tj.job.resize_interval_s, self._grow_due)
        else:
            self.growable.discard(aid)
        if machine.needs_placement(st):
            if aid not in self.waiting:
                exclude = st.move.exclude if st.move is not None else ()
                self.waiting[aid] = request_from_job(tj.job, exclude) if exclude else tj.request
                tj.queued_since = self.now
                self._changed()
        elif aid in self.waiting:
            del self.waiting[aid]
        if st.state in TERMINAL_JOB_STATES and tj.end_s is None and not tj.resubmit_pending:
            g = tj.gen
            interrupted = g is None or g.attempt != tj.attempt or not g.finished
            if not self.policy.auto_isolation and st.state != "succeeded" and interrupted:
                tj.resubmit_pending = True  # static: the user resubmits it
                self._at(self.now + self.policy.resubmit_s, self._resubmit, tj)
            else:
                tj.end_s = self.now

    def _take(self, tj: TwinJob, nodes: tuple[str, ...], *, commit: bool) -> None:
        req = tj.request
        if req.exclusive:
            gpus = sum(self.nodes[h].gpus for h in nodes)
        else:
            gpus = req.gpus_per_node * len(nodes)
        if commit and self.index is not None:
            self.index.commit(req, nodes)
        if commit and self.alloc is not None:
            self.alloc.commit(req, nodes)
        aid = tj.job.job_id
        tj.held, tj.gpus_held, tj.held_since = nodes, gpus, self.now
        tj.gpus_most = max(tj.gpus_most, gpus)
        self.meter.hold(self.now, gpus, 1)
        if self.tenant_meter is not None:
            self.tenant_meter.hold(self.now, req.tenant, gpus)
        for h in nodes:
            self.jobs_on.setdefault(h, set()).add(aid)
        self.holders[aid] = RunningJob(req, nodes, self.now)
        if tj.queued_since is not None:
            tj.waits.append(self.now - tj.queued_since)
            tj.queued_since = None

    def _release(self, tj: TwinJob, *, close: bool = True) -> None:
        """The job gives up its nodes (``close``: its generation ends with them)."""
        if close:
            self._count_interruption(tj.close_gen(self.now))
        self._segment(tj)
        if self.index is not None:
            self.index.release(tj.request, tj.held)
        if self.alloc is not None:
            self.alloc.release(tj.request, tj.held)
        if self.tenant_meter is not None:
            self.tenant_meter.hold(self.now, tj.request.tenant, -tj.gpus_held)
        aid = tj.job.job_id
        self.meter.hold(self.now, -tj.gpus_held, -1)
        tj.held_s += self.now - tj.held_since
        tj.held_gpu_s += (self.now - tj.held_since) * tj.gpus_held
        for h in tj.held:
            on = self.jobs_on.get(h)
            if on is not None:
                on.discard(aid)
                if not on:
                    del self.jobs_on[h]
                    self._recount(h)
                if h in self.draining or h in self.marked:
                    self._at(self.now, self._count_changed, h)
        self.holders.pop(aid, None)
        tj.held, tj.gpus_held = (), 0
        self._changed()

    def _segment(self, tj: TwinJob) -> None:
        """Record a multi-node gang's holding, from its placement to now."""
        if len(tj.held) > 1:
            seg = GangSegment(
                tj.spec.job_id, tj.held, tj.gpus_held, tj.job.priority, tj.held_since, self.now
            )
            self.segments.append(seg)

    def _count_interruption(self, what: tuple[str, str] | None) -> None:
        if what is not None:
            self.counts[f"interruption:{what[0]}:{what[1]}"] += 1

    def _checkpoints(
        self, tj: TwinJob, gen: Generation | None, ids: tuple[str, ...], step: int
    ) -> None:
        if gen is not None and tj.deliver_checkpoints(ids, gen, step, self.now):
            self._drive(tj)

    def _finish(self, tj: TwinJob, gen: Generation) -> None:
        st = tj.status
        if tj.live_gen() is not gen or gen.frozen_at is not None:
            return
        if gen.anchors and tj.finish_at(gen) > self.now:
            return  # its pace changed since: a later finish is on the heap
        if st.state != "running" or st.move is not None:
            return
        tj.report(self.now)
        gen.finished = True
        gen.frozen_at = self.now
        code = 1 if tj.spec.outcome == "failed" else 0
        st = tj.status
        exits = {m.node: code for m in st.members}
        tj.status = machine.observe_members(st, gen.number, self.now, exit_codes=exits)
        self._drive(tj)

    def _crash(self, tj: TwinJob, gen: Generation, node: str, cause: str) -> None:
        """The generation's processes die (the member on ``node`` exits 1)."""
        gen.crashed = True
        if gen.frozen_at is None:
            gen.frozen_at = self.now
        gen.cause = cause  # a crash outranks a planned stop it interrupted
        tj.status = machine.observe_member(tj.status, node, gen.number, self.now, exit_code=1)

    def _broken_crash(self, tj: TwinJob, gen: Generation, node: str) -> None:
        fault = self.broken.get(node)
        if tj.live_gen() is not gen or gen.crashed or gen.frozen_at is not None or fault is None:
            return
        self._crash(tj, gen, node, fault.cause)
        self._drive(tj)

    def _hang_check(self, tj: TwinJob, gen: Generation) -> None:
        if tj.live_gen() is gen:
            self._drive(tj)

    def _kill_hung(self, tj: TwinJob, gen: Generation) -> None:
        """A person notices the hung job and kills it."""
        if tj.live_gen() is not gen or gen.crashed or not tj.status.members:
            return
        self._crash(tj, gen, tj.status.members[0].node, gen.cause)
        self._drive(tj)

    # --- the fleet ---------------------------------------------------------------------

    def _live_on(self, handle: str) -> list[tuple[TwinJob, Generation]]:
        """The attempts whose processes run on a node (by id)."""
        out = []
        for aid in sorted(self.jobs_on.get(handle, ())):
            tj = self.attempts[aid]
            g = tj.live_gen()
            if g is not None and not g.crashed and handle in g.nodes:
                out.append((tj, g))
        return out

    def _jobs_on(self, handles: Iterable[str]) -> list[TwinJob]:
        ids = sorted({a for h in handles for a in self.jobs_on.get(h, ())})
        return [self.attempts[a] for a in ids]

    def _fault(self, f: Fault) -> None:
        h = f.node
        self.counts[f"fault:{f.kind}"] += 1
        if self.draining.get(h) is f:  # its jobs were still running there: they are hit
            del self.draining[h]
            self.counts["fault:hit_while_sub_healthy"] += 1
        if f.fault_id in self.averted:  # drained on its precursor: what still runs there dies
            live = self._live_on(h)
            for tj, g in live:
                self._crash(tj, g, h, f.cause)
            self.counts["fault:hit_while_draining" if live else "fault:prevented"] += 1
            self._drive_all(tj for tj, _ in live)
            return
        if h in self.out or (f.kind == "hardware" and h in self.broken):
            self.counts["fault:node_already_out"] += 1
            return
        live = self._live_on(h)
        if f.kind == "hardware":
            self.broken[h] = f
            for tj, g in live:
                self._crash(tj, g, h, f.cause)
            changes = self.health.fault(f, self.now) if self.policy.auto_isolation else ()
            touched = self._grades(changes)
            if self.nodes[h].schedulable:  # not isolated: a person will notice
                self._at(self.now + self.policy.human_notice_s, self._notice, f)
            else:
                self._take_out(h)
                self._at(self.now + f.repair_s + self.policy.delivery_s, self._repaired, h)
            self.counts["fault:hit" if live else "fault:idle_node"] += 1
            self._drive_all([*(tj for tj, _ in live), *self._jobs_on(touched)])
            return
        fresh = [(tj, g) for tj, g in live if g.frozen_at is None]
        if not fresh:
            self.counts["fault:idle_node"] += 1
            return
        # a software bug or a hang hits one job: the one holding the most GPUs there
        tj, g = min(fresh, key=lambda p: (-p[0].gpus_held, p[0].job.job_id))
        self.counts["fault:hit"] += 1
        if f.kind == "software":
            self._crash(tj, g, h, f.cause)
            self._drive(tj)
            return
        g.hung = True
        tj.freeze(self.now, f.cause)
        timeout = tj.job.hang_timeout or 0.0  # the twin's jobs set it (0: off)
        if timeout > 0:  # the machine's hang timeout will see it
            s = tj.spec
            own = g.clock(self.now)
            off = reached_offset(own, s.restart_cost_s, s.checkpoint_interval_s,
                                 s.checkpoint_cost_s)  # fmt: skip
            due = g.wall(off) + timeout + HANG_MARGIN_S
            self._at(max(self.now, due), self._hang_check, tj, g)
        # a person notices a hang nothing else caught (no timeout; the machine watches
        # only members on HEALTHY and SUB_HEALTHY nodes) and kills the job
        self._at(self.now + self.policy.human_notice_s, self._kill_hung, tj, g)

    def _notice(self, f: Fault) -> None:
        """A person notices a broken node nothing took out of service, and drains it."""
        h = f.node
        if self.broken.get(h) is not f or h in self.out:
            return
        live = self._live_on(h)
        for tj, g in live:  # whatever started there since dies on the broken hardware
            self._crash(tj, g, h, f.cause)
        touched: list[str] = []
        if self.policy.auto_isolation:
            touched = self._grades(self.health.drain(h, self.now, f"fault noticed: {f.cause}"))
        self._take_out(h)
        self._at(self.now + f.repair_s + self.policy.delivery_s, self._repaired, h)
        self._drive_all([*(tj for tj, _ in live), *self._jobs_on([h, *touched])])

    def _precursor(self, f: Fault) -> None:
        """The real decisions on a precursor (docs/decisions.md): SUB_HEALTHY takes no new
        work while its jobs run to their end (then MAINTENANCE: repaired before the
        fault) or to ``sub_healthy_drain_after_s`` (then moved with a fresh checkpoint); a
        node with no job drains at once; FAILING is isolated, its jobs moved."""
        h = f.node
        if h in self.out or h in self.broken:
            return
        touched = self._grades(self.health.precursor(f, self.now))
        grade = self.nodes[h].grade
        if grade == "HEALTHY":
            self.counts["precursor:missed"] += 1
            self._drive_all(self._jobs_on(touched))
            return
        self.counts["precursor:acted"] += 1
        if grade == "SUB_HEALTHY":
            self.draining[h] = f
            limit = self.health.drain_after_s
            if limit > 0:
                self._at(self.now + limit, self._drain_limit, h, f)
            self._drive_all(self._jobs_on(touched))
            return
        self._drained(h, f, touched)

    def _drained(self, h: str, f: Fault, touched: Sequence[str] = ()) -> None:
        """The node left service on ``f``'s precursor (MAINTENANCE, or FAILING): what
        still runs there is moved now (planned), and it is repaired before the fault."""
        self.draining.pop(h, None)
        for _, g in self._live_on(h):
            if not g.cause:
                g.cause = "precursor"
        self.averted.add(f.fault_id)
        self._take_out(h)
        self._at(self.now + f.repair_s + self.policy.delivery_s, self._repaired, h)
        self._drive_all(self._jobs_on([h, *touched]))

    def _drain_limit(self, h: str, f: Fault) -> None:
        """``sub_healthy_drain_after_s`` after the precursor, jobs still there: the part
        still degraded, the lifecycle moves the node to MAINTENANCE and its jobs."""
        if self.draining.get(h) is not f or h in self.out or h in self.broken:
            return
        touched = self._grades(self.health.still_degraded(f, self.now))
        if self.nodes[h].grade in OUT_OF_SERVICE:
            self.counts["precursor:drain_limit"] += 1
            self._drained(h, f, touched)
        else:
            self._drive_all(self._jobs_on(touched))

    def _count_changed(self, h: str) -> None:
        """A draining (precursor) or marked (straggler) node's count of jobs changed: the
        job manager's report; its last job gone, the lifecycle drains it (MAINTENANCE)."""
        f = self.draining.get(h)
        sg = self.marked.get(h)
        if (f is None and sg is None) or h in self.out or h in self.broken:
            return
        touched = self._grades(self.health.report_running([h], self.now))
        if self.nodes[h].grade not in OUT_OF_SERVICE:
            return
        if f is not None:
            self.marked.pop(h, None)
            self._drained(h, f, touched)
        elif sg is not None:
            self._straggler_drained(h, sg, touched)

    def _running_on(self, h: str) -> int:
        """The node's count of unfinished job members (the attempts holding it)."""
        return len(self.jobs_on.get(h, ()))

    def _planned(self, pm: PlannedMaintenance) -> None:
        h = pm.node
        if h in self.out or h in self.broken:
            self.counts["planned:skipped"] += 1
            return
        self.counts["planned:windows"] += 1
        for _, g in self._live_on(h):
            if not g.cause:
                g.cause = "planned maintenance"
        touched: list[str] = []
        if self.policy.auto_isolation:  # the machine moves its jobs with a fresh checkpoint
            touched = self._grades(self.health.drain(h, self.now, "planned maintenance"))
        else:  # static: the job is stopped at the window; its user resubmits it
            for tj in self._jobs_on([h]):
                tj.status = machine.request_cancel(tj.status, self.now)
        self._take_out(h)
        self._at(self.now + pm.duration_s, self._repaired, h)
        self._drive_all(self._jobs_on([h, *touched]))

    def _repaired(self, h: str) -> None:
        self.broken.pop(h, None)
        self.marked.pop(h, None)
        sg = self.slow.get(h)
        if sg is not None:  # whatever brought the node in fixed its slowdown too
            self._unstraggle(sg, "repaired")
        touched: list[str] = []
        if self.policy.auto_isolation:
            touched = self._grades(self.health.repaired(h, self.now))
        self.out.discard(h)
        self._refresh(h)
        self._drive_all(self._jobs_on(touched))

    # --- stragglers ----------------------------------------------------------------------

    def _straggle(self, sg: Straggler) -> None:
        """A node starts computing ``sg.slowdown`` slower: every generation on it slows to
        its pace; it lasts ``sg.duration_s`` unless the node is repaired first."""
        h = sg.node
        if h in self.out or h in self.broken or h in self.slow:
            self.counts["straggler:skipped"] += 1  # out of service, or slowed already
            return
        self.counts["straggler:episodes"] += 1
        self.slow[h] = sg
        self._at(self.now + sg.duration_s, self._unstraggle, sg, "cleared")
        for tj, g in self._live_on(h):
            if self._repace(tj, g):
                self.counts["straggler:slowed_generations"] += 1
            self._watch(tj, g, sg)

    def _unstraggle(self, sg: Straggler, why: str) -> None:
        """The slowdown ends (``cleared`` by itself or by hand, or ``repaired``)."""
        h = sg.node
        if self.slow.get(h) is not sg:
            return
        del self.slow[h]
        self.counts[f"straggler:{why}"] += 1
        for tj, g in self._live_on(h):
            self._repace(tj, g)

    def _pace_of(self, nodes: Iterable[str]) -> float:
        """A synchronous job's pace on ``nodes``: its slowest node's."""
        worst = 0.0
        for n in nodes:
            sg = self.slow.get(n)
            if sg is not None and sg.slowdown > worst:
                worst = sg.slowdown
        return 1.0 + worst

    def _repace(self, tj: TwinJob, g: Generation) -> bool:
        """Bring a generation to its nodes' pace now (a stopped one keeps what it did);
        its finish moves with it. Whether the pace changed."""
        if g.frozen_at is not None or g.finished or g.closed:
            return False
        pace = self._pace_of(g.nodes) * g.base
        if pace == g.pace:
            return False
        g.set_pace(self.now, pace)
        self._at(tj.finish_at(g), self._finish, tj, g)
        return True

    def _watch(self, tj: TwinJob, g: Generation, sg: Straggler) -> None:
        """The detector's verdict on ``sg``'s node in this generation, when it will come:
        its ranks are compared with their peers on the job's other nodes (2 nodes or
        more), from the first windows after the restart's warm-up, and a node at least
        the threshold slower for the persistence windows is named."""
        p = self.policy
        if not self.detect or len(g.nodes) < detector.MIN_PEERS:
            return
        if sg.slowdown < p.straggler_threshold:
            self.counts["straggler:below_threshold"] += 1
            return
        since = max(self.now, g.wall(tj.spec.restart_cost_s))
        self._at(since + p.straggler_delay_s, self._detected, sg, tj, g)

    def _detected(self, sg: Straggler, tj: TwinJob, g: Generation) -> None:
        """The detector names ``sg``'s node in ``tj``'s generation: the node is marked
        (SUB_HEALTHY, no new work) and the job moved off it when that pays (``move_pays``:
        slowdown x remaining run time > restart cost + lost work, with the job manager's
        figures: the remaining work at the job's own pace (the measured step time without
        the slowdown), and the time since the last checkpoint), else it finishes where it
        is, slowed."""
        h = sg.node
        st = tj.status
        if self.slow.get(h) is not sg or tj.live_gen() is not g or g.frozen_at is not None:
            return
        if st.state != "running" or st.move is not None or h not in g.nodes:
            return
        p = self.policy
        touched: list[str] = []
        if self.marked.get(h) is not sg:
            evidence = Reason(
                signal="jobs.straggler",
                value=round(sg.slowdown, 3),
                threshold=p.straggler_threshold,
                rule="straggler",
                message=(
                    f"{sg.slowdown:.0%} slower than its peers in job {tj.spec.job_id} for "
                    f"{p.straggler_persistence} windows of {p.straggler_window_s:g} s"
                ),
            )
            until = self.now + p.straggler_hold_s
            touched = self._grades(self.health.straggler(h, evidence, until, self.now))
            self.marked[h] = sg
            self.counts["straggler:detected"] += 1
        s = tj.spec
        tj.report(self.now)  # the steps and checkpoint the job manager has heard of
        # straggler_watch.remaining_s: the steps still to do x the step time without the
        # slowdown (a step is a second of work at the job's own pace)
        remaining = s.work_s - tj.progress(self.now)
        # the most a move may redo (it asks a fresh checkpoint first: in the twin, nothing)
        lost = straggler_watch.lost_work_s(tj.status, self.now)
        if detector.move_pays(sg.slowdown, remaining, s.restart_cost_s, lost):
            self.moves_off[tj.job.job_id] = MoveOff(
                generation=st.generation,
                nodes=(h,),
                cause="straggler",
                why=(
                    f"straggler {h}: {sg.slowdown:.0%} slower x {remaining:.0f} s to go > "
                    f"restart {s.restart_cost_s:g} s + {lost:.0f} s since the last checkpoint"
                ),
            )
            if not g.cause:
                g.cause = "straggler"
            tj.straggler_moves += 1
            tj.straggler_move_s += s.checkpoint_cost_s + s.restart_cost_s
            self.counts["straggler:moved"] += 1
        else:
            self.counts["straggler:kept"] += 1
        self._drive_all([tj, *self._jobs_on(touched)])

    def _straggler_drained(self, h: str, sg: Straggler, touched: Sequence[str] = ()) -> None:
        """A marked node's last job ended: the lifecycle drained it (MAINTENANCE); it is
        repaired (``sg.repair_s``) and delivered back."""
        self.marked.pop(h, None)
        self.counts["straggler:drained"] += 1
        self._take_out(h)
        self._at(self.now + sg.repair_s + self.policy.delivery_s, self._repaired, h)
        self._drive_all(self._jobs_on([h, *touched]))

    def _take_out(self, h: str) -> None:
        if h not in self.out:
            self.out.add(h)
            self._refresh(h)

    def _grades(self, changes: Sequence[GradeChangeLike]) -> list[str]:
        """Apply the health model's grade changes; the nodes they touched."""
        touched = sorted({ch.node for ch in changes})
        for h in touched:
            self._refresh(h)
        return touched

    def _refresh(self, h: str) -> None:
        """Rebuild a node's records from the health model and the repairs."""
        old = self.nodes[h]
        new = self.base[h]
        if self.policy.auto_isolation:
            new = self.health.fleet_node(new)
            self.grades[h] = new.grade
        if h in self.out and not new.cordoned:
            new = msgspec.structs.replace(new, cordoned=True)
        new = scheduler_view(new, self.inputs.placement)
        if new == old:
            return
        self.nodes[h] = new
        if self.index is not None and self.empty is not None:
            self.index.update_node(new)
            self.empty.update_node(new)
        if self.alloc is not None:
            self.alloc.update_node(new)
        self._recount(h)
        if new.schedulable and not old.schedulable:
            self._changed()

    def _recount(self, h: str) -> None:
        """Count a node down or up again (busy and down never overlap)."""
        down = not self.nodes[h].schedulable and not self.jobs_on.get(h)
        if down != (h in self._down):
            gpus = self.nodes[h].gpus
            if down:
                self._down.add(h)
                self.meter.down(self.now, gpus, 1)
            else:
                self._down.discard(h)
                self.meter.down(self.now, -gpus, -1)

    # --- the queue pass ------------------------------------------------------------------

    def _changed(self) -> None:
        """The queue or the capacity changed: a pass is due (at most one per interval)."""
        self._dirty = True
        if self._pass_at is None and (self.waiting or self.growable):
            self._pass_at = max(self.now, self._last_pass + self.policy.pass_interval_s)
            self._at(self._pass_at, self._pass)

    def _grow_due(self) -> None:
        """An elastic job's resize interval passed: a pass may grow it."""
        if self.growable:
            self._changed()

    def _may_grow(self, tj: TwinJob) -> bool:
        """A running elastic job below its ``max_nodes``, not moving (the manager's)."""
        return self.elastic and tj.spec.elastic and elastic.may_grow(tj.status)

    def _pass(self) -> None:
        self._pass_at = None
        if not self._dirty or not (self.waiting or self.growable):
            return
        self._dirty = False
        self._last_pass = self.now
        self.counts["scheduler:passes"] += 1
        running = list(self.holders.values())
        queue = list(self.waiting.values())
        decided = self._schedule(queue, running) if queue else QueuePass((), (), ())
        # the nodes held back for blocked jobs: no elastic start or growth takes them
        reserved = {h for b in decided.blocked for h in b.reserved}
        now = self.now
        for p in decided.placements:
            tj = self.attempts[p.job_id]
            self.counts["scheduler:placements"] += 1
            nodes, level = self._start_size(tj, p, reserved, running)
            self._take(tj, nodes, commit=False)  # the pass (or the start size) committed it
            self._apply(tj, machine.placed(tj.status, nodes, now, level))
            self._drive(tj)
        requests = {r.job_id: r for r in queue}
        for pre in decided.preemptions:
            by = self.attempts[pre.job_id].request.tenant if pre.job_id in self.attempts else ""
            reclaim_for = by if pre.cause == "reclaim" else ""
            shrinks = self._shrinks(pre, requests.get(pre.job_id), running)
            for victim in pre.victims:
                v = self.attempts.get(victim)
                if v is None:
                    continue
                if v.status.state == "running" and v.status.move is None:
                    v.report(now)  # the move records the furthest step and checkpoint
                shrink = shrinks.get(victim)
                if shrink is not None:  # it gives up what the preempting job needs
                    step = machine.resize(
                        v.status, now, shrink.to_nodes, "shrink", shrink.attributes()
                    )
                    if step.status is not v.status:
                        self.counts["elastic:shrinks"] += 1
                        self._apply(v, step)
                        self._drive(v)
                    continue
                step = machine.preempt(v.status, now, pre.job_id, reclaim_for)
                if step.status is v.status:
                    continue  # already moving
                self.counts["scheduler:preemptions"] += 1
                if reclaim_for:
                    self.counts["scheduler:reclaims"] += 1
                    if self.tenant_meter is not None:
                        self.tenant_meter.reclaim(reclaim_for, v.request.tenant)
                g = v.live_gen()
                if g is not None and not g.cause:
                    g.cause = "reclaimed" if reclaim_for else "preempted"
                self._apply(v, step)
                self._drive(v)

        if self.growable:
            self._grow(reserved, running)

    # --- elastic jobs (pooled; docs/twin.md "Elastic jobs") ------------------------------

    def _allowed(self, pool: Pool, running: Sequence[RunningJob]) -> Allowed:
        """Whether a tenant may hold a larger placement (its borrow limit)."""

        def allowed(req: JobRequest, nodes: Sequence[str]) -> bool:
            return quota.may_hold(pool.quotas, running, pool.index.nodes, req, nodes)

        return allowed

    def _start_size(
        self, tj: TwinJob, placed: Placement, reserved: set[str], running: Sequence[RunningJob]
    ) -> tuple[tuple[str, ...], str]:
        """Where a placed job starts: an elastic one at the largest size that fits now
        (the job manager's ``elastic_start``), its placement otherwise."""
        pool = self.alloc
        if not self.elastic or not tj.spec.elastic or not isinstance(pool, Pool):
            return placed.nodes, placed.level
        st = tj.status
        exclude = st.move.exclude if st.move is not None else ()
        req = request_from_job(tj.job, exclude)
        pool.release(req, placed.nodes)
        allowed = self._allowed(pool, running)
        chosen = elastic.start_placement(tj.job, placed, pool.index, exclude, reserved, allowed)
        pool.commit(req, chosen.nodes)
        return chosen.nodes, chosen.level

    def _shrinks(
        self, pre: Preemption, req: JobRequest | None, running: Sequence[RunningJob]
    ) -> dict[str, elastic.Resize]:
        """The elastic victims of a priority preemption that shrink instead of stopping
        (the job manager's rule: a reclaim stops its victims whole)."""
        pool = self.alloc
        if not self.elastic or req is None or pre.cause != "priority":
            return {}
        if not isinstance(pool, Pool):  # elastic implies pooled
            return {}
        jobs = {v: self.attempts[v].job for v in pre.victims if v in self.attempts}
        return elastic.shrink_victims(req, pre, running, jobs, pool.index)

    def _grow(self, reserved: set[str], running: Sequence[RunningJob]) -> None:
        """Grow the running elastic jobs into idle nodes (the job manager's pass): each
        by ``elastic.grow_decision`` on the pool, within its tenant's borrow limit."""
        pool = self.alloc
        if not isinstance(pool, Pool):
            return
        waiting = list(self.waiting.values())
        if any(pool.index.place(w) is not None for w in waiting):
            return  # the idle nodes serve the queue first: grow_decision's own check, made
            # once a pass here, not once per job (a growth that moves a job to a tighter
            # group may free nodes a waiting job fits on: the next pass places it)
        allowed = self._allowed(pool, running)
        now = self.now
        for aid in sorted(self.growable):
            tj = self.attempts[aid]
            g = tj.live_gen()
            if not self._may_grow(tj) or g is None:
                continue
            st = tj.status
            grown = elastic.grow_decision(tj.job, st.placement, pool.index, now, g.t0, (), reserved)
            if grown is None or not allowed(tj.request, grown.to_nodes):
                continue
            tj.report(now)  # the move records the furthest step and checkpoint
            step = machine.resize(st, now, grown.to_nodes, "grow", grown.attributes())
            if step.status is st:
                continue
            self.counts["elastic:grows"] += 1
            if not g.cause:
                g.cause = "resized"
            self._apply(tj, step)
            self._drive(tj)

    def _schedule(self, queue: list[JobRequest], running: list[RunningJob]) -> QueuePass:
        p = self.policy
        if self.alloc is not None:
            return self.alloc.schedule(queue, running, p)
        if self.index is not None:
            return scheduler.schedule_on(
                self.index,
                queue,
                running,
                empty=self.empty,
                preempt=p.preemption,
                backfill=p.backfill,
            )
        nodes = [self.nodes[h] for h in self._handles]
        return scheduler.schedule_queue(
            queue, nodes, running, preempt=p.preemption, backfill=p.backfill
        )
