"""What a node's grade and flags mean for new work: the one owner of that answer.

The scheduler (:class:`controller.jobs.scheduler.FleetNode`), the federation's capacity
view, provisioning and the lifecycle's ``accepts_new_work`` all ask here, so a node the
safety rail kept in service (rail-flagged) or an operator cordoned takes no new work on
any path (docs/lifecycle.md, "Grades").  Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from metalguard.proto.nodes import NodeRecord

NEW_WORK_GRADE = "HEALTHY"
"""The one grade that takes new work."""
RUNNING_WORK_GRADES = frozenset({"HEALTHY", "SUB_HEALTHY"})
"""Grades whose running jobs run on where they are (and are judged there: a hang on a
sub-healthy node is the job's as much as on a healthy one)."""
MOVE_CAUSES: Mapping[str, str] = {
    "FAILING": "node_failing",
    "MAINTENANCE": "maintenance",
    "UNREACHABLE": "lost",
}
"""Grades whose running jobs are moved now, and the cause recorded (in this order of
precedence when a job has members on several). FAILING: isolated, its jobs checkpointed
and moved. MAINTENANCE: an operator's maintenance, or a SUB_HEALTHY node at its drain
limit (a node that drained to MAINTENANCE by itself has no jobs left). UNREACHABLE: the
node is silent, so its runner can neither report progress nor take a command, and a gang
waits on every rank: the job restarts elsewhere from its last periodic checkpoint rather
than holding the other nodes idle (on the Slurm path the bridge leaves it to Slurm, which
sees the node NOT_RESPONDING)."""


GRADE_SEVERITY: Mapping[str, int] = {
    "HEALTHY": 0,
    "MAINTENANCE": 0,
    "SUB_HEALTHY": 1,
    "FAILING": 2,
    "UNREACHABLE": 3,
}
"""How bad each grade says the node's hardware is, for "the worst grade it took":
MAINTENANCE is a decision (drained, an operator's), not a finding, so it ranks with
HEALTHY; UNREACHABLE (nothing known) above every other."""


def worst_grade(grades: Iterable[str]) -> str:
    """The worst of ``grades`` by :data:`GRADE_SEVERITY` (the first of equals; an unknown
    grade ranks with UNREACHABLE); ValueError when there is none."""
    return max(grades, key=lambda g: GRADE_SEVERITY.get(g, GRADE_SEVERITY["UNREACHABLE"]))


def running_work(grade: str) -> str | None:
    """What happens to the jobs running on a node of this grade: None, they run on (HEALTHY,
    SUB_HEALTHY); else the cause under which they are moved now (:data:`MOVE_CAUSES`)."""
    return MOVE_CAUSES.get(grade)


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
    """Whether a node of this grade and these flags may be given new work (the same answer
    as :func:`why_no_new_work` is None, without building its sentence: the scheduler asks
    it for every node of every pass)."""
    return grade == NEW_WORK_GRADE and not (cordoned or held or rail_flagged)


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
