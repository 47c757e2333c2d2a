"""Ingest settings, and the names and filters derived from them (docs/ingest.md)."""

from __future__ import annotations

import gc
import zlib
from dataclasses import dataclass
from enum import Enum
from typing import Final

from metalguard.proto.base import node_handle
from metalguard.proto.subjects import Subjects, check_token


@dataclass(frozen=True, slots=True)
class IngestSettings:
    """How ingest consumes one region (docs/ingest.md)."""

    region: str
    durable_prefix: str = "mg-controller"
    clusters: tuple[str, ...] = ()
    """Clusters this process owns (consumer filter subjects); empty means all."""
    shard: tuple[int, int] | None = None
    """``(index, count)``: handle only nodes with crc32(region.cluster.node) % count == index."""
    fetch_batch: int = 256
    """Messages asked for per pull request."""
    fetch_timeout_s: float = 1.0
    """How long one pull waits for messages (also bounds how long stop() waits for it)."""
    max_ack_pending: int = 4096
    """Consumer limit on delivered, unacknowledged messages: the end of the backpressure."""
    ack_wait_s: float = 30.0
    """Redelivery timeout; must exceed the time a message can wait in a node's queue."""
    retry_delay_s: float = 2.0
    """Redelivery delay after a handler error or a failed dead-letter publish."""
    node_queue_size: int = 64
    """Messages queued per node; a full queue makes the fetch loop wait."""
    max_concurrent_nodes: int = 256
    """Nodes whose handler calls may run at the same moment."""
    stop_timeout_s: float = 10.0
    """How long stop() lets queued work finish before cancelling it."""
    log_interval_s: float = 60.0
    """At most one log line per sender per interval (decode and handler errors)."""

    def __post_init__(self) -> None:
        check_token(self.region, "region")
        check_token(self.durable_prefix, "durable_prefix")
        for c in self.clusters:
            check_token(c, "cluster")
        if len(set(self.clusters)) != len(self.clusters):
            raise ValueError(f"clusters {self.clusters} repeat a cluster")
        if self.shard is not None:
            index, count = self.shard
            if count < 1 or not 0 <= index < count:
                raise ValueError(f"shard {self.shard} must be (index, count), 0 <= index < count")
        for name in ("fetch_batch", "max_ack_pending", "node_queue_size", "max_concurrent_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def owns(self, region: str, cluster: str, node: str) -> bool:
        """Whether this process handles the node (its clusters and its hash shard)."""
        if region != self.region or (self.clusters and cluster not in self.clusters):
            return False
        return self.shard is None or (
            shard_of(node_handle(region, cluster, node), self.shard[1]) == self.shard[0]
        )


GC_THRESHOLDS: Final = (50_000, 20, 10)
"""The controller's garbage-collector thresholds (:func:`tune_gc`)."""


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Set up the garbage collector for a controller process, once its state is loaded.

    Collects, then freezes what is alive (the loaded KV state: never garbage, so full
    collections need not walk it) and raises the thresholds: with CPython's default
    (700, 10, 10) a controller taking in thousands of batches a second spent ~18 % of its
    CPU in collections, most of them walking per-node history that is alive by design
    (docs/benchmarks.md). Reference counting still frees everything that is not in a
    cycle at once; cycles wait for the next young collection (every 50,000 net
    allocations, a fraction of a second at full load).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


class StreamKind(Enum):
    """The two streams ingest consumes."""

    TELEMETRY = "tel"
    EVENTS = "evt"


def shard_of(key: str, count: int) -> int:
    """The hash shard (0..count-1) that owns a node key; stable across processes."""
    return zlib.crc32(key.encode()) % count


def durable_name(settings: IngestSettings, kind: StreamKind) -> str:
    """Consumer name: one per prefix, region, stream, cluster set and shard."""
    name = f"{settings.durable_prefix}-{settings.region}-{kind.value}"
    if settings.clusters:
        name += f"-c{zlib.crc32(','.join(sorted(settings.clusters)).encode()):08x}"
    if settings.shard is not None:
        name += f"-s{settings.shard[0]}of{settings.shard[1]}"
    return name


def filter_subjects(subjects: Subjects, settings: IngestSettings, kind: StreamKind) -> list[str]:
    """The consumer's filter subjects: the region, or each owned cluster of it."""
    clusters = sorted(settings.clusters) or ["*"]
    wildcard = [f"{subjects.prefix}.{kind.value}.{settings.region}.{c}.>" for c in clusters]
    return (
        wildcard if settings.clusters else [f"{subjects.prefix}.{kind.value}.{settings.region}.>"]
    )
