"""What a node's grade and flags mean for new work: the one owner of that answer.

The scheduler (:class:`controller.jobs.scheduler.FleetNode`), the federation's capacity
view, provisioning and the lifecycle's ``accepts_new_work`` all ask here, so a node the
safety rail kept in service (rail-flagged) or an operator cordoned takes no new work on
any path (docs/lifecycle.md, "Grades").  Pure.
"""

from __future__ import annotations

from metalguard.proto.nodes import NodeRecord

NEW_WORK_GRADE = "HEALTHY"
"""The one grade that takes new work."""
RUNNING_WORK_GRADES = frozenset({"HEALTHY", "SUB_HEALTHY"})
"""Grades whose running jobs run on where they are (and are judged there: a hang on a
sub-healthy node is the job's as much as on a healthy one)."""


def why_no_new_work(grade: str, *, cordoned: bool, held: bool, rail_flagged: bool) -> str | None:
    """Why a node of this grade and these flags takes no new work (None: it takes it)."""
    if grade != NEW_WORK_GRADE:
        return f"{grade}, not {NEW_WORK_GRADE}"
    if held:
        return "held (a repeat offender: out until an operator uncordons it)"
    if cordoned:
        return "cordoned"
    if rail_flagged:
        return "rail-flagged (the safety rail kept it in service: no new work)"
    return None


def takes_new_work(grade: str, *, cordoned: bool, held: bool, rail_flagged: bool) -> bool:
    """Whether a node of this grade and these flags may be given new work."""
    return why_no_new_work(grade, cordoned=cordoned, held=held, rail_flagged=rail_flagged) is None


def record_takes_new_work(record: NodeRecord) -> bool:
    """:func:`takes_new_work` of a node record."""
    return takes_new_work(
        record.grade, cordoned=record.cordoned, held=record.held, rail_flagged=record.rail_flagged
    )


def record_why_no_new_work(record: NodeRecord) -> str | None:
    """:func:`why_no_new_work` of a node record."""
    return why_no_new_work(
        record.grade, cordoned=record.cordoned, held=record.held, rail_flagged=record.rail_flagged
    )
