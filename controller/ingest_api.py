"""What ingest hands decoded messages to (the region controller implements it)."""

from __future__ import annotations

from typing import Protocol

from proto.events import NodeEvent
from proto.telemetry import TelemetryBatch


class IngestHandler(Protocol):
    """Receives decoded messages in per-node order; the message is acknowledged after
    the call returns, so a handler must be idempotent (a redelivery repeats a call)."""

    async def on_batch(self, batch: TelemetryBatch, received_ts: float) -> None:
        """A TelemetryBatch from ``<p>.tel.<region>.<cluster>.<node>``."""
        ...

    async def on_node_event(self, event: NodeEvent, received_ts: float) -> None:
        """A NodeEvent from ``<p>.evt.<region>.<cluster>.<node>.<kind>``."""
        ...
