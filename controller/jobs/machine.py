"""The life of one job as a pure state machine (docs/jobs.md).

:func:`advance` takes a job's status, what the controller knows now (node grades, the
replies to its commands, the time) and returns the next status, the commands to (re)send
and the events to publish.  It never does I/O: the job manager (controller/jobs.py)
persists the new status **before** it sends or publishes anything, so every step of a
move is recorded in MG_JOBS before it is taken, and a restarted controller, calling
:func:`advance` again on the stored status, re-sends the same commands (same ids: the
agents answer a repeated id with their stored reply) and finishes the move.

Placement is not decided here: queued jobs and moves in phase ``placing`` wait for the
manager's queue pass (the scheduler sees every job at once), which calls :func:`placed`.

A move: ``checkpointing`` (ask the live members for a checkpoint, with a deadline) →
``stopping`` (stop every member, with a deadline; a dead node's members count as stopped)
→ ``placing`` (or straight to ``starting`` on the same nodes for a hang or crash restart
when they are all healthy) → ``starting`` (start every rank with resume-from) → running.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, cast

import msgspec
from msgspec.structs import replace

from metalguard.controller.core.grades import MOVE_CAUSES, RUNNING_WORK_GRADES
from metalguard.proto.base import AttrValue
from metalguard.proto.events import CommandReply
from metalguard.proto.jobs import (
    TERMINAL_JOB_STATES,
    CheckpointRef,
    Job,
    JobMove,
    JobState,
    JobStatus,
    JobTransition,
    MemberState,
    MoveCause,
    MovePhase,
    MoveTarget,
)

HISTORY_MAX: Final = 50
DEAD_GRADES: Final = frozenset({"UNREACHABLE"})
"""A node in these grades cannot answer: its members count as stopped, no checkpoint."""
EVACUATE: Final[dict[str, MoveCause]] = {
    grade: cast("MoveCause", cause) for grade, cause in MOVE_CAUSES.items()
}
"""Grades that move a job off a node, and the cause recorded (``controller.core.grades``
owns the answer: :func:`grades.running_work`)."""


@dataclass(frozen=True, slots=True)
class Timings:
    """Deadlines of the moves (seconds)."""

    checkpoint_deadline_s: float = 30.0
    stop_deadline_s: float = 30.0
    start_deadline_s: float = 30.0
    """A start not answered by then moves the job away from the silent nodes."""
    restart_backoff_s: float = 1.0
    """The wait before the first try again after a refused start (:func:`backoff_s`)."""
    restart_backoff_max_s: float = 60.0
    """The longest wait between two tries after refused starts."""
    hang_timeout_s: float = 1800.0
    """The hang timeout of a job that sets none (0: off); armed for a member once it has
    reported progress (a workload that never reports steps is not judged by it)."""
    master_port_base: int = 29500
    master_port_span: int = 20000


@dataclass(frozen=True, slots=True)
class Send:
    """A command to send (again, if it has no reply yet) to a node."""

    node: str
    """Node handle ``region.cluster.node``."""
    verb: str
    command_id: str
    args: dict[str, AttrValue | list[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Emit:
    """An event to publish: ``kind`` (``job.*``), its message and attributes."""

    kind: str
    event_id: str
    message: str = ""
    attributes: dict[str, AttrValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class World:
    """What the controller knows when it advances a job."""

    now: float
    grades: Mapping[str, str]
    """Node handle → grade (a node not listed is treated as UNREACHABLE)."""
    replies: Mapping[str, CommandReply] = field(default_factory=dict)
    master_addr: str = ""
    """MG_MASTER_ADDR for every gang (empty: rank 0's node name)."""
    timings: Timings = Timings()
    moves_off: Mapping[str, MoveOff] = field(default_factory=dict)
    """Job id → a planned move off nodes the job manager asks for (a straggler whose
    move pays: docs/jobs.md "Stragglers")."""


@dataclass(frozen=True, slots=True)
class MoveOff:
    """Move a running job's generation off ``nodes`` (a planned move: fresh checkpoint)."""

    generation: int
    nodes: tuple[str, ...]
    cause: MoveCause
    why: str


@dataclass(frozen=True, slots=True)
class Step:
    """The result of :func:`advance`."""

    status: JobStatus
    sends: tuple[Send, ...] = ()
    emits: tuple[Emit, ...] = ()


# --- constructors and observations ------------------------------------------------------


def backoff_s(restart: int, timings: Timings) -> float:
    """The wait before the ``restart``-th restart (1-based, counted in ``crashes``) that
    follows a refused start: ``min(restart_backoff_s * 2 ** (restart - 1),
    restart_backoff_max_s)``; 0 for ``restart < 1``."""
    if restart < 1:
        return 0.0
    exponent = min(restart - 1, 62)  # no float overflow for a huge max_restarts
    return float(min(timings.restart_backoff_s * 2.0**exponent, timings.restart_backoff_max_s))


def is_permanent(reply: CommandReply) -> bool:
    """Whether a refused start will be refused again however often it is tried: the agent
    says so (``result.permanent``: no such file, permission denied, exec format error, a
    working directory that does not exist, invalid args); older agents never do."""
    return not reply.ok and reply.result.get("permanent") is True


def submitted(job: Job, now: float, reason: str = "submitted") -> Step:
    """The status of a newly submitted job: queued (``reason``: how it came)."""
    why = "" if reason == "submitted" else reason
    status = JobStatus(job_id=job.job_id, state="queued", job=job, updated_ts=now, reason=why)
    status = _record(status, now, "queued", reason)
    return Step(status, emits=(_emit(status, "job.queued", "0", f"{job.name} queued"),))


def observe_member(
    status: JobStatus,
    node: str,
    generation: int,
    now: float,
    *,
    step: int | None = None,
    exit_code: int | None = None,
    digest: str = "",
    exit_cause: str = "",
) -> JobStatus:
    """A member's report (progress, exit) for ``generation``; stale ones are ignored."""
    return observe_members(
        status,
        generation,
        now,
        steps=None if step is None else {node: step},
        exit_codes=None if exit_code is None else {node: exit_code},
        digests={node: digest} if digest else None,
        exit_causes={node: exit_cause} if exit_cause else None,
    )


def observe_members(
    status: JobStatus,
    generation: int,
    now: float,
    *,
    steps: Mapping[str, int] | None = None,
    exit_codes: Mapping[str, int] | None = None,
    digests: Mapping[str, str] | None = None,
    exit_causes: Mapping[str, str] | None = None,
) -> JobStatus:
    """Many members' reports (by node) for ``generation`` in one pass, each taken as
    :func:`observe_member` takes it: a gang's progress costs O(members), not O(members²)."""
    if generation != status.generation or status.state in TERMINAL_JOB_STATES:
        return status
    steps, exit_codes, digests = steps or {}, exit_codes or {}, digests or {}
    causes = exit_causes or {}
    members = []
    for m in status.members:
        new = m
        step = steps.get(m.node)
        if step is not None and step > m.step:
            new = replace(new, step=step, progress_ts=now)
        exit_code = exit_codes.get(m.node)
        if exit_code is not None and m.exit_code is None:
            new = replace(new, exit_code=exit_code, exit_cause=causes.get(m.node, ""))
        digest = digests.get(m.node, "")
        if digest and not m.digest:
            new = replace(new, digest=digest)
        members.append(new)
    return msgspec.structs.replace(status, members=tuple(members))


def observe_checkpoint(status: JobStatus, checkpoint: CheckpointRef) -> JobStatus:
    """A periodic checkpoint the workload reported: kept when newer than the last."""
    last = status.last_checkpoint
    if last is not None and last.step >= checkpoint.step:
        return status
    return msgspec.structs.replace(status, last_checkpoint=checkpoint)


def resumed(status: JobStatus, now: float) -> JobStatus:
    """After a controller restart: running members' progress clocks start again now (the
    stored ones are stale), so no hang is declared for the time the controller was away."""
    if status.state != "running":
        return status
    members = tuple(replace(m, progress_ts=now) for m in status.members)
    return msgspec.structs.replace(status, members=members)


def request_cancel(status: JobStatus, now: float) -> JobStatus:
    """Mark a job for cancellation; :func:`advance` stops it and ends it ``cancelled``."""
    if status.state in TERMINAL_JOB_STATES:
        return status
    return msgspec.structs.replace(status, cancel_requested=True, updated_ts=now)


def preempt(status: JobStatus, now: float, by: str, reclaim_for: str = "") -> Step:
    """Begin preempting a running job for ``by``: checkpoint, stop, back to the queue.

    ``reclaim_for``: the tenant whose guarantee takes the capacity back (the job ran on
    borrowed capacity, docs/scheduler.md "Tenant quotas"); a ``tenant.reclaim`` event
    says so beside ``job.preempted``."""
    if status.state != "running" or status.move is not None:
        return Step(status)
    move = _new_move(status, "preempted", now, exclude=(), target="queue")
    tenant = status.job.tenant if status.job is not None else ""
    why = f"reclaimed for tenant {reclaim_for} ({by})" if reclaim_for else f"preempted by {by}"
    status = _set_move(status, move, now, "preempted", why)
    attrs: dict[str, AttrValue] = {"by": by}
    if reclaim_for:
        attrs |= {"reclaim_for": reclaim_for, "tenant": tenant}
    emits = [_emit(status, "job.preempted", move.move_id, why, attrs)]
    if reclaim_for:
        message = (
            f"tenant {reclaim_for} takes back capacity {tenant} borrowed: "
            f"{status.job_id} stops for {by}"
        )
        emits.append(_emit(status, "tenant.reclaim", move.move_id, message, attrs))
    return Step(status, emits=tuple(emits))


def resize(
    status: JobStatus,
    now: float,
    to_nodes: tuple[str, ...],
    reason: str,
    attributes: Mapping[str, AttrValue],
) -> Step:
    """Begin resizing a running elastic job onto ``to_nodes`` (rank order): a fresh
    checkpoint, stop, then start there at once with the new world size (``reason``:
    ``grow`` into idle nodes, or ``shrink`` to make room for a preempting job;
    ``attributes``: the ``job.resized`` event's, :meth:`elastic.Resize.attributes`)."""
    if status.state != "running" or status.move is not None or not to_nodes:
        return Step(status)
    move = replace(_new_move(status, "resized", now, exclude=(), target="place"), to_nodes=to_nodes)
    why = f"resized ({reason}): {len(status.placement)} -> {len(to_nodes)} nodes"
    status = _set_move(status, move, now, "checkpointing", why)
    emit = _emit(status, "job.resized", move.move_id, why, dict(attributes))
    return Step(status, emits=(emit,))


def held_nodes(status: JobStatus) -> tuple[str, ...]:
    """The nodes a job holds for the scheduler: its placement, and during a resize the
    nodes it is about to start on (so nothing else is placed there meanwhile)."""
    move = status.move
    if move is None or not move.to_nodes:
        return status.placement
    return tuple(dict.fromkeys((*status.placement, *move.to_nodes)))


def needs_placement(status: JobStatus) -> bool:
    """Whether the job waits for the queue pass (queued, or a move in phase placing)."""
    if status.cancel_requested:
        return False
    if status.state == "queued":
        return True
    return status.move is not None and status.move.phase == "placing"


def placed(status: JobStatus, nodes: tuple[str, ...], now: float, level: str = "") -> Step:
    """The queue pass placed the job on ``nodes`` (rank order): start it."""
    move = status.move
    if move is None:  # from the queue: a first start, or a preempted job coming back
        cause: MoveCause = "preempted" if status.generation > 0 else "operator"
        move = _new_move(status, cause, now, exclude=(), target="place")
        move = replace(move, phase="starting", move_id=f"{status.job_id}.g{status.generation + 1}")
    else:
        move = replace(move, phase="starting", phase_ts=now)
    status = _start(status, move, nodes, now)
    attrs: dict[str, AttrValue] = {"nodes": ",".join(nodes), "level": level}
    emit = _emit(status, "job.placed", f"g{status.generation}", f"placed on {len(nodes)}", attrs)
    return Step(status, emits=(emit,))


# --- the machine -------------------------------------------------------------------------


def advance(status: JobStatus, world: World) -> Step:
    """The next status, the commands to (re)send and the events, from ``world``."""
    if status.state in TERMINAL_JOB_STATES or status.job is None:
        return Step(status)
    if status.move is not None:
        return _advance_move(status, status.move, world)
    if status.cancel_requested:
        if status.state == "queued":
            return _end(status, "cancelled", world.now, "cancelled by request")
        return _begin(status, "operator", world, exclude=(), target="cancelled", skip_ckpt=True)
    if status.state != "running":
        return Step(status)
    return _watch_running(status, world)


def _watch_running(status: JobStatus, world: World) -> Step:
    job = status.job
    assert job is not None
    now = world.now
    # a node that went bad takes precedence over what its members report
    bad = {
        m.node: world.grades.get(m.node, "UNREACHABLE")
        for m in status.members
        if world.grades.get(m.node, "UNREACHABLE") in EVACUATE
    }
    if bad:
        cause = EVACUATE[sorted(bad.values(), key=list(EVACUATE).index)[0]]
        dead = any(g in DEAD_GRADES for g in bad.values())
        return _begin(status, cause, world, exclude=tuple(sorted(bad)), skip_ckpt=dead)
    exited = [m for m in status.members if m.exit_code is not None]
    if exited and all(m.exit_code == 0 for m in status.members):
        digest = next((m.digest for m in status.members if m.rank == 0), "")
        step = _end(status, "succeeded", now, "every member exited 0", digest=digest)
        attrs: dict[str, AttrValue] = {"digest": digest, "restarts": status.restarts}
        emit = _emit(step.status, "job.finished", "end", f"{job.name} finished", attrs)
        return Step(step.status, step.sends, (*step.emits, emit))
    crashed = [m for m in exited if m.exit_code != 0]
    if crashed:
        m = crashed[0]
        attrs = {"rank": m.rank, "exit_code": m.exit_code, "node": m.node}
        why = f"rank {m.rank} on {m.node} exited {m.exit_code}"
        if m.exit_cause:
            attrs["cause"] = m.exit_cause
            why += f" ({m.exit_cause})"
        return _restart(status, "crash", world, why, "job.crashed", attrs)
    timeout, by_default = hang_timeout(job, world.timings)
    if timeout > 0:
        hung = [
            m
            for m in status.members
            if m.exit_code is None
            and world.grades.get(m.node) in RUNNING_WORK_GRADES
            and (m.step > 0 or not by_default)
            and now - m.progress_ts >= timeout
        ]
        if hung:
            steps = ",".join(f"{m.rank}={m.step}" for m in status.members)
            default = " (the controller's default)" if by_default else ""
            why = f"no progress for {timeout:g} s{default} (last steps {steps})"
            attrs = {
                "last_steps": steps,
                "hang_timeout": timeout,
                "by_default": by_default,
                "nodes": ",".join(sorted({m.node for m in hung})),
            }
            return _restart(status, "hang", world, why, "job.hung", attrs)
    off = world.moves_off.get(status.job_id)
    if off is not None and off.generation == status.generation:
        return _begin(status, off.cause, world, exclude=off.nodes, why=off.why)
    return Step(status)


def hang_timeout(job: Job, timings: Timings) -> tuple[float, bool]:
    """The job's hang timeout (0: off) and whether it is the controller's default (the
    job set none)."""
    if job.hang_timeout is None:
        return timings.hang_timeout_s, True
    return job.hang_timeout, False


def _restart(
    status: JobStatus,
    cause: MoveCause,
    world: World,
    why: str,
    kind: str,
    attrs: dict[str, AttrValue],
    *,
    backoff: bool = False,
) -> Step:
    """A hang, a crash or a refused start: restart from the last checkpoint, within the
    restart budget; after a refused start (``backoff``) the next start waits
    :func:`backoff_s`."""
    job = status.job
    assert job is not None
    crashes = status.crashes + 1
    status = msgspec.structs.replace(status, crashes=crashes)
    emit = _emit(status, kind, f"g{status.generation}", why, attrs)
    if crashes > job.max_restarts:
        why = f"{why}; restart budget of {job.max_restarts} spent"
        step = _begin(status, cause, world, exclude=(), target="failed", skip_ckpt=True, why=why)
    else:
        wait = backoff_s(crashes, world.timings) if backoff else 0.0
        step = _begin(
            status, cause, world, exclude=(), skip_ckpt=True, why=why, not_before=world.now + wait
        )
    return Step(step.status, step.sends, (emit, *step.emits))


def _begin(
    status: JobStatus,
    cause: MoveCause,
    world: World,
    *,
    exclude: tuple[str, ...],
    target: MoveTarget = "place",
    skip_ckpt: bool = False,
    why: str = "",
    not_before: float = 0.0,
) -> Step:
    move = _new_move(status, cause, world.now, exclude=exclude, target=target)
    if not_before > world.now:
        move = replace(move, not_before_ts=not_before)
    live = [m for m in status.members if world.grades.get(m.node) not in DEAD_GRADES]
    if skip_ckpt or not live or not status.members:
        move = replace(move, phase="stopping", checkpoint=status.last_checkpoint)
    state: JobState = "checkpointing" if move.phase == "checkpointing" else "rescheduling"
    reason = why or f"{cause}: {', '.join(exclude) or 'restart'}"
    status = _set_move(status, move, world.now, state, reason)
    step = _advance_move(status, move, world)
    ckpt = move.checkpoint
    if move.phase == "checkpointing" or ckpt is None or target in ("failed", "cancelled"):
        return step
    attrs: dict[str, AttrValue] = {"step": ckpt.step, "path": ckpt.path, "fresh": False}
    message = f"periodic checkpoint at step {ckpt.step} (no fresh one: {cause})"
    chosen = _emit(status, "job.checkpointed", move.move_id, message, attrs)
    return Step(step.status, step.sends, (chosen, *step.emits))


def _advance_move(status: JobStatus, move: JobMove, world: World) -> Step:
    now, t = world.now, world.timings
    if move.phase == "checkpointing":
        asked = _live_ids(status, world, f"{move.move_id}.ckpt")
        got = [world.replies[cid] for _, cid in asked if cid in world.replies]
        fresh = _newest(got, now)
        if len(got) < len(asked) and now - move.phase_ts < t.checkpoint_deadline_s:
            return Step(status, sends=_unanswered(status, world, "checkpoint", asked))
        chosen = fresh or status.last_checkpoint
        move = replace(
            move, phase="stopping", phase_ts=now, checkpoint=chosen, fresh=fresh is not None
        )
        last = status.last_checkpoint if fresh is None else fresh
        status = msgspec.structs.replace(status, last_checkpoint=last)
        status = _set_move(status, move, now, "rescheduling", "checkpoint chosen")
        emits: tuple[Emit, ...] = ()
        if chosen is not None:
            attrs: dict[str, AttrValue] = {
                "step": chosen.step,
                "path": chosen.path,
                "fresh": fresh is not None,
            }
            message = f"{'fresh' if fresh else 'periodic'} checkpoint at step {chosen.step}"
            emits = (_emit(status, "job.checkpointed", move.move_id, message, attrs),)
        step = _advance_move(status, move, world)
        return Step(step.status, step.sends, (*emits, *step.emits))
    if move.phase == "stopping":
        asked = _live_ids(status, world, f"{move.move_id}.stop")
        waiting = _unanswered(status, world, "stop", asked)
        if waiting and now - move.phase_ts < t.stop_deadline_s:
            return Step(status, sends=waiting)
        nodes = ",".join(m.node for m in status.members)
        stopped = _emit(status, "job.stopped", move.move_id, "members stopped", {"nodes": nodes})
        step = _after_stop(status, move, world)
        return Step(step.status, step.sends, (stopped, *step.emits))
    if move.phase == "starting":
        return _starting(status, move, world)
    if status.cancel_requested:  # placing: nothing runs any more, nothing to stop
        return _end(status, "cancelled", now, "cancelled by request while waiting to be placed")
    return Step(status)  # placing: the queue pass


def _live_ids(status: JobStatus, world: World, prefix: str) -> list[tuple[MemberState, str]]:
    """The members a command of a move goes to (not on a dead node), with its id."""
    return [
        (m, f"{prefix}.r{m.rank}")
        for m in status.members
        if world.grades.get(m.node) not in DEAD_GRADES
    ]


def _unanswered(
    status: JobStatus, world: World, verb: str, asked: list[tuple[MemberState, str]]
) -> tuple[Send, ...]:
    """The commands of ``asked`` with no reply yet (built only for those: a big gang's
    answered members cost no Send each time the job is advanced)."""
    return tuple(
        Send(m.node, verb, cid, _job_args(status, m))
        for m, cid in asked
        if cid not in world.replies
    )


def _after_stop(status: JobStatus, move: JobMove, world: World) -> Step:
    now = world.now
    if move.target in ("failed", "cancelled"):
        return _end(status, move.target, now, status.history[-1].reason if status.history else "")
    if move.target == "queue":
        status = msgspec.structs.replace(
            status, move=None, members=(), placement=(), last_checkpoint=move.checkpoint
        )
        status = _record(status, now, "queued", "requeued after preemption", step=_step(move))
        return Step(status)
    if move.to_nodes and all(world.grades.get(n) == "HEALTHY" for n in move.to_nodes):
        move = replace(move, phase="starting", phase_ts=now)  # a resize: its nodes are held
        status = _start(status, move, move.to_nodes, now)
        return _starting(status, move, world)
    same = move.cause in ("hang", "crash") and all(
        world.grades.get(n) == "HEALTHY" for n in status.placement
    )
    if same:
        move = replace(move, phase="starting", phase_ts=now)
        status = _start(status, move, status.placement, now)
        return _starting(status, move, world)
    exclude = tuple(
        sorted({*move.exclude, *(n for n in status.placement if world.grades.get(n) != "HEALTHY")})
    )
    move = replace(move, phase="placing", phase_ts=now, exclude=exclude, to_nodes=())
    status = msgspec.structs.replace(status, placement=(), members=())  # it holds no node
    status = _set_move(status, move, now, "rescheduling", "waiting for a placement")
    return Step(status)


def _start(status: JobStatus, move: JobMove, nodes: tuple[str, ...], now: float) -> JobStatus:
    """Record a new generation on ``nodes``, resuming from ``move.checkpoint``."""
    generation = status.generation + 1
    members = tuple(MemberState(rank=r, node=n, progress_ts=now) for r, n in enumerate(nodes))
    ckpt = move.checkpoint
    resume = ckpt.step if ckpt is not None else None
    redone = status.steps_redone + max(0, move.last_step - (resume or 0))
    restarts = status.restarts + (1 if status.generation > 0 else 0)
    status = msgspec.structs.replace(
        status,
        generation=generation,
        members=members,
        placement=nodes,
        move=move,
        resumed_from_step=resume,
        steps_redone=redone if status.generation > 0 else status.steps_redone,
        restarts=restarts,
    )
    return _record(
        status, now, "placing", "starting", from_nodes=move.from_nodes, to=nodes, step=resume
    )


def _starting(status: JobStatus, move: JobMove, world: World) -> Step:
    now = world.now
    ids = _start_ids(status)
    waiting = [(node, cid) for node, cid in ids if cid not in world.replies]
    grades = {m.node: world.grades.get(m.node, "UNREACHABLE") for m in status.members}
    bad = tuple(sorted(n for n, g in grades.items() if g in EVACUATE))
    late = now - max(move.phase_ts, move.not_before_ts) >= world.timings.start_deadline_s
    if bad or (waiting and late):  # a node went bad or never answered: move again
        exclude = bad or tuple(sorted({node for node, _ in waiting}))
        cause = EVACUATE[grades[bad[0]]] if bad else "lost"
        spent = status.downtime_s + max(0.0, now - move.started_ts)
        status = msgspec.structs.replace(status, move=None, downtime_s=spent)
        why = f"{cause} while starting: {', '.join(exclude)}"
        return _begin(status, cause, world, exclude=exclude, skip_ckpt=True, why=why)
    if now < move.not_before_ts:  # backing off after a refused start: nothing runs yet
        if status.cancel_requested:
            return _end(status, "cancelled", now, "cancelled by request while backing off")
        return Step(status)
    if waiting:
        answered = {cid for _, cid in ids} - {cid for _, cid in waiting}
        return Step(status, sends=_start_sends(status, world, skip=answered))
    refused = [(node, world.replies[cid]) for node, cid in ids]
    refused = [(node, r) for node, r in refused if not r.ok]
    status = msgspec.structs.replace(status, move=None)
    if refused:
        return _refused(status, refused, world)
    members = tuple(replace(m, progress_ts=now) for m in status.members)
    first = status.generation == 1 and move.cause == "operator"
    downtime = 0.0 if first else max(0.0, now - move.started_ts)
    status = msgspec.structs.replace(
        status, members=members, downtime_s=status.downtime_s + downtime
    )
    status = _record(status, now, "running", "started", to=status.placement)
    started: dict[str, AttrValue] = {
        "generation": status.generation,
        "resume_step": status.resumed_from_step,
    }
    emits = [_emit(status, "job.started", f"g{status.generation}", "started", started)]
    if not first:
        resume = status.resumed_from_step or 0
        attrs: dict[str, AttrValue] = {
            "from": ",".join(move.from_nodes),
            "to": ",".join(status.placement),
            "step": resume,
            "downtime_s": round(downtime, 3),
            "cause": move.cause,
        }
        msg = f"{move.cause}: resumed at step {resume} after {downtime:.1f} s"
        emits.append(_emit(status, "job.rescheduled", move.move_id, msg, attrs))
        lost = max(0, move.last_step - resume)
        if lost:
            lost_attrs: dict[str, AttrValue] = {"steps_redone": lost, "step": resume}
            msg = f"{lost} steps to redo"
            emits.append(_emit(status, "job.lost_progress", move.move_id, msg, lost_attrs))
    return Step(status, sends=(), emits=tuple(emits))


def _refused(status: JobStatus, refused: list[tuple[str, CommandReply]], world: World) -> Step:
    """Nodes refused the start: a permanent cause fails the job at once (members that did
    start are stopped first); any other counts as a restart, tried again on the same nodes
    after :func:`backoff_s`, within ``max_restarts``."""
    nodes = sorted({node for node, _ in refused})
    permanent = [r for _, r in refused if is_permanent(r)]
    first = (permanent or [r for _, r in refused])[0]
    why = f"start refused on {', '.join(nodes)}: {first.message}"
    if permanent:
        why = f"{why} (permanent: not tried again)"
        return _begin(status, "crash", world, exclude=(), target="failed", skip_ckpt=True, why=why)
    cause = first.result.get("cause")
    attrs: dict[str, AttrValue] = {
        "start_refused": True,
        "nodes": ",".join(nodes),
        "cause": cause if isinstance(cause, str) and cause else first.status,
        "generation": status.generation,
    }
    return _restart(status, "crash", world, why, "job.crashed", attrs, backoff=True)


def _start_id(status: JobStatus, m: MemberState) -> str:
    return f"{status.job_id}.g{status.generation}.start.r{m.rank}"


def _start_ids(status: JobStatus) -> list[tuple[str, str]]:
    """(node, command id) of each start command of the current generation."""
    if status.move is None:
        return []
    return [(m.node, _start_id(status, m)) for m in status.members]


def _start_sends(
    status: JobStatus, world: World, skip: frozenset[str] | set[str] = frozenset()
) -> tuple[Send, ...]:
    """The start commands of the current generation (idempotent: resent until answered),
    but those whose command id is in ``skip`` (answered already)."""
    job = status.job
    assert job is not None
    move = status.move
    if move is None:
        return ()
    ckpt = move.checkpoint
    port = world.timings.master_port_base + (
        (zlib.crc32(status.job_id.encode()) + status.generation * 7919)
        % world.timings.master_port_span
    )
    master = world.master_addr or (
        status.placement[0].rsplit(".", 1)[-1] if status.placement else ""
    )
    argv, env = list(job.args), [f"{k}={v}" for k, v in sorted(job.env.items())]
    shared: dict[str, AttrValue | list[str]] = {
        "world_size": len(status.members),
        "master_addr": master,
        "master_port": port,
        "command": job.command,
        "args": argv,
        "env": env,
        "checkpoint_dir": job.checkpoint_dir,
        "checkpoint_every": job.checkpoint_every,
        "timing_window_s": job.timing_window_s,
    }
    if job.dataset:  # MG_DATASET / MG_DATASET_DIR on the node (docs/workloads.md)
        shared["dataset"] = job.dataset
    shared["resume_from"] = ckpt.path if ckpt is not None else ""
    shared["resume_step"] = ckpt.step if ckpt is not None else 0
    sends = []
    for m in status.members:
        command_id = _start_id(status, m)
        if command_id in skip:
            continue
        args = _job_args(status, m)
        args.update(shared)
        args["args"], args["env"] = list(argv), list(env)  # each send its own lists
        sends.append(Send(m.node, "start", command_id, args))
    return tuple(sends)


def _job_args(status: JobStatus, m: MemberState) -> dict[str, AttrValue | list[str]]:
    return {"job_id": status.job_id, "generation": status.generation, "rank": m.rank}


def _newest(replies: list[CommandReply], now: float) -> CheckpointRef | None:
    best: CheckpointRef | None = None
    for r in replies:
        step, path = r.result.get("step"), r.result.get("path")
        if not r.ok or not isinstance(step, int) or not isinstance(path, str) or not path:
            continue
        if best is None or step > best.step:
            best = CheckpointRef(path=path, step=step, ts=now)
    return best


def _new_move(
    status: JobStatus,
    cause: MoveCause,
    now: float,
    *,
    exclude: tuple[str, ...],
    target: MoveTarget,
) -> JobMove:
    phase: MovePhase = "checkpointing"
    last = max((m.step for m in status.members), default=0)
    return JobMove(
        move_id=f"{status.job_id}.m{status.generation}.{cause}",
        cause=cause,
        phase=phase,
        started_ts=now,
        phase_ts=now,
        from_nodes=status.placement,
        exclude=exclude,
        checkpoint=status.last_checkpoint,
        last_step=last,
        target=target,
    )


def _set_move(
    status: JobStatus, move: JobMove, now: float, state: JobState, reason: str
) -> JobStatus:
    status = msgspec.structs.replace(status, move=move)
    return _record(status, now, state, reason, from_nodes=move.from_nodes, step=_step(move))


def _step(move: JobMove) -> int | None:
    return move.checkpoint.step if move.checkpoint is not None else None


def _end(status: JobStatus, state: JobState, now: float, reason: str, digest: str = "") -> Step:
    status = msgspec.structs.replace(
        status, move=None, reason=reason, digest=digest or status.digest
    )
    status = _record(status, now, state, reason)
    emits: tuple[Emit, ...] = ()
    if state in ("failed", "cancelled"):
        kind = f"job.{state}"
        emits = (_emit(status, kind, "end", reason, {"reason": reason}),)
    return Step(status, emits=emits)


def _record(
    status: JobStatus,
    now: float,
    state: JobState,
    reason: str,
    *,
    from_nodes: tuple[str, ...] = (),
    to: tuple[str, ...] = (),
    step: int | None = None,
) -> JobStatus:
    entry = JobTransition(
        ts=now, state=state, reason=reason, from_nodes=from_nodes, to_nodes=to, step=step
    )
    history = (*status.history, entry)[-HISTORY_MAX:]
    return msgspec.structs.replace(status, state=state, history=history, updated_ts=now)


def _emit(
    status: JobStatus,
    kind: str,
    suffix: str,
    message: str,
    attributes: dict[str, AttrValue] | None = None,
) -> Emit:
    return Emit(kind, f"{status.job_id}.{kind}.{suffix}", message, dict(attributes or {}))


def members_per_node(statuses: Iterable[JobStatus]) -> Counter[str]:
    """Unfinished job members per node handle: one for each node a job that has not ended
    is placed on, and for each node where a member of it still runs outside that placement
    (an older generation's, being stopped). A member that exited while the rest of its job
    runs still counts: the job holds the node until it ends, and a node drained under it
    would move the whole job (what the lifecycle waits for before a SUB_HEALTHY node's
    MAINTENANCE)."""
    counts: Counter[str] = Counter()
    for s in statuses:
        if s.state in TERMINAL_JOB_STATES:
            continue
        placed = set(s.placement)
        counts.update(placed)
        counts.update({m.node for m in s.members if m.exit_code is None} - placed)
    return counts
