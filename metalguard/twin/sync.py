"""The twin's synchronisation time (issue 31, item 4): each multi-node gang's training
step is its compute plus a gradient all-reduce whose time follows from where the gang
sits on the fabric (docs/twin.md "Synchronisation time").

Pure: no clock, no IO. The engine records each gang's holdings (:class:`GangSegment`:
its nodes, from when to when); :func:`summarise` sweeps them in time order, keeping the
load every gang puts on the shared links, and gives each gang's step time, the share
of it spent synchronising and its scaling efficiency against the same job on one leaf.

**The fabric** (:class:`Fabric`): every node has ``rails_per_node`` NICs of
``rail_gbps`` (one per GPU, rail-optimised); a rack's nodes share one leaf switch,
non-blocking inside; a leaf's uplinks to the spines carry its nodes' NIC bandwidth
divided by ``leaf_oversubscription``; a cluster's spines reach the core (other
clusters) with a further ``spine_oversubscription``.

**The all-reduce** (alpha-beta, :func:`allreduce_time`): over ``n`` ranks (GPUs) ring
and tree both move ``2(n-1)/n`` of the message over each rank's bottleneck link (NCCL's
bus bandwidth relation, nccl-tests doc/PERFORMANCE.md: ``busbw = algbw x 2(n-1)/n``);
a ring takes ``2(n-1)`` latency steps, a (double binary) tree ``2 ceil(log2 n)``.

**The bottleneck** (:func:`gang_bandwidth`): a gang on one leaf is NIC-bound. A gang
across leaves sends each node's traffic through its leaf's uplinks (its ranks are not
ordered by leaf: ring neighbours and tree parents on other leaves), so each of its nodes
gets its share of every uplink it crosses, shared with the nodes of every other gang
crossing it (congestion, :func:`link_share`); across clusters, also of the cluster's
core uplinks. The gang runs at its slowest node's share. Each link is shared on its
own: a flow held back elsewhere still counts for its full share here (no max-min
redistribution), so congested figures are on the pessimistic side. With a QoS priority
class (``priority_share``, a QoS profile's guaranteed ``bandwidth_percent``; off by
default), the flows of gangs of priority ``>= priority_min`` get that share of a
congested link between them, the others the rest (ETS: work-conserving, a class's
unused share goes to the other).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from metalguard.controller.jobs.scheduler import FleetNode

PlacementMode = Literal["topology", "blind"]
PLACEMENT_MODES: Final[tuple[PlacementMode, ...]] = ("topology", "blind")
"""``topology``: the scheduler sees the fleet's racks and clusters; ``blind``: the same
scheduler with every node in one rack of one cluster (the sync model still judges the
placements on the real topology)."""

BLIND: Final = "blind"
"""The one rack and cluster every node is in as a ``blind`` scheduler sees it."""

Algorithm = Literal["ring", "tree", "auto"]
Bound = Literal["nic", "leaf_uplink", "spine_uplink"]
BOUNDS: Final[tuple[Bound, ...]] = ("nic", "leaf_uplink", "spine_uplink")

GBPS_BYTES: Final = 1e9 / 8
"""Bytes per second in one Gb/s."""
GIB: Final = 2**30


@dataclass(frozen=True, slots=True)
class Fabric:
    """The network the gangs synchronise over; each default with its reason."""

    rail_gbps: float = 400.0
    """One NDR InfiniBand / 400 GbE NIC per GPU (ConnectX-7 in HGX/DGX H100 servers)."""
    rails_per_node: int = 8
    """One rail per GPU of the twin's 8-GPU nodes (NVIDIA's rail-optimised design)."""
    nvlink_gbps: float = 3600.0
    """Per GPU, one direction, inside a node (H100 NVLink 4: 900 GB/s both ways)."""
    leaf_oversubscription: float = 2.0
    """Leaf downlink / uplink bandwidth. 2:1 is the common taper of a two-tier Clos
    built to save spine ports; a SuperPOD-style rail fabric is 1:1 (then no placement
    inside a cluster is ever uplink-bound: a leaf's uplinks carry all its nodes at
    full rate), a general-purpose data-centre leaf 3:1 to 4:1."""
    spine_oversubscription: float = 7.0
    """A cluster's spine-to-core taper: Llama 3's clusters are non-blocking inside a
    3,072-GPU AI zone and 1:7 between zones (Meta, "The Llama 3 Herd of Models", 2024;
    the twin's cluster of 32 racks x 16 nodes x 8 GPUs is 4,096 GPUs, about one zone)."""
    hop_latency_s: float = 5e-6
    """Latency of one all-reduce step between nodes on one leaf (NCCL over RDMA: a few
    microseconds)."""
    switch_latency_s: float = 1e-6
    """Added per extra switch a step crosses (leaf-spine-leaf: +2; via the core: +4)."""
    priority_share: float | None = None
    """A priority class for urgent gangs: its guaranteed share of a congested link (a
    QoS profile's ``bandwidth_percent``, e.g. 0.5). None (the default): every gang's
    traffic in the one training class (docs/qos.md's example profile maps all training
    traffic to one class), every flow an equal share."""
    priority_min: int = 1
    """A gang of this priority or more sends in the priority class."""

    @property
    def node_gbps(self) -> float:
        """A node's NIC bandwidth, all rails."""
        return self.rail_gbps * self.rails_per_node

    def leaf_uplink_gbps(self, ports: int) -> float:
        """The uplink bandwidth of a leaf with ``ports`` nodes."""
        return ports * self.node_gbps / self.leaf_oversubscription

    def spine_uplink_gbps(self, ports: int) -> float:
        """The core uplink bandwidth of a cluster with ``ports`` nodes."""
        return self.leaf_uplink_gbps(ports) / self.spine_oversubscription


@dataclass(frozen=True, slots=True)
class StepModel:
    """What one training step of every multi-node gang does; each default with its
    reason (the figures scale with ``message_bytes / compute_s``)."""

    compute_s: float = 1.0
    """Forward and backward per step (an assumption: about a second for a large model
    at a few thousand tokens per GPU)."""
    message_bytes: float = 2.0 * GIB
    """Gradient bytes each GPU all-reduces per step: a ~8-billion-parameter model's
    bf16 gradients (16 GB) sharded 8 ways by tensor parallelism inside the node."""
    overlap: float = 0.0
    """Share of the compute time the all-reduce may hide behind (bucketed all-reduce
    during the backward pass overlaps up to about two thirds of it); 0: none, the
    seed's "synchronisation time" is the whole all-reduce."""
    algorithm: Algorithm = "auto"
    """``ring``, ``tree`` or ``auto`` (the faster, as NCCL's tuner picks)."""


FABRIC: Final = Fabric()
STEP: Final = StepModel()


def scheduler_view(node: FleetNode, placement: PlacementMode) -> FleetNode:
    """``node`` as the scheduler sees it: as it is (``topology``), or with its zone,
    cluster, rack and leaf collapsed into one (``blind``: every placement fits the
    tightest level, so best fit alone picks the nodes)."""
    if placement == "topology":
        return node
    return msgspec.structs.replace(node, zone="", cluster=BLIND, rack=BLIND, leaf="")


# --- the all-reduce ----------------------------------------------------------------------


def bus_factor(ranks: int) -> float:
    """``2(n-1)/n``: the share of the message each rank sends (and receives) in an
    all-reduce over ``ranks`` ranks; 0 for one rank."""
    return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce from its algorithm bandwidth (message
    size / time): ``algbw x 2(n-1)/n``, comparable with the link's speed."""
    return algbw * bus_factor(ranks)


def latency_steps(ranks: int, algorithm: Literal["ring", "tree"]) -> int:
    """Sequential latency steps of one all-reduce: ring ``2(n-1)`` (reduce-scatter then
    all-gather), tree ``2 ceil(log2 n)`` (reduce up, broadcast down)."""
    if ranks <= 1:
        return 0
    if algorithm == "ring":
        return 2 * (ranks - 1)
    return 2 * math.ceil(math.log2(ranks))


def allreduce_time(
    message_bytes: float,
    ranks: int,
    rank_bytes_per_s: float,
    latency_s: float,
    algorithm: Algorithm = "ring",
) -> float:
    """Seconds for one all-reduce of ``message_bytes`` per rank over ``ranks`` ranks,
    each sending at ``rank_bytes_per_s`` over its bottleneck link: latency steps x
    ``latency_s`` + ``2(n-1)/n x message / bandwidth``; ``auto`` the faster of both."""
    if ranks <= 1:
        return 0.0
    if rank_bytes_per_s <= 0:
        raise ValueError(f"a rank's bandwidth must be positive, not {rank_bytes_per_s}")
    moved = bus_factor(ranks) * message_bytes / rank_bytes_per_s
    if algorithm == "auto":
        steps = min(latency_steps(ranks, "ring"), latency_steps(ranks, "tree"))
    else:
        steps = latency_steps(ranks, algorithm)
    return steps * latency_s + moved


def step_time(compute_s: float, sync_s: float, overlap: float = 0.0) -> float:
    """One step: compute, then the part of the all-reduce not hidden behind
    ``overlap`` x the compute."""
    return compute_s + exposed_sync(compute_s, sync_s, overlap)


def exposed_sync(compute_s: float, sync_s: float, overlap: float = 0.0) -> float:
    """The all-reduce time a step waits for: what ``overlap`` x compute does not hide."""
    return max(0.0, sync_s - overlap * compute_s)


# --- the links -------------------------------------------------------------------------


def link_share(
    capacity: float,
    flows_priority: int,
    flows_other: int,
    *,
    priority: bool,
    flow_cap: float,
    priority_share: float | None,
) -> float:
    """One flow's bandwidth on a link of ``capacity`` crossed by ``flows_priority`` +
    ``flows_other`` greedy flows (the asking one counted), none above ``flow_cap`` (its
    NIC). Without a priority class (``priority_share`` None, or one class alone): an
    equal share. With one (ETS): the priority class gets at least ``priority_share`` of
    the link, the other class the rest, each class's unused share going to the other."""
    total = flows_priority + flows_other
    if total <= 0 or (priority and flows_priority <= 0) or (not priority and flows_other <= 0):
        raise ValueError("the asking flow must be one of the link's flows")
    if priority_share is None or flows_priority == 0 or flows_other == 0:
        return min(flow_cap, capacity / total)
    high_need = flows_priority * flow_cap
    low_need = flows_other * flow_cap
    high = min(high_need, max(priority_share * capacity, capacity - low_need))
    if priority:
        return high / flows_priority
    return min(low_need, capacity - high) / flows_other


@dataclass(frozen=True, slots=True)
class FabricMap:
    """Where each node sits: its leaf and cluster, and how many nodes each holds."""

    leaf_of: Mapping[str, tuple[str, ...]]
    cluster_of: Mapping[str, tuple[str, ...]]
    leaf_ports: Mapping[tuple[str, ...], int]
    cluster_ports: Mapping[tuple[str, ...], int]

    @classmethod
    def from_nodes(cls, nodes: Iterable[FleetNode]) -> FabricMap:
        """The map of the fleet's real topology (``leaf_key``, cluster ``group_key``)."""
        leaf_of: dict[str, tuple[str, ...]] = {}
        cluster_of: dict[str, tuple[str, ...]] = {}
        leaf_ports: dict[tuple[str, ...], int] = defaultdict(int)
        cluster_ports: dict[tuple[str, ...], int] = defaultdict(int)
        for node in nodes:
            leaf, cluster = node.leaf_key, node.group_key("cluster")
            leaf_of[node.handle], cluster_of[node.handle] = leaf, cluster
            leaf_ports[leaf] += 1
            cluster_ports[cluster] += 1
        return cls(leaf_of, cluster_of, dict(leaf_ports), dict(cluster_ports))


@dataclass(frozen=True, slots=True)
class Layout:
    """A gang's nodes per leaf and per cluster."""

    leaves: Mapping[tuple[str, ...], int]
    clusters: Mapping[tuple[str, ...], int]

    @property
    def spread(self) -> Literal["one_leaf", "leaves", "clusters"]:
        """One leaf, several leaves of one cluster, or several clusters."""
        if len(self.clusters) > 1:
            return "clusters"
        return "leaves" if len(self.leaves) > 1 else "one_leaf"


def layout_of(nodes: Iterable[str], where: FabricMap) -> Layout:
    """A placement's :class:`Layout` on the real topology."""
    leaves: dict[tuple[str, ...], int] = defaultdict(int)
    clusters: dict[tuple[str, ...], int] = defaultdict(int)
    for handle in nodes:
        leaves[where.leaf_of[handle]] += 1
        clusters[where.cluster_of[handle]] += 1
    return Layout(dict(leaves), dict(clusters))


@dataclass(slots=True)
class Loads:
    """The flows (nodes of gangs crossing them) on each leaf's and cluster's uplinks,
    per class: ``[priority, other]``."""

    leaves: dict[tuple[str, ...], list[int]] = field(default_factory=dict)
    clusters: dict[tuple[str, ...], list[int]] = field(default_factory=dict)

    def add(self, layout: Layout, priority: bool, sign: int = 1) -> None:
        """Put a gang's flows on (``sign`` 1) or off (-1) the uplinks it crosses."""
        cls = 0 if priority else 1
        if len(layout.leaves) > 1:
            for leaf, count in layout.leaves.items():
                self.leaves.setdefault(leaf, [0, 0])[cls] += sign * count
        if len(layout.clusters) > 1:
            for cluster, count in layout.clusters.items():
                self.clusters.setdefault(cluster, [0, 0])[cls] += sign * count


def gang_bandwidth(
    layout: Layout, priority: bool, loads: Loads, where: FabricMap, fabric: Fabric = FABRIC
) -> tuple[float, Bound]:
    """Each node's network bandwidth (Gb/s) in a gang so placed, with the others' flows
    in ``loads`` (its own included), and what bounds it: its slowest node's share of the
    uplinks it crosses, at most its NIC."""
    best: tuple[float, Bound] = (fabric.node_gbps, "nic")
    tiers: list[tuple[Mapping[tuple[str, ...], int], dict[tuple[str, ...], list[int]], Bound]] = []
    if len(layout.leaves) > 1:
        tiers.append((layout.leaves, loads.leaves, "leaf_uplink"))
    if len(layout.clusters) > 1:
        tiers.append((layout.clusters, loads.clusters, "spine_uplink"))
    for groups, flows, bound in tiers:
        for key in groups:
            ports = where.leaf_ports[key] if bound == "leaf_uplink" else where.cluster_ports[key]
            capacity = (
                fabric.leaf_uplink_gbps(ports)
                if bound == "leaf_uplink"
                else fabric.spine_uplink_gbps(ports)
            )
            high, low = flows[key]
            share = link_share(
                capacity,
                high,
                low,
                priority=priority,
                flow_cap=fabric.node_gbps,
                priority_share=fabric.priority_share,
            )
            if share < best[0]:
                best = (share, bound)
    return best


def step_latency_s(layout: Layout, fabric: Fabric = FABRIC) -> float:
    """One all-reduce step's latency on this layout: more switches across leaves and
    across clusters."""
    extra = {"one_leaf": 0, "leaves": 2, "clusters": 4}[layout.spread]
    return fabric.hop_latency_s + extra * fabric.switch_latency_s


def gang_sync_s(
    gpus: int,
    nodes: int,
    node_gbps: float,
    latency_s: float,
    fabric: Fabric = FABRIC,
    step: StepModel = STEP,
) -> float:
    """A gang's all-reduce seconds per step: ``gpus`` ranks, each at its share of its
    node's bandwidth (one rail), inside one node over NVLink."""
    per_gpu_gbps = fabric.nvlink_gbps
    if nodes > 1:
        per_gpu_gbps = min(per_gpu_gbps, node_gbps * nodes / gpus)
        return allreduce_time(
            step.message_bytes, gpus, per_gpu_gbps * GBPS_BYTES, latency_s, step.algorithm
        )
    return allreduce_time(step.message_bytes, gpus, per_gpu_gbps * GBPS_BYTES, 0.0, step.algorithm)


def one_leaf_sync_s(
    gpus: int, nodes: int, fabric: Fabric = FABRIC, step: StepModel = STEP
) -> float:
    """The same gang's all-reduce on one leaf as large as it needs: NIC-bound, alone."""
    return gang_sync_s(gpus, nodes, fabric.node_gbps, fabric.hop_latency_s, fabric, step)


# --- the run -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GangSegment:
    """A gang holding ``nodes`` from ``start_s`` to ``end_s`` (one placement)."""

    job_id: str
    nodes: tuple[str, ...]
    gpus: int
    priority: int
    start_s: float
    end_s: float


@dataclass(slots=True)
class GangSync:
    """One gang's time-weighted totals over its placements (wall seconds held)."""

    job_id: str
    gpus: int
    priority: bool
    wall_s: float = 0.0
    step_s: float = 0.0
    """Sum of wall seconds x step time."""
    sync_s: float = 0.0
    """Sum of wall seconds x exposed all-reduce time."""
    one_leaf_sync_s: float = 0.0
    steps: float = 0.0
    """Sum of wall seconds / step time (steps done)."""
    one_leaf_steps: float = 0.0
    """The steps the same wall would have given on one leaf."""
    bound_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BOUNDS, 0.0))
    spread_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("one_leaf", "leaves", "clusters"), 0.0)
    )

    @property
    def mean_step_s(self) -> float:
        """Its time-weighted step time."""
        return self.step_s / self.wall_s

    @property
    def mean_sync_s(self) -> float:
        """Its time-weighted all-reduce time per step."""
        return self.sync_s / self.wall_s

    @property
    def efficiency(self) -> float:
        """Its steps per GPU against the same job on one leaf."""
        return self.steps / self.one_leaf_steps


@dataclass(slots=True)
class _Live:
    segment: GangSegment
    gang: GangSync
    layout: Layout
    one_leaf_sync: float
    since: float = 0.0
    sync: float = 0.0
    bound: Bound = "nic"


def summarise(
    segments: Iterable[GangSegment],
    nodes: Sequence[FleetNode],
    fabric: Fabric = FABRIC,
    step: StepModel = STEP,
) -> list[GangSync]:
    """Every multi-node gang's synchronisation over the run, in order of job id: the
    placements swept in time order (an end before a start at the same time), each
    gang's all-reduce recomputed whenever the load on an uplink it crosses changes."""
    where = FabricMap.from_nodes(nodes)
    events: list[tuple[float, int, int, GangSegment]] = []
    for seq, seg in enumerate(segments):
        if len(seg.nodes) > 1 and seg.end_s > seg.start_s:
            events.append((seg.start_s, 1, seq, seg))
            events.append((seg.end_s, 0, seq, seg))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    gangs: dict[str, GangSync] = {}
    live: dict[int, _Live] = {}
    loads = Loads()
    on_leaf: dict[tuple[str, ...], set[int]] = defaultdict(set)
    on_cluster: dict[tuple[str, ...], set[int]] = defaultdict(set)
    for now, starting, seq, seg in events:
        if starting:
            gang = gangs.setdefault(
                seg.job_id, GangSync(seg.job_id, seg.gpus, seg.priority >= fabric.priority_min)
            )
            layout = layout_of(seg.nodes, where)
            base = one_leaf_sync_s(seg.gpus, len(seg.nodes), fabric, step)
            here = _Live(seg, gang, layout, base, since=now)
            live[seq] = here
            loads.add(layout, gang.priority)
            touched = _register(seq, layout, on_leaf, on_cluster, add=True)
        else:
            here = live.pop(seq)
            _settle(here, now, step)
            loads.add(here.layout, here.gang.priority, -1)
            touched = _register(seq, here.layout, on_leaf, on_cluster, add=False)
        for other in sorted(touched):
            if other in live:
                _settle(live[other], now, step)
                _judge(live[other], loads, where, fabric, step)
    return [gangs[k] for k in sorted(gangs)]


def _register(
    seq: int,
    layout: Layout,
    on_leaf: dict[tuple[str, ...], set[int]],
    on_cluster: dict[tuple[str, ...], set[int]],
    *,
    add: bool,
) -> set[int]:
    """Enter (or leave) the uplinks a gang crosses; the gangs whose share may change."""
    touched = {seq} if add else set()
    tiers = []
    if len(layout.leaves) > 1:
        tiers.append((layout.leaves, on_leaf))
    if len(layout.clusters) > 1:
        tiers.append((layout.clusters, on_cluster))
    for groups, users in tiers:
        for key in groups:
            if add:
                users[key].add(seq)
            else:
                users[key].discard(seq)
            touched |= users[key]
    return touched


def _settle(here: _Live, now: float, step: StepModel) -> None:
    """Add the time since the last change at the gang's current pace."""
    dt = now - here.since
    here.since = now
    if dt <= 0:
        return
    g = here.gang
    step_s = step_time(step.compute_s, here.sync, step.overlap)
    base_s = step_time(step.compute_s, here.one_leaf_sync, step.overlap)
    g.wall_s += dt
    g.step_s += dt * step_s
    g.sync_s += dt * exposed_sync(step.compute_s, here.sync, step.overlap)
    g.one_leaf_sync_s += dt * exposed_sync(step.compute_s, here.one_leaf_sync, step.overlap)
    g.steps += dt / step_s
    g.one_leaf_steps += dt / base_s
    g.bound_s[here.bound] += dt
    g.spread_s[here.layout.spread] += dt


def _judge(here: _Live, loads: Loads, where: FabricMap, fabric: Fabric, step: StepModel) -> None:
    """The gang's all-reduce under the loads now."""
    gbps, bound = gang_bandwidth(here.layout, here.gang.priority, loads, where, fabric)
    latency = step_latency_s(here.layout, fabric)
    here.sync = gang_sync_s(here.segment.gpus, len(here.segment.nodes), gbps, latency, fabric, step)
    here.bound = bound
