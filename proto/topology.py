"""NodeTopology: where a node sits in the fleet and what it can run.

region > zone > cluster > rack > leaf switch > node.  ``region`` and ``cluster`` come
from the node's identity; the rest from the agent's ``[node]`` config (or the
controller's ``[topology]``, which overrides it).  Every field has a default, so a node
that says nothing still decodes (docs/scheduler.md).

The fields are declared here only: the agent's ``[node]`` section and the scheduler's
``FleetNode`` are NodeTopology subclasses that add their own fields.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from metalguard.proto.base import NonNegInt, Record

RdmaPortName = Annotated[str, msgspec.Meta(pattern=r"^[^/\s]+/[0-9]+\Z", max_length=128)]
"""``<device>/<port>`` as the kernel names them (``mlx5_0/1``)."""
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


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
    rdma_ports: tuple[RdmaPortName, ...] = ()
    """The RDMA ports cabled to the fabric, as ``<device>/<port>`` (``mlx5_0/1``): one
    whose ``phys_state`` is not LinkUp is FAILING (docs/scoring.md "RDMA")."""
    rdma_rate_gbps: NonNegFloat = 0.0
    """The rate every RDMA port of the node should run at (Gb/s); 0: not checked."""
