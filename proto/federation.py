"""What regions tell each other (docs/federation.md): summaries and node lookups."""

from __future__ import annotations

from proto.base import Message, NonNegInt, Record
from proto.nodes import NodeRecord


class GpuCapacity(Record, frozen=True):
    """A region's nodes of one GPU type (``""``: nodes without GPUs)."""

    gpu_type: str
    nodes: NonNegInt
    healthy_nodes: NonNegInt
    """HEALTHY and not cordoned: where new work may go."""
    gpus: NonNegInt
    healthy_gpus: NonNegInt


class RegionSummary(Message, frozen=True, tag="region_summary"):
    """One region's state for the others (``<p>.fed.summary.<region>``, every interval)."""

    region: str
    ts: float
    """When the summary was made (the publishing controller's clock)."""
    interval_s: float
    """How often the region publishes one: older than 3 intervals is stale."""
    controller: str = ""
    """The publishing controller (its HA instance name, if any)."""
    nodes: NonNegInt = 0
    grades: dict[str, NonNegInt] = {}
    capacity: tuple[GpuCapacity, ...] = ()
    queued_jobs: NonNegInt = 0
    running_jobs: NonNegInt = 0


class NodeLookup(Message, frozen=True, tag="node_lookup"):
    """Which region knows the node with this UUID (request, ``<p>.fed.lookup.<region>``)."""

    uuid: str


class NodeLookupReply(Message, frozen=True, tag="node_lookup_reply"):
    """The answer: the node's region, handle and record, or ``found`` false."""

    uuid: str
    found: bool
    region: str = ""
    handle: str = ""
    record: NodeRecord | None = None
