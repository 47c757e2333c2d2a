"""The twin's health system: synthesized telemetry (:mod:`.signals`) through the REAL
scorer, lifecycle and safety rail, called the way the region controller calls them
(controller/region.py): each batch is scored by ``assess`` with the node's own history
and :class:`ScoringMemo`; a steady healthy batch only moves the record's liveness
(``decide.steady_batch``), any other goes through one ``decide`` round with the
cluster's size; a NodeEvent goes through ``decide.event_input``; an operator's action
through ``decide_operator``; a node that falls silent through ``decide_silence``.

Records, rail states and histories exist only for the nodes touched (a precursor, a
fault, a drain); a node never touched is HEALTHY. The rail's cluster size is the fleet's
node count of the cluster. Pure given its inputs: no clock, no randomness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metalguard.controller.core.decide import (
    NodeInput,
    Outcome,
    batch_step,
    changed_counts,
    decide,
    decide_operator,
    decide_running,
    decide_silence,
    decide_stragglers,
    event_input,
)
from metalguard.controller.core.grades import worst_grade
from metalguard.controller.core.handles import ClusterKey
from metalguard.controller.core.lifecycle import (
    LifecycleConfig,
    OperatorAction,
    accepts_new_work,
    silence_limit_s,
)
from metalguard.controller.core.scoring.config import DEFAULT_SCORING, ScoringConfig
from metalguard.controller.core.scoring.engine import (
    Assessment,
    NodeSignals,
    ScoringMemo,
    assess,
)
from metalguard.controller.core.topology import fleet_node
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.events import NodeEvent
from metalguard.proto.nodes import NodeRecord, RailState
from metalguard.proto.telemetry import TelemetryBatch
from metalguard.proto.topology import NodeTopology
from metalguard.twin import signals
from metalguard.twin.model import Fault, Policy, Signal

OPERATOR = "twin"
"""Who the operator actions are by (``operator:twin`` in the records)."""
MIN_STEP_S = 0.001
"""How far a message is moved past the node's previous one when both would fall at the
same time (the lifecycle drops a message not newer than the last as a replay)."""
"""The scorer's grades, mildest first."""


@dataclass(frozen=True, slots=True)
class GradeChange:
    """One grade change the real lifecycle made."""

    node: str
    before: str
    after: str
    at_s: float
    reason: str
    """The lifecycle's message for it, with the rules behind it."""


class _Node:
    """What the twin keeps for one touched node beside its record: the controller's
    scoring history and memo, the agent's last seq and time stamp, and which part's
    sections its batches carry."""

    __slots__ = (
        "clean",
        "generation",
        "handle",
        "identity",
        "last_ts",
        "memo",
        "rack",
        "seq",
        "signal",
        "signals",
        "step",
    )

    def __init__(self, node: FleetNode) -> None:
        self.handle = node.handle
        name = node.handle.removeprefix(f"{node.region}.{node.cluster}.")
        if name == node.handle or not name:
            raise ValueError(f"{node.handle!r} is not REGION.CLUSTER.NODE")
        self.identity = NodeIdentity(region=node.region, cluster=node.cluster, node=name)
        self.rack = node.rack
        self.signals: NodeSignals | None = None
        self.memo = ScoringMemo()
        self.seq = 0
        self.last_ts: float | None = None
        self.signal: Signal = ""
        self.step = 0
        """Precursor batches of ``signal`` sent since its part was last clean."""
        self.generation = 0
        """Repairs so far: a replaced part's identity (GPU UUID, disk serial)."""
        self.clean: tuple[Signal, int] | None = None
        """(signal, generation) of the clean readings the last batch carried, if clean."""


class HealthModel:
    """The fleet's health system in the twin: the real scoring, lifecycle and rail."""

    def __init__(
        self,
        nodes: Sequence[FleetNode],
        policy: Policy,
        *,
        lifecycle: LifecycleConfig | None = None,
        scoring: ScoringConfig | None = None,
        running: Callable[[str], int] = lambda _handle: 0,
    ) -> None:
        """``running``: each node's count of unfinished job members (the engine sets its
        own), which the model hands the lifecycle as the job manager does
        (``decide.changed_counts`` after every round, ``decide_running``)."""
        self.policy = policy
        self.running = running
        self.lifecycle = lifecycle or LifecycleConfig()
        self.scoring = scoring or DEFAULT_SCORING
        self.interval_s = signals.AGENT_BATCH_INTERVAL_S
        self._fleet: dict[str, FleetNode] = {}
        for node in nodes:
            if node.handle in self._fleet:
                raise ValueError(f"node {node.handle!r} appears twice")
            self._fleet[node.handle] = node
        self._sizes: Counter[ClusterKey] = Counter((n.region, n.cluster) for n in nodes)
        self.records: dict[str, NodeRecord] = {}
        """The controller's record of each touched node."""
        self.rails: dict[ClusterKey, RailState] = {}
        self._nodes: dict[str, _Node] = {}
        self._rail_held = False
        """The rail refused an isolation in the current call."""
        self.decisions: Counter[str] = Counter()
        """What the real code decided: ``grade:A->B``, ``precursor:<scored grade>``,
        ``precursor_missed``, ``rail_held`` (calls whose isolation the rail refused),
        ``rail_tripped`` (its alerts, one per window), ``held`` (repeat offenders),
        ``operator:maintenance``, ``operator:uncordon``, ``event_ignored:<kind>``,
        ``repaired_not_healthy``."""

    # --- queries ------------------------------------------------------------------------

    @property
    def drain_after_s(self) -> float:
        """The lifecycle's ``sub_healthy_drain_after_s`` (0: never)."""
        return self.lifecycle.sub_healthy_drain_after_s

    def grade(self, handle: str) -> str:
        """The node's grade ("HEALTHY" for a node never touched)."""
        record = self.records.get(handle)
        return "HEALTHY" if record is None else record.grade

    def record(self, handle: str) -> NodeRecord | None:
        """The controller's record of the node (None: never touched)."""
        return self.records.get(handle)

    def accepts_work(self, handle: str) -> bool:
        """``lifecycle.accepts_new_work``: HEALTHY and not cordoned, held or rail-flagged."""
        record = self.records.get(handle)
        return record is None or accepts_new_work(record)

    def fleet_node(self, node: FleetNode) -> FleetNode:
        """``node`` as the scheduler sees it, built by the controller's own
        ``topology.fleet_node`` from the record (grade; cordoned = cordoned or held);
        ``node`` itself when never touched."""
        record = self.records.get(node.handle)
        if record is None:
            return node
        place = NodeTopology(**{f: getattr(node, f) for f in NodeTopology.__struct_fields__})
        return fleet_node(node.handle, record, place, node.warm_datasets)

    # --- inputs -------------------------------------------------------------------------

    def precursor(self, fault: Fault, now: float) -> list[GradeChange]:
        """The part of ``fault`` degrading: a baseline batch, then the precursor batches
        one agent interval apart ending at ``now``, each scored and decided. A precursor
        the scorer grades HEALTHY throughout is missed (``precursor_missed``)."""
        self._rail_held = False
        changes = self._precursor(fault, now)
        self._count_rail()
        return changes

    def still_degraded(self, fault: Fault, now: float) -> list[GradeChange]:
        """One more precursor batch of ``fault``'s part at ``now`` (the part has not got
        better): what a SUB_HEALTHY node's agent keeps sending; at the lifecycle's
        ``sub_healthy_drain_after_s`` it moves the node to MAINTENANCE with its jobs."""
        st = self._touch(fault.node)
        if not fault.signal or st.signal != fault.signal:
            return []
        st.step += 1
        st.seq += 1
        batch = signals.precursor(
            fault.signal,
            st.identity,
            seq=st.seq,
            ts=self._next_ts(st, now),
            step=st.step,
            generation=st.generation,
        )
        assert batch is not None
        st.clean = None
        return self._scored(st, batch)[1]

    def report_running(self, handles: Sequence[str], now: float) -> list[GradeChange]:
        """The job manager's pass: the changed counts of these nodes, decided."""
        known = {h: self.records[h] for h in handles if h in self.records}
        counts = {h: self.running(h) for h in known}
        changed = changed_counts(known, counts)
        if not changed:
            return []
        return self._apply(decide_running(self.records, changed, now, self.lifecycle), now)

    def fault(self, fault: Fault, now: float) -> list[GradeChange]:
        """The hardware fault as the agent reports it (:func:`signals.fault_report`): a
        fatal event or batch, decided (FAILING, unless the rail holds it: ``rail_held``);
        a node of signal "" falls silent and the silence check, one silence limit later,
        makes it UNREACHABLE. Nothing without automatic isolation, nor for a software
        fault or a hang (the node is fine)."""
        self._rail_held = False
        changes = self._fault(fault, now)
        self._count_rail()
        return changes

    def _count_rail(self) -> None:
        if self._rail_held:
            self.decisions["rail_held"] += 1
        self._rail_held = False

    def _precursor(self, fault: Fault, now: float) -> list[GradeChange]:
        if not self.policy.precursors:
            return []
        signal = fault.signal
        if not signal:
            self.decisions["precursor_missed"] += 1
            return []
        st = self._touch(fault.node)
        steps = signals.PRECURSOR_STEPS
        changes: list[GradeChange] = []
        if st.clean != (signal, st.generation):  # the rates need a clean reading first
            st.signal = signal
            changes += self._send(st, self._baseline(st, now - steps * self.interval_s))
        st.step = 0
        worst = "HEALTHY"
        for step in range(1, steps + 1):
            at = now - (steps - step) * self.interval_s
            st.seq += 1
            batch = signals.precursor(
                signal,
                st.identity,
                seq=st.seq,
                ts=self._next_ts(st, at),
                step=step,
                generation=st.generation,
            )
            assert batch is not None
            st.clean = None
            assessment, found = self._scored(st, batch)
            changes += found
            for event in signals.precursor_events(
                signal,
                st.identity,
                ts=self._next_ts(st, at),
                event_id=f"twin-{fault.fault_id}-p{step}",
                step=step,
            ):
                changes += self._event(st, event)
            st.step = step
            worst = worst_grade((worst, assessment.grade))
        self.decisions[f"precursor:{worst}"] += 1
        if worst == "HEALTHY":
            self.decisions["precursor_missed"] += 1
        return changes

    def _fault(self, fault: Fault, now: float) -> list[GradeChange]:
        if not self.policy.auto_isolation or fault.kind != "hardware":
            return []
        st = self._touch(fault.node)
        signal = fault.signal
        if not signal:
            return self._silent(st, now)
        step = st.step if st.signal == signal else 0
        st.signal = signal
        ts = self._next_ts(st, now)
        report = signals.fault_report(
            signal,
            st.identity,
            seq=st.seq + 1,
            ts=ts,
            event_id=f"twin-{fault.fault_id}",
            step=step,
            generation=st.generation,
        )
        if report is None:
            return self._silent(st, ts)
        if isinstance(report, NodeEvent):
            return self._event(st, report)
        st.seq += 1
        st.clean = None
        return self._scored(st, report)[1]

    def straggler(
        self, handle: str, evidence: Reason, until: float, now: float
    ) -> list[GradeChange]:
        """The job manager's straggler mark (``decide_stragglers``): SUB_HEALTHY until
        ``until`` (no new work, running jobs continue), whatever its telemetry says; a
        node in a worse grade keeps it. Nothing without automatic isolation."""
        if not self.policy.auto_isolation:
            return []
        st = self._touch(handle)
        changes: list[GradeChange] = []
        if handle not in self.records:  # the controller knows every node it was sent
            changes += self._send(st, self._baseline(st, now))
        outcome = decide_stragglers(self.records, {handle: evidence}, until, now, self.lifecycle)
        return changes + self._apply(outcome, now)

    def drain(self, handle: str, now: float, reason: str) -> list[GradeChange]:
        """An operator's maintenance (a person, or the metalguard policy draining a
        sub-healthy node): MAINTENANCE, pinned until :meth:`repaired` uncordons it."""
        st = self._touch(handle)
        record = self.records.get(handle) or NodeRecord(node=st.identity, rack=st.rack)
        return self._operator(record, "maintenance", reason, now)

    def repaired(self, handle: str, now: float) -> list[GradeChange]:
        """The node is back from repair: an operator's uncordon if it is held, in
        maintenance, cordoned or marked a straggler, then clean batches of its new part
        one interval apart from ``now`` on, until the lifecycle says HEALTHY (a FAILING node needs
        ``clean_cycles_to_recover`` of them) or ``clean_cycles_to_recover + 2`` batches
        (``repaired_not_healthy``: the scorer's windows still hold the old readings)."""
        record = self.records.get(handle)
        if record is None:
            return []
        st = self._nodes[handle]
        changes: list[GradeChange] = []
        if record.held or record.maintenance or record.cordoned or record.straggler is not None:
            changes += self._operator(record, "uncordon", "repaired", now)
        st.generation += 1
        st.step = 0
        for k in range(self.lifecycle.clean_cycles_to_recover + 2):
            changes += self._send(st, self._baseline(st, now + k * self.interval_s))
            after = self.records[handle]
            if after.grade == "HEALTHY" and not after.rail_flagged:
                break
        else:
            self.decisions["repaired_not_healthy"] += 1
        return changes

    # --- the controller's calls -----------------------------------------------------------

    def _touch(self, handle: str) -> _Node:
        st = self._nodes.get(handle)
        if st is None:
            node = self._fleet.get(handle)
            if node is None:
                raise KeyError(f"unknown node {handle!r}")
            st = self._nodes[handle] = _Node(node)
        return st

    def _next_ts(self, st: _Node, want: float) -> float:
        """``want``, or just after the node's previous message if that is not earlier."""
        last = st.last_ts
        ts = want if last is None or want > last else last + MIN_STEP_S
        st.last_ts = ts
        return ts

    def _baseline(self, st: _Node, at: float) -> TelemetryBatch:
        st.seq += 1
        st.clean = (st.signal, st.generation)
        ts = self._next_ts(st, at)
        return signals.baseline(st.signal, st.identity, seq=st.seq, ts=ts, generation=st.generation)

    def _send(self, st: _Node, batch: TelemetryBatch) -> list[GradeChange]:
        return self._scored(st, batch)[1]

    def _scored(self, st: _Node, batch: TelemetryBatch) -> tuple[Assessment, list[GradeChange]]:
        """RegionController.on_batch_now: score, then the steady path or a round
        (``decide.batch_step``)."""
        st.signals, assessment = assess(st.signals, batch, self.scoring, st.memo)
        step = batch_step(self.records.get(st.handle), batch, assessment, batch.ts, st.rack)
        if isinstance(step, NodeRecord):
            self.records[st.handle] = step
            return assessment, []
        return assessment, self._round(step, batch.ts)

    def _event(self, st: _Node, event: NodeEvent) -> list[GradeChange]:
        """RegionController.on_node_event: a fatal event is a fatal assessment."""
        item = event_input(event, self.records.get(st.handle), event.ts)
        if item is None:
            self.decisions[f"event_ignored:{event.kind}"] += 1
            return []
        return self._round(item, event.ts)

    def _round(self, item: NodeInput, now: float) -> list[GradeChange]:
        """RegionController._decide: one round, the cluster's size from the fleet (the
        round's node is added by ``decide`` itself while it has no record)."""
        node = item.node
        handle, key = node.handle, (node.region, node.cluster)
        known = self._sizes[key] - (0 if handle in self.records else 1)
        outcome = decide(self.records, self.rails, [item], now, self.lifecycle, {key: known})
        settled = outcome.records.get(handle)
        if (
            settled is not None
            and item.obs.deserved == "FAILING"
            and settled.grade != "FAILING"
            and settled.rail_flagged
            and not (settled.held or settled.maintenance)
        ):
            self._rail_held = True
        return self._apply(outcome, now)

    def _silent(self, st: _Node, now: float) -> list[GradeChange]:
        """The node stops reporting at ``now``: ``decide_silence`` one silence limit later
        (a node never heard of first sends its last batch at ``now``)."""
        changes: list[GradeChange] = []
        if st.handle not in self.records:
            changes += self._send(st, self._baseline(st, now))
        record = self.records[st.handle]
        heard = max(now, record.last_seen_ts or now)
        # one step past the limit: (heard + limit) - heard can round below the limit
        limit = silence_limit_s(self.interval_s, self.lifecycle) + MIN_STEP_S
        at = self._next_ts(st, heard + limit)
        outcome = decide_silence({st.handle: record}, at, self.lifecycle)
        return changes + self._apply(outcome, at)

    def _operator(
        self, record: NodeRecord, action: OperatorAction, reason: str, now: float
    ) -> list[GradeChange]:
        outcome = decide_operator(record, action, reason, OPERATOR, now, self.lifecycle)
        if outcome.records or outcome.events:
            self.decisions[f"operator:{action}"] += 1
        return self._apply(outcome, now)

    def _apply(self, outcome: Outcome, now: float) -> list[GradeChange]:
        """Keep what the round changed; the grade changes, in node order."""
        changes: list[GradeChange] = []
        for handle in sorted(outcome.records):
            record = outcome.records[handle]
            before = self.records.get(handle)
            was = "HEALTHY" if before is None else before.grade
            self.records[handle] = record
            if record.grade != was:
                self.decisions[f"grade:{was}->{record.grade}"] += 1
                changes.append(GradeChange(handle, was, record.grade, now, _why(record)))
        self.rails.update(outcome.rails)
        for event in outcome.events:
            if event.kind == "node.held":
                self.decisions["held"] += 1
            elif event.kind == "rail.tripped":
                self.decisions["rail_tripped"] += 1
        # the job manager's next pass: a new record's count (or one a round reset)
        counts = {h: self.running(h) for h in outcome.records}
        changed = changed_counts({h: self.records[h] for h in outcome.records}, counts)
        if changed:
            running = decide_running(self.records, changed, now, self.lifecycle)
            changes += self._apply(running, now)
        return changes


def _why(record: NodeRecord) -> str:
    """The lifecycle's message of the record's newest grade change, with its rules."""
    if not record.history:
        return ""
    entry = record.history[-1]
    rules = ", ".join(dict.fromkeys(r.rule for r in entry.reasons if r.rule))
    return f"{entry.message} ({rules})" if rules else entry.message
