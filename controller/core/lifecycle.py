"""The node lifecycle: a pure state machine over NodeRecord (docs/lifecycle.md).

Every function takes a record and one input (an assessment, the time, an operator's
action) and returns a :class:`Transition`: the new record and the decisions to announce.
No I/O and no clock reads: time comes in as an argument.  A transition that wants an
automatic isolation must pass the safety rail (:func:`controller.rail.apply_rail`) before
it is kept.  The types live in :mod:`controller.lifecycle_model` and are re-exported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from msgspec.structs import replace

from metalguard.controller.core.lifecycle_model import (
    BAD_GRADES,
    KIND_ENTERING,
    OUT_OF_SERVICE,
    SECONDS_PER_DAY,
    Action,
    AssessedGrade,
    Decision,
    JobSource,
    LifecycleConfig,
    Observation,
    OperatorAction,
    Transition,
    accepts_new_work,
    change_grade,
    job_count,
    node_decision,
    to_event,
    unfinished_jobs,
    with_job_count,
)
from metalguard.controller.core.receiving import Span, silence_s
from metalguard.proto.base import Reason
from metalguard.proto.nodes import Grade, NodeRecord

__all__ = [
    "BAD_GRADES",
    "KIND_ENTERING",
    "OUT_OF_SERVICE",
    "SECONDS_PER_DAY",
    "Action",
    "AssessedGrade",
    "Decision",
    "JobSource",
    "LifecycleConfig",
    "Observation",
    "OperatorAction",
    "Transition",
    "accepts_new_work",
    "check_silence",
    "is_straggling",
    "is_suspected",
    "observe",
    "operator",
    "recent_isolations",
    "silence_due_ts",
    "silence_limit_s",
    "straggle",
    "suspect",
    "to_event",
    "unfinished_jobs",
    "update_jobs",
]

# --- assessments ----------------------------------------------------------------------


def observe(record: NodeRecord, obs: Observation, cfg: LifecycleConfig) -> Transition:
    """Take in one assessment: update the score and move the grade if the rules say so."""
    if _is_replay(record, obs):
        return Transition(record)
    if obs.deserved == "HEALTHY" and is_suspected(record, obs.ts):
        # blamed for other jobs' failures: clean telemetry does not clear that
        obs = dataclasses.replace(
            obs, grade="SUB_HEALTHY", reasons=(*obs.reasons, suspect_reason(record))
        )
    if obs.deserved == "HEALTHY" and is_straggling(record, obs.ts) and record.straggler:
        # slower than its peers in a job: clean telemetry does not clear that either
        obs = dataclasses.replace(
            obs, grade="SUB_HEALTHY", reasons=(*obs.reasons, record.straggler)
        )
    base = _absorb(record, obs, cfg)
    deserved = obs.deserved
    if deserved != "HEALTHY" and obs.sent_ts is not None:
        newest_bad = max(obs.sent_ts, record.bad_sent_ts or obs.sent_ts)
        base = replace(base, bad_sent_ts=newest_bad)
    if record.held or record.maintenance:
        return Transition(base)  # pinned to FAILING / MAINTENANCE until an uncordon
    was = _grade_before_silence(record)
    if deserved == "FAILING":
        if was == "FAILING":
            return Transition(replace(base, clean_cycles=0))
        return _isolate(base, was, obs, cfg)
    if deserved == "SUB_HEALTHY":
        if was == "FAILING":
            target: Grade = "FAILING"
            message = f"score {obs.score:.0f}: still not clean, stays FAILING"
        elif was == "MAINTENANCE" or (was == "SUB_HEALTHY" and unfinished_jobs(base) == 0):
            target = "MAINTENANCE"
            message = f"score {obs.score:.0f}: sub-healthy with no running jobs"
        elif was == "SUB_HEALTHY" and (since := sub_healthy_since(record)) is not None:
            elapsed = obs.ts - since
            drain = cfg.sub_healthy_drain_after_s
            if drain > 0 and elapsed >= drain:
                return _drained_at_deadline(base, obs, cfg, elapsed)
            target = "SUB_HEALTHY"
            message = f"score {obs.score:.0f}: sub-healthy, no new work; running jobs continue"
        else:  # first SUB_HEALTHY, announced as such; drained to MAINTENANCE next cycle
            target = "SUB_HEALTHY"
            message = f"score {obs.score:.0f}: sub-healthy, no new work; running jobs continue"
        return change_grade(
            replace(base, clean_cycles=0), target, obs.ts, cfg, obs.reasons, message
        )
    if was not in BAD_GRADES and not record.rail_flagged:
        return change_grade(base, "HEALTHY", obs.ts, cfg, obs.reasons, "telemetry resumed, healthy")
    if _collected_before_the_bad(record, obs):
        # A clean batch older than the evidence against the node (delivered late, e.g.
        # from the agent's spool after an outage): alive, but no clean cycle.
        return Transition(replace(base, score=record.score, reasons=record.reasons))
    cycles = record.clean_cycles + 1
    if cycles < cfg.clean_cycles_to_recover:
        message = f"telemetry resumed; {cycles} clean assessment(s), still {was}"
        return change_grade(
            replace(base, clean_cycles=cycles), was, obs.ts, cfg, obs.reasons, message
        )
    reason = Reason(
        signal="lifecycle.clean_cycles",
        value=cycles,
        threshold=cfg.clean_cycles_to_recover,
        rule="clean_cycles_to_recover",
        message=f"{cycles} consecutive clean assessments",
    )
    return change_grade(
        replace(base, clean_cycles=0, rail_flagged=False),
        "HEALTHY",
        obs.ts,
        cfg,
        (reason,),
        f"{cycles} consecutive clean assessments: back in service",
        action="release" if record.grade in OUT_OF_SERVICE else None,
    )


def is_suspected(record: NodeRecord, now: float) -> bool:
    """Whether the job manager's blame still holds the node (``suspect_until``)."""
    return record.suspect_until is not None and now < record.suspect_until


def suspect_reason(record: NodeRecord) -> Reason:
    """Why a suspected node is SUB_HEALTHY: the jobs that failed on it."""
    jobs = record.suspect_jobs
    return Reason(
        signal="jobs.failures",
        value=len(jobs),
        rule="job_failures",
        message=(
            f"blamed by {len(jobs)} different jobs ({', '.join(jobs)}): their generations "
            "failed, crashed or hung here, or the same application XID hit one of its GPUs, "
            "while their other nodes were not"
        ),
    )


def suspect(
    record: NodeRecord, jobs: tuple[str, ...], until: float, now: float, cfg: LifecycleConfig
) -> Transition:
    """The job manager blames the node for ``jobs``' failures: SUB_HEALTHY (no new work,
    running jobs finish) until ``until``, whatever its telemetry says; a node already in
    a worse grade keeps it."""
    if jobs == record.suspect_jobs and until == record.suspect_until:
        return Transition(record)
    base = replace(record, suspect_jobs=jobs, suspect_until=until, updated_ts=now)
    if record.grade != "HEALTHY" or record.held or record.maintenance:
        return Transition(base)
    reason = suspect_reason(base)
    return change_grade(
        replace(base, clean_cycles=0, reasons=(reason,)),
        "SUB_HEALTHY",
        now,
        cfg,
        (reason,),
        f"suspected: {reason.message}; no new work, running jobs continue",
    )


def is_straggling(record: NodeRecord, now: float) -> bool:
    """Whether the job manager's straggler mark still holds the node."""
    return record.straggler_until is not None and now < record.straggler_until


def straggle(
    record: NodeRecord, evidence: Reason, until: float, now: float, cfg: LifecycleConfig
) -> Transition:
    """The job manager found the node slowing a job (``evidence``: docs/jobs.md
    "Stragglers"): SUB_HEALTHY (no new work; its jobs finish, or the job manager moves
    the slowed one when that pays) until ``until``, whatever its telemetry says; a node
    already in a worse grade keeps it."""
    if evidence == record.straggler and until == record.straggler_until:
        return Transition(record)
    base = replace(record, straggler=evidence, straggler_until=until, updated_ts=now)
    if record.grade != "HEALTHY" or record.held or record.maintenance:
        return Transition(base)
    return change_grade(
        replace(base, clean_cycles=0, reasons=(evidence,)),
        "SUB_HEALTHY",
        now,
        cfg,
        (evidence,),
        f"straggler: {evidence.message}; no new work",
    )


def sub_healthy_since(record: NodeRecord) -> float | None:
    """When the node last entered SUB_HEALTHY (None: not in its history)."""
    for change in reversed(record.history):
        if change.grade_to == "SUB_HEALTHY":
            return change.ts
    return None


def _drained_at_deadline(
    base: NodeRecord, obs: Observation, cfg: LifecycleConfig, elapsed: float
) -> Transition:
    """A SUB_HEALTHY node past ``sub_healthy_drain_after_s`` with jobs still on it:
    MAINTENANCE, and its jobs are moved (``isolate``: a planned move, fresh checkpoint)."""
    reason = Reason(
        signal="lifecycle.sub_healthy_s",
        value=round(elapsed, 1),
        threshold=cfg.sub_healthy_drain_after_s,
        rule="sub_healthy_drain_after_s",
        message=f"sub-healthy for {elapsed:.0f} s with jobs still running",
    )
    return change_grade(
        replace(base, clean_cycles=0),
        "MAINTENANCE",
        obs.ts,
        cfg,
        (*obs.reasons, reason),
        f"sub-healthy for {elapsed:.0f} s (the drain limit is "
        f"{cfg.sub_healthy_drain_after_s:g} s): its remaining jobs are moved",
        action="isolate",
    )


def _collected_before_the_bad(record: NodeRecord, obs: Observation) -> bool:
    """Whether a clean assessment was collected no later than the newest bad one."""
    return (
        obs.sent_ts is not None
        and record.bad_sent_ts is not None
        and obs.sent_ts <= record.bad_sent_ts
    )


def _is_replay(record: NodeRecord, obs: Observation) -> bool:
    """An assessment already taken in (a redelivery after a controller restart)."""
    if record.last_seen_ts is None or obs.seq > record.last_seq:
        return False
    last_sent = record.last_sent_ts
    reset = obs.sent_ts is not None and last_sent is not None and obs.sent_ts > last_sent
    return not reset


def _absorb(record: NodeRecord, obs: Observation, cfg: LifecycleConfig) -> NodeRecord:
    """The record with the assessment's score, freshness and job count taken in."""
    return replace(
        record,
        score=obs.score,
        reasons=obs.reasons,
        last_seen_ts=obs.ts,
        last_sent_ts=obs.sent_ts,
        last_seq=obs.seq,
        interval_s=obs.interval_s or record.interval_s,
        running_jobs=record.running_jobs if obs.running_jobs is None else obs.running_jobs,
        isolations=recent_isolations(record.isolations, obs.ts, cfg),
        unreachable_from=None,
        updated_ts=obs.ts,
        dma_posture=record.dma_posture if obs.dma_posture is None else obs.dma_posture,
        dma_reasons=record.dma_reasons if obs.dma_posture is None else obs.dma_reasons,
    )


def _grade_before_silence(record: NodeRecord) -> Grade:
    """The grade the node holds, or held before it went UNREACHABLE."""
    if record.grade == "UNREACHABLE":
        return record.unreachable_from or "HEALTHY"
    return record.grade


def recent_isolations(
    times: tuple[float, ...], now: float, cfg: LifecycleConfig
) -> tuple[float, ...]:
    """The isolation times still inside the repeat-offender window (D days)."""
    start = now - cfg.repeat_offender_days * SECONDS_PER_DAY
    return tuple(t for t in times if t > start)


def _isolate(base: NodeRecord, was: Grade, obs: Observation, cfg: LifecycleConfig) -> Transition:
    """Isolation for a FAILING assessment, and the outcome should the rail refuse it."""
    isolations = (*base.isolations, obs.ts)
    held = len(isolations) >= cfg.repeat_offender_count
    isolated = change_grade(
        replace(base, clean_cycles=0, isolations=isolations, held=held, rail_flagged=False),
        "FAILING",
        obs.ts,
        cfg,
        obs.reasons,
        f"score {obs.score:.0f}{', fatal signal' if obs.fatal else ''}: isolate now",
        action="isolate",
        attributes={"fatal": obs.fatal},
    )
    decisions = isolated.decisions
    if held:
        days = f"{cfg.repeat_offender_days:g}"
        reason = Reason(
            signal="lifecycle.isolations",
            value=len(isolations),
            threshold=cfg.repeat_offender_count,
            rule="repeat_offender_count",
            message=f"isolated {len(isolations)} times within {days} days",
        )
        decisions += (
            node_decision(
                isolated.record,
                "node.held",
                obs.ts,
                (reason,),
                f"repeat offender (isolated {len(isolations)} times within {days} days): "
                "stays out until an operator uncordons it",
            ),
        )
    denied = change_grade(
        replace(base, clean_cycles=0, rail_flagged=True),
        was,
        obs.ts,
        cfg,
        obs.reasons,
        f"score {obs.score:.0f}: isolation refused by the safety rail; kept in service, flagged",
        by="rail",
    )
    return Transition(isolated.record, decisions, if_denied=denied)


# --- time and jobs --------------------------------------------------------------------


def silence_limit_s(interval_s: float, cfg: LifecycleConfig) -> float:
    """The silence that makes a node of batch interval ``interval_s`` UNREACHABLE:
    ``unreachable_after_intervals`` of its intervals, at least ``unreachable_after_s``."""
    return max(cfg.unreachable_after_intervals * interval_s, cfg.unreachable_after_s)


def silence_due_ts(
    record: NodeRecord, cfg: LifecycleConfig, watching_since: float | None = None
) -> float | None:
    """The earliest time :func:`check_silence` can find the node silent (its stalls
    only delay that), or None when it never will as the record stands (not in service,
    never heard, no interval)."""
    if record.grade not in ("HEALTHY", "SUB_HEALTHY") or record.last_seen_ts is None:
        return None
    if record.interval_s <= 0:
        return None
    since = max(record.last_seen_ts, watching_since or record.last_seen_ts)
    return since + silence_limit_s(record.interval_s, cfg)


def check_silence(
    record: NodeRecord,
    now: float,
    cfg: LifecycleConfig,
    *,
    bmc_power_on: bool | None = None,
    bmc_health: str = "",
    watching_since: float | None = None,
    stalls: Sequence[Span] = (),
) -> Transition:
    """Mark a silent in-service node UNREACHABLE (not FAILING), with the BMC's word on it.

    Silence counts from the last batch taken in, or from ``watching_since`` (when the
    controller started) if later: a restarted controller gives every node its full
    allowance before calling it silent (its batches may still be in the stream). Only
    receiving time counts: ``stalls`` are the stretches in which the controller's own
    intake was stalled (:mod:`controller.core.receiving`), left out of the silence.
    """
    if record.grade not in ("HEALTHY", "SUB_HEALTHY") or record.last_seen_ts is None:
        return Transition(record)
    if record.interval_s <= 0:
        return Transition(record)
    limit = silence_limit_s(record.interval_s, cfg)
    since = max(record.last_seen_ts, watching_since or record.last_seen_ts)
    silent = silence_s(since, now, stalls)
    if silent < limit:
        return Transition(record)
    floor = limit > cfg.unreachable_after_intervals * record.interval_s
    intervals = f"{cfg.unreachable_after_intervals} intervals of {record.interval_s:g} s"
    if floor:
        intervals = f"at least {cfg.unreachable_after_s:g} s; {intervals}"
    stalled_s = now - since - silent
    if stalled_s >= 0.5:
        intervals += f"; {stalled_s:.0f} s of the controller's own stalled intake not counted"
    reasons = [
        Reason(
            signal="telemetry.silence_s",
            value=silent,
            threshold=limit,
            rule="unreachable_after_s" if floor else "unreachable_after_intervals",
            message=f"no telemetry for {silent:.0f} s ({intervals})",
        )
    ]
    if bmc_power_on is None:
        oob = "no out-of-band reading to cross-check"
    else:
        oob = f"the BMC says it is powered {'on' if bmc_power_on else 'off'}"
        reasons.append(Reason(signal="bmc.power_on", value=bmc_power_on, message=oob))
    if bmc_health and bmc_health != "ok":
        said = f"the BMC reports health {bmc_health}"
        reasons.append(Reason(signal="bmc.health", value=bmc_health, message=said))
        oob = said if bmc_power_on is None else f"{oob}; it reports health {bmc_health}"
    return change_grade(
        replace(record, unreachable_from=record.grade),
        "UNREACHABLE",
        now,
        cfg,
        tuple(reasons),
        f"no telemetry for {silent:.0f} s; {oob}",
        attributes={"bmc_power_on": bmc_power_on, "bmc_health": bmc_health or None},
    )


def update_jobs(
    record: NodeRecord,
    count: int,
    now: float,
    cfg: LifecycleConfig,
    source: JobSource = "jobs",
) -> Transition:
    """Take in one source's count of the node's unfinished jobs (``jobs``: the job
    manager's job members, ``slurm``: the Slurm bridge's active Slurm jobs): a SUB_HEALTHY
    node whose count over both sources (:func:`unfinished_jobs`) is known to be 0 enters
    MAINTENANCE."""
    if count == job_count(record, source):
        return Transition(record)
    base = replace(with_job_count(record, source, count), updated_ts=now)
    if record.grade != "SUB_HEALTHY" or unfinished_jobs(base) != 0:
        return Transition(base)
    reason = Reason(
        signal="lifecycle.running_jobs",
        value=0,
        rule="sub_healthy_drain",
        message="its last job ended",
    )
    return change_grade(
        base,
        "MAINTENANCE",
        now,
        cfg,
        (*record.reasons, reason),
        "sub-healthy and its last job ended",
    )


# --- operators ------------------------------------------------------------------------


def operator(
    record: NodeRecord,
    action: OperatorAction,
    reason: str,
    who: str,
    now: float,
    cfg: LifecycleConfig,
) -> Transition:
    """An operator's cordon, uncordon or maintenance, with their reason.

    Repeating an action with the same reason changes nothing and announces nothing.
    """
    by = f"operator:{who}"
    why = (Reason(signal=f"operator.{action}", value=who, rule=action, message=reason),)
    if action == "cordon":
        if record.maintenance or (record.cordoned and record.operator_reason == reason):
            return Transition(record)  # maintenance already includes a cordon
        cordoned = replace(
            record,
            cordoned=True,
            operator_reason=reason,
            operator_by=by,
            operator_ts=record.operator_ts if record.cordoned else now,
            updated_ts=now,
        )
        message = f"cordoned by {who}: {reason}; no new work, running jobs continue"
        return change_grade(
            cordoned, record.grade, now, cfg, why, message, by=by, kind="node.cordoned"
        )
    if action == "maintenance":
        if record.maintenance and record.operator_reason == reason:
            return Transition(record)
        pinned = replace(
            record,
            cordoned=True,
            maintenance=True,
            operator_reason=reason,
            operator_by=by,
            operator_ts=record.operator_ts if record.maintenance else now,
            clean_cycles=0,
            rail_flagged=False,
            unreachable_from=None,
        )
        message = f"maintenance by {who}: {reason}"
        action_: Action | None = None if record.grade in OUT_OF_SERVICE else "isolate"
        return change_grade(
            pinned,
            "MAINTENANCE",
            now,
            cfg,
            why,
            message,
            by=by,
            kind="node.maintenance",
            action=action_,
        )
    if action == "uncordon":
        return _uncordon(record, reason, who, now, cfg, why)
    raise ValueError(f"unknown operator action {action!r}")


def _uncordon(
    record: NodeRecord,
    reason: str,
    who: str,
    now: float,
    cfg: LifecycleConfig,
    why: tuple[Reason, ...],
) -> Transition:
    """Clear cordon, maintenance, hold, flags and isolation history: back to HEALTHY.

    An UNREACHABLE node stays so until its telemetry resumes, then returns HEALTHY.
    """
    silent = record.grade == "UNREACHABLE"
    target: Grade = "UNREACHABLE" if silent else "HEALTHY"
    cleared = replace(
        record,
        grade=target,
        cordoned=False,
        maintenance=False,
        held=False,
        rail_flagged=False,
        suspect_jobs=(),
        suspect_until=None,
        straggler=None,
        straggler_until=None,
        isolations=(),
        clean_cycles=0,
        operator_reason="",
        operator_by="",
        operator_ts=None,
        unreachable_from=("HEALTHY" if record.unreachable_from else None) if silent else None,
    )
    if cleared == record:
        return Transition(record)
    by = f"operator:{who}"
    return change_grade(
        replace(cleared, grade=record.grade),
        target,
        now,
        cfg,
        why,
        f"uncordoned by {who}: {reason}",
        by=by,
        kind="node.uncordoned",
        action="release" if record.grade in OUT_OF_SERVICE else None,
    )
