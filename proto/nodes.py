"""NodeRecord: a region controller's view of one node (KV ``MG_NODES``, key = handle).

A restarted controller resumes from these records, so every field a decision depends on
(hysteresis counters, isolation history, operator holds) lives here, not in memory.
RailState is the same for a cluster's safety rail (docs/lifecycle.md).
"""

from __future__ import annotations

from typing import Literal

from metalguard.proto.base import Message, NodeIdentity, NonNegInt, Reason, Record, Token

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
    """An operator took the node out of service (cordon or maintenance): no new work."""
    maintenance: bool = False
    """An operator put the node in MAINTENANCE: its grade stays there until uncordon."""
    operator_reason: str = ""
    operator_by: str = ""
    """Who cordoned it or put it in maintenance (``operator:<name>``)."""
    operator_ts: float | None = None
    """When the operator's cordon or maintenance began."""
    clean_cycles: NonNegInt = 0
    """Consecutive clean assessments while in a bad grade (hysteresis)."""
    isolations: tuple[float, ...] = ()
    """Times of automatic isolations within the repeat-offender window."""
    held: bool = False
    """A repeat offender: stays out until an operator uncordons it."""
    rail_flagged: bool = False
    """Would have been isolated, but the safety rail held it in service."""
    suspect_jobs: tuple[str, ...] = ()
    """Jobs whose failed, crashed or hung generations the job manager blames on this node
    (their other members' nodes were not): it is kept SUB_HEALTHY until ``suspect_until``."""
    suspect_until: float | None = None
    """Controller time the suspicion ends (an operator's uncordon ends it sooner)."""
    straggler: Reason | None = None
    """The job manager found the node slowing a synchronous job without failing (its
    ranks slower than their peers; docs/jobs.md "Stragglers"): the evidence. It is kept
    SUB_HEALTHY until ``straggler_until``."""
    straggler_until: float | None = None
    """Controller time the straggler mark ends (an operator's uncordon ends it sooner)."""
    unreachable_from: Grade | None = None
    """While UNREACHABLE: the grade it had when it went silent."""
    running_jobs: NonNegInt | None = None
    """Unfinished job members on the node, as the native job manager last reported them
    (None: not known yet). A SUB_HEALTHY node enters MAINTENANCE only once its count of
    unfinished jobs (this plus ``slurm_jobs``) is known to be 0: its running jobs finish
    first (docs/lifecycle.md)."""
    slurm_jobs: NonNegInt | None = None
    """Active Slurm jobs on the node (running, suspended, completing), as the Slurm bridge
    last reported them in a ``slurm_jobs`` NodeEvent (None: not known; docs/slurm.md).
    Kept apart from ``running_jobs`` so neither source overwrites the other's count."""
    last_seen_ts: float | None = None
    """Controller time of the last accepted assessment."""
    last_sent_ts: float | None = None
    """The node's own time stamp of that batch (tells a replay from a reset ``seq``)."""
    last_seq: NonNegInt = 0
    interval_s: float = 0.0
    bad_sent_ts: float | None = None
    """The node's own time stamp of the newest assessment that was not clean: a clean
    batch collected before it (spooled while the node was cut off, delivered after a
    fatal event) is no clean cycle."""
    history: tuple[GradeChange, ...] = ()
    """The most recent grade changes, oldest first (bounded)."""
    dma_posture: str = ""
    """The node's DMA isolation posture as its agent last reported it (``isolated``,
    ``shared``, ``off``, ``unknown``; "" not reported): a sensitive job or instance goes
    only where it is ``isolated`` (docs/security.md "DMA isolation")."""
    dma_reasons: tuple[str, ...] = ()
    """Why it is not ``isolated`` (the agent's reasons)."""
    updated_ts: float = 0.0


class RailState(Message, frozen=True, tag="rail_state"):
    """The safety rail of one cluster: its recent automatic isolations."""

    region: Token
    cluster: Token
    isolations: tuple[float, ...] = ()
    """Times of automatic isolations within the rail window."""
    tripped_ts: float | None = None
    """When the rail last raised its alert (at most one per window)."""
    updated_ts: float = 0.0
