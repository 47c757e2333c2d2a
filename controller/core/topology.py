"""The fleet's topology as the region controller knows it (docs/scheduler.md).

Two sources, merged per node by :func:`resolve` (pure): what the node reports in its
batches (``TelemetryBatch.topology``, from the agent's ``[node]`` keys) and the
controller config's optional ``[topology]`` section, which overrides it field by field::

    report < [topology] < [topology.clusters.<c>] < [...<c>.racks.<rack>] < [...<c>.nodes.<node>]

:class:`TopologyView` keeps the newest report of each node (fed by the region
controller's batch intake), with the datasets warm there (:mod:`.warm`), and turns node
records into the scheduler's ``FleetNode``s.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from metalguard.controller.core.warm import batch_warm_datasets
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.proto.access import ConfigSection
from metalguard.proto.base import NodeIdentity, NonNegInt
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.telemetry import TelemetryBatch
from metalguard.proto.topology import NodeTopology, NonNegFloat, RdmaPortName

FIELDS: tuple[str, ...] = NodeTopology.__struct_fields__


class RackOverride(ConfigSection, frozen=True):
    """``[...racks.<rack>]``: fields forced on a rack's nodes (all but ``rack``)."""

    zone: str | None = None
    leaf: str | None = None
    gpus: NonNegInt | None = None
    gpu_type: str | None = None
    cpu_cores: NonNegInt | None = None
    memory_gb: NonNegInt | None = None
    bandwidth_tier: NonNegInt | None = None
    rdma_ports: tuple[RdmaPortName, ...] | None = None
    rdma_rate_gbps: NonNegFloat | None = None


class TopologyOverride(RackOverride, frozen=True):
    """Fields forced on the nodes a table covers; a key left out changes nothing."""

    rack: str | None = None


class ClusterTopology(TopologyOverride, frozen=True):
    """``[topology.clusters.<cluster>]``: the cluster's zone and anything else forced on
    all its nodes, then per rack and per node (by node name)."""

    racks: dict[str, RackOverride] = {}
    nodes: dict[str, TopologyOverride] = {}


class TopologySection(TopologyOverride, frozen=True):
    """``[topology]``: fields forced on every node of the region, then per cluster."""

    clusters: dict[str, ClusterTopology] = {}


def _apply(base: NodeTopology, override: RackOverride | None) -> NodeTopology:
    if override is None:
        return base
    changes = {f: v for f in FIELDS if (v := getattr(override, f, None)) is not None}
    return msgspec.structs.replace(base, **changes) if changes else base


def resolve(
    identity: NodeIdentity, reported: NodeTopology | None, config: TopologySection
) -> NodeTopology:
    """A node's topology: its report, overridden by the config's tables in order."""
    topo = _apply(reported or NodeTopology(), config)
    cluster = config.clusters.get(identity.cluster)
    if cluster is None:
        return topo
    topo = _apply(topo, cluster)
    node = cluster.nodes.get(identity.node)
    if node is not None and node.rack is not None:  # the node's rack decides its table
        topo = msgspec.structs.replace(topo, rack=node.rack)
    topo = _apply(topo, cluster.racks.get(topo.rack))
    return _apply(topo, node)


EMPTY = NodeTopology()
"""The topology of a node that reports none and has none forced on it."""


def with_topology(batch: TelemetryBatch, topology: NodeTopology) -> TelemetryBatch:
    """``batch`` carrying the node's resolved ``topology`` (what the scoring rules read,
    docs/scoring.md "RDMA"); ``batch`` itself when that is what it carries already."""
    own = batch.topology
    if topology is own or topology == (own or EMPTY):
        return batch
    return msgspec.structs.replace(batch, topology=topology)


def fleet_node(
    handle: str,
    record: NodeRecord,
    topology: NodeTopology,
    warm: frozenset[str] = frozenset(),
) -> FleetNode:
    """The scheduler's view of one node (its rack falls back to the record's; ``warm``:
    the datasets warm there)."""
    place = msgspec.structs.asdict(topology)
    place["rack"] = topology.rack or record.rack
    return FleetNode(
        handle=handle,
        region=record.node.region,
        cluster=record.node.cluster,
        grade=record.grade,
        cordoned=record.cordoned or record.held,
        rail_flagged=record.rail_flagged,
        warm_datasets=warm,
        dma_posture=record.dma_posture,
        **place,
    )


class TopologyView:
    """The newest reported topology of each node, merged with the config on demand.

    In memory: after a controller restart it fills again with each node's next batch
    (until then a node has only what the config says about it, and no warm dataset).
    """

    def __init__(self, config: TopologySection | None = None) -> None:
        self.config = config or TopologySection()
        self._reported: dict[str, NodeTopology] = {}
        self._resolved: dict[str, NodeTopology] = {}
        """The last resolved topology of each node: handed out again while equal (the
        scorer's memo reuses a batch section by identity)."""
        self._warm: dict[str, frozenset[str]] = {}
        """The datasets warm on each node as of its newest batch (none: not kept)."""

    def observe(self, handle: str, batch: TelemetryBatch) -> None:
        """Take in a node's batch: its ``topology`` (None changes nothing) and which
        datasets are warm there (``controller.core.warm``, judged at the batch's ``ts``).
        An out-of-band batch (a bmc-proxy's) changes neither."""
        if batch.out_of_band:
            return
        if batch.topology is not None:
            self._reported[handle] = batch.topology
        warm = batch_warm_datasets(batch)
        if warm:
            self._warm[handle] = warm
        else:
            self._warm.pop(handle, None)

    def warm_datasets(self, handle: str) -> frozenset[str]:
        """The datasets warm on the node as of its newest batch (empty when none)."""
        return self._warm.get(handle, frozenset())

    def reported(self, handle: str) -> NodeTopology | None:
        """What the node itself last reported."""
        return self._reported.get(handle)

    def topology(self, handle: str, identity: NodeIdentity) -> NodeTopology:
        """The node's topology: report merged with the config."""
        resolved = resolve(identity, self._reported.get(handle), self.config)
        kept = self._resolved.get(handle)
        if kept is not None and kept == resolved:
            return kept
        self._resolved[handle] = resolved
        return resolved

    def fleet(self, records: Mapping[str, NodeRecord]) -> list[FleetNode]:
        """The scheduler's nodes for these records (``controller.jobs.FleetView``)."""
        warm = self._warm
        return [
            fleet_node(
                handle, record, self.topology(handle, record.node), warm.get(handle, frozenset())
            )
            for handle, record in records.items()
        ]
