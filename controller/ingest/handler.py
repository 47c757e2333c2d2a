"""What ingest hands decoded messages to (the region controller implements it)."""

from __future__ import annotations

from typing import Protocol

from metalguard.proto.events import NodeEvent
from metalguard.proto.telemetry import TelemetryBatch


class IngestHandler(Protocol):
    """Receives decoded messages in per-node order; the message is acknowledged after
    the call returns, so a handler must be idempotent (a redelivery repeats a call).

    A handler may also have ``on_batch_now(batch, received_ts)``: ``on_batch`` up to its
    first I/O, synchronous, returning None when that was all or a callable whose awaitable
    finishes the batch. Ingest then calls it from the fetch loop for a node with nothing
    queued (no task switch per batch), acknowledges at once when it returns None, and
    otherwise queues the rest in the node's lane ahead of its later messages; a raise, or
    a raise of the rest, is a handler error as from ``on_batch``.

    And ``on_intake(pending)``: evidence that ingest's intake is live now, with the
    telemetry consumer's pending count (None: not known); see controller/ingest/consumer.py.
    """

    async def on_batch(self, batch: TelemetryBatch, received_ts: float) -> None:
        """A TelemetryBatch from ``<p>.tel.<region>.<cluster>.<node>``."""
        ...

    async def on_node_event(self, event: NodeEvent, received_ts: float) -> None:
        """A NodeEvent from ``<p>.evt.<region>.<cluster>.<node>.<kind>``."""
        ...
