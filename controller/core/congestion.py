"""The fleet's congestion per cluster: pause frames and RDMA ``port_xmit_wait`` growth
(docs/qos.md, "Congestion per cluster"; served on ``GET /v1/qos``).

Pause frames (PFC) and transmit waits are how a lossless fabric copes with congestion:
they are the fabric's state, never a node's fault by themselves, so this view is kept
beside the score, not in it.  :class:`CongestionTracker` keeps, per node, the last
sample of its counters (``NetInterface.rx_pause``/``tx_pause`` of every interface,
``RdmaPort.counters["port_xmit_wait"]`` of every port) and the rates of its last
interval; a cluster's rates are the sums over its nodes heard lately.  Memory is one
sample per node, and a node unheard for ``forget_after_s`` is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Final

from metalguard.proto.telemetry import QosInterfaceStatus, TelemetryBatch

XMIT_WAIT: Final = "port_xmit_wait"
TOP_NODES: Final = 5
"""Nodes listed per cluster, most congested first."""
MAX_COUNTERS: Final = 512
"""Counters kept per node (interfaces x 2 + RDMA ports): a bound, not a fleet's need."""
PRUNE_EVERY_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class NodeRates:
    """One node's congestion over its last interval between two batches."""

    handle: str
    node: str
    rx_pause_per_s: float | None
    """Pause frames received per second, all interfaces (None: no interface counts them)."""
    tx_pause_per_s: float | None
    xmit_wait_per_s: float | None
    """RDMA ``port_xmit_wait`` ticks per second, all ports (None: no port counts them)."""
    received_ts: float
    share: float = 0.0
    """Its largest share of its cluster's pause frames or transmit waits (0-1)."""

    @property
    def pause_per_s(self) -> float | None:
        """Pause frames sent and received per second."""
        if self.rx_pause_per_s is None and self.tx_pause_per_s is None:
            return None
        return (self.rx_pause_per_s or 0.0) + (self.tx_pause_per_s or 0.0)


@dataclass(frozen=True, slots=True)
class DegradedNode:
    """A node whose newest batch has interfaces in QoS status ``degraded``."""

    handle: str
    node: str
    interfaces: tuple[QosInterfaceStatus, ...]


@dataclass(frozen=True, slots=True)
class ClusterRates:
    """One cluster's congestion: sums over its nodes heard within ``stale_after_s``."""

    region: str
    cluster: str
    nodes_reporting: int
    """Nodes heard lately whose counters gave a rate (two samples at least)."""
    rx_pause_per_s: float
    tx_pause_per_s: float
    xmit_wait_per_s: float
    top: tuple[NodeRates, ...]
    """The most congested of them (largest share first), at most TOP_NODES, share > 0."""
    degraded: tuple[DegradedNode, ...]

    @property
    def pause_per_s(self) -> float:
        """Pause frames sent and received per second."""
        return self.rx_pause_per_s + self.tx_pause_per_s


@dataclass(frozen=True, slots=True)
class CongestionView:
    """Every cluster's congestion at ``ts``."""

    ts: float
    stale_after_s: float
    clusters: tuple[ClusterRates, ...]


@dataclass(slots=True)
class _Node:
    region: str
    cluster: str
    node: str
    ts: float
    """The batch time of the sample (the agent's clock: intervals are measured by it)."""
    received_ts: float
    sample: dict[str, int]
    rates: tuple[float | None, float | None, float | None] | None = None
    """(rx pause, tx pause, xmit wait) per second over the last interval."""
    degraded: tuple[QosInterfaceStatus, ...] = ()


@dataclass(slots=True)
class CongestionTracker:
    """Per-node counter samples and rates, per-cluster sums (pure: time comes in)."""

    stale_after_s: float = 60.0
    """A node not heard for this long counts no more in its cluster's rates."""
    forget_after_s: float = 3600.0
    """A node not heard for this long is dropped."""
    _nodes: dict[str, _Node] = field(default_factory=dict)
    _pruned_ts: float = 0.0

    def observe(self, batch: TelemetryBatch, received_ts: float) -> None:
        """Take one in-band batch of a node."""
        if batch.out_of_band:
            return
        handle = batch.node.handle
        sample = dict(_counters(batch))
        degraded = tuple(q for q in batch.qos if q.status == "degraded")
        prev = self._nodes.get(handle)
        if prev is not None and not sample and not prev.sample and batch.ts != prev.ts:
            # No counters now or before (most nodes): what a new _Node would hold, in place.
            prev.ts, prev.received_ts, prev.degraded, prev.rates = (
                batch.ts,
                received_ts,
                degraded,
                None,
            )
            if received_ts - self._pruned_ts >= PRUNE_EVERY_S:
                self.prune(received_ts)
            return
        node = _Node(
            batch.node.region,
            batch.node.cluster,
            batch.node.node,
            batch.ts,
            received_ts,
            sample,
            degraded=degraded,
        )
        if prev is not None:
            dt = batch.ts - prev.ts
            if dt == 0:  # the same cycle again (a redelivery): nothing new
                prev.received_ts, prev.degraded = received_ts, degraded
                return
            if dt > 0:  # else the agent's clock went back: a new baseline
                per_s, _ = rates(prev.sample, sample, dt)
                node.rates = per_s if any(r is not None for r in per_s) else None
        self._nodes[handle] = node
        if received_ts - self._pruned_ts >= PRUNE_EVERY_S:
            self.prune(received_ts)

    def prune(self, now: float) -> None:
        """Drop the nodes not heard for ``forget_after_s``."""
        self._pruned_ts = now
        for handle in [
            h for h, n in self._nodes.items() if now - n.received_ts > self.forget_after_s
        ]:
            del self._nodes[handle]

    def __len__(self) -> int:
        return len(self._nodes)

    def view(self, now: float) -> CongestionView:
        """Every cluster with a node heard within ``forget_after_s``, sorted."""
        by_cluster: dict[tuple[str, str], list[tuple[str, _Node]]] = {}
        for handle, n in sorted(self._nodes.items()):
            if now - n.received_ts <= self.forget_after_s:
                by_cluster.setdefault((n.region, n.cluster), []).append((handle, n))
        clusters = tuple(
            _cluster(region, cluster, members, now, self.stale_after_s)
            for (region, cluster), members in sorted(by_cluster.items())
        )
        return CongestionView(now, self.stale_after_s, clusters)


def _counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """The node's congestion counters by a key of their own (at most MAX_COUNTERS)."""
    count = 0
    for iface in batch.net:
        for kind, value in (("rx_pause", iface.rx_pause), ("tx_pause", iface.tx_pause)):
            if value is not None and count < MAX_COUNTERS:
                count += 1
                yield f"{kind}:{iface.name}", value
    for port in batch.rdma:
        value = port.counters.get(XMIT_WAIT)
        if value is not None and XMIT_WAIT not in port.saturated and count < MAX_COUNTERS:
            count += 1
            yield f"{XMIT_WAIT}:{port.device}/{port.port}", value


def rates(
    before: dict[str, int], after: dict[str, int], dt: float
) -> tuple[tuple[float | None, float | None, float | None], int]:
    """(rx pause, tx pause, xmit wait) per second from two samples ``dt`` seconds apart,
    and how many counters went down (a reset: that counter counts nothing this interval).
    A kind none of whose counters is in both samples is None."""
    sums: dict[str, float] = {}
    resets = 0
    for key, value in after.items():
        old = before.get(key)
        if old is None:
            continue
        kind = key.split(":", 1)[0]
        grown = value - old
        if grown < 0:
            resets += 1
            grown = 0
        sums[kind] = sums.get(kind, 0.0) + grown
    per_s = {kind: total / dt for kind, total in sums.items()}
    return (per_s.get("rx_pause"), per_s.get("tx_pause"), per_s.get(XMIT_WAIT)), resets


def _cluster(
    region: str, cluster: str, members: list[tuple[str, _Node]], now: float, stale_s: float
) -> ClusterRates:
    fresh = [
        NodeRates(h, n.node, *n.rates, received_ts=n.received_ts)
        for h, n in members
        if n.rates is not None and now - n.received_ts <= stale_s
    ]
    rx = sum(r.rx_pause_per_s or 0.0 for r in fresh)
    tx = sum(r.tx_pause_per_s or 0.0 for r in fresh)
    wait = sum(r.xmit_wait_per_s or 0.0 for r in fresh)
    shared = []
    for r in fresh:
        shares = [(r.pause_per_s or 0.0) / (rx + tx) if rx + tx > 0 else 0.0]
        shares.append((r.xmit_wait_per_s or 0.0) / wait if wait > 0 else 0.0)
        share = max(shares)
        if share > 0:
            shared.append(replace(r, share=share))
    shared.sort(key=lambda r: (-r.share, r.handle))
    degraded = tuple(
        DegradedNode(h, n.node, n.degraded)
        for h, n in members
        if n.degraded and now - n.received_ts <= stale_s
    )
    return ClusterRates(
        region=region,
        cluster=cluster,
        nodes_reporting=len(fresh),
        rx_pause_per_s=rx,
        tx_pause_per_s=tx,
        xmit_wait_per_s=wait,
        top=tuple(shared[:TOP_NODES]),
        degraded=degraded,
    )
