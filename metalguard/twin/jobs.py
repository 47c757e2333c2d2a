"""The job side of the twin: each JobSpec as a real ``Job`` whose ``JobStatus`` only the
real job machine changes, and the twin playing the agents that run its members.

Progress is lazy (no event per periodic checkpoint): a generation started at wall ``t0``
from step ``s0`` spends ``restart_cost_s`` loading, then works, pausing
``checkpoint_cost_s`` after every ``checkpoint_interval_s`` of work (not after the last
piece: a job that finishes does not checkpoint). Steps are seconds of useful progress.
A generation's progress freezes when its processes stop making progress: a crash, a hang,
a fresh checkpoint asked by a move (the move stops it right after), a stop.

A straggler among a generation's nodes slows all of it (a synchronous job runs at its
slowest node's pace): the generation keeps its own clock, which runs ``pace`` times
slower than the wall (1 + the slowest node's slowdown), and the schedule above (restart,
work, pauses) runs on that clock. Without a straggler the clock is the wall since ``t0``.

The agents' answers to the machine's commands (docs/workloads.md): ``start`` and
``stop`` at once (ok); ``checkpoint`` after the job's checkpoint cost with the step
reached, or refused at once when the processes are dead or hung.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

import msgspec

from metalguard.controller.jobs import machine
from metalguard.controller.jobs.machine import Send, Timings
from metalguard.controller.jobs.scheduler import JobRequest, request_from_job
from metalguard.proto.events import CommandReply, CommandStatus
from metalguard.proto.jobs import CheckpointRef, Job, JobStatus
from metalguard.twin.model import JobSpec, Policy

MAX_RESTARTS: Final = 1_000_000
"""reactive / metalguard: the machine restarts a job after every crash or hang (a long
training run meets dozens); the budget only stops a job that can never run."""
EPS: Final = 1e-9


# --- progress, pure ----------------------------------------------------------------------


def work_done(elapsed: float, restart: float, interval: float, cost: float) -> float:
    """Useful work after ``elapsed`` wall seconds of a generation (uncapped)."""
    e = elapsed - restart
    if e <= 0.0:
        return 0.0
    if interval <= 0.0:
        return e
    cycle = interval + cost
    k = math.floor(e / cycle)
    return k * interval + min(e - k * cycle, interval)


def checkpoints_before(remaining: float, interval: float) -> int:
    """Periodic checkpoints a generation with ``remaining`` work takes before it finishes
    (none at the finish itself)."""
    if interval <= 0.0 or remaining <= 0.0:
        return 0
    return max(0, math.ceil(remaining / interval - EPS) - 1)


def wall_to_finish(remaining: float, restart: float, interval: float, cost: float) -> float:
    """Wall seconds from a (re)start to the end of ``remaining`` work, overheads included."""
    return restart + max(0.0, remaining) + checkpoints_before(remaining, interval) * cost


def periodic_done(elapsed: float, restart: float, interval: float, cost: float) -> int:
    """Periodic checkpoints completed (their pause over) after ``elapsed`` wall seconds."""
    e = elapsed - restart
    if interval <= 0.0 or e <= 0.0:
        return 0
    return math.floor(e / (interval + cost))


def reached_offset(elapsed: float, restart: float, interval: float, cost: float) -> float:
    """When (offset from the start) the progress of ``elapsed`` was reached: the start
    during warm-up, a pause's beginning during a checkpoint pause, else ``elapsed``."""
    e = elapsed - restart
    if e <= 0.0:
        return 0.0
    if interval <= 0.0:
        return elapsed
    cycle = interval + cost
    k = math.floor(e / cycle)
    if e - k * cycle > interval:
        return restart + k * cycle + interval
    return elapsed


# --- the real Job ------------------------------------------------------------------------


def make_job(spec: JobSpec, policy: Policy, job_id: str, submitted_ts: float) -> Job:
    """The ``proto.jobs.Job`` the twin submits for ``spec`` under ``policy``."""
    # static: a fault fails the job (its user resubmits it); a task that failed in the
    # trace fails by itself under every policy (the machine must not retry it)
    restarts = MAX_RESTARTS if policy.auto_isolation and spec.outcome != "failed" else 0
    hang = 0.0
    if policy.hang_detection:
        # the job's own pauses (loading, a checkpoint) never count as a hang
        hang = policy.hang_timeout_s + max(spec.restart_cost_s, spec.checkpoint_cost_s)
    job = Job(
        job_id=job_id,
        name=spec.job_id,
        tenant=spec.tenant or "default",
        nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node,
        gpu_type=spec.gpu_type,
        cpu=spec.cpu,
        memory_gb=spec.memory_gb,
        priority=spec.priority if policy.priorities else 0,
        preemptible=spec.preemptible,
        command="twin",
        checkpoint_dir=f"/twin/ckpt/{spec.job_id}",
        checkpoint_every=spec.checkpoint_interval_s,
        hang_timeout=hang,
        max_restarts=restarts,
        submitted_ts=submitted_ts,
    )
    if not spec.elastic:
        return job
    return msgspec.structs.replace(
        job,
        min_nodes=spec.min_nodes or spec.nodes,
        max_nodes=spec.max_nodes or spec.nodes,
        resize_interval_s=spec.resize_interval_s,
    )


def timings_for(spec: JobSpec) -> Timings:
    """The machine's deadlines for one job: the checkpoint deadline above its checkpoint
    cost (a deployment sets it so; the twin's agents always answer in time)."""
    return Timings(checkpoint_deadline_s=max(30.0, spec.checkpoint_cost_s + 60.0))


# --- one job -----------------------------------------------------------------------------


@dataclass(slots=True)
class Generation:
    """One run of a job's members (the machine's ``generation``) as the agents see it."""

    attempt: int
    number: int
    t0: float
    s0: int
    nodes: tuple[str, ...]
    frozen_at: float | None = None
    """Progress stops here (crash, hang, fresh checkpoint, stop)."""
    crashed: bool = False
    """The processes are dead: checkpoints are refused."""
    hung: bool = False
    finished: bool = False
    """Its work reached ``work_s`` (it exited by itself)."""
    closed: bool = False
    cause: str = ""
    """What interrupted it (a fault's cause, a move's cause)."""
    base: float = 1.0
    """Its pace on a straggler-free fleet: 1, or for an elastic job at ``k`` of its
    ``n`` nominal members ``n / k`` (data-parallel scaling taken as linear: loading, work
    and checkpoints all spread over its members)."""
    pace: float = 1.0
    """Wall seconds per second of its own clock now: ``base`` x (1 + its slowest node's
    slowdown)."""
    anchors: list[tuple[float, float, float]] = field(default_factory=list)
    """(wall, own clock, pace) at each change of pace, oldest first; none: pace 1 since
    ``t0``."""

    def clock(self, t: float) -> float:
        """Its own clock at wall ``t``: seconds of its schedule (restart, work, checkpoint
        pauses) behind it."""
        for wall, own, pace in reversed(self.anchors):
            if t >= wall:
                return own + (t - wall) / pace
        return t - self.t0

    def wall(self, own: float) -> float:
        """The wall time its own clock reads ``own`` (the inverse of :meth:`clock`)."""
        for wall, at, pace in reversed(self.anchors):
            if own >= at:
                return wall + (own - at) * pace
        return self.t0 + own

    def set_pace(self, t: float, pace: float) -> None:
        """From wall ``t`` on, its clock runs ``pace`` times slower than the wall."""
        self.anchors.append((t, self.clock(t), pace))
        self.pace = pace

    def slowed(self, t: float) -> float:
        """Wall seconds lost to stragglers (a pace above ``base``) by wall ``t``."""
        if not self.anchors:
            return 0.0
        return max(0.0, (t - self.t0) - self.clock(t) * self.base)


@dataclass(slots=True)
class TwinJob:
    """One JobSpec through the run: its current attempt's status and its ledger."""

    spec: JobSpec
    policy: Policy
    job: Job
    status: JobStatus
    request: JobRequest
    timings: Timings
    attempt: int = 0
    gen: Generation | None = None
    replies: dict[str, CommandReply] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)
    """Checkpoint command ids whose answer is on its way."""
    held: tuple[str, ...] = ()
    gpus_held: int = 0
    gpus_most: int = 0
    """The most GPUs it held at once (a whole-node job's GPUs are its nodes')."""
    resubmit_pending: bool = False
    # ledger
    first_start_s: float | None = None
    end_s: float | None = None
    held_s: float = 0.0
    held_gpu_s: float = 0.0
    """GPU-seconds held by past holdings (an elastic job's size changes)."""
    held_since: float = 0.0
    queued_since: float | None = None
    waits: list[float] = field(default_factory=list)
    unplanned: int = 0
    planned: int = 0
    computed: float = 0.0
    """Progress computed by closed generations (kept or lost)."""
    slowed_s: float = 0.0
    """Wall seconds closed generations lost to stragglers (a slower pace)."""
    straggler_moves: int = 0
    straggler_move_s: float = 0.0

    @classmethod
    def submit(cls, spec: JobSpec, policy: Policy, now: float) -> tuple[TwinJob, machine.Step]:
        """A newly arrived job, queued by the machine."""
        job = make_job(spec, policy, spec.job_id, spec.submit_s)
        step = machine.submitted(job, now)
        tj = cls(spec, policy, job, step.status, request_from_job(job), timings_for(spec))
        return tj, step

    def resubmit(self, now: float) -> machine.Step:
        """static: the user submits the job again (a new id) from its last checkpoint."""
        ckpt = self.status.last_checkpoint
        self.attempt += 1
        job = make_job(self.spec, self.policy, f"{self.spec.job_id}.r{self.attempt}", now)
        step = machine.submitted(job, now, "resubmitted")
        status = step.status
        if ckpt is not None:
            status = machine.observe_checkpoint(status, ckpt)
        self.job, self.status, self.request = job, status, request_from_job(job)
        self.replies, self.pending, self.resubmit_pending = {}, set(), False
        return machine.Step(status, step.sends, step.emits)

    # --- progress ---------------------------------------------------------------------

    def live_gen(self) -> Generation | None:
        """The generation of the current attempt and generation number, if any."""
        g = self.gen
        if g is None or g.attempt != self.attempt or g.number != self.status.generation:
            return None
        return g

    def progress(self, now: float) -> float:
        """Progress of the current generation at ``now`` (0 without one)."""
        g = self.gen
        if g is None:
            return 0.0
        s = self.spec
        t = now if g.frozen_at is None else min(now, g.frozen_at)
        done = work_done(g.clock(t), s.restart_cost_s, s.checkpoint_interval_s, s.checkpoint_cost_s)
        return min(g.s0 + done, s.work_s)

    def periodic(self, now: float) -> CheckpointRef | None:
        """The generation's last periodic checkpoint by ``now`` (None: none yet)."""
        g = self.gen
        s = self.spec
        if g is None or s.checkpoint_interval_s <= 0.0:
            return None
        t = now if g.frozen_at is None else min(now, g.frozen_at)
        rs, iv, cost = s.restart_cost_s, s.checkpoint_interval_s, s.checkpoint_cost_s
        k = min(periodic_done(g.clock(t), rs, iv, cost), checkpoints_before(s.work_s - g.s0, iv))
        if k < 1:
            return None
        step = int(g.s0 + k * iv)
        ts = g.t0 + rs + k * (iv + cost) if not g.anchors else g.wall(rs + k * (iv + cost))
        return CheckpointRef(path=f"twin://{self.spec.job_id}/step-{step}", step=step, ts=ts)

    def report(self, now: float) -> None:
        """What the members' agents have reported by ``now``: the last periodic checkpoint
        and the step reached, at the time it was reached.

        The machine reads the furthest step of the members (a move's ``last_step``) and,
        with a hang timeout, each member's progress clock. A gang advances in lock-step,
        so rank 0 reports the step (``observe_member``) and every member's clock is set to
        the time it was reached in one pass (``machine.observe_members`` where the
        machine has it, else ``machine.resumed``, which sets exactly those clocks):
        ``observe_member`` for each of n members would cost O(n^2). The other ranks'
        ``step`` fields are left behind; nothing the machine decides reads them."""
        g = self.live_gen()
        st = self.status
        if g is None or not st.members:
            return
        ckpt = self.periodic(now)
        if ckpt is not None:
            st = machine.observe_checkpoint(st, ckpt)
        s = self.spec
        t = now if g.frozen_at is None else min(now, g.frozen_at)
        rs, iv, cost = s.restart_cost_s, s.checkpoint_interval_s, s.checkpoint_cost_s
        step = int(self.progress(now))
        at = min(now, g.wall(reached_offset(g.clock(t), rs, iv, cost)))
        rank0 = st.members[0]
        hangs = (self.job.hang_timeout or 0.0) > 0  # the twin's jobs set it (0: off)
        if hangs:
            st = machine.observe_members(st, g.number, at, steps={m.node: step for m in st.members})
        elif rank0.step < step:  # no hang timeout: rank 0's step is all the machine reads
            st = machine.observe_member(st, rank0.node, g.number, at, step=step)
        self.status = st

    def open_gen(self, now: float) -> Generation:
        """The machine started a new generation: its members run from now."""
        st = self.status
        size = len(st.placement)
        nominal = self.spec.nodes
        self.gen = Generation(
            attempt=self.attempt,
            number=st.generation,
            t0=now,
            s0=st.resumed_from_step or 0,
            nodes=st.placement,
            base=nominal / size if self.spec.elastic and size and size != nominal else 1.0,
        )
        return self.gen

    def finish_at(self, g: Generation) -> float:
        """When ``g`` reaches the job's work if nothing stops it."""
        s = self.spec
        rest = s.work_s - g.s0
        return g.wall(wall_to_finish(rest, s.restart_cost_s, s.checkpoint_interval_s,
                                     s.checkpoint_cost_s))  # fmt: skip

    def freeze(self, now: float, cause: str) -> None:
        """The current generation stops making progress now (first cause wins)."""
        g = self.live_gen()
        if g is None:
            return
        if g.frozen_at is None:
            g.frozen_at = now
        if not g.cause:
            g.cause = cause

    def close_gen(self, now: float) -> tuple[str, str] | None:
        """The current generation ends (a new one, a release, the end of the run): count
        its work; returns ``(kind, cause)`` of the interruption it was, None when it
        finished (or was closed already)."""
        g = self.gen
        if g is None or g.closed:
            return None
        if g.frozen_at is None and not g.finished:
            g.frozen_at = now
        g.closed = True
        self.computed += max(0.0, self.progress(now) - g.s0)
        self.slowed_s += g.slowed(now if g.frozen_at is None else min(now, g.frozen_at))
        if g.finished:
            return None
        if g.crashed or g.hung:
            self.unplanned += 1
            return ("unplanned", g.cause or "crash")
        self.planned += 1
        return ("planned", g.cause or "moved")

    def settle(self, end_s: float) -> tuple[str, str] | None:
        """The run ends: count the work of a generation still open; one interrupted and
        not yet replaced (hung, crashed, being moved) counts as an interruption."""
        g = self.gen
        if g is None or g.closed:
            return None
        if g.frozen_at is None or g.finished:
            g.closed = True
            self.computed += max(0.0, self.progress(end_s) - g.s0)
            t = end_s if g.frozen_at is None else min(end_s, g.frozen_at)
            self.slowed_s += g.slowed(t)
            return None
        return self.close_gen(end_s)

    # --- the agents ---------------------------------------------------------------------

    def answer(self, sends: tuple[Send, ...], now: float) -> tuple[bool, list[str], int]:
        """Answer the machine's commands as the agents would.

        Returns (whether an answer was added now, the checkpoint command ids whose answer
        comes after the checkpoint cost, the step they will carry)."""
        now_added = False
        later: list[str] = []
        g = self.live_gen()
        step = int(self.progress(now))
        for send in sends:
            cid = send.command_id
            if cid in self.replies or cid in self.pending:
                continue
            if send.verb == "checkpoint":
                if g is None or g.crashed or g.hung:
                    self.replies[cid] = _reply(cid, now, False, "the job's processes are gone")
                    now_added = True
                    continue
                move = self.status.move
                self.freeze(now, move.cause if move is not None else "checkpoint")
                self.pending.add(cid)
                later.append(cid)
            else:  # stop, start: done at once
                if send.verb == "stop":
                    move = self.status.move
                    self.freeze(now, move.cause if move is not None else "stopped")
                self.replies[cid] = _reply(cid, now, True, "")
                now_added = True
        return now_added, later, step

    def deliver_checkpoints(
        self, ids: tuple[str, ...], gen: Generation, step: int, now: float
    ) -> bool:
        """The checkpoint answers asked ``checkpoint_cost_s`` ago arrive (refused when the
        processes died meanwhile); False when they no longer matter."""
        if self.live_gen() is not gen:
            return False
        fresh = [cid for cid in ids if cid in self.pending]
        if not fresh:
            return False
        for cid in fresh:
            self.pending.discard(cid)
            if gen.crashed:
                self.replies[cid] = _reply(cid, now, False, "the job's processes are gone")
            else:
                path = f"twin://{self.spec.job_id}/fresh-{step}"
                self.replies[cid] = _reply(cid, now, True, "", {"step": step, "path": path})
        return True


def _reply(
    cid: str, now: float, ok: bool, message: str, result: dict[str, int | str] | None = None
) -> CommandReply:
    return CommandReply(
        command_id=cid,
        ts=now,
        ok=ok,
        status=CommandStatus.DONE if ok else CommandStatus.FAILED,
        message=message,
        result=dict(result or {}),
    )
