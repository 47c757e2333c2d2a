"""The node lifecycle: a pure state machine over NodeRecord (docs/lifecycle.md).

Every function takes a record and one input (an assessment, the time, an operator's
action) and returns a :class:`Transition`: the new record and the decisions to announce.
No I/O and no clock reads: time comes in as an argument.  A transition that wants an
automatic isolation must pass the safety rail (:func:`controller.rail.apply_rail`) before
it is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec.structs import replace

from proto.base import AttrValue, NodeIdentity, Reason
from proto.events import ControllerEvent
from proto.nodes import Grade, GradeChange, NodeRecord

SECONDS_PER_DAY = 86_400.0

Action = Literal["isolate", "release"]
"""``isolate``: fence the node, checkpoint and move its jobs; ``release``: unfence it."""
OperatorAction = Literal["cordon", "uncordon", "maintenance"]
AssessedGrade = Literal["HEALTHY", "SUB_HEALTHY", "FAILING"]

OUT_OF_SERVICE: frozenset[Grade] = frozenset({"FAILING", "MAINTENANCE"})
"""Grades whose node runs no work; leaving them for HEALTHY is a ``release``."""
BAD_GRADES: frozenset[Grade] = frozenset({"SUB_HEALTHY", "FAILING", "MAINTENANCE"})
"""Grades left for HEALTHY only after N clean assessments (or an uncordon)."""
KIND_ENTERING: Mapping[Grade, str] = {
    "HEALTHY": "node.returned",
    "SUB_HEALTHY": "node.sub_healthy",
    "FAILING": "node.isolated",
    "MAINTENANCE": "node.maintenance",
    "UNREACHABLE": "node.unreachable",
}
"""An automatic grade change is announced under the kind of the grade it enters."""


class LifecycleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Thresholds of the lifecycle and the safety rail; defaults in docs/lifecycle.md."""

    clean_cycles_to_recover: Annotated[int, msgspec.Meta(ge=1)] = 3
    """N: consecutive clean assessments that take a node out of a bad grade."""
    unreachable_after_intervals: Annotated[int, msgspec.Meta(ge=1)] = 3
    """Silence, in the node's own batch intervals, that makes it UNREACHABLE."""
    repeat_offender_count: Annotated[int, msgspec.Meta(ge=1)] = 3
    """K: the K-th automatic isolation within D days holds the node out."""
    repeat_offender_days: Annotated[float, msgspec.Meta(gt=0)] = 7.0
    """D, in days."""
    rail_max_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.10
    """Share of a cluster automatic isolation may take out per window (rounded down)."""
    rail_window_s: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    """The rail's sliding window; also the spacing of its alerts."""
    rail_min_nodes: Annotated[int, msgspec.Meta(ge=0)] = 1
    """Isolations always allowed per window, however small the cluster."""
    history_max: Annotated[int, msgspec.Meta(ge=1)] = 50
    """Grade changes kept in a NodeRecord."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LifecycleConfig:
        """Validate a config table; raises ``msgspec.ValidationError`` naming the key."""
        return msgspec.convert(data, cls)


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """One assessment of one node, as the lifecycle needs it (built from the scorer's)."""

    ts: float
    """Controller time the batch was taken in (freshness and windows use it)."""
    seq: int
    """The batch's ``seq``: one not above the last accepted is a replay."""
    score: float
    grade: AssessedGrade
    fatal: bool = False
    reasons: tuple[Reason, ...] = ()
    interval_s: float = 0.0
    """The agent's batch interval (0: keep the last known)."""
    running_jobs: int | None = None
    """Jobs placed on the node, when the caller knows (None: unchanged)."""
    sent_ts: float | None = None
    """The batch's own ``ts``; a newer one with a lower ``seq`` means the agent reset it."""

    @property
    def deserved(self) -> AssessedGrade:
        """The grade this assessment alone asks for: a fatal signal is FAILING."""
        return "FAILING" if self.fatal else self.grade


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One decision to announce as a ControllerEvent (and carry out, if ``action``)."""

    kind: str
    ts: float
    region: str
    cluster: str
    node: NodeIdentity | None = None
    grade_from: Grade | None = None
    grade_to: Grade | None = None
    score: float | None = None
    reasons: tuple[Reason, ...] = ()
    message: str = ""
    action: Action | None = None
    by: str = "controller"
    attributes: Mapping[str, AttrValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Transition:
    """A new record and what to announce; ``if_denied`` is the outcome if the rail refuses."""

    record: NodeRecord
    decisions: tuple[Decision, ...] = ()
    if_denied: Transition | None = None

    @property
    def wants_isolation(self) -> bool:
        """It holds an automatic isolation the safety rail has not yet allowed."""
        return self.if_denied is not None


def to_event(decision: Decision, event_id: str) -> ControllerEvent:
    """The ControllerEvent that announces ``decision``."""
    attributes: dict[str, AttrValue] = {"cluster": decision.cluster, "by": decision.by}
    if decision.grade_from is not None:
        attributes["grade_from"] = decision.grade_from
    if decision.grade_to is not None:
        attributes["grade_to"] = decision.grade_to
    if decision.score is not None:
        attributes["score"] = decision.score
    if decision.action is not None:
        attributes["action"] = decision.action
    attributes.update(decision.attributes)
    return ControllerEvent(
        event_id=event_id,
        ts=decision.ts,
        region=decision.region,
        kind=decision.kind,
        node=decision.node,
        reasons=decision.reasons,
        message=decision.message,
        attributes=attributes,
    )


def accepts_new_work(record: NodeRecord) -> bool:
    """Whether the scheduler may place new work on the node."""
    flagged = record.cordoned or record.held or record.rail_flagged
    return record.grade == "HEALTHY" and not flagged


# --- assessments ----------------------------------------------------------------------


def observe(record: NodeRecord, obs: Observation, cfg: LifecycleConfig) -> Transition:
    """Take in one assessment: update the score and move the grade if the rules say so."""
    if _is_replay(record, obs):
        return Transition(record)
    base = _absorb(record, obs, cfg)
    if record.held or record.maintenance:
        return Transition(base)  # pinned to FAILING / MAINTENANCE until an uncordon
    was = _grade_before_silence(record)
    deserved = obs.deserved
    if deserved == "FAILING":
        if was == "FAILING":
            return Transition(replace(base, clean_cycles=0))
        return _isolate(base, was, obs, cfg)
    if deserved == "SUB_HEALTHY":
        if was == "FAILING":
            target: Grade = "FAILING"
            message = f"score {obs.score:.0f}: still not clean, stays FAILING"
        elif was == "MAINTENANCE" or base.running_jobs == 0:
            target = "MAINTENANCE"
            message = f"score {obs.score:.0f}: sub-healthy with no running jobs"
        else:
            target = "SUB_HEALTHY"
            message = f"score {obs.score:.0f}: sub-healthy, no new work; running jobs continue"
        return _change(replace(base, clean_cycles=0), target, obs.ts, cfg, obs.reasons, message)
    if was not in BAD_GRADES and not record.rail_flagged:
        return _change(base, "HEALTHY", obs.ts, cfg, obs.reasons, "telemetry resumed, healthy")
    cycles = record.clean_cycles + 1
    if cycles < cfg.clean_cycles_to_recover:
        message = f"telemetry resumed; {cycles} clean assessment(s), still {was}"
        return _change(replace(base, clean_cycles=cycles), was, obs.ts, cfg, obs.reasons, message)
    reason = Reason(
        signal="lifecycle.clean_cycles",
        value=cycles,
        threshold=cfg.clean_cycles_to_recover,
        rule="clean_cycles_to_recover",
        message=f"{cycles} consecutive clean assessments",
    )
    return _change(
        replace(base, clean_cycles=0, rail_flagged=False),
        "HEALTHY",
        obs.ts,
        cfg,
        (reason,),
        f"{cycles} consecutive clean assessments: back in service",
        action="release" if record.grade in OUT_OF_SERVICE else None,
    )


def _is_replay(record: NodeRecord, obs: Observation) -> bool:
    """An assessment already taken in (a redelivery after a controller restart)."""
    if record.last_seen_ts is None or obs.seq > record.last_seq:
        return False
    reset = obs.sent_ts is not None and obs.sent_ts > (record.last_sent_ts or float("inf"))
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
    isolated = _change(
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
            _decision(
                isolated.record,
                "node.held",
                obs.ts,
                (reason,),
                f"repeat offender (isolated {len(isolations)} times within {days} days): "
                "stays out until an operator uncordons it",
            ),
        )
    denied = _change(
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


def check_silence(
    record: NodeRecord,
    now: float,
    cfg: LifecycleConfig,
    *,
    bmc_power_on: bool | None = None,
) -> Transition:
    """Mark a silent in-service node UNREACHABLE (not FAILING), with the BMC's word on it."""
    if record.grade not in ("HEALTHY", "SUB_HEALTHY") or record.last_seen_ts is None:
        return Transition(record)
    limit = cfg.unreachable_after_intervals * record.interval_s
    silent = now - record.last_seen_ts
    if record.interval_s <= 0 or silent < limit:
        return Transition(record)
    intervals = f"{cfg.unreachable_after_intervals} intervals of {record.interval_s:g} s"
    reasons = [
        Reason(
            signal="telemetry.silence_s",
            value=silent,
            threshold=limit,
            rule="unreachable_after_intervals",
            message=f"no telemetry for {silent:.0f} s ({intervals})",
        )
    ]
    if bmc_power_on is None:
        oob = "no out-of-band reading to cross-check"
    else:
        oob = f"the BMC says it is powered {'on' if bmc_power_on else 'off'}"
        reasons.append(Reason(signal="bmc.power_on", value=bmc_power_on, message=oob))
    return _change(
        replace(record, unreachable_from=record.grade),
        "UNREACHABLE",
        now,
        cfg,
        tuple(reasons),
        f"no telemetry for {silent:.0f} s; {oob}",
        attributes={"bmc_power_on": bmc_power_on},
    )


def update_jobs(
    record: NodeRecord, running_jobs: int, now: float, cfg: LifecycleConfig
) -> Transition:
    """Take in the node's job count: a SUB_HEALTHY node with none enters MAINTENANCE."""
    if running_jobs == record.running_jobs:
        return Transition(record)
    base = replace(record, running_jobs=running_jobs, updated_ts=now)
    if record.grade != "SUB_HEALTHY" or running_jobs:
        return Transition(base)
    return _change(
        base, "MAINTENANCE", now, cfg, record.reasons, "sub-healthy and its last job left"
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
        return _change(cordoned, record.grade, now, cfg, why, message, by=by, kind="node.cordoned")
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
        return _change(
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
    return _change(
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


# --- building transitions -------------------------------------------------------------


def _change(
    record: NodeRecord,
    to: Grade,
    ts: float,
    cfg: LifecycleConfig,
    reasons: tuple[Reason, ...],
    message: str,
    *,
    by: str = "controller",
    kind: str | None = None,
    action: Action | None = None,
    attributes: Mapping[str, AttrValue] | None = None,
) -> Transition:
    """Move ``record`` to grade ``to``.

    A real grade change is added to the history and announced (under ``kind``, else the
    kind of the grade entered); an explicit ``kind`` is announced even without one.
    """
    changed = to != record.grade
    new = replace(record, grade=to, updated_ts=ts)
    if changed:
        entry = GradeChange(
            ts=ts,
            grade_from=record.grade,
            grade_to=to,
            score=record.score,
            by=by,
            message=message,
            reasons=reasons,
        )
        new = replace(new, history=(*record.history, entry)[-cfg.history_max :])
    if not changed and kind is None:
        return Transition(new)
    decision = _decision(
        new,
        kind or KIND_ENTERING[to],
        ts,
        reasons,
        message,
        grade_from=record.grade,
        by=by,
        action=action,
        attributes=attributes,
    )
    return Transition(new, (decision,))


def _decision(
    record: NodeRecord,
    kind: str,
    ts: float,
    reasons: tuple[Reason, ...],
    message: str,
    *,
    grade_from: Grade | None = None,
    by: str = "controller",
    action: Action | None = None,
    attributes: Mapping[str, AttrValue] | None = None,
) -> Decision:
    return Decision(
        kind=kind,
        ts=ts,
        region=record.node.region,
        cluster=record.node.cluster,
        node=record.node,
        grade_from=grade_from or record.grade,
        grade_to=record.grade,
        score=record.score,
        reasons=reasons,
        message=message,
        action=action,
        by=by,
        attributes=dict(attributes or {}),
    )
