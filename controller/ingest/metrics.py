"""Ingest's counters: Prometheus metrics on a registry of its own, a plain snapshot for
tests and the status API, and the per-sender log rate limiter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


@dataclass(slots=True)
class StreamStats:
    """What happened to one stream's messages since the Ingest was created."""

    ingested: int = 0
    """Handled and acknowledged."""
    decode_errors: int = 0
    """Dead-lettered and acknowledged (undecodable, wrong type, bad subject)."""
    dead_letter_failures: int = 0
    """Dead-letter publishes that failed; the original was nak'ed for a retry."""
    handler_errors: int = 0
    """Handler calls that raised; the message was nak'ed for redelivery."""
    skipped: int = 0
    """Acknowledged without handling: the node belongs to another shard."""
    backpressure_waits: int = 0
    """Times the fetch loop waited for room in a node's full queue."""
    lag: int = 0
    """Messages still pending on the consumer (from the last fetched message)."""


@dataclass(slots=True)
class IngestStats:
    """A snapshot of :class:`IngestMetrics` (copies; safe to keep)."""

    streams: dict[str, StreamStats] = field(default_factory=dict)
    active_nodes: int = 0
    """Nodes with a live worker (messages queued or being handled)."""

    def total(self, name: str) -> int:
        """Sum of one StreamStats field over the streams."""
        return sum(int(getattr(s, name)) for s in self.streams.values())


class IngestMetrics:
    """Prometheus metrics (label ``stream`` = stream name) plus the same counts as ints."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ingested = Counter(
            "metalguard_ingest_messages_total", "Messages handled and acked", ["stream"], registry=r
        )
        self.decode_errors = Counter(
            "metalguard_ingest_decode_errors_total",
            "Undecodable messages dead-lettered and acked",
            ["stream"],
            registry=r,
        )
        self.dead_letter_failures = Counter(
            "metalguard_ingest_dead_letter_failures_total",
            "Dead-letter publishes that failed (original nak'ed)",
            ["stream"],
            registry=r,
        )
        self.handler_errors = Counter(
            "metalguard_ingest_handler_errors_total",
            "Handler calls that raised (message nak'ed)",
            ["stream"],
            registry=r,
        )
        self.skipped = Counter(
            "metalguard_ingest_skipped_total",
            "Messages of another shard's nodes, acked unhandled",
            ["stream"],
            registry=r,
        )
        self.backpressure = Counter(
            "metalguard_ingest_backpressure_waits_total",
            "Fetch loop waits on a full per-node queue",
            ["stream"],
            registry=r,
        )
        self.lag = Gauge(
            "metalguard_ingest_lag_messages",
            "Messages pending on the consumer",
            ["stream"],
            registry=r,
        )
        self.latency = Histogram(
            "metalguard_ingest_handle_seconds",
            "Handler call duration",
            ["stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.active_nodes = Gauge(
            "metalguard_ingest_active_nodes", "Nodes with a live worker", registry=r
        )
        self._stats: dict[str, StreamStats] = {}
        self._children: dict[tuple[str, str], Any] = {}
        """Labelled metrics by (metric, stream): ``labels()`` costs more than the update."""

    def stream(self, stream: str) -> StreamStats:
        """The live counts of one stream (created on first use)."""
        return self._stats.setdefault(stream, StreamStats())

    def count(self, stream: str, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (a StreamStats field) of ``stream``."""
        s = self.stream(stream)
        setattr(s, name, getattr(s, name) + n)
        child = self._children.get((name, stream))
        if child is None:
            metric: Counter = getattr(
                self, "backpressure" if name == "backpressure_waits" else name
            )
            child = self._children[(name, stream)] = metric.labels(stream=stream)
        child.inc(n)

    def observe_latency(self, stream: str, seconds: float) -> None:
        """One handler call of ``stream`` took ``seconds``."""
        child = self._children.get(("latency", stream))
        if child is None:
            child = self._children[("latency", stream)] = self.latency.labels(stream=stream)
        child.observe(seconds)

    def set_lag(self, stream: str, pending: int) -> None:
        """Record the consumer's pending count."""
        self.stream(stream).lag = pending
        self.lag.labels(stream=stream).set(pending)

    def snapshot(self, active_nodes: int) -> IngestStats:
        """Copies of the current counts."""
        self.active_nodes.set(active_nodes)
        streams = {name: StreamStats(**_fields(s)) for name, s in self._stats.items()}
        return IngestStats(streams=streams, active_nodes=active_nodes)


def _fields(s: StreamStats) -> dict[str, int]:
    return {name: getattr(s, name) for name in StreamStats.__slots__}


class RateLimiter:
    """Allows one event per key per ``interval_s``; counts what it suppresses.

    Keys are senders (``region.cluster.node`` or ``unknown``); when more than
    ``max_keys`` are remembered, keys whose interval has passed are forgotten.
    """

    def __init__(
        self, interval_s: float, clock: Callable[[], float], max_keys: int = 10_000
    ) -> None:
        self._interval = interval_s
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        """None if suppressed; otherwise how many were suppressed since the last allow."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        if len(self._last) >= self._max_keys:
            self._prune(now)
        self._last[key] = now
        return self._suppressed.pop(key, 0)

    def _prune(self, now: float) -> None:
        stale = [k for k, t in self._last.items() if now - t >= self._interval]
        for k in stale:
            del self._last[k]
            self._suppressed.pop(k, None)
