"""Assemble a TelemetryBatch from one cycle's readings (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metalguard.agent.collectors.base import BatchField
from metalguard.proto.base import NodeIdentity
from metalguard.proto.telemetry import (
    CollectorError,
    CollectorRun,
    KmsgCounts,
    QosInterfaceStatus,
    TelemetryBatch,
)
from metalguard.proto.topology import NodeTopology


@dataclass(frozen=True, slots=True)
class CycleResult:
    """The readings of one cycle, by batch field, plus this cycle's runs and errors
    (what :class:`metalguard.agent.collection.Collection` hands the batch)."""

    readings: dict[BatchField, tuple[object, ...]]
    runs: tuple[CollectorRun, ...]
    errors: tuple[CollectorError, ...]
    ran: frozenset[str] = field(default_factory=frozenset)


def build_batch(
    node: NodeIdentity,
    seq: int,
    cycle: CycleResult,
    *,
    ts: float,
    started_ts: float | None = None,
    interval_s: float = 0.0,
    spool_dropped: int = 0,
    qos: tuple[QosInterfaceStatus, ...] = (),
    topology: NodeTopology | None = None,
    kmsg: KmsgCounts | None = None,
) -> TelemetryBatch:
    """The batch of one cycle (``qos``: the QoS reconciler's last verdicts; ``topology``:
    the node's ``[node]`` place and capacity; ``kmsg``: the kernel log monitor's counts)."""
    readings: dict[str, Any] = {str(k): v for k, v in cycle.readings.items()}
    postures = readings.pop("iommu", ())  # one posture per node, not a list
    return TelemetryBatch(
        iommu=postures[-1] if postures else None,
        node=node,
        seq=seq,
        ts=ts,
        started_ts=started_ts,
        interval_s=interval_s,
        collectors=cycle.runs,
        errors=cycle.errors,
        spool_dropped=spool_dropped,
        qos=qos,
        topology=topology,
        kmsg=kmsg,
        **readings,
    )
