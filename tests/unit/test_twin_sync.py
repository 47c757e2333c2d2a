"""The twin's synchronisation model (metalguard/twin/sync.py), pure: NCCL's bus bandwidth
relation, ring and tree latency, one leaf against across leaves and clusters,
oversubscription, congestion from other gangs, the QoS priority class's share, the sweep
over a run's placements, the ``blind`` scheduler view and the report's section."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metalguard.twin import report as rep
from metalguard.twin import sync
from metalguard.twin.fleet import fleet_from_count
from tests.support.twin_results import result

NO_LATENCY = sync.Fabric(hop_latency_s=0.0, switch_latency_s=0.0, priority_share=None)
"""Bandwidth terms only: every ratio below is exact."""
FLEET = fleet_from_count(64, rack_nodes=16, racks_per_cluster=2)
"""2 clusters of 2 racks of 16 nodes: leaves r001, r002 in c0001 and c0002."""
WHERE = sync.FabricMap.from_nodes(FLEET)


def rack(cluster: int, rack: int) -> list[str]:
    """The handles on one leaf, in order."""
    return [n.handle for n in FLEET if n.cluster == f"c{cluster:04d}" and n.rack == f"r{rack:03d}"]


def ideal_sync_s(message: float, gpus: int, per_gpu_gbps: float) -> float:
    """The bandwidth term from first principles: 2(n-1)/n of the message at the rate."""
    return 2 * (gpus - 1) / gpus * message / (per_gpu_gbps * 1e9 / 8)


# --- NCCL's relation ---------------------------------------------------------------------


@given(
    ranks=st.integers(min_value=2, max_value=100_000),
    message=st.floats(min_value=1.0, max_value=1e11),
    bandwidth=st.floats(min_value=1e6, max_value=1e12),
    algorithm=st.sampled_from(["ring", "tree", "auto"]),
)
def test_bus_bandwidth_of_the_modelled_time_is_the_link_rate(
    ranks: int, message: float, bandwidth: float, algorithm: sync.Algorithm
) -> None:
    # nccl-tests doc/PERFORMANCE.md: algbw = size / time, busbw = algbw x 2(n-1)/n; an
    # all-reduce limited by its links shows a busbw equal to the bottleneck's speed
    t = sync.allreduce_time(message, ranks, bandwidth, 0.0, algorithm)
    assert sync.bus_bandwidth(message / t, ranks) == pytest.approx(bandwidth, rel=1e-9)


def test_bus_bandwidth_is_nccl_tests_formula() -> None:
    assert sync.bus_bandwidth(100.0, 8) == pytest.approx(100.0 * 2 * 7 / 8)
    assert sync.bus_bandwidth(100.0, 2) == pytest.approx(100.0)
    assert sync.bus_factor(1) == 0.0
    assert sync.allreduce_time(1e9, 1, 1e9, 1e-3) == 0.0


@given(ranks=st.integers(min_value=2, max_value=100_000))
def test_ring_and_tree_latency_steps(ranks: int) -> None:
    latency = 1e-5
    ring = sync.allreduce_time(0.0, ranks, 1.0, latency, "ring")
    tree = sync.allreduce_time(0.0, ranks, 1.0, latency, "tree")
    assert ring == pytest.approx(2 * (ranks - 1) * latency)
    assert tree == pytest.approx(2 * math.ceil(math.log2(ranks)) * latency)
    assert sync.allreduce_time(0.0, ranks, 1.0, latency, "auto") == min(ring, tree)


def test_overlap_hides_at_most_its_share_of_the_compute() -> None:
    assert sync.step_time(1.0, 0.3) == pytest.approx(1.3)
    assert sync.step_time(1.0, 0.3, overlap=0.2) == pytest.approx(1.1)
    assert sync.step_time(1.0, 0.3, overlap=0.5) == pytest.approx(1.0)


# --- one leaf, across leaves and clusters ------------------------------------------------


def alone(nodes: list[str], fabric: sync.Fabric = NO_LATENCY) -> tuple[float, sync.Bound]:
    """A gang's per-node bandwidth with no other gang on the fabric."""
    layout = sync.layout_of(nodes, WHERE)
    loads = sync.Loads()
    loads.add(layout, priority=False)
    return sync.gang_bandwidth(layout, False, loads, WHERE, fabric)


def test_one_leaf_is_nic_bound() -> None:
    layout = sync.layout_of(rack(1, 1), WHERE)
    assert layout.spread == "one_leaf"
    assert alone(rack(1, 1)) == (NO_LATENCY.node_gbps, "nic")
    fabric, step = NO_LATENCY, sync.STEP
    expected = ideal_sync_s(step.message_bytes, 128, fabric.rail_gbps)
    assert sync.one_leaf_sync_s(128, 16, fabric, step) == pytest.approx(expected)


@given(oversubscription=st.floats(min_value=0.5, max_value=16.0))
def test_oversubscription_slows_a_gang_across_two_full_leaves(oversubscription: float) -> None:
    fabric = replace(NO_LATENCY, leaf_oversubscription=oversubscription)
    gbps, bound = alone(rack(1, 1) + rack(1, 2), fabric)
    # 16 nodes of one gang cross each leaf's uplinks: 16 NICs / oversubscription
    assert gbps == pytest.approx(min(fabric.node_gbps, fabric.node_gbps / oversubscription))
    assert bound == ("leaf_uplink" if oversubscription > 1 else "nic")
    one_leaf = sync.one_leaf_sync_s(256, 32, fabric)
    across = sync.gang_sync_s(256, 32, gbps, 0.0, fabric)
    assert across / one_leaf == pytest.approx(max(1.0, oversubscription))


def test_a_few_nodes_per_leaf_stay_within_the_uplinks() -> None:
    # 4 + 4 nodes: 4 flows on uplinks built for 16 NICs / 2
    assert alone(rack(1, 1)[:4] + rack(1, 2)[:4]) == (NO_LATENCY.node_gbps, "nic")


def test_across_clusters_the_core_is_the_bottleneck() -> None:
    nodes = rack(1, 1) + rack(2, 1)
    layout = sync.layout_of(nodes, WHERE)
    assert layout.spread == "clusters"
    gbps, bound = alone(nodes)
    # each cluster: 32 nodes' NICs / 2 (leaf) / 7 (spine) over this gang's 16 flows
    core = 32 * NO_LATENCY.node_gbps / 2 / 7
    assert gbps == pytest.approx(core / 16)
    assert bound == "spine_uplink"
    assert gbps < alone(rack(1, 1) + rack(1, 2))[0] < alone(rack(1, 1))[0]


def test_latency_grows_with_the_switches_crossed() -> None:
    fabric = sync.FABRIC
    one = sync.step_latency_s(sync.layout_of(rack(1, 1), WHERE), fabric)
    leaves = sync.step_latency_s(sync.layout_of(rack(1, 1) + rack(1, 2), WHERE), fabric)
    clusters = sync.step_latency_s(sync.layout_of(rack(1, 1) + rack(2, 1), WHERE), fabric)
    assert one == fabric.hop_latency_s
    assert one < leaves < clusters


# --- congestion and the priority class -----------------------------------------------------


def test_other_gangs_on_the_same_uplinks_share_them() -> None:
    a = rack(1, 1)[:8] + rack(1, 2)[:8]
    b = rack(1, 1)[8:] + rack(1, 2)[8:]
    alone_gbps, _ = alone(a)
    layouts = [sync.layout_of(g, WHERE) for g in (a, b)]
    loads = sync.Loads()
    for layout in layouts:
        loads.add(layout, priority=False)
    shared, bound = sync.gang_bandwidth(layouts[0], False, loads, WHERE, NO_LATENCY)
    assert alone_gbps == NO_LATENCY.node_gbps  # 8 flows on uplinks for 8 NICs
    assert shared == pytest.approx(NO_LATENCY.node_gbps / 2)  # 16 flows on them
    assert bound == "leaf_uplink"
    loads.add(layouts[1], priority=False, sign=-1)
    assert sync.gang_bandwidth(layouts[0], False, loads, WHERE, NO_LATENCY)[0] == alone_gbps


def test_a_gang_on_one_leaf_neither_loads_nor_feels_the_uplinks() -> None:
    loads = sync.Loads()
    loads.add(sync.layout_of(rack(1, 1), WHERE), priority=False)
    assert loads.leaves == {}
    assert loads.clusters == {}


@given(
    capacity=st.floats(min_value=1.0, max_value=1e5),
    high=st.integers(min_value=1, max_value=64),
    low=st.integers(min_value=1, max_value=64),
    share=st.floats(min_value=0.05, max_value=0.95),
    cap=st.floats(min_value=1.0, max_value=1e4),
)
def test_the_priority_class_keeps_its_guaranteed_share(
    capacity: float, high: int, low: int, share: float, cap: float
) -> None:
    hi = sync.link_share(capacity, high, low, priority=True, flow_cap=cap, priority_share=share)
    lo = sync.link_share(capacity, high, low, priority=False, flow_cap=cap, priority_share=share)
    flat = sync.link_share(capacity, high, low, priority=True, flow_cap=cap, priority_share=None)
    assert hi >= min(cap, share * capacity / high) * (1 - 1e-9)
    assert lo >= min(cap, (1 - share) * capacity / low) * (1 - 1e-9)
    assert high * hi + low * lo <= capacity * (1 + 1e-9)  # never more than the link
    assert flat == pytest.approx(min(cap, capacity / (high + low)))
    if share >= high / (high + low):  # a class at least its fair share of the flows gains
        assert hi >= flat * (1 - 1e-9)
    # work-conserving: the link is full unless every flow is at its cap
    assert high * hi + low * lo == pytest.approx(min(capacity, (high + low) * cap))


def test_a_priority_gang_keeps_its_share_against_congestion() -> None:
    fabric = replace(NO_LATENCY, priority_share=0.5)
    urgent = rack(1, 1)[:4] + rack(1, 2)[:4]
    crowd = rack(1, 1)[4:] + rack(1, 2)[4:]
    loads = sync.Loads()
    layout = sync.layout_of(urgent, WHERE)
    loads.add(layout, priority=True)
    loads.add(sync.layout_of(crowd, WHERE), priority=False)
    with_class, _ = sync.gang_bandwidth(layout, True, loads, WHERE, fabric)
    without, _ = sync.gang_bandwidth(layout, True, loads, WHERE, NO_LATENCY)
    uplinks = 16 * fabric.node_gbps / 2
    assert without == pytest.approx(uplinks / 16)  # 16 equal flows per leaf
    assert with_class == pytest.approx(min(fabric.node_gbps, 0.5 * uplinks / 4))
    assert with_class > without


# --- the sweep over a run ----------------------------------------------------------------


def segment(
    job: str, nodes: list[str], start: float, end: float, priority: int = 0
) -> sync.GangSegment:
    return sync.GangSegment(job, tuple(nodes), 8 * len(nodes), priority, start, end)


def test_scaling_efficiency_is_one_on_one_leaf() -> None:
    (gang,) = sync.summarise([segment("a", rack(1, 1), 0.0, 100.0)], FLEET, NO_LATENCY)
    assert gang.efficiency == pytest.approx(1.0)
    assert gang.mean_sync_s == pytest.approx(sync.one_leaf_sync_s(128, 16, NO_LATENCY))
    assert gang.bound_s["nic"] == 100.0
    assert gang.spread_s["one_leaf"] == 100.0


def test_congestion_counts_only_while_the_gangs_overlap() -> None:
    a = rack(1, 1)[:8] + rack(1, 2)[:8]
    b = rack(1, 1)[8:] + rack(1, 2)[8:]
    step = sync.STEP
    gangs = sync.summarise(
        [segment("a", a, 0.0, 100.0), segment("b", b, 50.0, 150.0)], FLEET, NO_LATENCY, step
    )
    ga, gb = gangs
    fast = ideal_sync_s(step.message_bytes, 128, NO_LATENCY.rail_gbps)
    slow = ideal_sync_s(step.message_bytes, 128, NO_LATENCY.rail_gbps / 2)
    assert ga.mean_sync_s == pytest.approx((fast + slow) / 2)
    assert gb.mean_sync_s == pytest.approx((slow + fast) / 2)
    assert ga.bound_s == {"nic": 50.0, "leaf_uplink": 50.0, "spine_uplink": 0.0}
    expected = (50 / (1 + slow) + 50 / (1 + fast)) / (100 / (1 + fast))
    assert ga.efficiency == pytest.approx(expected)
    assert ga.efficiency < 1.0


def test_a_move_and_a_one_node_gang() -> None:
    moved = [
        segment("a", rack(1, 1)[:2], 0.0, 10.0),
        segment("a", rack(1, 1)[:1] + rack(2, 1)[:1], 10.0, 30.0),
    ]
    single = segment("one", rack(1, 2)[:1], 0.0, 30.0)
    (gang,) = sync.summarise([*moved, single], FLEET, NO_LATENCY)
    assert gang.job_id == "a"
    assert gang.wall_s == 30.0
    assert gang.spread_s == {"one_leaf": 10.0, "leaves": 0.0, "clusters": 20.0}


# --- the blind view and the report ---------------------------------------------------------


def test_blind_collapses_only_the_topology() -> None:
    node = FLEET[17]
    seen = sync.scheduler_view(node, "blind")
    assert sync.scheduler_view(node, "topology") is node
    assert (seen.zone, seen.cluster, seen.rack, seen.leaf) == ("", sync.BLIND, sync.BLIND, "")
    assert (seen.handle, seen.region, seen.gpus, seen.grade) == (
        node.handle,
        node.region,
        node.gpus,
        node.grade,
    )
    assert {sync.scheduler_view(n, "blind").leaf_key for n in FLEET} == {seen.leaf_key}


def test_the_report_section() -> None:
    a = rack(1, 1)[:8] + rack(1, 2)[:8]
    b = rack(1, 1)[8:] + rack(1, 2)[8:]
    base = result()
    run = replace(
        base,
        inputs=replace(base.inputs, nodes=FLEET, placement="blind"),
        segments=(segment("a", a, 0.0, 100.0, priority=1), segment("b", b, 0.0, 100.0)),
    )
    report = rep.build_report(run, fabric=NO_LATENCY)
    section = report["sync"]
    assert report["placement"] == "blind"
    assert section["gangs"] == 2
    assert section["by_class"]["priority"]["gangs"] == 1
    assert set(section["by_gang_gpus"]) == {"128"}
    assert section["bound_by"]["leaf_uplink"] == 1.0
    slow = ideal_sync_s(sync.STEP.message_bytes, 128, NO_LATENCY.rail_gbps / 2)
    assert section["sync_time_share"] == pytest.approx(slow / (1 + slow), abs=1e-6)
    assert section["step_time_s"]["p50"] == pytest.approx(1 + slow, abs=1e-6)
    assert section["model"]["fabric"]["leaf_oversubscription"] == 2.0
    empty = rep.build_report(base)["sync"]
    assert empty["gangs"] == 0
    assert empty["sync_time_share"] is None
    assert empty["scaling_efficiency"] is None
    assert empty["step_time_s"]["p90"] is None
