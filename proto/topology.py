"""NodeTopology: where a node sits in the fleet and what it can run.

region > zone > cluster > rack > leaf switch > node.  ``region`` and ``cluster`` come
from the node's identity; the rest from the agent's ``[node]`` config (or the
controller's ``[topology]``, which overrides it).  Every field has a default, so a node
that says nothing still decodes (docs/scheduler.md).

The fields are declared here only: the agent's ``[node]`` section and the scheduler's
``FleetNode`` are NodeTopology subclasses that add their own fields.
"""

from __future__ import annotations

from metalguard.proto.base import NonNegInt, Record


class NodeTopology(Record, frozen=True, kw_only=True):
    """A node's place in the topology and its capacity for workloads."""

    zone: str = ""
    """Availability zone of the node's cluster ("" = the region's single zone)."""
    rack: str = ""
    leaf: str = ""
    """Leaf (top-of-rack) switch; "" = one leaf per rack."""
    gpus: NonNegInt = 0
    gpu_type: str = ""
    cpu_cores: NonNegInt = 0
    memory_gb: NonNegInt = 0
    bandwidth_tier: NonNegInt = 0
    """Network bandwidth class; a job asking for tier T needs a node of tier >= T."""
