"""The region controller's decision core: pure, no I/O, time as an argument.

One *round* takes the current records and rail states and some inputs, runs the
lifecycle (:mod:`controller.lifecycle`) and the safety rail (:mod:`controller.rail`), and
returns what changed and the events to announce, each with a deterministic event id
(docs/controller.md): deciding the same input against the same state again gives the
same ids, so a republished event is dropped by the ``<P>_CONTROL`` duplicate window.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard, TypeVar

from msgspec.structs import replace

from metalguard.controller.core.handles import ClusterKey
from metalguard.controller.core.lifecycle import (
    Decision,
    JobSource,
    LifecycleConfig,
    Observation,
    OperatorAction,
    Transition,
    check_silence,
    observe,
    operator,
    straggle,
    suspect,
    to_event,
    update_jobs,
)
from metalguard.controller.core.lifecycle_model import rail_flag_change
from metalguard.controller.core.rail import apply_rail
from metalguard.controller.core.receiving import Span
from metalguard.controller.core.scoring.engine import Assessment
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.events import SLURM_JOBS_KIND, ControllerEvent, NodeEvent
from metalguard.proto.nodes import NodeRecord, RailState
from metalguard.proto.telemetry import TelemetryBatch

FATAL_EVENT_KINDS: frozenset[str] = frozenset(
    {
        "ecc_uncorrectable",
        "aer_fatal",
        "aer_nonfatal",
        "smart_failed",
        "gpu_ecc_dbe",
        "gpu_row_remap_failure",
    }
)
"""NodeEvent kinds acted on at once, as a fatal assessment (the scorer's fatal rules)."""
FATAL_WHEN_CRITICAL_KINDS: frozenset[str] = frozenset(
    {
        "gpu_xid",
        "device_removed",
        "device_unbound",
        "kmsg_gpu_fallen_off_bus",
        "kmsg_gpu_sxid",
        "kmsg_memory_uncorrected",
        "kmsg_pcie_aer",
        "kmsg_pcie_link_down",
        "kmsg_fs_readonly",
        "kmsg_nvme_down",
        "kmsg_kernel_panic",
    }
)
"""Kinds acted on at once when the agent rated them ``critical``: a lost GPU (XID 79),
a physical device gone from the bus or unbound by its driver after an error; from the
kernel log (docs/kmsg.md): a GPU off the bus, a fatal NVSwitch SXid, an uncorrected
memory error, a fatal AER or a PCIe link down, a file system remounted read-only, an
NVMe controller down, a kernel panic. Hung tasks and lockups are graded from the batch
(severe), not isolated on one line."""


def is_fatal_event(event: NodeEvent) -> bool:
    """Whether the controller isolates the node at once on this event."""
    if event.kind in FATAL_EVENT_KINDS:
        return True
    return event.kind in FATAL_WHEN_CRITICAL_KINDS and event.severity == "critical"


FATAL_EVENT_SCORE = 0.0
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class NodeInput:
    """One observation of one node, and the tag that makes its event ids unique."""

    node: NodeIdentity
    obs: Observation
    tag: str
    """Names the input: ``b<seq>@<batch ms>`` for a batch, ``e<event id>`` for an event."""
    rack: str | None = None
    """The node's rack as its topology says now (a batch's); None keeps the record's."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a round changed (only what changed) and what to announce, in order."""

    records: dict[str, NodeRecord] = field(default_factory=dict)
    rails: dict[ClusterKey, RailState] = field(default_factory=dict)
    events: tuple[ControllerEvent, ...] = ()


def batch_input(
    batch: TelemetryBatch, assessment: Assessment, received_ts: float, rack: str | None = None
) -> NodeInput:
    """The lifecycle's view of one scored batch (``ts`` is when it was taken in; ``rack``:
    the node's resolved topology's, for its record)."""
    grade = assessment.grade
    if grade not in ("HEALTHY", "SUB_HEALTHY", "FAILING"):
        raise ValueError(f"the scorer graded {grade}")  # grade_for never does
    obs = Observation(
        ts=received_ts,
        seq=batch.seq,
        sent_ts=batch.ts,
        interval_s=batch.interval_s,
        score=assessment.score,
        grade=grade,
        fatal=assessment.fatal,
        reasons=assessment.reasons,
        dma_posture=batch.iommu.posture if batch.iommu is not None else None,
        dma_reasons=batch.iommu.reasons if batch.iommu is not None else (),
    )
    return NodeInput(batch.node, obs, f"b{batch.seq}@{_ms(batch.ts)}", rack)


EVENT_VALUE_KEYS = ("ue_count", "new", "new_TOTAL_ERR_FATAL", "new_TOTAL_ERR_NONFATAL", "xid")
"""NodeEvent attributes that carry the count a fatal event's reason shows as its value."""


def event_input(
    event: NodeEvent, record: NodeRecord | None, received_ts: float
) -> NodeInput | None:
    """A fatal NodeEvent as a fatal assessment of its node; None for other kinds.

    It keeps the record's ``seq`` and uses the event's time as the batch time, so the
    lifecycle takes it in once (a redelivery, or an event older than the last batch taken
    in, is a replay) and the next batch (a higher ``seq``) is taken in as usual.
    """
    if not is_fatal_event(event):
        return None
    what = f"{event.kind} on {event.device}" if event.device else event.kind
    counts = [event.attributes.get(k) for k in EVENT_VALUE_KEYS]
    value = next((c for c in counts if isinstance(c, int | float)), event.device or None)
    reason = Reason(
        signal=f"event.{event.kind}",
        value=value,
        threshold=1 if isinstance(value, int | float) else None,
        rule=event.kind,
        message=event.message or f"{what} reported by {event.source or 'the agent'}",
    )
    obs = Observation(
        ts=received_ts,
        seq=record.last_seq if record else 0,
        sent_ts=event.ts,
        score=FATAL_EVENT_SCORE,
        grade="FAILING",
        fatal=True,
        reasons=(reason,),
    )
    return NodeInput(event.node, obs, f"e{event.event_id}")


def steady(record: NodeRecord | None, item: NodeInput) -> NodeRecord | None:
    """The record after ``item`` when it only continues a steady healthy node (same score
    and reasons, same rack, nothing pending), else None and the full round decides.

    Then :func:`decide` would change nothing but the record's liveness fields and
    announce nothing (tests/unit/test_decide_steady.py holds it to that), so the region
    controller skips the round. The cluster's rail state is not pruned here; the rail
    prunes its window on every use.
    """
    obs = item.obs
    if (
        not _settled(record)
        or obs.grade != "HEALTHY"
        or obs.fatal
        or obs.running_jobs is not None
        or obs.seq <= record.last_seq
        or obs.score != record.score
        or obs.reasons != record.reasons
        or (item.rack is not None and item.rack != record.rack)
        or (obs.dma_posture is not None and obs.dma_posture != record.dma_posture)
        or (obs.dma_posture is not None and obs.dma_reasons != record.dma_reasons)
    ):
        return None
    return _seen(record, obs.ts, obs.sent_ts, obs.seq, obs.interval_s)


def steady_batch(
    record: NodeRecord | None,
    batch: TelemetryBatch,
    assessment: Assessment,
    received_ts: float,
    rack: str | None = None,
) -> NodeRecord | None:
    """``steady(record, batch_input(batch, assessment, received_ts, rack))`` without
    building the input (most batches take this path; tests/unit/test_decide_steady.py
    holds the two equal)."""
    if (
        not _settled(record)
        or assessment.grade != "HEALTHY"
        or assessment.fatal
        or batch.seq <= record.last_seq
        or assessment.score != record.score
        or (rack is not None and rack != record.rack)
        or _dma_changed(record, batch)
    ):
        return None
    findings = assessment.findings
    reasons = record.reasons
    if len(findings) != len(reasons) or any(
        f.reason != r for f, r in zip(findings, reasons, strict=True)
    ):
        return None
    return _seen(record, received_ts, batch.ts, batch.seq, batch.interval_s)


def _dma_changed(record: NodeRecord, batch: TelemetryBatch) -> bool:
    """Whether the batch reports another DMA isolation posture (or reasons) than the
    record holds: a round takes it in."""
    posture = batch.iommu
    return posture is not None and (
        posture.posture != record.dma_posture or posture.reasons != record.dma_reasons
    )


def batch_step(
    record: NodeRecord | None,
    batch: TelemetryBatch,
    assessment: Assessment,
    received_ts: float,
    rack: str | None = None,
) -> NodeRecord | NodeInput:
    """What a scored batch does to its node: the record after it when it only continues
    a steady healthy node (:func:`steady_batch`: no round), else the input of the round
    that decides it (:func:`batch_input`). The region controller and the fleet twin both
    take a batch in through this."""
    after = steady_batch(record, batch, assessment, received_ts, rack)
    return after if after is not None else batch_input(batch, assessment, received_ts, rack)


def changed_counts(
    records: Mapping[str, NodeRecord], counts: Mapping[str, int], region: str | None = None
) -> dict[str, int]:
    """The job manager's report: each known node (of ``region``, when given) whose
    recorded count of unfinished job members differs from ``counts`` (a node missing
    from ``counts`` has none), for :func:`decide_running`."""
    return {
        handle: counts.get(handle, 0)
        for handle, record in records.items()
        if (region is None or record.node.region == region)
        and record.running_jobs != counts.get(handle, 0)
    }


def _settled(record: NodeRecord | None) -> TypeGuard[NodeRecord]:
    """A HEALTHY record seen before with nothing pending: not cordoned, in maintenance,
    held, flagged by the rail or unreachable, no clean cycles counted, no isolations."""
    return (
        record is not None
        and record.grade == "HEALTHY"
        and not (
            record.cordoned
            or record.maintenance
            or record.held
            or record.rail_flagged
            or record.unreachable_from is not None
            or record.clean_cycles
            or record.isolations
            or record.last_seen_ts is None
        )
    )


def _seen(
    record: NodeRecord, ts: float, sent_ts: float | None, seq: int, interval_s: float
) -> NodeRecord:
    """``record`` with only its liveness moved on to a message of ``ts``."""
    return replace(
        record,
        last_seen_ts=ts,
        last_sent_ts=sent_ts,
        last_seq=seq,
        interval_s=interval_s or record.interval_s,
        updated_ts=ts,
    )


def decide(
    records: Mapping[str, NodeRecord],
    rails: Mapping[ClusterKey, RailState],
    inputs: Sequence[NodeInput],
    now: float,
    cfg: LifecycleConfig,
    cluster_sizes: Mapping[ClusterKey, int] | None = None,
) -> Outcome:
    """Observe each input (at most one per node), then settle each cluster's rail.

    A cluster's size for the rail is ``cluster_sizes`` (the nodes known in it; counted
    from ``records`` when not given), plus the round's nodes not yet in ``records``.
    """
    handles = [i.node.handle for i in inputs]
    if len(set(handles)) != len(handles):
        raise ValueError("decide takes at most one input per node per round")
    by_cluster: dict[ClusterKey, list[tuple[NodeInput, NodeRecord, Transition]]] = {}
    for item, handle in zip(inputs, handles, strict=True):
        record = records.get(handle) or NodeRecord(node=item.node)
        key = (item.node.region, item.node.cluster)
        placed = _in_rack(record, item.rack)
        by_cluster.setdefault(key, []).append((item, record, observe(placed, item.obs, cfg)))
    changed: dict[str, NodeRecord] = {}
    new_rails: dict[ClusterKey, RailState] = {}
    events: list[ControllerEvent] = []
    for key, round_ in by_cluster.items():
        region, cluster = key
        if cluster_sizes is None:
            known = sum(1 for r in records.values() if (r.node.region, r.node.cluster) == key)
        else:
            known = cluster_sizes.get(key, 0)
        size = known + sum(1 for item, _, _ in round_ if item.node.handle not in records)
        state = rails.get((region, cluster)) or RailState(region=region, cluster=cluster)
        result = apply_rail(state, size, [t for _, _, t in round_], now, cfg)
        for (item, before, _), settled in zip(round_, result.transitions, strict=True):
            if settled.record != before:
                changed[item.node.handle] = settled.record
            decisions = _with_flag_change(before, settled, now)
            events += _events(decisions, item.node.handle, item.tag)
        if result.state != state:
            new_rails[(region, cluster)] = result.state
        if result.alerts:
            round_tag = _digest(sorted(f"{i.node.handle}:{i.tag}" for i, _, _ in round_))
            events += _events(result.alerts, f"{region}.{cluster}", round_tag)
    return Outcome(changed, new_rails, tuple(events))


def decide_silence(
    records: Mapping[str, NodeRecord],
    now: float,
    cfg: LifecycleConfig,
    *,
    watching_since: float | None = None,
    bmc_power_on: Mapping[str, bool] | None = None,
    bmc_health: Mapping[str, str] | None = None,
    stalls: Sequence[Span] = (),
) -> Outcome:
    """Mark every silent in-service node UNREACHABLE, with its BMC's latest word on its
    power and health (by handle) where there is one. Silence is receiving time only:
    ``stalls`` (the controller's own stalled intake, :mod:`controller.core.receiving`)
    do not count.

    The event id names the last batch taken in (``s<last seen ms>``): the same silence
    decided again after a restart has the same id.
    """
    power, health = bmc_power_on or {}, bmc_health or {}
    changed: dict[str, NodeRecord] = {}
    events: list[ControllerEvent] = []
    for handle, record in sorted(records.items()):
        t = check_silence(
            record,
            now,
            cfg,
            bmc_power_on=power.get(handle),
            bmc_health=health.get(handle, ""),
            watching_since=watching_since,
            stalls=stalls,
        )
        if t.record != record:
            changed[handle] = t.record
            decisions = _with_flag_change(record, t, now)
            events += _events(decisions, handle, f"s{_ms(record.last_seen_ts or 0.0)}")
    return Outcome(changed, {}, tuple(events))


def decide_operator(
    record: NodeRecord,
    action: OperatorAction,
    reason: str,
    who: str,
    now: float,
    cfg: LifecycleConfig,
) -> Outcome:
    """An operator's action on one node (event ids tagged ``o<now ms>``)."""
    t = operator(record, action, reason, who, now, cfg)
    if t.record == record and not t.decisions:
        return Outcome()
    handle = record.node.handle
    decisions = _with_flag_change(record, t, now, f"operator:{who}")
    return Outcome({handle: t.record}, {}, _events(decisions, handle, f"o{_ms(now)}"))


def _with_flag_change(
    before: NodeRecord, t: Transition, now: float, operator: str | None = None
) -> tuple[Decision, ...]:
    """``t``'s decisions, and ``node.rail_flagged`` first when the rail flag changed
    (``operator``: an operator's action changed it)."""
    flag = rail_flag_change(before, t.record, now, operator)
    return t.decisions if flag is None else (flag, *t.decisions)


def decide_running(
    records: Mapping[str, NodeRecord],
    counts: Mapping[str, int],
    now: float,
    cfg: LifecycleConfig,
    *,
    source: JobSource = "jobs",
    tag: str | None = None,
) -> Outcome:
    """Each node's count of unfinished jobs from one ``source`` (by handle; a node not in
    ``records`` is skipped): the job manager's job members (``jobs``) or the Slurm
    bridge's active Slurm jobs (``slurm``). A SUB_HEALTHY node whose count over both
    sources is then 0 enters MAINTENANCE, "sub-healthy and its last job ended". Event ids
    are tagged ``tag``, by default ``j<now ms>`` (``sj<now ms>`` for Slurm's)."""

    def change(record: NodeRecord, count: int) -> Transition:
        return update_jobs(record, count, now, cfg, source)

    default = f"{'j' if source == 'jobs' else 'sj'}{_ms(now)}"
    return _per_node(records, counts, change, tag or default)


def slurm_job_count(event: NodeEvent) -> int | None:
    """The count of active Slurm jobs a ``slurm_jobs`` NodeEvent carries (its ``running``
    attribute); None for another kind, or a count missing, not an integer or negative."""
    if event.kind != SLURM_JOBS_KIND:
        return None
    value = event.attributes.get("running")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def decide_suspects(
    records: Mapping[str, NodeRecord],
    suspects: Mapping[str, tuple[str, ...]],
    until: float,
    now: float,
    cfg: LifecycleConfig,
) -> Outcome:
    """The job manager's blame: each node (by handle) and the jobs whose failures it is
    blamed for; a HEALTHY one becomes SUB_HEALTHY until ``until`` (event ids tagged
    ``f<now ms>``). A node not in ``records`` is skipped."""
    return _per_node(
        records, suspects, lambda r, jobs: suspect(r, jobs, until, now, cfg), f"f{_ms(now)}"
    )


def decide_stragglers(
    records: Mapping[str, NodeRecord],
    stragglers: Mapping[str, Reason],
    until: float,
    now: float,
    cfg: LifecycleConfig,
) -> Outcome:
    """The job manager's straggler marks: each node (by handle) and its evidence; a
    HEALTHY one becomes SUB_HEALTHY until ``until`` (event ids tagged ``s<now ms>``). A
    node not in ``records`` is skipped."""
    return _per_node(
        records, stragglers, lambda r, why: straggle(r, why, until, now, cfg), f"s{_ms(now)}"
    )


def _per_node(
    records: Mapping[str, NodeRecord],
    inputs: Mapping[str, _T],
    change: Callable[[NodeRecord, _T], Transition],
    tag: str,
) -> Outcome:
    """``change`` applied to each known node's record with its input, in handle order."""
    changed: dict[str, NodeRecord] = {}
    events: list[ControllerEvent] = []
    for handle, value in sorted(inputs.items()):
        record = records.get(handle)
        if record is None:
            continue
        t = change(record, value)
        if t.record != record:
            changed[handle] = t.record
            events += _events(t.decisions, handle, tag)
    return Outcome(changed, {}, tuple(events))


def _in_rack(record: NodeRecord, rack: str | None) -> NodeRecord:
    """The record in ``rack`` (None: where it is)."""
    return record if rack is None or rack == record.rack else replace(record, rack=rack)


def event_id(subject: str, kind: str, tag: str) -> str:
    """``<node handle or region.cluster>:<kind>:<input tag>``."""
    return f"{subject}:{kind}:{tag}"


def _events(decisions: Sequence[Decision], subject: str, tag: str) -> tuple[ControllerEvent, ...]:
    return tuple(to_event(d, event_id(subject, d.kind, tag)) for d in decisions)


def _ms(ts: float) -> int:
    return round(ts * 1000)


def _digest(parts: Sequence[str]) -> str:
    return "r" + hashlib.sha1("\n".join(parts).encode(), usedforsecurity=False).hexdigest()[:16]
