"""NodeRecord: a region controller's view of one node (KV ``MG_NODES``, key = handle).

A restarted controller resumes from these records, so every field a decision depends on
(hysteresis counters, isolation history, operator holds) lives here, not in memory.
"""

from __future__ import annotations

from typing import Literal

from proto.base import Message, NodeIdentity, NonNegInt, Reason, Record

Grade = Literal["HEALTHY", "SUB_HEALTHY", "FAILING", "MAINTENANCE", "UNREACHABLE"]
GRADES: tuple[Grade, ...] = ("HEALTHY", "SUB_HEALTHY", "FAILING", "MAINTENANCE", "UNREACHABLE")


class GradeChange(Record, frozen=True):
    """One transition of a node's grade, with what caused it."""

    ts: float
    grade_from: Grade
    grade_to: Grade
    score: float | None = None
    by: str = "controller"
    """``controller``, ``rail`` or ``operator:<name>``."""
    message: str = ""
    reasons: tuple[Reason, ...] = ()


class NodeRecord(Message, frozen=True, tag="node_record"):
    """The controller's state of one node."""

    node: NodeIdentity
    grade: Grade = "HEALTHY"
    score: float = 100.0
    reasons: tuple[Reason, ...] = ()
    """Why the node has its current score (empty when nothing is wrong)."""
    rack: str = ""
    cordoned: bool = False
    """An operator took the node out of service (cordon or maintenance)."""
    operator_reason: str = ""
    clean_cycles: NonNegInt = 0
    """Consecutive clean assessments while in a bad grade (hysteresis)."""
    isolations: tuple[float, ...] = ()
    """Times of automatic isolations within the repeat-offender window."""
    held: bool = False
    """A repeat offender: stays out until an operator uncordons it."""
    rail_flagged: bool = False
    """Would have been isolated, but the safety rail held it in service."""
    running_jobs: NonNegInt = 0
    last_seen_ts: float | None = None
    last_seq: NonNegInt = 0
    interval_s: float = 0.0
    history: tuple[GradeChange, ...] = ()
    """The most recent grade changes, oldest first (bounded)."""
    updated_ts: float = 0.0
