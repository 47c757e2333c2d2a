"""The per-cluster congestion view (controller/core/congestion.py): rates from the deltas
of successive batches, a node that stops reporting, counter resets, bounded memory."""

from __future__ import annotations

import pytest

from metalguard.controller.core.congestion import (
    MAX_COUNTERS,
    TOP_NODES,
    CongestionTracker,
    rates,
)
from metalguard.proto.base import NodeIdentity
from metalguard.proto.telemetry import NetInterface, QosInterfaceStatus, RdmaPort, TelemetryBatch
from tests.support.clock import T0

INTERVAL = 10.0


def batch(
    node: str,
    seq: int,
    *,
    rx: int | None = None,
    tx: int | None = None,
    wait: int | None = None,
    cluster: str = "c1",
    saturated: bool = False,
    qos: tuple[QosInterfaceStatus, ...] = (),
) -> TelemetryBatch:
    """A batch of ``r1.<cluster>.<node>`` at ``T0 + seq * INTERVAL`` with one interface's
    pause counters and one RDMA port's ``port_xmit_wait``."""
    net = (NetInterface(name="eth2", rx_pause=rx, tx_pause=tx),)
    rdma: tuple[RdmaPort, ...] = ()
    if wait is not None:
        rdma = (
            RdmaPort(
                device="mlx5_0",
                port=1,
                counters={"port_xmit_wait": wait},
                saturated=("port_xmit_wait",) if saturated else (),
            ),
        )
    return TelemetryBatch(
        node=NodeIdentity(region="r1", cluster=cluster, node=node),
        seq=seq,
        ts=T0 + seq * INTERVAL,
        interval_s=INTERVAL,
        net=net,
        rdma=rdma,
        qos=qos,
    )


def feed(tracker: CongestionTracker, *batches: TelemetryBatch) -> None:
    for b in batches:
        tracker.observe(b, b.ts + 0.5)


def test_rates_are_deltas_over_the_batch_interval() -> None:
    tracker = CongestionTracker()
    feed(tracker, batch("n1", 1, rx=100, tx=0, wait=1000))
    (first,) = tracker.view(T0 + 11).clusters
    assert first.nodes_reporting == 0, "one sample gives no rate"
    assert first.top == ()
    feed(tracker, batch("n1", 2, rx=600, tx=100, wait=6000))
    (c1,) = tracker.view(T0 + 21).clusters
    assert (c1.region, c1.cluster, c1.nodes_reporting) == ("r1", "c1", 1)
    assert (c1.rx_pause_per_s, c1.tx_pause_per_s) == (50.0, 10.0)
    assert c1.pause_per_s == 60.0
    assert c1.xmit_wait_per_s == 500.0
    (n1,) = c1.top
    assert (n1.handle, n1.node, n1.share) == ("r1.c1.n1", "n1", 1.0)
    assert (n1.pause_per_s, n1.xmit_wait_per_s) == (60.0, 500.0)


def test_a_cluster_sums_its_nodes_and_ranks_them_by_share() -> None:
    tracker = CongestionTracker()
    feed(
        tracker,
        batch("n1", 1, rx=0, wait=0),
        batch("n2", 1, rx=0, wait=0),
        batch("n3", 1, rx=0, wait=0),
        batch("m1", 1, rx=0, cluster="c2"),
    )
    feed(
        tracker,
        batch("n1", 2, rx=100, wait=0),  # 10 pause/s: 1/3 of the cluster's pauses
        batch("n2", 2, rx=200, wait=900),  # 2/3 of the pauses, all the waits
        batch("n3", 2, rx=0, wait=0),  # quiet: reporting, not in the top
        batch("m1", 2, rx=50, cluster="c2"),
    )
    c1, c2 = tracker.view(T0 + 21).clusters
    assert (c1.cluster, c1.nodes_reporting, c1.rx_pause_per_s, c1.xmit_wait_per_s) == (
        "c1",
        3,
        30.0,
        90.0,
    )
    assert [(n.node, round(n.share, 3)) for n in c1.top] == [("n2", 1.0), ("n1", 0.333)]
    assert (c2.cluster, c2.rx_pause_per_s, c2.xmit_wait_per_s) == ("c2", 5.0, 0.0)
    assert c2.top[0].xmit_wait_per_s is None, "no RDMA port: no transmit-wait rate"


def test_the_top_is_bounded() -> None:
    tracker = CongestionTracker()
    names = [f"n{i}" for i in range(TOP_NODES + 3)]
    feed(tracker, *(batch(n, 1, rx=0) for n in names))
    feed(tracker, *(batch(n, 2, rx=10 * (i + 1)) for i, n in enumerate(names)))
    (c1,) = tracker.view(T0 + 21).clusters
    assert c1.nodes_reporting == len(names)
    assert [n.node for n in c1.top] == list(reversed(names))[:TOP_NODES]


def test_a_node_that_stops_reporting_leaves_the_sums_then_the_memory() -> None:
    tracker = CongestionTracker(stale_after_s=30.0, forget_after_s=120.0)
    feed(tracker, batch("n1", 1, rx=0), batch("n2", 1, rx=0))
    feed(tracker, batch("n1", 2, rx=100), batch("n2", 2, rx=300))
    feed(tracker, batch("n2", 3, rx=600), batch("n2", 4, rx=900))  # n1 went silent
    (c1,) = tracker.view(T0 + 41).clusters
    assert (c1.nodes_reporting, c1.rx_pause_per_s) == (2, 40.0), "n1 heard 20.5 s ago"
    (c1,) = tracker.view(T0 + 51).clusters
    assert (c1.nodes_reporting, c1.rx_pause_per_s) == (1, 30.0), "n1 stale: left out"
    assert [n.node for n in c1.top] == ["n2"]
    assert len(tracker) == 2
    tracker.prune(T0 + 20.5 + 121)
    assert len(tracker) == 1, "n1 forgotten"
    assert tracker.view(T0 + 400).clusters == (), "nobody heard for too long"


def test_a_counter_reset_counts_nothing_for_that_interval() -> None:
    tracker = CongestionTracker()
    feed(tracker, batch("n1", 1, rx=5000, tx=100, wait=10**6))
    feed(tracker, batch("n1", 2, rx=20, tx=200, wait=10))  # rx and xmit_wait reset
    (c1,) = tracker.view(T0 + 21).clusters
    assert (c1.rx_pause_per_s, c1.tx_pause_per_s, c1.xmit_wait_per_s) == (0.0, 10.0, 0.0)
    feed(tracker, batch("n1", 3, rx=120, tx=200, wait=510))  # from the new base
    (c1,) = tracker.view(T0 + 31).clusters
    assert (c1.rx_pause_per_s, c1.xmit_wait_per_s) == (10.0, 50.0)


def test_rates_of_two_samples() -> None:
    before = {"rx_pause:eth2": 10, "rx_pause:eth3": 7, "port_xmit_wait:mlx5_0/1": 5}
    after = {"rx_pause:eth2": 30, "rx_pause:eth3": 2, "tx_pause:eth2": 9}
    assert rates(before, after, 2.0) == ((10.0, None, None), 1)


def test_a_saturated_xmit_wait_is_not_a_rate() -> None:
    tracker = CongestionTracker()
    feed(tracker, batch("n1", 1, wait=2**32 - 1, saturated=True))
    feed(tracker, batch("n1", 2, wait=2**32 - 1, saturated=True))
    (c1,) = tracker.view(T0 + 21).clusters
    assert c1.nodes_reporting == 0


def test_a_redelivered_or_earlier_batch_gives_no_rate() -> None:
    tracker = CongestionTracker()
    feed(tracker, batch("n1", 2, rx=0))
    feed(tracker, batch("n1", 3, rx=100))
    feed(tracker, batch("n1", 3, rx=100))  # the same cycle again
    (c1,) = tracker.view(T0 + 31).clusters
    assert c1.rx_pause_per_s == 10.0
    feed(tracker, batch("n1", 1, rx=100))  # the agent's clock went back: a new baseline
    (c1,) = tracker.view(T0 + 31).clusters
    assert c1.nodes_reporting == 0


def test_degraded_nodes_come_from_the_newest_batch() -> None:
    degraded = QosInterfaceStatus(
        interface="eth2", version=3, status="degraded", reasons=("np_cnp_sent +0",)
    )
    applied = QosInterfaceStatus(interface="eth3", version=3, status="applied")
    tracker = CongestionTracker()
    feed(tracker, batch("n1", 1, qos=(degraded, applied)), batch("n2", 1, qos=(applied,)))
    (c1,) = tracker.view(T0 + 11).clusters
    (node,) = c1.degraded
    assert (node.handle, node.interfaces) == ("r1.c1.n1", (degraded,))
    feed(tracker, batch("n1", 2, qos=(applied,)))
    assert tracker.view(T0 + 21).clusters[0].degraded == ()


def test_out_of_band_batches_are_not_the_nodes_counters() -> None:
    tracker = CongestionTracker()
    oob = TelemetryBatch(
        node=NodeIdentity(region="r1", cluster="c1", node="n1"), seq=1, ts=T0, out_of_band=True
    )
    tracker.observe(oob, T0)
    assert len(tracker) == 0


@pytest.mark.parametrize("interfaces", [10, MAX_COUNTERS + 50])
def test_memory_per_node_is_bounded(interfaces: int) -> None:
    net = tuple(NetInterface(name=f"veth{i}", rx_pause=i, tx_pause=i) for i in range(interfaces))
    b = TelemetryBatch(
        node=NodeIdentity(region="r1", cluster="c1", node="n1"), seq=1, ts=T0, net=net
    )
    tracker = CongestionTracker()
    tracker.observe(b, T0)
    (node,) = tracker._nodes.values()
    assert len(node.sample) == min(2 * interfaces, MAX_COUNTERS)
