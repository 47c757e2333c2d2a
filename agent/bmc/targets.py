"""The ``[[bmc]]`` targets of an agent's config: which BMC, how to reach it, as whom.

Every protocol module (``snmp``, ``redfish``, ``ipmi``) exposes one coroutine with the
shape of :class:`BmcReader`: it reads one target and returns a
:class:`proto.telemetry.BmcReading`.  It never raises for an unreachable or misbehaving
BMC: that is a reading with ``reachable=False`` and a ``message`` saying why.
"""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

import msgspec

from proto.access import ConfigSection
from proto.telemetry import BmcReading

Protocol_ = Literal["snmp", "redfish", "ipmi"]


class BmcTarget(ConfigSection, frozen=True):
    """One ``[[bmc]]`` entry: the BMC of node ``node`` (``REGION.CLUSTER.NODE``)."""

    node: str
    """The node this BMC belongs to, ``REGION.CLUSTER.NODE``."""
    address: str
    """``host:port`` (port optional: 161 for snmp, 443 for redfish, 623 for ipmi)."""
    protocol: Protocol_
    profile: str = ""
    """SNMP OID map name (e.g. ``entity-sensor``); unused by the other protocols."""
    community: str = ""
    """SNMP v2c community; empty with ``credentials`` set means SNMPv3."""
    credentials: str = ""
    """Path of a file with the user/password (or SNMPv3 secrets), see docs/bmc.md."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=120)] = 3.0
    retries: Annotated[int, msgspec.Meta(ge=0, le=5)] = 1
    verify_tls: bool = True
    """Redfish only: verify the BMC's certificate (on by default)."""

    def region_cluster_node(self) -> tuple[str, str, str]:
        """Split ``node`` into its three tokens; raise ValueError when it has not three."""
        parts = self.node.split(".")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"bmc.node: {self.node!r} is not REGION.CLUSTER.NODE")
        return parts[0], parts[1], parts[2]

    def host_port(self, default_port: int) -> tuple[str, int]:
        """The address as (host, port), ``default_port`` when none is given."""
        host, sep, port = self.address.rpartition(":")
        if not sep or not port.isdigit() or host.endswith(":"):  # bare host or IPv6
            return self.address.strip("[]"), default_port
        return host.strip("[]"), int(port)


class BmcReader(Protocol):
    """Reads one target; unreachable is a reading (``reachable=False``), never a raise."""

    async def __call__(self, target: BmcTarget) -> BmcReading: ...
