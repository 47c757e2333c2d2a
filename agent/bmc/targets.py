"""The ``[[bmc]]`` targets of an agent's config: which BMC, how to reach it, as whom.

Every protocol module (``snmp``, ``redfish``, ``ipmi``) exposes one coroutine with the
shape of :class:`BmcReader`: it reads one target and returns a
:class:`proto.telemetry.BmcReading`.  It never raises for an unreachable or misbehaving
BMC: that is a reading with ``reachable=False`` and a ``message`` saying why.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Final, Literal, Protocol

import msgspec

from metalguard.proto.access import ConfigSection
from metalguard.proto.addresses import AddressError, Endpoint, parse_bmc_address
from metalguard.proto.telemetry import BmcReading

Protocol_ = Literal["snmp", "redfish", "ipmi"]


class BmcTarget(ConfigSection, frozen=True):
    """One ``[[bmc]]`` entry: the BMC of node ``node`` (``REGION.CLUSTER.NODE``)."""

    node: str
    """The node this BMC belongs to, ``REGION.CLUSTER.NODE``."""
    address: str
    """``host`` or ``host:port`` (port optional: 161 for snmp, 443 for redfish, 623 for
    ipmi; ``[v6]:port`` for IPv6); redfish also ``https://host[:port]`` (the same as no
    scheme) and ``http://host[:port]`` (plain HTTP, port 80 by default: labs and
    emulators). Anything else is refused when the config is loaded."""
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

    def __post_init__(self) -> None:
        self.region_cluster_node()
        if not self.address.strip():
            raise ValueError("address: empty")
        try:
            parse_bmc_address(self.address, self.protocol, 1)
        except AddressError as exc:
            raise ValueError(f"address: {exc}") from None
        if self.protocol == "snmp":
            from metalguard.agent.bmc.snmp_profiles import PROFILES

            if self.profile and self.profile not in PROFILES:
                raise ValueError(
                    f"profile: unknown SNMP profile {self.profile!r} (known: {', '.join(PROFILES)})"
                )
            if not self.community and not self.credentials:
                raise ValueError("snmp needs `community` (v2c) or `credentials` (v3)")

    def region_cluster_node(self) -> tuple[str, str, str]:
        """Split ``node`` into its three tokens; raise ValueError when it has not three."""
        parts = self.node.split(".")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"node: {self.node!r} is not REGION.CLUSTER.NODE")
        return parts[0], parts[1], parts[2]

    def endpoint(self, default_port: int) -> Endpoint:
        """The parsed address: scheme (``https``/``http`` for redfish, ``""`` for the
        others), host (IPv6 without brackets) and port (``default_port`` when none is
        given; 80 for ``http://``)."""
        return parse_bmc_address(self.address, self.protocol, default_port)

    def host_port(self, default_port: int) -> tuple[str, int]:
        """The address as (host, port), ``default_port`` when none is given."""
        endpoint = self.endpoint(default_port)
        return endpoint.host, endpoint.port


class BmcReader(Protocol):
    """Reads one target; unreachable is a reading (``reachable=False``), never a raise."""

    async def __call__(self, target: BmcTarget) -> BmcReading: ...


READERS: Final[dict[str, str]] = {
    "snmp": "metalguard.agent.bmc.snmp",
    "redfish": "metalguard.agent.bmc.redfish",
    "ipmi": "metalguard.agent.bmc.ipmi",
}
"""Protocol -> the module whose ``read_bmc`` reads it (imported when first needed)."""

UNAVAILABLE: Final = "protocol not available"


def unreachable(target: BmcTarget, message: str) -> BmcReading:
    """The reading of a target that could not be read."""
    return BmcReading(node=target.node, source=target.protocol, reachable=False, message=message)


def reader_for(protocol: str) -> BmcReader | None:
    """The ``read_bmc`` coroutine of the protocol's module; None when not installed."""
    module_name = READERS.get(protocol)
    if module_name is None:
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    reader: BmcReader | None = getattr(module, "read_bmc", None)
    return reader


async def read_target(target: BmcTarget) -> BmcReading:
    """Read one target with its protocol's reader; never raises for a BMC's failure.

    A protocol whose module is missing reads ``reachable=False``, ``protocol not
    available``; a reader that raises anyway reads ``reachable=False`` with the error.
    """
    reader = reader_for(target.protocol)
    if reader is None:
        return unreachable(target, UNAVAILABLE)
    try:
        reading = await reader(target)
    except Exception as exc:  # a reader's bug must not stop the other targets
        return unreachable(target, f"{type(exc).__name__}: {exc}")
    if reading.node != target.node:
        reading = msgspec.structs.replace(reading, node=target.node)
    return reading
