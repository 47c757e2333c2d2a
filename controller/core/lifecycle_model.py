"""The lifecycle's vocabulary: its config, its input, its outputs (docs/lifecycle.md).

:class:`Observation` goes into :mod:`controller.lifecycle`; a :class:`Transition` (a new
NodeRecord and its :class:`Decision` s) comes out, and :mod:`controller.rail` settles the
isolations it wants.  Everything here is pure data and pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec.structs import replace

from metalguard.controller.core.grades import record_takes_new_work
from metalguard.proto.base import AttrValue, NodeIdentity, Reason
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import Grade, GradeChange, NodeRecord

SECONDS_PER_DAY = 86_400.0

Action = Literal["isolate", "release"]
"""``isolate``: fence the node, checkpoint and move its jobs; ``release``: unfence it."""
OperatorAction = Literal["cordon", "uncordon", "maintenance"]
AssessedGrade = Literal["HEALTHY", "SUB_HEALTHY", "FAILING"]
JobSource = Literal["jobs", "slurm"]
"""Who counted a node's jobs: ``jobs``, the native job manager (``NodeRecord.running_jobs``);
``slurm``, the Slurm bridge (``NodeRecord.slurm_jobs``)."""

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
    unreachable_after_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    """The floor of that silence, in seconds: a node of a short interval is not called
    silent over a scheduler hiccup (the silence is the larger of the two)."""
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
    sub_healthy_drain_after_s: Annotated[float, msgspec.Meta(ge=0)] = 86_400.0
    """How long a SUB_HEALTHY node's running jobs may run on; past it the node enters
    MAINTENANCE with the action ``isolate`` and its jobs are moved with a fresh
    checkpoint (a planned move). 0: never."""

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
    dma_posture: str | None = None
    """The DMA isolation posture the batch reports (None: none, the record's stays)."""
    dma_reasons: tuple[str, ...] = ()

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


def unfinished_jobs(record: NodeRecord) -> int | None:
    """The node's unfinished jobs over both sources: None while neither the job manager
    nor the Slurm bridge has counted them, else the sum of the counts known."""
    counts = [n for n in (record.running_jobs, record.slurm_jobs) if n is not None]
    return sum(counts) if counts else None


def with_job_count(record: NodeRecord, source: JobSource, count: int | None) -> NodeRecord:
    """``record`` with ``source``'s count set (the other source's left as it is)."""
    if source == "slurm":
        return replace(record, slurm_jobs=count)
    return replace(record, running_jobs=count)


def job_count(record: NodeRecord, source: JobSource) -> int | None:
    """The count ``source`` last reported for the node (None: not known)."""
    return record.slurm_jobs if source == "slurm" else record.running_jobs


def accepts_new_work(record: NodeRecord) -> bool:
    """Whether the scheduler may place new work on the node (``controller.core.grades``)."""
    return record_takes_new_work(record)


# --- building transitions -------------------------------------------------------------


def change_grade(
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
    decision = node_decision(
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


def node_decision(
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
    """A decision about ``record`` (already in its new grade)."""
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


RAIL_FLAGGED_KIND = "node.rail_flagged"
"""Announced when the safety rail flags a node (``flagged`` true) and when the flag clears
(``flagged`` false): the node takes no new work while flagged."""


def rail_flag_change(
    before: NodeRecord, after: NodeRecord, ts: float, operator: str | None = None
) -> Decision | None:
    """The ``node.rail_flagged`` decision when ``after`` differs from ``before`` in its rail
    flag (None: no change); ``operator``: the action clears it (``operator:<who>``)."""
    if before.rail_flagged == after.rail_flagged:
        return None
    if after.rail_flagged:
        return node_decision(
            after,
            RAIL_FLAGGED_KIND,
            ts,
            after.reasons,
            "rail-flagged: the safety rail kept the node in service instead of isolating "
            "it; its running jobs continue, it takes no new work",
            grade_from=before.grade,
            by="rail",
            attributes={"flagged": True},
        )
    if operator is not None:
        why = f"an operator's action ({operator})"
    elif after.grade == "FAILING":
        why = "the isolation the rail refused went ahead"
    else:
        why = "it assessed clean enough times"
    return node_decision(
        after,
        RAIL_FLAGGED_KIND,
        ts,
        (),
        f"rail flag cleared: {why}",
        grade_from=before.grade,
        by=operator or "controller",
        attributes={"flagged": False, "takes_new_work": record_takes_new_work(after)},
    )
