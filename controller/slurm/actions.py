"""Pure: a controller decision + Slurm's current view -> what to do to Slurm.

Idempotent by construction: every plan is computed against what Slurm shows now, so a
repeated event (a redelivery, a restart) finds the node already drained and plans
nothing new.  Safety, in order:

- the bridge resumes only nodes whose drain reason starts with its own prefix: a node an
  operator drained (any other reason) is never resumed, and its reason never overwritten;
- automatic drains (decided by the controller, not by an operator) are capped: at most
  ``max(min_nodes, floor(max_fraction x Slurm nodes))`` nodes drained by metalguard at
  once; past it the node is left in service and the refusal is announced.  This comes on
  top of the controller's own safety rail: a node the rail refuses to isolate is
  announced ``node.rail_flagged`` and only drained (no new work; uncapped, a drain stops
  nothing that runs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from metalguard.controller.core.grades import NEW_WORK_GRADE, running_work
from metalguard.controller.core.lifecycle_model import RAIL_FLAGGED_KIND
from metalguard.controller.slurm.parse import SlurmJob, SlurmNode
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import NodeRecord

Intent = Literal["evacuate", "drain", "resume"]

REASON_MAX = 200
"""Slurm keeps reasons short in its displays; longer ones are cut."""

EVACUATE_KINDS = frozenset({"node.isolated", "node.held"})
DRAIN_KINDS = frozenset({"node.sub_healthy", "node.cordoned"})
RESUME_KINDS = frozenset({"node.returned", "node.uncordoned"})


@dataclass(frozen=True, slots=True)
class Trigger:
    """What one ControllerEvent asks of Slurm."""

    intent: Intent
    node: NodeIdentity
    kind: str
    event_id: str
    why: str
    """The decision's own words (message, else its first reason)."""
    automatic: bool
    """Decided by the controller (capped), not by an operator."""

    @property
    def handle(self) -> str:
        """``region.cluster.node``."""
        return self.node.handle


def trigger_of(event: ControllerEvent) -> Trigger | None:
    """The Slurm intent of a controller decision; None for kinds Slurm need not hear of.

    node.isolated, node.held, and an operator's node.maintenance -> ``evacuate`` (drain,
    checkpoint and requeue its jobs); node.sub_healthy, node.cordoned and the automatic
    node.maintenance (a sub-healthy node with no jobs) -> ``drain`` (running jobs
    continue); node.returned and node.uncordoned -> ``resume``; node.rail_flagged ->
    ``drain`` while flagged (uncapped), ``resume`` when the flag clears on a node that
    takes new work again.
    """
    if event.node is None:
        return None
    by = str(event.attributes.get("by") or "controller")
    automatic = not by.startswith("operator")
    if event.kind in EVACUATE_KINDS:
        intent: Intent = "evacuate"
    elif event.kind == "node.maintenance":
        intent = "evacuate" if event.attributes.get("action") == "isolate" else "drain"
    elif event.kind in DRAIN_KINDS:
        intent = "drain"
    elif event.kind in RESUME_KINDS:
        intent = "resume"
    elif event.kind == RAIL_FLAGGED_KIND:
        # Flagged: drained (no new work; its jobs run on). Not counted against the bridge's
        # cap: the rail has already bounded it, and a drain stops nothing that runs.
        if event.attributes.get("flagged") is True:
            intent, automatic = "drain", False
        elif event.attributes.get("takes_new_work") is True:
            intent = "resume"
        else:
            return None
    else:
        return None
    why = event.message or (event.reasons[0].message if event.reasons else "")
    return Trigger(intent, event.node, event.kind, event.event_id, why, automatic)


def trigger_of_record(record: NodeRecord) -> Trigger | None:
    """What a node record the controller holds asks of Slurm, for the bridge's start-up
    reconciliation: the out-of-service states drain (and evacuate) as their events would;
    nothing is ever resumed from a record.  The event id is derived from the record's
    last change, so a restart with nothing changed announces nothing new."""
    operator = record.operator_reason or ""
    first = record.reasons[0].message if record.reasons else ""
    intent: Intent
    moved = running_work(record.grade)  # controller.core.grades: the one owner
    if record.held:
        kind, intent, automatic = "node.held", "evacuate", True
    elif moved == "node_failing":
        kind, intent, automatic = "node.isolated", "evacuate", True
    elif moved == "maintenance":
        # an operator's maintenance moves its jobs; a node that drained by itself has
        # none left (one at its drain limit was announced with its jobs' move)
        automatic = not record.maintenance
        kind, intent = "node.maintenance", "drain" if automatic else "evacuate"
    elif record.cordoned:
        kind, intent, automatic = "node.cordoned", "drain", False
    elif moved is None and record.grade != NEW_WORK_GRADE:  # SUB_HEALTHY: jobs continue
        kind, intent, automatic = "node.sub_healthy", "drain", True
    elif record.rail_flagged:
        kind, intent, automatic = RAIL_FLAGGED_KIND, "drain", False
        first = "rail-flagged: the safety rail kept it in service; no new work"
    else:  # in service, or UNREACHABLE (Slurm sees the node NOT_RESPONDING itself)
        return None
    why = (operator if not automatic else first) or first or operator
    event_id = f"reconcile@{int(record.updated_ts * 1000)}"
    return Trigger(intent, record.node, kind, event_id, why, automatic)


@dataclass(frozen=True, slots=True)
class Drain:
    """``scontrol update NodeName=N State=DRAIN Reason=...``"""

    slurm_node: str
    reason: str


@dataclass(frozen=True, slots=True)
class Resume:
    """``scontrol update NodeName=N State=RESUME``"""

    slurm_node: str


@dataclass(frozen=True, slots=True)
class Evacuate:
    """Signal each job to checkpoint, wait up to the deadline, then ``scontrol requeue``."""

    slurm_node: str
    job_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing done on purpose; announced so operators see why."""

    slurm_node: str
    why: str


Action = Drain | Resume | Evacuate | Skip


def drain_reason(prefix: str, trigger: Trigger) -> str:
    """``metalguard: node.isolated: <why>`` on one line, at most REASON_MAX characters."""
    text = f"{prefix} {trigger.kind}: {trigger.why}" if trigger.why else f"{prefix} {trigger.kind}"
    text = " ".join(text.split())
    return text if len(text) <= REASON_MAX else text[: REASON_MAX - 1] + "…"


def is_ours(node: SlurmNode, prefix: str) -> bool:
    """Drained by metalguard (its reason starts with the bridge's prefix)."""
    return node.drained and node.reason.startswith(prefix)


def drain_cap(total_nodes: int, max_fraction: float, min_nodes: int) -> int:
    """``max(min_nodes, floor(max_fraction x total))``, never more than the cluster."""
    share = math.floor(round(max_fraction * total_nodes, 6))
    return min(total_nodes, max(min_nodes, share))


def plan(
    trigger: Trigger,
    slurm_node: str,
    nodes: Mapping[str, SlurmNode],
    jobs: Iterable[SlurmJob],
    *,
    prefix: str,
    max_fraction: float,
    min_nodes: int,
) -> tuple[Action, ...]:
    """The actions for one trigger against Slurm's current view (``nodes`` by name,
    ``jobs`` as squeue lists them)."""
    node = nodes.get(slurm_node)
    if node is None:
        return (Skip(slurm_node, "not a node of this Slurm cluster"),)
    if trigger.intent == "resume":
        return _plan_resume(node, prefix)
    actions: list[Action] = []
    if node.drained:
        if not is_ours(node, prefix):
            why = f"already drained by someone else ({node.reason or 'no reason'}): kept"
            actions.append(Skip(slurm_node, why))
    else:
        ours = sum(1 for n in nodes.values() if is_ours(n, prefix))
        cap = drain_cap(len(nodes), max_fraction, min_nodes)
        if trigger.automatic and ours >= cap:
            why = f"bridge cap: {ours} of {len(nodes)} Slurm nodes already drained (limit {cap})"
            return (Skip(slurm_node, why),)
        actions.append(Drain(slurm_node, drain_reason(prefix, trigger)))
    if trigger.intent == "evacuate":
        actions += _plan_evacuation(slurm_node, jobs)
    return tuple(actions)


def _plan_resume(node: SlurmNode, prefix: str) -> tuple[Action, ...]:
    if is_ours(node, prefix):
        return (Resume(node.name),)
    if node.drained:
        why = f"drained by someone else ({node.reason or 'no reason'}): not resumed"
        return (Skip(node.name, why),)
    return ()


def _plan_evacuation(slurm_node: str, jobs: Iterable[SlurmJob]) -> list[Action]:
    here = [j for j in jobs if j.active and slurm_node in j.nodes]
    movable = tuple(j.job_id for j in here if j.requeue and j.batch)
    actions: list[Action] = []
    if movable:
        actions.append(Evacuate(slurm_node, movable))
    for job in here:
        if not (job.requeue and job.batch):
            what = "not requeueable" if job.batch else "not a batch job"
            actions.append(Skip(slurm_node, f"job {job.job_id} is {what}: left to Slurm"))
    return actions


def jobs_per_node(
    nodes: Iterable[SlurmNode], jobs: Iterable[SlurmJob]
) -> dict[str, tuple[str, ...]]:
    """Each listed Slurm node's active jobs (running, suspended, configuring or
    completing: they hold the node), ids sorted; a node with none has ``()``. Pending and
    finished jobs, and nodes squeue names that sinfo does not list, are left out."""
    held: dict[str, set[str]] = {n.name: set() for n in nodes}
    for job in jobs:
        if not job.active:
            continue
        for name in job.nodes:
            if name in held:
                held[name].add(job.job_id)
    return {name: tuple(sorted(ids, key=_job_order)) for name, ids in sorted(held.items())}


def _job_order(job_id: str) -> tuple[int, str]:
    """Numeric job ids in numeric order (``9`` before ``10``), then the others."""
    head = job_id.split("_", 1)[0]
    return (int(head), job_id) if head.isdigit() else (-1, job_id)


def job_count_changes(
    previous: Mapping[str, int] | None, current: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """The nodes of ``current`` (name -> active job ids) whose count of active jobs
    differs from ``previous`` (name -> count last announced); all of them when
    ``previous`` is None (the bridge's first poll)."""
    return {
        name: ids
        for name, ids in current.items()
        if previous is None or previous.get(name) != len(ids)
    }


def down_changes(
    previous: frozenset[str], nodes: Iterable[SlurmNode]
) -> tuple[tuple[SlurmNode, ...], tuple[str, ...], frozenset[str]]:
    """Slurm's own view, as changes: (nodes newly DOWN or NOT_RESPONDING, names that
    recovered, the new set of down names)."""
    listed = {n.name: n for n in nodes}
    down = frozenset(name for name, n in listed.items() if n.down)
    newly = tuple(listed[name] for name in sorted(down - previous))
    recovered = tuple(sorted(name for name in previous - down if name in listed))
    return newly, recovered, down
